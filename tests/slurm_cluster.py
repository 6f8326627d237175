"""A real one-node Slurm cluster for the tests: munged, slurmctld and slurmd from Debian's packages, with a
munge key, a slurm.conf, state and logs in a temporary directory and ports of their own, so nothing of a
Slurm that the machine may already run is touched. Installs the packages when they are missing (as root),
and stops exactly the daemons it started.

The node's Slurm name differs from the hostname (NodeHostname is the hostname, NodeAddr 127.0.0.1), as on
cloud clusters, so the bridge has to find it through NodeHostname/NodeAddr.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
NODE = "pd-spot-1"


class Unavailable(Exception):
    """Slurm cannot run here; the message says why (the tests skip with it)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_packages() -> None:
    """Install Slurm and munge from the distribution when a tool is missing (Debian/Ubuntu, as root)."""
    tools = ("munged", "slurmctld", "slurmd", "sinfo", "squeue", "scontrol", "scancel", "sbatch")
    if all(shutil.which(t) or Path("/usr/sbin", t).exists() for t in tools):
        return
    if os.geteuid() != 0:
        raise Unavailable(
            "Slurm is not installed and installing it needs root (apt-get install " + " ".join(PACKAGES) + ")"
        )
    if shutil.which("apt-get") is None:
        raise Unavailable("Slurm is not installed and this machine has no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise Unavailable(f"{' '.join(argv)} failed: {done.stderr.strip()[-500:]}")


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class SlurmCluster:
    """One controller and one node. ``env`` is what Slurm's client tools need (SLURM_CONF)."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pd-slurm-", dir="/tmp")))
    node: str = NODE
    _pids: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60.0) -> None:
        if os.geteuid() != 0:
            raise Unavailable("slurmd and munged need root to run jobs as their users")
        ensure_packages()
        munge = self.root / "munge"
        keydir = self.root / "munge-key"
        for path in (munge, keydir, self.root / "state", self.root / "spool", self.root / "log"):
            path.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o755)
        keydir.chmod(0o700)
        key = keydir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = munge / "munge.socket"
        self._daemon(
            "munged",
            [
                _sbin("munged"),
                "--force",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
            munge / "munged.pid",
        )
        self._write_conf(socket_path)
        self._daemon("slurmctld", [_sbin("slurmctld"), "-f", str(self.conf)], self.root / "slurmctld.pid")
        self._daemon(
            "slurmd", [_sbin("slurmd"), "-f", str(self.conf), "-N", self.node], self.root / "slurmd.pid"
        )
        self.wait_node(lambda n: "IDLE" in n["states"] and "NOT_RESPONDING" not in n["states"], timeout)

    def _write_conf(self, munge_socket: Path) -> None:
        host = socket.gethostname()
        cpus = os.cpu_count() or 1
        lines = [
            "ClusterName=preemptdtest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            # A short scheduling interval: a released job starts within seconds, not a minute.
            "SchedulerParameters=sched_interval=2,bf_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "JobRequeue=1",
            "MinJobAge=600",
            "KillWait=5",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            f"NodeName={self.node} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            f"PartitionName=main Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemon(self, name: str, argv: Sequence[str], pid_file: Path) -> None:
        """Start a daemon that forks into the background; keep its pid from its pid file."""
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False, env=self.env)
        if done.returncode != 0:
            raise Unavailable(
                f"{name} did not start ({done.returncode}): {done.stderr.strip()[-800:]}{self.logs(name)}"
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                self._pids[name] = int(pid_file.read_text().split()[0])
                return
            except (OSError, ValueError, IndexError):
                time.sleep(0.05)
        raise Unavailable(f"{name} wrote no pid file {pid_file}{self.logs(name)}")

    def logs(self, name: str) -> str:
        path = self.root / "log" / f"{name}.log"
        try:
            return "\n--- " + str(path) + "\n" + path.read_text()[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self._pids.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGCONT)  # a paused controller (a test that failed) would ignore SIGTERM
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    # --- controller outages (the bridge's retries are tested against these) ---

    def pause_controller(self) -> None:
        """SIGSTOP slurmctld: a hung controller. Its port still accepts connections (the kernel's backlog)
        and nothing answers them, so every client call runs into its timeout."""
        os.kill(self._pids["slurmctld"], signal.SIGSTOP)

    def continue_controller(self) -> None:
        os.kill(self._pids["slurmctld"], signal.SIGCONT)

    def kill_controller(self, how: signal.Signals = signal.SIGTERM) -> None:
        """Stop slurmctld: a dead controller (nothing listens on its port; slurmd and the jobs go on).
        SIGTERM lets it save its state first. Before a SIGKILL the node's state is saved on purpose (a
        resume is saved about a second later, and a restart would bring back an older drain); a running
        job's start is not (slurmctld writes it only minutes later), so SIGKILL only without jobs."""
        if how == signal.SIGKILL:
            self._save_node_state()
        pid = self._pids.pop("slurmctld")
        os.kill(pid, how)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if _alive(pid):
            raise AssertionError(f"slurmctld ({pid}) did not stop within 30 s{self.logs('slurmctld')}")
        # The restart must not read the dead daemon's pid.
        (self.root / "slurmctld.pid").unlink(missing_ok=True)

    def _save_node_state(self, timeout: float = 30.0) -> None:
        """Change the node's comment and wait until slurmctld has written its node state file."""
        before = time.time() - 0.05  # file times come from a clock that may lag a tick behind
        self.run("scontrol", "update", f"NodeName={self.node}", f"Comment=saved at {before:.0f}")
        state = self.root / "state" / "node_state"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if state.stat().st_mtime >= before:
                    return
            time.sleep(0.1)
        raise AssertionError(f"slurmctld did not save {state} within {timeout:g} s")

    def start_controller(self, timeout: float = 60.0) -> None:
        """Start slurmctld again on the same slurm.conf (state directory and port): it recovers the jobs and
        the node's drain from its state files. Returns once it answers."""
        self._daemon("slurmctld", [_sbin("slurmctld"), "-f", str(self.conf)], self.root / "slurmctld.pid")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.run("sinfo", "--json", check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise AssertionError(f"slurmctld did not answer within {timeout:g} s{self.logs('slurmctld')}")

    # --- what the tests use ---

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=30, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def node_state(self) -> dict[str, Any]:
        doc = json.loads(self.run("sinfo", "--json", "--nodes", self.node).stdout)
        node = next(n for n in doc["nodes"] if n["name"] == self.node)
        states = _as_set(node.get("state")) | _as_set(node.get("state_flags"))
        return {"states": states, "reason": node.get("reason") or "", "raw": node}

    def wait_node(self, predicate: Any, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        state: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                state = self.node_state()
            except (AssertionError, StopIteration, ValueError):
                state = {}
            if state and predicate(state):
                return state
            time.sleep(0.2)
        raise AssertionError(
            f"node {self.node} did not reach the state in {timeout:g} s: {state}{self.logs('slurmctld')}"
        )

    def submit(self, script: str, *options: str, env: Mapping[str, str] | None = None) -> int:
        path = self.root / f"job-{time.monotonic_ns()}.sh"
        path.write_text("#!/bin/bash\n" + script + "\n")
        done = subprocess.run(
            ["sbatch", "--parsable", f"--output={self.root}/slurm-%j.out", *options, str(path)],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"sbatch failed: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, Any]:
        doc = json.loads(self.run("squeue", "--json", "--states", "all", "--jobs", str(job_id)).stdout)
        for job in doc["jobs"]:
            if job["job_id"] == job_id:
                state = job["job_state"]
                job["state"] = state if isinstance(state, str) else state[0]
                return dict(job)
        raise AssertionError(f"job {job_id} is not known to the controller")

    def wait_job(self, job_id: int, predicate: Any, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        job: dict[str, Any] = {}
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if predicate(job):
                return job
            time.sleep(0.2)
        raise AssertionError(
            f"job {job_id} did not reach the state in {timeout:g} s: {job.get('state')} {job.get('state_reason')}"
        )

    def output(self, job_id: int) -> str:
        try:
            return (self.root / f"slurm-{job_id}.out").read_text()
        except OSError:
            return ""

    def cancel_all(self) -> None:
        self.run("scancel", "--user=root", check=False)
        state = self.node_state()
        if state["states"] & {"DRAIN", "DRAINED", "DRAINING"}:
            self.run("scontrol", "update", f"NodeName={self.node}", "State=RESUME", check=False)


def _as_set(value: Any) -> set[str]:
    if isinstance(value, str):
        return {p.upper() for p in value.replace("+", " ").split()}
    if isinstance(value, list):
        return {str(p).upper() for p in value}
    return set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False
