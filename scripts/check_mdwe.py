"""Check that the agent works under ``MemoryDenyWriteExecute=yes`` (called by scripts/check-units.sh).

systemd implements that setting with a seccomp filter; Linux >= 6.3 has the same rule as a process flag,
``prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN)``: no mapping may be writable and executable, and no mapping
may become executable. The flag survives ``execve``, so a small wrapper sets it and then runs

1. ``preemptd run`` (``python -m agent run``): it must report READY=1, answer ``GET /v1/status`` and accept a
   drill, with ``gpu.library_path`` pointing at the fake NVIDIA driver (tests/fake_nvml) when it builds;
2. pynvml itself against that driver (init, devices, an event set), and a ctypes callback (libffi closures
   are the usual reason to need W+X memory; pynvml does not use them, but a library loaded later might).

``CHECK_MDWE_NVML=system`` uses the host's own ``libnvidia-ml.so.1`` instead (run it on a GPU host).
Exit status 0 when both pass or the kernel lacks PR_SET_MDWE (said on stdout), 1 otherwise.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PR_SET_MDWE = 65
PR_GET_MDWE = 66
PR_MDWE_REFUSE_EXEC_GAIN = 1

# Runs in the wrapped process: set the flag, then exec the command.
WRAPPER = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    f"if libc.prctl({PR_SET_MDWE}, {PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0) != 0:\n"
    "    sys.exit('PR_SET_MDWE failed: errno %d' % ctypes.get_errno())\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)

PYNVML_PROBE = """
import ctypes, mmap, sys
libc = ctypes.CDLL(None)
assert libc.prctl(%(get)d, 0, 0, 0, 0) == %(flag)d, "MDWE is not in force after execve"
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
except OSError:
    pass
else:
    sys.exit("a writable and executable mapping was allowed: MDWE is not in force")
callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(lambda x: x + 1)
assert callback(41) == 42
import pynvml
if len(sys.argv) > 1:
    pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
pynvml.nvmlInit()
count = pynvml.nvmlDeviceGetCount()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
name = pynvml.nvmlDeviceGetName(handle)
event_set = pynvml.nvmlEventSetCreate()
pynvml.nvmlEventSetFree(event_set)
pynvml.nvmlShutdown()
print(f"pynvml: {count} GPU(s), GPU 0 {name!r}, event set created and freed")
"""


def mdwe_supported() -> bool:
    """True when this kernel knows PR_GET_MDWE (asked without changing this process)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(PR_GET_MDWE, 0, 0, 0, 0) >= 0)


def wrapped(argv: list[str]) -> list[str]:
    return [sys.executable, "-c", WRAPPER, *argv]


def build_fake_driver(directory: Path) -> Path | None:
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        return None
    from tests.fake_nvml.build import build_fake_nvml

    return build_fake_nvml(directory)


def probe_pynvml(library: Path | None, env: dict[str, str]) -> None:
    args = [sys.executable, "-c", PYNVML_PROBE % {"get": PR_GET_MDWE, "flag": PR_MDWE_REFUSE_EXEC_GAIN}]
    if library is not None:
        args.append(str(library))
    done = subprocess.run(wrapped(args), env=env, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise SystemExit(f"MDWE probe: pynvml failed:\n{done.stdout}{done.stderr}")
    print(f"check-mdwe: {done.stdout.strip()}; ctypes callback works")


def probe_agent(base: Path, library: Path | None, env: dict[str, str]) -> None:
    from agent.client.transport import request_json

    sock_path = base / "a.sock"
    notify_path = base / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(1.0)
    settings = ["--set", f"gpu.library_path={json.dumps(str(library))}"] if library is not None else []
    argv = [
        sys.executable, "-m", "agent", "run", "--socket", str(sock_path), "--state-dir", str(base / "state"),
        "--cloud", "none", "--log-format", "json", *settings,
    ]  # fmt: skip
    log_path = base / "agent.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            wrapped(argv), env={**env, "NOTIFY_SOCKET": str(notify_path)}, stdout=log, stderr=log, cwd=REPO
        )
    try:
        deadline = time.monotonic() + 60
        ready = False
        while not ready:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"MDWE probe: the agent never became ready (exit {proc.returncode}):\n{log_path.read_text()}"
                )
            try:
                ready = "READY=1" in notify.recv(65536).decode().split("\n")
            except TimeoutError:
                continue
        status = request_json("GET", "/v1/status", socket_path=sock_path, timeout=10)
        drill = request_json("POST", "/v1/drills", {"in_s": 60}, socket_path=sock_path, timeout=10)
        assert drill["notice"]["drill"] is True, drill
        sources = sorted(status.get("sources", {}))
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        if code != 0:
            raise SystemExit(f"MDWE probe: the agent exited with {code}:\n{log_path.read_text()}")
        print(f"check-mdwe: agent: ready, status ({sources=}) and a drill answered, clean exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


def main() -> int:
    if not mdwe_supported():
        print(f"check-mdwe: skipped: this kernel ({os.uname().release}) has no PR_SET_MDWE (Linux >= 6.3)")
        return 0
    base = Path(tempfile.mkdtemp(prefix="pd-mdwe-", dir="/tmp"))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "NOTIFY_", "LISTEN_"))}
        env["PYTHONPATH"] = str(REPO)
        if os.environ.get("CHECK_MDWE_NVML") == "system":  # on a GPU host: the real libnvidia-ml.so.1
            probe_pynvml(None, env)
            probe_agent(base, None, env)
        else:
            library = build_fake_driver(base / "nvml")
            if library is not None:
                env["FAKE_NVML_SCENARIO"] = str(base / "nvml" / "scenario.txt")
                (base / "nvml" / "scenario.txt").write_text("# one healthy GPU\n")
                probe_pynvml(library, env)
            else:
                print("check-mdwe: no C compiler for the fake NVIDIA driver: pynvml not probed")
            probe_agent(base, library, env)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("check-mdwe: OK under MemoryDenyWriteExecute (prctl PR_SET_MDWE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
