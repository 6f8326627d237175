"""The evacuation's byte movers: files sent and received through a process group (gloo or NCCL on host
tensors: no new listener), and DCP's file system with a CRC32 of every file computed as it is written.

Files cross in chunks through two small buffers on each side: the sender reads the next chunk on a thread
while this one is sent (and checksums it only when its CRC32 was not summed as the file was written); the
receiver checksums each chunk on one thread and writes it on another while the next one arrives.
(Mapping the files instead was measured slower: a page fault per 4 KiB page costs more than the copy on a
VM.) Part of :mod:`agent.client.peer.evacuate`.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem

from agent.checkpoint.checksum import crc32

# Bytes per send and per CRC32 step: a bounded buffer on both sides whatever the size of a shard file, small
# enough to stay in the cache between the socket, the CRC32 and the write, and for its two buffers' first
# page faults to cost little (fresh pages cost dearly on a VM: bench/RESULTS.md, "Evacuation").
CHUNK = 8 << 20


class _Summing(io.RawIOBase):
    """A write stream that computes the CRC32 of what passes through it: a large write is summed piece by
    piece on ``pool``'s one thread while this thread writes the pieces (each summed before the call returns,
    since the caller's buffer is only lent for the call); a small one on the writing thread."""

    def __init__(self, raw: BinaryIO, pool: ThreadPoolExecutor, chunk: int = CHUNK) -> None:
        super().__init__()
        self.raw = raw
        self.pool = pool
        self.chunk = chunk
        self.crc = 0
        self.size = 0

    def _sum(self, piece: memoryview) -> None:
        self.crc = crc32(piece, self.crc)

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if len(view) <= self.chunk:
            self._sum(view)
            self.raw.write(view)
        else:
            pieces = [view[o : o + self.chunk] for o in range(0, len(view), self.chunk)]
            summed = [self.pool.submit(self._sum, piece) for piece in pieces]  # in order: one thread
            for piece in pieces:
                self.raw.write(piece)
            for future in summed:
                future.result()
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()


class SummingFileSystem(FileSystem):
    """DCP's local file system, except that every file written whole through it gets its CRC32 and size
    recorded by name (``sums``) as it is written, beside the write: nobody reads the files back to
    checksum them."""

    def __init__(self, chunk: int = CHUNK) -> None:
        super().__init__()
        self.sums: dict[str, tuple[int, int]] = {}  # name → (CRC32, size)
        self.chunk = chunk
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, "wb") as raw, ThreadPoolExecutor(1, thread_name_prefix="evacuate-sum") as pool:
            summing = _Summing(raw, pool, self.chunk)
            yield summing
        with self._lock:
            self.sums[Path(path).name] = (summing.crc, summing.size)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.sums:
                self.sums[Path(new_path).name] = self.sums.pop(Path(path).name)


def _global(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def send_file(group: Any, to: int, path: Path, size: int, chunk: int = CHUNK, crc: int | None = None) -> None:
    """Send ``size`` bytes of ``path`` to rank ``to`` of ``group`` in chunks, then their CRC32: ``crc`` when
    the caller knows it (summed as the file was written), else computed as the chunks are read; -1 when the
    file could not be read whole (zeros were sent in its place, and the receiver refuses it). The next chunk
    is read (and checksummed) on a thread while this one is sent; the receiver uses the same ``chunk``."""
    dst = _global(group, to)
    piece = min(chunk, max(size, 1))
    buffers = (torch.empty(piece, dtype=torch.uint8), torch.empty(piece, dtype=torch.uint8))
    summed, bad = [0], [False]
    try:
        handle = open(path, "rb")  # noqa: SIM115  # closed below, read in chunks
    except OSError:
        handle, bad[0] = None, True

    def fill(index: int, offset: int) -> torch.Tensor:
        part = buffers[index % 2][: min(piece, size - offset)]
        view = part.numpy().data
        try:
            got = handle.readinto(view) if handle is not None else 0
        except OSError:
            got = 0
        if got != len(view):  # the file shrank or failed: zeros, and a CRC that cannot match
            view[got:] = bytes(len(view) - got)
            bad[0] = True
        if crc is None:
            summed[0] = crc32(view, summed[0])
        return part

    try:
        with ThreadPoolExecutor(1, thread_name_prefix="evacuate-read") as reader:
            pending = reader.submit(fill, 0, 0)
            for index, offset in enumerate(range(0, size, piece)):
                part = pending.result()
                if offset + piece < size:  # the other buffer: its chunk was sent before this one
                    pending = reader.submit(fill, index + 1, offset + piece)
                dist.send(part, dst, group=group)
    finally:
        if handle is not None:
            handle.close()
    told = -1 if bad[0] else summed[0] if crc is None else crc
    dist.send(torch.tensor([told], dtype=torch.int64), dst, group=group)


def receive_file(
    group: Any, sender: int, path: Path, size: int, chunk: int = CHUNK
) -> tuple[int, str | None]:
    """Receive what :func:`send_file` sends into ``path``: (its CRC32, None) or (…, the problem: a write
    that failed, a CRC32 that does not match). Receives every byte whatever happens, since the sender is
    blocked until they are read. Each chunk is checksummed on one thread and written on another while the
    next one arrives."""
    src = _global(group, sender)
    piece = min(chunk, max(size, 1))
    buffers = (torch.empty(piece, dtype=torch.uint8), torch.empty(piece, dtype=torch.uint8))
    crc: list[int] = [0]
    problem: list[str] = []
    try:
        handle = open(path, "wb")  # noqa: SIM115  # closed below; written in chunks
    except OSError as exc:
        handle = None
        problem.append(f"cannot write {path}: {exc}")

    def checksum(part: torch.Tensor) -> None:
        crc[0] = crc32(part.numpy().data, crc[0])

    def write(part: torch.Tensor) -> None:
        if handle is not None and not problem:
            try:
                handle.write(part.numpy().data)
            except OSError as exc:
                problem.append(f"cannot write {path}: {exc}")

    try:
        with (
            ThreadPoolExecutor(1, thread_name_prefix="evacuate-crc") as summer,
            ThreadPoolExecutor(1, thread_name_prefix="evacuate-write") as writer,
        ):
            pending: list[tuple[Future[None], Future[None]] | None] = [None, None]
            for index, offset in enumerate(range(0, size, piece)):
                slot = index % 2
                earlier = pending[slot]
                if earlier is not None:  # that buffer's earlier chunk is summed and written first
                    earlier[0].result()
                    earlier[1].result()
                part = buffers[slot][: min(piece, size - offset)]
                dist.recv(part, src, group=group)
                pending[slot] = (summer.submit(checksum, part), writer.submit(write, part))
    finally:
        if handle is not None:
            handle.close()
    told = torch.empty(1, dtype=torch.int64)
    dist.recv(told, src, group=group)
    if not problem and int(told.item()) != crc[0]:
        problem.append(
            f"{path.name} from rank {sender} arrived damaged (CRC32 {crc[0]:#010x}, sent {int(told.item())})"
        )
    return crc[0], problem[0] if problem else None


def file_crc(path: Path) -> int:
    """The CRC32 of a file read back (what was not summed as it was written)."""
    crc = 0
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            crc = crc32(block, crc)
    return crc
