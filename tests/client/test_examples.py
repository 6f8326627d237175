"""The training examples as a new user reads their output: two ranks' progress lines never share a line, and
torch's FSDP2 view-tensor warning is not repeated by every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import REPO

pytest.importorskip("torch")

EXAMPLES = ("fault_tolerant_training.py", "sharded_training.py")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    # No agent: the examples train on and keep looking for one in the background.
    environ.update(
        {
            "PREEMPTD_SOCKET": str(tmp_path / "no-agent.sock"),
            "PYTHONPATH": str(REPO),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            **extra,
        }
    )
    return environ


def _lines(out: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.torch_mp
@pytest.mark.parametrize("example", EXAMPLES)
def test_two_processes_emitting_at_once_never_share_a_line(example: str, tmp_path: Path) -> None:
    """Two processes on one stdout pipe (unbuffered, as torchrun's ranks under ``preemptd demo``), released
    together and each writing 2000 progress lines with the example's emit(): every line read back is one whole
    JSON object."""
    per_process, pad = 2000, "x" * 600
    code = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(REPO / "examples")!r})
        from {example.removesuffix(".py")} import emit

        gate_read, gate_write = os.pipe()
        children = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                os.close(gate_write)
                os.read(gate_read, 1)  # both start when the gate closes
                for index in range({per_process}):
                    emit("tick", rank=rank, index=index, pad={pad!r})
                os._exit(0)
            children.append(pid)
        os.close(gate_write)
        sys.exit(max(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=_env(tmp_path, PYTHONUNBUFFERED="1"),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert 0 == proc.returncode, proc.stderr
    broken = [line[:120] for line in proc.stdout.splitlines() if not line.startswith('{"event": "tick"')]
    assert [] == broken
    ticks = _lines(proc.stdout)
    assert [per_process, per_process] == [sum(1 for t in ticks if t["rank"] == rank) for rank in (0, 1)]


@pytest.mark.torch_mp
def test_sharded_example_on_two_ranks_shows_no_fsdp_view_warning(tmp_path: Path) -> None:
    """The sharded example under torchrun with two ranks: FSDP2's "returned a view tensor" warning, which does
    not apply to its loop, is not printed (it was, once per rank)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    example = [str(REPO / "examples" / "sharded_training.py"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(
        [*torchrun, *example, "--steps", "2", "--no-signals"],
        check=False,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert 0 == proc.returncode, proc.stderr
    assert (2, 0) == (
        sum(1 for e in _lines(proc.stdout) if e["event"] == "done"),
        proc.stderr.count("returned a view tensor"),
    )
