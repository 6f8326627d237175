"""The notified rank's DCP output streamed straight to its buddy: no file on the notified host, and the
buddy writes what arrives while its own DCP write runs.

On the notified rank, :class:`StreamingFileSystem` is DCP's file system: each shard file (``*.distcp``) it is
asked to create goes to the buddy piece by piece as DCP writes it (small writes gathered into one piece,
large ones sent from DCP's own buffer in ``CHUNK`` pieces while their CRC32 is summed on a thread), then its
size and CRC32; any other file (rank 0's ``.metadata``) is written locally and summed, as
:class:`~agent.client.peer._transfer.SummingFileSystem` does, and sent afterwards by path. On the buddy,
a :class:`StreamReceiver` thread per sender writes the pieces into its RAM tier's step directory (the CRC32
of each piece on one thread, its write on another, while the next one arrives) and checks each file's CRC32
and size. The stream runs on a gloo group of its own (made once with the store), never on the group DCP's
collectives use. The sender always ends with :meth:`StreamSender.end` (ok or aborted); a sender that dies
makes the receiver's ``recv`` fail: either way the receiver stops with a problem and nothing it received is
confirmed. Part of :mod:`agent.client.peer.evacuate`.

Frames: a header of four int64 (kind, file index, a, b) and, for ``OPEN`` and ``PIECE``, a payload of ``a``
bytes (the file's name, or a piece); ``CLOSE`` carries (CRC32, size); ``END`` carries 1 (every file was
written) or 0 (the sender's save failed).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import threading
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import numpy
import torch
import torch.distributed as dist

from agent.checkpoint.checksum import crc32
from agent.client.peer._transfer import CHUNK, SummingFileSystem

OPEN, PIECE, CLOSE, END = 1, 2, 3, 4
_GATHER = 256 << 10  # writes smaller than this are gathered into one piece (torch.save writes ~40 per tensor)


def streamed(name: str) -> bool:
    """Whether the notified rank streams this file of its DCP output (its shard files) instead of writing it."""
    return name.endswith(".distcp")


def _tensor(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``view``'s bytes without copying them (DCP lends read-only buffers; they are only
    read: sent)."""
    if not view.readonly:
        return torch.frombuffer(view, dtype=torch.uint8)
    address = numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data
    return torch.frombuffer((ctypes.c_uint8 * len(view)).from_address(address), dtype=torch.uint8)


def send_piece(group: Any, dst: int, header: tuple[int, int, int, int], payload: memoryview | None) -> None:
    """One frame to global rank ``dst``: the header, then the payload's bytes if any."""
    dist.send(torch.tensor(header, dtype=torch.int64), dst, group=group)
    if payload is not None and len(payload):
        dist.send(_tensor(payload), dst, group=group)


class StreamSender:
    """The frames of one notified rank to its buddy (rank ``to`` of ``group``); thread-safe: DCP may write
    several files at once, each frame goes whole."""

    def __init__(self, group: Any, to: int) -> None:
        self.group = group
        self.dst = dist.get_global_rank(group, to)
        self._lock = threading.Lock()
        self._files = 0

    def _send(self, header: tuple[int, int, int, int], payload: memoryview | None = None) -> None:
        with self._lock:
            send_piece(self.group, self.dst, header, payload)

    def open(self, name: str) -> int:
        encoded = name.encode()
        with self._lock:
            index = self._files
            self._files += 1
            send_piece(self.group, self.dst, (OPEN, index, len(encoded), 0), memoryview(encoded))
        return index

    def piece(self, index: int, view: memoryview) -> None:
        self._send((PIECE, index, len(view), 0), view)

    def close(self, index: int, crc: int, size: int) -> None:
        self._send((CLOSE, index, crc, size))

    def end(self, ok: bool) -> None:
        self._send((END, -1, int(ok), 0))


