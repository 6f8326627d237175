"""The RAM tier under the packaged systemd unit (docs/ram-tier.md, "Under the packaged systemd unit"): the
unit's capability and system call settings are what the tier needs, and a real agent running as an
unprivileged user with exactly the unit's capabilities (setpriv, as the unit's AmbientCapabilities= give them)
serves a job of a third user: the job's directory is given to that user, the drain runs as that user with no
capability left, and without CAP_SETUID/CAP_SETGID the drain fails saying so. Needs root (it makes the other
users' processes) and util-linux setpriv."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ramtier.support import JOB, request_as, write_step
from tests.support import REPO, http_json, short_tmp

UNIT = REPO / "systemd" / "preemptd.service"
SETPRIV = shutil.which("setpriv")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
AGENT_UID = 64321  # the unit's "preemptd": no name needed, setpriv takes numbers
JOB_UID = 65534
STEP = 5
# What the tier does on the agent's behalf (chown a job's directory) and on the drain's (take the job's user,
# drop the capabilities); and what must stay forbidden.
TIER_CALLS = {
    "chown",
    "fchown",
    "fchownat",
    "lchown",
    "setgroups",
    "setresgid",
    "setresuid",
    "capset",
    "prctl",
}
STILL_DENIED = {"chroot", "pivot_root", "bpf", "acct", "setfsuid", "setrlimit", "mount", "reboot"}

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or SETPRIV is None, reason="needs root and util-linux setpriv to run other users"
)


def unit_values(key: str) -> list[str]:
    return [
        line.split("=", 1)[1].strip() for line in UNIT.read_text().splitlines() if line.startswith(f"{key}=")
    ]


def unit_capabilities() -> list[str]:
    return [cap for value in unit_values("AmbientCapabilities") for cap in value.split()]


def setpriv_caps(caps: list[str]) -> str:
    return ",".join("+" + cap.removeprefix("CAP_").lower() for cap in caps)


def as_unit_user(caps: list[str]) -> list[str]:
    """setpriv as the unit starts the agent: its own user, no groups, the capabilities ambient and bounding,
    no_new_privs."""
    assert SETPRIV is not None
    spec = setpriv_caps(caps)
    return [
        SETPRIV, f"--reuid={AGENT_UID}", f"--regid={AGENT_UID}", "--clear-groups", f"--inh-caps=-all,{spec}",
        f"--ambient-caps={spec}", f"--bounding-set=-all,{spec}", "--no-new-privs", "--",
    ]  # fmt: skip


def test_the_unit_grants_the_tier_its_capabilities_ambient_and_bounding() -> None:
    ambient = set(unit_capabilities())
    bounding = {cap for value in unit_values("CapabilityBoundingSet") for cap in value.split()}
    assert ambient == bounding
    assert {"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_SYSLOG"} == ambient
    # Stopping the service must not delete the tier's files under /dev/shm: it outlives agent restarts.
    assert ["no"] == unit_values("RemoveIPC")


def expand(token: str, seen: dict[str, set[str]]) -> set[str]:
    """A system call group as systemd knows it, nested groups included; a plain name is itself."""
    if not token.startswith("@"):
        return {token}
    if token not in seen:
        assert SYSTEMD_ANALYZE is not None
        out = subprocess.run(
            [SYSTEMD_ANALYZE, "syscall-filter", token], capture_output=True, text=True, check=True, timeout=30
        ).stdout
        names = [
            line.strip() for line in out.splitlines()[1:] if line.strip() and not line.strip().startswith("#")
        ]
        seen[token] = set().union(*(expand(name, seen) for name in names)) if names else set()
    return seen[token]


def unit_filter(lines: list[str]) -> set[str]:
    """The system calls ``SystemCallFilter=`` lines allow, by systemd's rule: the first line is an allow list;
    later ~lines remove from it, later plain lines add to it."""
    seen: dict[str, set[str]] = {}
    allowed: set[str] = set()
    for number, value in enumerate(lines):
        deny = value.startswith("~")
        names = set().union(*(expand(token, seen) for token in value.lstrip("~").split()))
        assert not (number == 0 and deny), "the first SystemCallFilter= must be an allow list"
        allowed = allowed - names if deny else allowed | names
    return allowed


needs_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)"
)


@pytest.mark.service
@needs_analyze
def test_the_units_system_call_filter_lets_the_tiers_calls_through_and_no_more() -> None:
    allowed = unit_filter(unit_values("SystemCallFilter"))
    assert set() == TIER_CALLS - allowed
    assert set() == STILL_DENIED & allowed


# In the child: the unit's system call filter as a real seccomp filter (libseccomp through ctypes), then the
# agent's chown of a job's directory
# (inventory.make_step_dir), then the drain's identity switch; what is left, read from /proc.
# The unit's SystemCallFilter= as seccomp applies it: every call not allowed fails with EPERM
# (SystemCallErrorNumber=EPERM); it stays across exec, as systemd's does.
LOAD_FILTER = """
import ctypes, errno


