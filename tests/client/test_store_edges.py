"""The checkpoint store on its edges: a root holding another run's higher steps, a full disk, a directory the
user cannot write, malformed manifests, and a step that verifies by size but does not load."""

from __future__ import annotations

import asyncio
import errno
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.client import CheckpointError, CheckpointStore, CheckpointWarning, Reporter
from agent.client.preempted import ENV, read_records
from agent.core.reports import Report
from tests.lazy import Lazy
from tests.store_fs import fill, small_fs
from tests.support import REPO, http_json, running_agent

__all__ = ["small_fs"]  # the fixture, used by name

# torch and agent.client.torch are imported by the first test that uses them (tests/lazy.py).
torch = Lazy("torch")
agree_load = Lazy("agent.client.torch", "agree_load")
load_torch = Lazy("agent.client.torch", "load_torch")
torch_writer = Lazy("agent.client.torch", "torch_writer")


def write_files(files: dict[str, bytes]) -> Callable[[Path], None]:
    def writer(directory: Path) -> None:
        for name, data in files.items():
            (directory / name).write_bytes(data)

    return writer


def store(root: Path, keep: int = 3, **options: Any) -> CheckpointStore:
    return CheckpointStore(root, keep, report=False, **options)


def older_run(root: Path) -> None:
    """Steps 100 to 102 of another run, as a root reused by a new job holds them."""
    for step in (100, 101, 102):
        store(root).save(step, write_files({"a": b"old"}))


# -- 1. a root that holds an older run's higher steps


def test_a_lower_step_than_the_newest_starts_a_new_run_that_is_kept_and_resumed(tmp_path: Path) -> None:
    older_run(tmp_path)
    s = store(tmp_path)
    with pytest.warns(
        CheckpointWarning, match=r"step 5 into .*newest checkpoint is step 102: this starts run 1"
    ):
        saved = s.save(5, write_files({"a": b"new"}))
    latest = s.latest()
    assert latest is not None
    assert (True, 5, b"new", 1, [5, 102, 101]) == (
        saved.path.is_dir(), latest.step, latest.file("a").read_bytes(), latest.run, s.steps(),
    )  # fmt: skip


def test_the_new_runs_saves_prune_the_older_runs_steps_first_without_warning_again(tmp_path: Path) -> None:
    older_run(tmp_path)
    s = store(tmp_path)
    with pytest.warns(CheckpointWarning):
        s.save(5, write_files({"a": b"new"}))
    s.save(6, write_files({"a": b"new"}))  # filterwarnings=error: a second warning would fail here
    s.save(7, write_files({"a": b"new"}))
    assert [7, 6, 5] == s.steps()


def test_saving_the_newest_step_again_stays_in_its_run(tmp_path: Path) -> None:
    older_run(tmp_path)
    again = store(tmp_path).save(102, write_files({"a": b"again"}))
    assert (0, [102, 101, 100]) == (again.run, store(tmp_path).steps())


def test_start_run_begins_a_new_run_on_purpose_without_a_warning(tmp_path: Path) -> None:
    """A job that trains from scratch in a root an earlier run used: even its higher step is a new run."""
    older_run(tmp_path)
    s = store(tmp_path)
    s.start_run()
    first = s.save(1, write_files({"a": b"new"}))  # filterwarnings=error: a warning would fail here
    then = s.save(2, write_files({"a": b"new"}))
    assert (1, 1, [2, 1, 102]) == (first.run, then.run, s.steps())


# -- 2. storage failures


