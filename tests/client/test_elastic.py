"""agent.client.elastic at the rank level: three real processes in a gloo group, each with a stand-in for its
node's torchrun (a process of its own, so the tests can see which were told to stop), and the launcher's
settings read from a real process' command line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.client.reporting import elastic_nodes
from tests.lazy import HAS_TORCH
from tests.support import REPO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_mp,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed"),
]

RANKS = Path(__file__).parents[1] / "elastic_ranks.py"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def _stand_ins(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One long sleep per node, standing in for its torchrun: a SIGTERM ends it with -15."""
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _ranks(
    agents: Sequence[subprocess.Popen[bytes]],
    *args: str,
    hung: int | None = None,
    restarts_used: Sequence[int] = (),
) -> list[tuple[int, dict[str, Any]]]:
    """Run the three ranks; each one's exit status and answer (empty for a rank that printed none). Rank
    ``hung`` is killed once the others have answered; rank i's torchrun has restarted ``restarts_used[i]``
    times of its 3."""
    port = _free_port()
    procs = []
    for rank, agent in enumerate(agents):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "RANK": str(rank),
            "WORLD_SIZE": str(len(agents)),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "TORCHELASTIC_MAX_RESTARTS": "3",
            "TORCHELASTIC_RESTART_COUNT": str(restarts_used[rank] if rank < len(restarts_used) else 0),
        }
        env.pop("PREEMPTD_EXEC_DIR", None)
        command = [sys.executable, str(RANKS), "--agent-pid", str(agent.pid), *args]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    found = []
    for rank, proc in enumerate(procs):
        if rank == hung:
            others = [p for p in procs if p is not proc]
            for other in others:
                other.wait(timeout=100)
            proc.kill()
        out, err = proc.communicate(timeout=100)
        lines = [line for line in out.decode().splitlines() if line.startswith("{")]
        found.append((proc.returncode, json.loads(lines[-1]) if lines else {"stderr": err.decode()[-2000:]}))
    return found


def _signalled(agents: Sequence[subprocess.Popen[bytes]]) -> list[bool]:
    """Which stand-ins a rank told to stop (given a moment for the signal to land)."""
    result = []
    for agent in agents:
        try:
            result.append(agent.wait(timeout=2) == -signal.SIGTERM)
        except subprocess.TimeoutExpired:
            result.append(False)
    return result


def test_the_noticed_node_leaves_and_the_others_form_a_group_of_two_that_works() -> None:
    with _stand_ins(3) as agents:
        found = _ranks(agents, "--noticed", "1")
        assert [0, 75, 0] == [code for code, _ in found], found
        assert ["continue", "leave", "continue"] == [doc["action"] for _, doc in found]
        kept = [doc for _, doc in found if doc["action"] == "continue"]
        assert [(0, 2, 2.0, ["0", "2"]), (1, 2, 2.0, ["1", "2"])] == [
            (d["rank"], d["world_size"], d["sum"], d["env"]) for d in kept
        ]  # the old ranks 0 and 2 summed over the new group, renumbered 0 and 1
        assert [False, True, False] == _signalled(agents)  # only the leaving node's torchrun is told to stop


def test_restart_workers_lets_the_noticed_node_leave_and_the_others_exit_to_be_restarted() -> None:
    """Lightning's way (``restart_workers``): the same agreement, no group is built; the staying ranks answer
    ``restart`` at world size 2 and only the leaving node's torchrun is told to stop."""
    with _stand_ins(3) as agents:
        found = _ranks(agents, "--noticed", "1", "--restart")
        assert [75] * 3 == [code for code, _ in found], found
        assert [("restart", 2), ("leave", 2), ("restart", 2)] == [
            (doc["action"], doc["world_size"]) for _, doc in found
        ]
        assert [False, True, False] == _signalled(agents)


def test_restarting_the_workers_stops_the_job_when_a_staying_torchrun_has_no_restart_left() -> None:
    with _stand_ins(3) as agents:
        found = _ranks(agents, "--noticed", "1", "--restart", restarts_used=(0, 0, 3))
        assert {"stop"} == {doc["action"] for _, doc in found}, found
        assert "no restart left" in found[0][1]["reason"]
        assert [True] * 3 == _signalled(agents)  # the job stops for the notice: no restart in its window