def load_filter(allowed):
    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(0x00050000 | errno.EPERM)
    for name in allowed:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number >= 0:
            assert lib.seccomp_rule_add(ctx, 0x7FFF0000, number, 0) == 0, name
    assert lib.seccomp_load(ctx) == 0
"""
# Loads the filter given as JSON in argv[1], then runs argv[2:].
UNDER_FILTER = (
    LOAD_FILTER
    + """
import json, os, sys
load_filter(json.loads(sys.argv[1]))
os.execv(sys.argv[2], sys.argv[2:])
"""
)
PROBE = (
    LOAD_FILTER
    + """
import json, os, sys
from pathlib import Path
from agent.ramtier import identity
from agent.ramtier.inventory import TierError, make_step_dir, prepare_root
uid, give, allowed = json.loads(sys.stdin.read())
# MemoryDenyWriteExecute=yes as the kernel's own prctl (Linux >= 6.3): the drop's ctypes calls work.
mdwe = ctypes.CDLL(None).prctl(65, 1, 0, 0, 0) == 0
if allowed is not None:
    load_filter(allowed)
out = {"mdwe": mdwe}
if give is not None:
    try:
        make_step_dir(prepare_root(Path(give)), uid, uid, "job-1", 1)
    except TierError as exc:
        out["give_error"] = str(exc)
    job = Path(give) / str(uid) / "job-1"
    out["given_to"] = os.stat(job).st_uid if os.path.exists(job) else None
try:
    identity.become(uid, uid)
except PermissionError as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
else:
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    out.update(ids=[os.getresuid(), os.getresgid(), os.getgroups()], no_new_privs=status["NoNewPrivs"].strip())
    out.update(identity.capabilities())
print(json.dumps(out))
"""
)


def drain_probe(
    uid: int, caps: list[str], give: Path | None = None, allowed: set[str] | None = None
) -> dict[str, Any]:
    """Run PROBE as the unit runs the agent (``caps``), under the system call filter ``allowed`` if given."""
    done = subprocess.run(
        [*as_unit_user(caps), sys.executable, "-c", PROBE],
        input=json.dumps([uid, str(give) if give else None, sorted(allowed) if allowed is not None else None]),
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert 0 == done.returncode, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@needs_root
def test_the_drain_takes_the_jobs_user_and_keeps_no_capability() -> None:
    """Capabilities survive a switch between two non-root users: the drain drops every one itself."""
    held = drain_probe(AGENT_UID, unit_capabilities())  # the agent's own user: no switch, still dropped
    switched = drain_probe(JOB_UID, unit_capabilities())
    job = [JOB_UID] * 3
    assert ([job, job, []], "1") == (switched["ids"], switched["no_new_privs"])
    assert held["mdwe"] is switched["mdwe"]  # True where the kernel has PR_SET_MDWE
    for probe in (held, switched):
        assert (0, 0, 0, 0) == (probe["CapEff"], probe["CapPrm"], probe["CapInh"], probe["CapAmb"])


@needs_root
def test_without_setuid_the_drain_refuses_naming_the_capability() -> None:
    caps = [cap for cap in unit_capabilities() if cap not in ("CAP_SETUID", "CAP_SETGID")]
    probe = drain_probe(JOB_UID, caps)
    assert probe["error"].startswith(
        f"IdentityError: the drain must run as the job's user (uid {JOB_UID}, gid {JOB_UID}), and the agent runs "
        f"as uid {AGENT_UID} without CAP_SETUID and CAP_SETGID"
    )
    assert 'docs/ram-tier.md, "Under the packaged systemd unit"' in probe["error"]


needs_seccomp = pytest.mark.skipif(
    ctypes.util.find_library("seccomp") is None,
    reason="libseccomp is not installed (apt-get install libseccomp2)",
)


def given_directory(tmp_path: Path) -> Path:
    """A tier's root as the agent has just made it: its own; the probe makes a job's directory in it."""
    root = tmp_path / "ram"
    root.mkdir(mode=0o700)
    os.chown(root, AGENT_UID, AGENT_UID)
    return root


@pytest.mark.service
@needs_root
@needs_analyze
@needs_seccomp
def test_under_the_units_system_call_filter_a_directory_is_given_and_the_drain_switches(
    tmp_path: Path,
) -> None:
    allowed = unit_filter(unit_values("SystemCallFilter"))
    probe = drain_probe(JOB_UID, unit_capabilities(), given_directory(tmp_path), allowed)
    job = [JOB_UID] * 3
    assert (JOB_UID, None, [job, job, []]) == (probe["given_to"], probe.get("give_error"), probe.get("ids"))
    assert (0, 0, 0, 0) == (probe["CapEff"], probe["CapPrm"], probe["CapInh"], probe["CapAmb"])


@pytest.mark.service
@needs_root
@needs_analyze
@needs_seccomp
def test_without_the_filters_ram_tier_line_chown_and_the_switch_fail_saying_so(tmp_path: Path) -> None:
    """The unit's filter less the line that lets @chown @setuid capset back: what the errors say."""
    lines = [line for line in unit_values("SystemCallFilter") if "@chown" not in line]
    probe = drain_probe(JOB_UID, unit_capabilities(), given_directory(tmp_path), unit_filter(lines))
    assert None is probe["given_to"]  # not left behind as the agent's
    assert "needs CAP_CHOWN, and a system call filter that lets @chown through" in probe["give_error"]
    assert (
        "switching was refused (Operation not permitted) although it holds CAP_SETUID and CAP_SETGID: a system "
        "call filter must let @setuid through"
    ) in probe["error"]