class _Sending(io.RawIOBase):
    """The write stream DCP gets for a streamed file: sends what is written, summing its CRC32."""

    def __init__(self, sender: StreamSender, index: int, pool: ThreadPoolExecutor, chunk: int) -> None:
        super().__init__()
        self.sender = sender
        self.index = index
        self.pool = pool
        self.chunk = chunk
        self.crc = 0
        self.size = 0
        self._gathered = bytearray()

    def _sum(self, piece: memoryview) -> None:
        self.crc = crc32(piece, self.crc)

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if len(self._gathered) + len(view) <= _GATHER:
            self._gathered += view
        else:
            self.flush()
            pieces = [view[o : o + self.chunk] for o in range(0, len(view), self.chunk)]
            summed = [self.pool.submit(self._sum, piece) for piece in pieces]  # in order: one thread
            for piece in pieces:
                self.sender.piece(self.index, piece)
            for future in summed:
                future.result()
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        if self._gathered:
            gathered, self._gathered = memoryview(self._gathered), bytearray()
            self._sum(gathered)
            self.sender.piece(self.index, gathered)

    def tell(self) -> int:
        return self.size


class StreamingFileSystem(SummingFileSystem):
    """DCP's file system on a notified rank: its shard files go to the buddy as they are written (``sent``:
    name → size, once each file's CRC32 and size went after it; ``sums`` has their CRC32s), the rest is
    written and summed locally. :meth:`end` must follow the save, whether it succeeded or not."""

    def __init__(self, group: Any, to: int, chunk: int = CHUNK) -> None:
        super().__init__(chunk)
        self.sender = StreamSender(group, to)
        self.sent: dict[str, int] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        name = Path(path).name
        if mode != "wb" or not streamed(name):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        index = self.sender.open(name)
        with ThreadPoolExecutor(1, thread_name_prefix="evacuate-sum") as pool:
            sending = _Sending(self.sender, index, pool, self.chunk)
            yield sending
            sending.flush()
        self.sender.close(index, sending.crc, sending.size)
        with self._lock:
            self.sums[name] = (sending.crc, sending.size)
            self.sent[name] = sending.size

    def end(self, ok: bool) -> None:
        """Tell the buddy the stream is over: ``ok`` when the save wrote every file."""
        self.sender.end(ok)


class Streams:
    """The streams of one evacuating rank around its DCP save (a context): ``fs`` is the file system its
    writer uses (streaming to ``buddy`` when it has one, else writing and summing locally); a buddy receives
    from each of ``senders`` meanwhile. On leaving, a sender ends its stream (aborted when the save raised)
    and a buddy waits for its receivers: ``received`` (name → (CRC32, size)) and ``problem``."""

    def __init__(self, group: Any, buddy: int | None, senders: list[int], directory: Path) -> None:
        self.fs = StreamingFileSystem(group, buddy) if buddy is not None else SummingFileSystem()
        self.receivers = [StreamReceiver(group, sender, directory) for sender in senders]
        self.received: dict[str, tuple[int, int]] = {}
        self.problem: str | None = None

    @property
    def sent(self) -> dict[str, int]:
        return dict(self.fs.sent) if isinstance(self.fs, StreamingFileSystem) else {}

    def __enter__(self) -> Streams:
        for receiver in self.receivers:
            receiver.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: Any) -> None:
        try:
            if isinstance(self.fs, StreamingFileSystem):
                try:
                    self.fs.end(kind is None)
                except Exception:
                    if kind is None:
                        raise  # else the save's own exception says more; the buddy's recv fails anyway
        finally:
            problems = []
            for receiver in self.receivers:
                files, problem = receiver.result()
                self.received.update(files)
                problems += [problem] if problem else []
            self.problem = "; ".join(problems) or None