def test_two_notices_at_once_leave_two_nodes_and_the_other_two_go_on() -> None:
    """N = 4, notices on nodes 1 and 3 at once, MIN 2: N - 2 >= MIN, so both leave together and 0 and 2 go on."""
    with _stand_ins(4) as agents:
        found = _ranks(agents, "--noticed", "1", "3", "--max-nodes", "4")
        assert [0, 75, 0, 75] == [code for code, _ in found], found
        kept = [doc for _, doc in found if doc["action"] == "continue"]
        assert [(0, 2, 2.0), (1, 2, 2.0)] == [(d["rank"], d["world_size"], d["sum"]) for d in kept]
        assert [False, True, False, True] == _signalled(agents)


def test_below_min_every_rank_stops_and_every_torchrun_is_told_to_stop() -> None:
    with _stand_ins(3) as agents:
        found = _ranks(agents, "--noticed", "1", "--min-nodes", "3", "--max-nodes", "4")
        assert [75] * 3 == [code for code, _ in found], found
        assert {("stop", "2 node(s) would stay, below --nnodes MIN 3")} == {
            (doc["action"], doc["reason"]) for _, doc in found
        }
        assert [True] * 3 == _signalled(agents)


def test_a_signal_without_a_notice_makes_no_node_leave_and_tells_no_torchrun_to_stop() -> None:
    """torchrun stopping its own workers (a restart, a grow) looks like this: every rank stops, torchrun goes on."""
    with _stand_ins(3) as agents:
        found = _ranks(agents)
        assert [75] * 3 == [code for code, _ in found], found
        assert {("stop", "no rank has the notice")} == {(doc["action"], doc["reason"]) for _, doc in found}
        assert [False] * 3 == _signalled(agents)


def test_a_staying_rank_that_dies_during_the_re_form_turns_the_answer_into_stop_within_the_timeout() -> None:
    with _stand_ins(3) as agents:
        found = _ranks(agents, "--noticed", "1", "--die", "2")
        assert [75, 75, 9] == [code for code, _ in found], found
        assert "stop" == found[0][1]["action"]
        assert "re-form at 2 rank(s) failed" in found[0][1]["reason"], found[0][1]
        assert "leave" == found[1][1]["action"]
        assert [True, True] == _signalled(agents)[
            :2
        ]  # the job stops for the notice: no restart in its window


def test_a_staying_rank_that_hangs_during_the_re_form_is_waited_for_only_reform_timeout() -> None:
    """A frozen staying rank (alive, sockets open, silent) never arrives at the new group's store: the others
    stop after ``reform_timeout`` (3 s here) instead of gloo's 30 minutes, and the notice stops the job."""
    with _stand_ins(3) as agents:
        found = _ranks(agents, "--noticed", "1", "--hang", "2", hung=2)
        assert [75, 75, -signal.SIGKILL] == [code for code, _ in found], found
        assert ("stop", "leave") == (found[0][1]["action"], found[1][1]["action"])
        assert "re-form at 2 rank(s) failed" in found[0][1]["reason"], found[0][1]
        assert [True, True] == _signalled(agents)[:2]


def test_the_launch_is_read_from_torchruns_own_command_line(tmp_path: Path) -> None:
    """``python …/torchrun --nnodes 2:4 --rdzv-backend c10d …`` as the parent: its flags, parsed by torchrun's
    own parser, the training script's own flags left alone."""
    from agent.client.launch import Launch, listens_on, torchrun_args

    script = tmp_path / "torchrun"
    script.write_text("import time\ntime.sleep(600)\n")
    argv = [
        sys.executable,
        str(script),
        "--nnodes",
        "2:4",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "10.0.0.1:29555",
        "--max-restarts",
        "3",
        "train.py",
        "--nnodes",
        "9",
    ]
    proc = subprocess.Popen(argv)
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        while str(script) not in cmdline.read_bytes().decode():  # until the child has exec'd the script
            time.sleep(0.01)
        launch = Launch.of_parent(proc.pid)
        assert launch is not None
        assert (2, 4, "c10d", "10.0.0.1:29555", 3, 29555, True) == (
            launch.min_nodes,
            launch.max_nodes,
            launch.rdzv_backend,
            launch.rdzv_endpoint,
            launch.max_restarts,
            launch.store_port,
            launch.elastic,
        )
    finally:
        proc.kill()
        proc.wait()
    assert ["--nnodes", "3"] == torchrun_args(["python3", "-m", "torch.distributed.run", "--nnodes", "3"])
    assert torchrun_args(["python3", "train.py"]) is None
    assert Launch.of_parent(os.getpid()) is None  # pytest is not torchrun
    static = Launch(1, 3, 3, "c10d", "h:1", 0)
    assert not static.elastic
    assert Launch(1, 2, 3, "etcd-v2", "h:2379", 0).store_port is None
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert listens_on(os.getpid(), port)
    assert not listens_on(os.getpid(), port)