@contextlib.contextmanager
def as_job_user() -> Iterator[None]:
    os.setegid(JOB_UID)
    os.seteuid(JOB_UID)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@contextlib.asynccontextmanager
async def unit_agent(
    base: Path, caps: list[str], allowed: set[str] | None = None, more_config: str = ""
) -> AsyncIterator[Path]:
    """``preemptd run`` as AGENT_UID with ``caps`` and the unit's umask, under the system call filter
    ``allowed`` if given, its RAM tier in ``base/ram`` (and ``more_config`` in its file); its socket path."""
    under = [] if allowed is None else [sys.executable, "-c", UNDER_FILTER, json.dumps(sorted(allowed))]
    config = base / "config.toml"
    config.write_text(
        f'socket_mode = 0o666\n[ram_tier]\nenabled = true\npath = "{base / "ram"}"\ncap_bytes = 1048576\n'
        + more_config
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "NOTIFY_SOCKET", "LISTEN_"))}
    sock = base / "a.sock"
    [umask] = unit_values("UMask")
    with (base / "agent.log").open("ab") as log:
        proc = await asyncio.create_subprocess_exec(
            "sh", "-c", f'umask {umask} && exec "$@"', "sh", *as_unit_user(caps), *under,
            sys.executable, "-m", "agent", "run", "--config", str(config), "--socket", str(sock), "--state-dir", str(base / "state"), "--cloud", "none", "--log-format", "json",
            env={**env, "PYTHONPATH": str(REPO)}, stdout=log, stderr=log, cwd=REPO,
        )  # fmt: skip
    try:
        await until(lambda doc: doc["ram_tier"]["state"] == "ready", sock, proc, base)
        # sh, setpriv and the loader exec'd into it
        status = await asyncio.to_thread(Path(f"/proc/{proc.pid}/status").read_text)
        assert "NoNewPrivs:\t1" in status
        assert ("Seccomp:\t2" in status) is (allowed is not None)
        yield sock
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)


async def until(ready: Any, sock: Path, proc: Any = None, base: Path | None = None) -> dict[str, Any]:
    """``/v1/status`` once ``ready(status)`` holds (bounded)."""
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if proc is not None and proc.returncode is not None:
            raise AssertionError(f"the agent exited: {(base / 'agent.log').read_text() if base else ''}")
        with contextlib.suppress(OSError, KeyError, TypeError, ValueError):
            status, doc = await http_json(sock, "GET", "/v1/status")
            if status == 200 and ready(doc):
                return dict(doc)
        await asyncio.sleep(0.1)
    raise AssertionError(f"not ready in time: {(base / 'agent.log').read_text() if base else ''}")