def test_a_save_that_fills_the_disk_names_the_space_and_keeps_the_earlier_step(small_fs: Path) -> None:
    s = store(small_fs)
    s.save(1, torch_writer({"w": torch.zeros(1000)}))
    with pytest.raises(CheckpointError) as caught:
        s.save(2, torch_writer({"w": torch.zeros(1 << 19)}))  # 2 MiB into a 1 MiB file system
    error = caught.value
    latest = s.latest()
    assert latest is not None
    assert ("no_space", 1, []) == (error.reason, latest.step, [p.name for p in small_fs.glob(".tmp-*")])
    assert re.search(
        rf"save of step 2 under {small_fs} failed: no space left on the file system of {small_fs}: \d+ bytes "
        r"\(.* MiB\) were free when the save started and it needs more .*the newest committed step, 1, "
        r"takes \d+ bytes",
        str(error),
    ), str(error)


async def test_a_failed_emergency_save_hands_the_notice_to_the_earlier_step_for_exec_and_the_agent(
    small_fs: Path, base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """exec exits 75 on the record, and the agent hears the save failed with the step it fell back to."""
    from agent.cli.exec import decide

    channel = tmp_path / "exec"
    channel.mkdir()
    monkeypatch.setenv(ENV, str(channel))
    reports: list[Report] = []
    async with running_agent(base) as agent:
        agent.hooks.on_report(reports.append)
        reporter = Reporter(base / "a.sock")
        s = CheckpointStore(small_fs, reporter=reporter)
        await asyncio.to_thread(s.save, 1, torch_writer({"w": torch.zeros(1000)}))
        big = torch_writer({"w": torch.zeros(1 << 19)})
        with pytest.raises(CheckpointError) as caught:
            await asyncio.to_thread(s.save, 2, big, emergency=True, notice_id="n-1")
        assert await asyncio.to_thread(reporter.flush, 10.0)
        await asyncio.to_thread(s.close)
    fallback = caught.value.fallback
    [record] = read_records(channel)
    [failed] = [r for r in reports if r.phase == "failed"]
    assert fallback is not None
    assert (1, True, 2, "n-1", "no space left" in record["error"]) == (
        fallback.step, record["fallback"], record["failed_step"], record["notice_id"], True,
    )  # fmt: skip
    assert (2, True, "n-1", {"fallback_step": 1}) == (
        failed.step, failed.emergency, failed.notice_id, dict(failed.flush),
    )  # fmt: skip
    assert 75 == decide(1, [record], ["torchrun"], io.StringIO())


def test_a_failed_emergency_save_without_an_earlier_step_records_nothing(
    small_fs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    channel = tmp_path / "exec"
    channel.mkdir()
    monkeypatch.setenv(ENV, str(channel))
    with pytest.raises(CheckpointError) as caught:
        store(small_fs).save(1, torch_writer({"w": torch.zeros(1 << 19)}), emergency=True)
    assert (None, "no_space", []) == (caught.value.fallback, caught.value.reason, read_records(channel))


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_the_example_on_a_disk_that_fills_up_exits_75_with_the_step_it_had(
    base: Path, small_fs: Path
) -> None:
    """examples/fault_tolerant_training.py under exec: step 1 fits, the disk fills while it trains, a drill:
    the emergency save fails, the example reports the fallback step and exits 75."""
    from tests.client.test_dcp import Run

    ckpt = small_fs / "ckpt"
    example = [
        sys.executable,
        str(REPO / "examples" / "fault_tolerant_training.py"),
        "--checkpoint-dir",
        str(ckpt),
    ]
    first = await Run.start(
        [*example, "--steps", "1", "--interval-s", "0.001", "--socket", str(base / "no.sock")]
    )
    assert 0 == await first.finish(), first.stderr[-3000:]
    async with running_agent(base):
        sock = base / "a.sock"
        command = [*example, "--steps", "100000", "--step-time", "0.02", "--socket", str(sock)]
        run = await Run.start([sys.executable, "-m", "agent", "exec", "--", *command])
        await run.until("agent_connected")
        fill(small_fs)
        status, body = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
        assert status == 201, body
        code = await run.finish()
    [preempted] = run.of("preempted")
    assert (75, 1, True) == (code, preempted["step"], "no space left" in preempted["error"]), run.stderr[
        -3000:
    ]
    assert preempted["failed_step"] > 1


_AS_NOBODY = textwrap.dedent(
    """
    import os, sys
    from agent.client import CheckpointError, CheckpointStore
    os.setgid(65534)
    os.setuid(65534)  # from here on an unprivileged user, as a training job runs
    try:
        CheckpointStore(sys.argv[1], report=False).save(1, lambda d: (d / "a").write_bytes(b"x"))
    except CheckpointError as exc:
        print(exc.reason, exc, sep="\\n")
    """
)


def test_a_root_the_user_cannot_write_is_a_permission_error_naming_it() -> None:
    """A real process that gave up root (whose writes bypass permissions) saving into root's directory."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the save as another user")
    top = Path(tempfile.mkdtemp(prefix="pd-perm-"))  # under /tmp, reachable by every user
    try:
        top.chmod(0o755)
        root = top / "ckpt"
        root.mkdir()
        done = subprocess.run(
            [sys.executable, "-c", _AS_NOBODY, str(root)],
            capture_output=True, text=True, check=False, cwd=str(REPO),
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    finally:
        shutil.rmtree(top, ignore_errors=True)
    reason, message = [*done.stdout.splitlines(), "", ""][:2]
    assert ("permission", True) == (reason, f"permission denied on {root}/.tmp-" in message), done.stderr
    assert f"check the owner and mode of {root}" in message


def _raised_in_a_writer(error: OSError) -> RuntimeError:
    """What torch's writer raises when the file object under it fails: its own error, the OSError its
    context."""
    try:
        try:
            raise error
        except OSError:
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
            ) from None
    except RuntimeError as wrapped:
        wrapped.__context__ = error
        return wrapped


@pytest.mark.parametrize(
    ("code", "reason", "says"),
    [
        (
            errno.EIO,
            "io",
            "I/O error on /ckpt/x (.*): the disk or network file system failed; see the kernel log",
        ),
        (errno.EROFS, "read_only", "the file system of /ckpt is read-only .*remount it read-write"),
        (errno.EDQUOT, "no_space", "no space left on the file system of /ckpt: 4096 bytes"),
        (errno.EACCES, "permission", "permission denied on /ckpt/x"),
        (errno.ENAMETOOLONG, "os", r"File name too long: '/ckpt/x' \(RuntimeError: .*unexpected pos"),
    ],
)
def test_a_save_failure_names_the_storage_cause_found_behind_torchs_error(
    code: int, reason: str, says: str
) -> None:
    """The errno is found in the exception's context, as torch's writer leaves it."""
    from agent.client.store_failure import save_failure

    exc = _raised_in_a_writer(OSError(code, os.strerror(code), "/ckpt/x"))
    error = save_failure(exc, 3, Path("/ckpt"), None, 4096, lambda: None)
    assert (reason, True) == (error.reason, bool(re.search(says, str(error)))), str(error)


# -- 3. malformed manifests and a step that does not load


def _manifest_with(path: Path, field: str, raw: str) -> None:
    """Set ``field`` of the manifest at ``path`` to the raw JSON text ``raw`` (which json.dumps cannot
    write: 1e400, a nesting too deep to parse)."""
    doc = json.loads(path.read_text())
    doc[field] = "@@"
    path.write_text(json.dumps(doc).replace('"@@"', raw))


@pytest.mark.parametrize(
    ("field", "raw", "why"),
    [
        ("step", "1e400", "'step' must be a whole number"),
        ("step", '"2"', "'step' must be a whole number"),
        ("metadata", "12345", "'metadata' must be dict"),
        ("bytes", "-1", "'bytes' must be a whole number"),
        ("time", "5", "'time' must be an ISO 8601 time"),
        ("emergency", '"yes"', "'emergency' must be bool"),
        ("duration_s", "NaN", "'duration_s' must be a finite number"),
        ("files", '"x"', "'files' must be a list"),
        ("files", '[{"path": "../../x", "bytes": 1}]', "'files\\[0\\].path' must be a relative path"),
        ("files", '[{"path": "a", "bytes": 1, "crc32": -3}]', "'files\\[0\\].crc32' must be a CRC32"),
        ("metadata", "[" * 100_000 + "]" * 100_000, "unreadable"),
    ],
)
def test_a_malformed_manifest_is_skipped_with_a_warning_naming_the_file_and_field(
    tmp_path: Path, field: str, raw: str, why: str
) -> None:
    s = store(tmp_path)
    s.save(1, write_files({"a": b"good"}))
    s.save(2, write_files({"a": b"good"}))
    manifest = tmp_path / "step-000000000002" / "manifest.json"
    _manifest_with(manifest, field, raw)
    with pytest.warns(CheckpointWarning, match=f"{re.escape(str(manifest))}: .*{why}"):
        latest = s.latest()
    assert latest is not None
    assert 1 == latest.step


def _unloadable_emergency_step(root: Path, step: int) -> Path:
    """An emergency step whose CRCs were never written (as when the process dies before its deferred
    checksums finish) and whose file then reads as garbage of the right size; its file."""
    store(root, checksum=False).save(
        step, torch_writer({"w": torch.full((100,), float(step))}), emergency=True
    )
    state = root / f"step-{step:012d}" / "state.pt"
    state.write_bytes(bytes(state.stat().st_size))
    return state


def test_a_step_that_verifies_by_size_but_does_not_load_falls_back_to_the_previous(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.save(1, torch_writer({"w": torch.full((100,), 1.0)}))
    state = _unloadable_emergency_step(tmp_path, 2)
    with pytest.warns(CheckpointWarning, match=f"{re.escape(str(state))}: torch cannot load it"):
        found = s.load_latest(load_torch)
    assert found is not None
    checkpoint, loaded = found
    assert (1, 1.0) == (checkpoint.step, loaded["w"][0].item())


_AGREE = textwrap.dedent(
    """
    import json, sys, warnings
    import torch.distributed as dist
    from agent.client import CheckpointStore
    from agent.client.torch import agree_load, load_torch
    dist.init_process_group("gloo")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        found = agree_load(CheckpointStore(sys.argv[1], report=False), load_torch)
    print(json.dumps({"step": found[0].step, "value": found[1]["w"][0].item(),
                      "warnings": [str(w.message) for w in seen]}))
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.torch_mp
def test_ranks_agree_on_the_previous_step_when_one_ranks_newest_does_not_load(tmp_path: Path) -> None:
    """Rank 1's step 2 does not load; rank 0's does: both resume from step 1, in two real processes, and both
    say why step 2 was skipped."""
    for rank in (0, 1):
        store(tmp_path / f"rank-{rank}").save(1, torch_writer({"w": torch.full((100,), 1.0)}))
    store(tmp_path / "rank-0").save(2, torch_writer({"w": torch.full((100,), 2.0)}))
    _unloadable_emergency_step(tmp_path / "rank-1", 2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo",
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        command = [sys.executable, "-c", _AGREE, str(tmp_path / f"rank-{rank}")]
        procs.append(
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        )
    outs = [proc.communicate(timeout=50) for proc in procs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _err in outs]
    assert [(1, 1.0), (1, 1.0)] == [(r["step"], r["value"]) for r in results], [e for _o, e in outs]
    # Both skip step 2 saying why, rank 0 too, whose own step 2 loaded.
    assert [True, True] == [
        bool(re.match(r"skipping step 2: rank 1: .*state\.pt: torch cannot load it", r["warnings"][0]))
        for r in results
    ], results


def test_agree_load_without_a_process_group_is_the_local_load_latest(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.save(1, torch_writer({"w": torch.full((100,), 1.0)}))
    _unloadable_emergency_step(tmp_path, 2)
    with pytest.warns(CheckpointWarning, match="torch cannot load it"):
        found = agree_load(s, load_torch)
    assert found is not None
    assert 1 == found[0].step