@pytest.mark.parametrize(
    ("nnodes", "expected"),
    [("2:3", "1 2:3 min 2"), ("--nnodes=1:4", "1 1:4 min 1"), ("3", "min -"), ("2:2", "min -")],
)
def test_exec_turns_torchruns_shared_store_off_for_an_elastic_launch(
    tmp_path: Path, nnodes: str, expected: str
) -> None:
    """A later round after a shrink would wait on the first round's store (served by a node that left): exec
    sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for ``torchrun --nnodes MIN:MAX`` unless it is set already, and
    PREEMPTD_ELASTIC_NODES, which the ranks' registration (client_info) reports as min_nodes/max_nodes."""
    script = tmp_path / "torchrun"
    script.write_text(
        f'#!/bin/sh\nprintf \'%s %s \' "$TORCH_DISABLE_SHARE_RDZV_TCP_STORE" "$PREEMPTD_ELASTIC_NODES"\n'
        f"exec {sys.executable} -c 'from agent.client.reporting import client_info; "
        'print("min", client_info().get("min_nodes", "-"))\'\n'
    )
    script.chmod(0o755)
    flags = [nnodes] if nnodes.startswith("--") else ["--nnodes", nnodes]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "PREEMPTD_ELASTIC_NODES")
    }
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-m", "agent", "exec", "--", str(script), *flags],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (0, expected) == (done.returncode, done.stdout.strip()), done.stderr


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2:3", {"min_nodes": 2, "max_nodes": 3}), ("3", {}), ("3:2", {}), ("0:2", {}), ("a:b", {}), ("", {})],
)
def test_elastic_nodes_of_the_launch(value: str, expected: dict[str, int]) -> None:
    assert elastic_nodes(value) == expected


def test_exec_notes_a_stopping_signal_for_its_command_to_tell_from_its_launchers(tmp_path: Path) -> None:
    """A SIGTERM that reaches exec (a scheduler stopping the job) is noted in the channel directory before it is
    passed on; a signal the command's own launcher sends (torchrun stopping its workers to grow) is not."""
    child = tmp_path / "child.py"
    child.write_text(
        textwrap.dedent("""
        import signal, sys, time
        from agent.client.preempted import stopped_from_outside
        def stop(signum, frame):
            print("outside" if stopped_from_outside() else "launcher", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGUSR2, lambda *a: stop(0, None))
        print("ready", stopped_from_outside(), flush=True)
        time.sleep(60)
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    answers = []
    for outside in (False, True):
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "exec", "--no-hold", "--", sys.executable, str(child)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert "ready False" == proc.stdout.readline().strip()
        if outside:
            proc.send_signal(signal.SIGTERM)  # to exec, as a scheduler would
        else:
            command = next(
                p for p in psutil.Process(proc.pid).children(recursive=True) if "exec" not in p.cmdline()
            )
            os.kill(command.pid, signal.SIGUSR2)  # straight to the command, as its launcher would
        answers.append(proc.stdout.readline().strip())
        proc.wait(timeout=30)
        proc.stdout.close()
    assert ["launcher", "outside"] == answers


async def test_a_hosts_capacity_pool_for_the_re_form_is_read_from_its_agent_once_it_knows_it(
    base: Path,
) -> None:
    """What a rank tells the others of its host at a re-form (``Member.pool``), so that the staying hosts avoid
    the departed hosts' pools as snapshot holders (``Siblings.pools``): its agent's domain, through the RAM
    tier; None (and asked again next time) while the agent does not know it or cannot be reached."""
    from agent.client.elastic import Elastic
    from agent.simulate import AwsSimulator
    from tests.cloud_harness import rig

    settings = {"ram_tier.enabled": True, "ram_tier.path": str(base / "ram"), "ram_tier.cap_bytes": 1 << 20}
    assert Elastic(socket_path=base / "none.sock")._host_pool() is None
    async with AwsSimulator() as sim, rig("aws", base, sim=sim, settings=settings) as r:
        await r.status_until(lambda d: d["agent"].get("domain") is not None, "the domain", timeout=20)
        elastic = Elastic(socket_path=r.socket)
        pool = await asyncio.to_thread(elastic._host_pool)
    assert "aws/p4d.24xlarge/us-east-1a/spot" == pool
    assert pool == elastic._host_pool()  # kept: the agent is gone now