async def hold(sock: Path, durable_root: Path) -> Path:
    """The job's user reserves, writes and commits a step, naming its durable root; the step's directory."""
    _, res = await request_as(
        sock, JOB_UID, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": STEP, "bytes": 8}
    )
    with as_job_user():
        write_step(Path(res["path"]), STEP, {".metadata": b"meta", "__0_0.distcp": b"data"})
    status, answer = await request_as(
        sock, JOB_UID, "POST", f"/v1/ram-tier/jobs/{JOB}/steps/{STEP}/commit",
        {"reservation": res["reservation"], "durable_root": str(durable_root)},
    )  # fmt: skip
    assert 200 == status, answer
    return Path(res["path"])


def drain_of(doc: dict[str, Any]) -> dict[str, Any]:
    drain: dict[str, Any] = doc["ram_tier"]["drains"][f"{JOB_UID}/{JOB}/{STEP}"]
    return drain


def finished(doc: dict[str, Any]) -> bool:
    return drain_of(doc)["state"] in ("committed", "failed")


@pytest.fixture
def base() -> Iterator[Path]:
    path = short_tmp("pdu-")
    os.chmod(path, 0o755)
    os.chown(path, AGENT_UID, AGENT_UID)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def shipped_filter() -> set[str] | None:
    """The unit's system call filter, where this machine can expand and load it (else none: the test then
    checks the capabilities alone)."""
    if SYSTEMD_ANALYZE is None or ctypes.util.find_library("seccomp") is None:
        return None
    return unit_filter(unit_values("SystemCallFilter"))


@needs_root
@pytest.mark.slow
@pytest.mark.service
async def test_an_agent_with_the_units_capabilities_serves_a_job_of_another_user(base: Path) -> None:
    """As the unit runs it: its own user, the unit's capabilities, umask, no_new_privs and system call filter
    (the drain, its child, inherits them)."""
    durable = base / "job-owned"
    durable.mkdir()
    os.chown(durable, JOB_UID, JOB_UID)
    locked = base / "root-owned"  # 0755 root: the job's user may not write there; CAP_DAC_OVERRIDE could
    locked.mkdir(mode=0o755)
    async with unit_agent(base, unit_capabilities(), shipped_filter()) as sock:
        step = await hold(sock, durable / "ckpt")
        drain = drain_of(await until(finished, sock, None, base))
        committed = durable / "ckpt" / f"step-{STEP:012d}"
        owners = {p.stat().st_uid for p in [committed, *committed.iterdir()]}
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in committed.iterdir()}
        # The same step drained again to a root the job's user may not write: the drain holds no
        # CAP_DAC_OVERRIDE (the agent does), so it fails, and the step stays in RAM.
        again, answer = await request_as(
            sock, JOB_UID, "POST", f"/v1/ram-tier/jobs/{JOB}/steps/{STEP}/commit",
            {"reservation": "again", "durable_root": str(locked / "ckpt")},
        )  # fmt: skip
        assert 200 == again, answer
        refused = drain_of(
            await until(
                lambda d: drain_of(d)["durable_root"] == str(locked / "ckpt") and finished(d),
                sock,
                None,
                base,
            )
        )
    assert (JOB_UID, JOB_UID) == (step.parent.stat().st_uid, step.stat().st_uid)
    assert ("committed", {JOB_UID}) == (drain["state"], owners), drain
    # As the job's own save would leave them, not with the agent's UMask=0077.
    assert ({"0o644"}, True) == (
        set(modes.values()),
        {"__0_0.distcp", ".metadata", "manifest.json"} <= set(modes),
    )
    assert 0o755 == committed.stat().st_mode & 0o777
    assert "failed" == refused["state"]
    assert f"Permission denied: '{locked / 'ckpt'}'" in refused["error"]
    assert not (locked / "ckpt").exists()
    # The tier outlives the agent: a new one reads the job's files back (CRC-checked).
    async with unit_agent(base, unit_capabilities(), shipped_filter()) as sock:
        _, job = await http_json(sock, "GET", f"/v1/ram-tier/jobs/{JOB}?uid={JOB_UID}")
    assert [STEP] == [s["step"] for s in job["steps"]]