class StreamReceiver:
    """Receives one sender's stream into ``directory`` on a thread of its own; :meth:`result` waits for it:
    (name → (CRC32, size) of each file received whole and matching its CRC32, the problem or None)."""

    def __init__(self, group: Any, sender: int, directory: Path, chunk: int = CHUNK) -> None:
        self.group = group
        self.sender = sender
        self.src = dist.get_global_rank(group, sender)
        self.directory = directory
        self.chunk = chunk
        self.files: dict[str, tuple[int, int]] = {}
        self.problems: list[str] = []
        self._thread = threading.Thread(target=self._run, name=f"evacuate-stream-{sender}", daemon=True)

    def start(self) -> StreamReceiver:
        self._thread.start()
        return self

    def result(self) -> tuple[dict[str, tuple[int, int]], str | None]:
        self._thread.join()
        return dict(self.files), "; ".join(self.problems) or None

    def _recv(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.recv(tensor, self.src, group=self.group)
        return tensor

    def _run(self) -> None:
        opened: dict[int, _Incoming] = {}
        try:
            with (
                ThreadPoolExecutor(1, thread_name_prefix="evacuate-crc") as summer,
                ThreadPoolExecutor(1, thread_name_prefix="evacuate-write") as writer,
            ):
                self._receive(opened, summer, writer)
        except Exception as exc:  # the sender died or the group failed: nothing more arrives
            self.problems.append(f"the stream from rank {self.sender} broke: {type(exc).__name__}: {exc}")
        finally:
            for incoming in opened.values():
                incoming.discard()

    def _receive(
        self, opened: dict[int, _Incoming], summer: ThreadPoolExecutor, writer: ThreadPoolExecutor
    ) -> None:
        buffers = (torch.empty(self.chunk, dtype=torch.uint8), torch.empty(self.chunk, dtype=torch.uint8))
        pending: list[list[Future[None]]] = [[], []]
        turn = 0

        def drain() -> None:
            for futures in pending:
                for future in futures:
                    future.result()
                futures.clear()

        header = torch.empty(4, dtype=torch.int64)
        while True:
            kind, index, a, b = (int(x) for x in self._recv(header).tolist())
            if kind == OPEN:
                name = bytes(self._recv(torch.empty(a, dtype=torch.uint8)).numpy()).decode(errors="replace")
                opened[index] = _Incoming(self.directory, name, self.problems)
            elif kind == PIECE:
                incoming = opened.get(index) or _Incoming(self.directory, "", self.problems)  # refused
                if a > self.chunk:  # a sender with a larger chunk: one buffer of its size
                    part = self._recv(torch.empty(a, dtype=torch.uint8))
                    drain()
                    incoming.sum(part)
                    incoming.write(part)
                    continue
                slot, turn = turn, 1 - turn
                for future in pending[slot]:  # that buffer's earlier piece is summed and written first
                    future.result()
                part = self._recv(buffers[slot][:a])
                pending[slot] = [summer.submit(incoming.sum, part), writer.submit(incoming.write, part)]
            elif kind == CLOSE:
                drain()
                incoming = (
                    opened.pop(index) if index in opened else _Incoming(self.directory, "", self.problems)
                )
                if incoming.finish(a, b, self.sender):
                    self.files[incoming.name] = (a, b)
            elif kind == END:
                drain()
                if not a:
                    self.problems.append(f"rank {self.sender}'s save failed: its stream was cut short")
                return
            else:
                raise ValueError(f"unknown frame {kind} from rank {self.sender}")


class _Incoming:
    """One file arriving: its CRC32 and size so far, its handle (None once a write failed)."""

    def __init__(self, directory: Path, name: str, problems: list[str]) -> None:
        self.name = name
        self.path = directory / name
        self.problems = problems
        self.crc = 0
        self.size = 0
        self.handle: BinaryIO | None = None
        if Path(name).name != name or name in ("", ".", ".."):
            problems.append(f"refused a file named {name!r}")
            return
        try:
            self.handle = open(self.path, "wb")  # noqa: SIM115  # closed in finish/discard
        except OSError as exc:
            problems.append(f"cannot write {self.path}: {exc}")

    def sum(self, part: torch.Tensor) -> None:
        self.crc = crc32(part.numpy().data, self.crc)

    def write(self, part: torch.Tensor) -> None:
        self.size += part.numel()
        if self.handle is not None:
            try:
                self.handle.write(part.numpy().data)
            except OSError as exc:
                self.problems.append(f"cannot write {self.path}: {exc}")
                self.discard()

    def finish(self, crc: int, size: int, sender: int) -> bool:
        """Closes the file: True when it was written whole and matches the sender's CRC32 and size."""
        if self.handle is None:
            return False
        try:
            self.handle.close()
        except OSError as exc:
            self.problems.append(f"cannot write {self.path}: {exc}")
            return False
        finally:
            self.handle = None
        if (self.crc, self.size) != (crc, size):
            self.problems.append(
                f"{self.name} from rank {sender} arrived damaged (CRC32 {self.crc:#010x}, {self.size} bytes; "
                f"sent {crc:#010x}, {size} bytes)"
            )
            return False
        return True

    def discard(self) -> None:
        if self.handle is not None:
            with contextlib.suppress(OSError):
                self.handle.close()
            self.handle = None