@needs_root
@pytest.mark.slow
async def test_an_agent_without_setuid_keeps_the_step_and_says_what_the_drain_lacks(base: Path) -> None:
    durable = base / "job-owned"
    durable.mkdir()
    os.chown(durable, JOB_UID, JOB_UID)
    caps = [cap for cap in unit_capabilities() if cap not in ("CAP_SETUID", "CAP_SETGID")]
    async with unit_agent(base, caps) as sock:
        await hold(sock, durable / "ckpt")
        drain = drain_of(await until(finished, sock, None, base))
        _, job = await http_json(sock, "GET", f"/v1/ram-tier/jobs/{JOB}?uid={JOB_UID}")
    assert "failed" == drain["state"]
    assert f"as uid {AGENT_UID} without CAP_SETUID and CAP_SETGID: give the agent" in drain["error"]
    assert not (durable / "ckpt").exists()
    assert [STEP] == [s["step"] for s in job["steps"]]


@needs_root
def test_a_durable_root_on_a_read_only_mount_names_the_drop_in_line(tmp_path: Path) -> None:
    """As ProtectSystem=strict leaves it: a read-only bind mount in a private mount namespace."""
    ro = tmp_path / "ckpts"
    ro.mkdir()
    plan = json.dumps({"uid": 0, "gid": 0, "durable_root": str(ro / "job-1")})
    script = f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && exec {sys.executable} -m agent.ramtier.drain"
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script], input=plan, capture_output=True, text=True, timeout=60,
        check=False, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    if not done.stdout.strip():  # unshare or mount refused: the drain never ran
        pytest.skip(f"no private mount namespace with a read-only bind mount here: {done.stderr.strip()}")
    outcome = json.loads(done.stdout.splitlines()[-1])
    assert "failed" == outcome["state"]
    assert f"`ReadWritePaths={ro}`" in outcome["error"]
    assert outcome["error"].startswith(
        f"ReadOnlyRootError: the durable root {ro / 'job-1'} is on a read-only"
    )


@needs_root
@pytest.mark.slow
async def test_an_agent_without_dac_override_refuses_another_users_step_saying_what_it_lacks(
    base: Path,
) -> None:
    """The job's directory is given to its user (0700): an agent that may chown but not override permissions
    cannot make the step directory inside it. A 503 that says so (the client falls back), not a 500."""
    caps = [cap for cap in unit_capabilities() if cap != "CAP_DAC_OVERRIDE"]
    probe = await asyncio.to_thread(
        subprocess.run,
        [*as_unit_user(caps), sys.executable, "-c", "import agent"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd="/",
    )
    if probe.returncode != 0:  # the interpreter or the checkout in a directory only root may read
        pytest.skip(
            f"{sys.executable} cannot import the agent from {REPO} as uid {AGENT_UID} without "
            f"CAP_DAC_OVERRIDE: {probe.stderr}"
        )
    async with unit_agent(base, caps) as sock:
        status, answer = await request_as(
            sock, JOB_UID, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": STEP, "bytes": 8}
        )
    assert 503 == status, answer
    assert (
        f"the agent (uid {AGENT_UID}) may not use {base / 'ram' / str(JOB_UID) / JOB} (Permission denied)"
        in (answer["error"])
    )
    assert "needs CAP_DAC_OVERRIDE beside CAP_CHOWN" in answer["error"]


# A hook that copies its capability sets into the file named after it (a system program: the hook runs without
# CAP_DAC_OVERRIDE, so it must be reachable by the agent's user as such).
CAPS_HOOK = 'grep ^Cap /proc/self/status > "$0"'


@needs_root
@pytest.mark.slow
async def test_a_hook_starts_without_the_ram_tiers_capabilities(base: Path) -> None:
    """Under the unit's capabilities the agent's hooks keep CAP_KILL and CAP_SYSLOG (as before the RAM tier)
    but not the tier's CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_SETUID, CAP_SETGID, which together amount to root."""
    seen = base / "hook-caps"
    hook = f"[[actions.hooks]]\nargv = {json.dumps(['/bin/sh', '-c', CAPS_HOOK, str(seen)])}\n"
    async with unit_agent(base, unit_capabilities(), more_config=hook) as sock:
        status, body = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
        assert 201 == status, body
        await until(lambda doc: seen.exists() and seen.stat().st_size > 0, sock, None, base)
    sets = {k: int(v, 16) for k, v in (line.split(":") for line in seen.read_text().splitlines())}
    kill_syslog = 1 << 5 | 1 << 34
    assert (kill_syslog, kill_syslog, kill_syslog) == (sets["CapAmb"], sets["CapPrm"], sets["CapEff"]), sets
