"""The checks that need a real NVIDIA GPU (CI has none): the agent's NVML source on the real driver, and a
CUDA/NCCL training job flushed by a drill and resumed.

    python3 scripts/gpu_check.py OUT_DIR [--width 2048 --layers 4]

1. ``preemptd run --cloud none`` with the real libnvidia-ml: the NVML source up (``/metrics``), every GPU in
   ``/v1/status`` and not lost, and the training rank among its compute processes while it runs.
2. ``preemptd exec -- torchrun --nproc-per-node 1 examples/sharded_training.py`` on the GPU (NCCL for CUDA
   tensors, gloo for the store): a termination drill, the emergency checkpoint (its size and seconds), exit 75;
   the job started again resumes at the saved step with the same digest and finishes.

Everything it saw goes to OUT_DIR (summary.json, the agent's log, the status documents, the runs' output);
it exits 1 when a check failed. It binds only a Unix socket and loopback (torchrun's rendezvous).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def http(sock: Path, method: str, path: str, body: Any = None) -> tuple[int, str]:
    """One HTTP/1.1 request over the agent's Unix socket (the standard library only)."""
    raw = b"" if body is None else json.dumps(body).encode()
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(10)
        conn.connect(str(sock))
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(raw)}\r\n"
        conn.sendall((head + "Content-Type: application/json\r\n\r\n").encode() + raw)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    header, _, text = data.partition(b"\r\n\r\n")
    status = int(header.split()[1])
    if b"chunked" in header.lower():
        text = _unchunk(text)
    return status, text.decode()


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return out


def events(path: Path) -> list[dict[str, Any]]:
    found = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
    return found


def until(check: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.1)
    raise TimeoutError(f"no {what} in {timeout:g} s")


def train(out: Path, name: str, sock: Path, ckpt: Path, steps: int, port: int, model: list[str]) -> Any:
    command = [
        sys.executable, "-m", "agent", "exec", "--",
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
        "--master-port", str(port), str(REPO / "examples" / "sharded_training.py"), "--checkpoint-dir",
        str(ckpt), "--socket", str(sock), "--steps", str(steps), "--step-time", "0.01", *model,
    ]  # fmt: skip
    stdout = (out / f"{name}.out").open("wb")
    stderr = (out / f"{name}.err").open("wb")
    return subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=REPO, env=os.environ.copy())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--width", default="2048")
    parser.add_argument("--layers", default="4")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = ["--width", args.width, "--layers", args.layers, "--heads", "16"]
    summary: dict[str, Any] = {"checks": {}}
    base = Path(tempfile.mkdtemp(prefix="pd-gpu-"))
    sock = base / "a.sock"
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--cloud", "none", "--socket", str(sock), "--state-dir",
         str(base / "state"), "--log-format", "json"],
        stdout=(out / "agent.log").open("wb"), stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    try:
        until(sock.exists, 30, "agent socket")
        time.sleep(2)  # the NVML source's first poll
        status, text = http(sock, "GET", "/v1/status")
        (out / "status_idle.json").write_text(text)
        doc = json.loads(text)
        summary["gpu_idle"] = doc.get("gpu") or doc.get("gpus")
        summary["sources"] = doc.get("sources")
        _, metrics = http(sock, "GET", "/metrics")
        source_up = [line for line in metrics.splitlines() if line.startswith("preemptd_source_")]
        (out / "metrics_sources.txt").write_text("\n".join(source_up))
        gpus = summary["gpu_idle"] or []
        summary["checks"]["nvml_source_up"] = 'preemptd_source_up{source="nvml",state="ok"} 1.0' in source_up
        summary["checks"]["nvml_gpus_ok"] = bool(gpus) and all(not g.get("lost") for g in gpus)

        ckpt = base / "ckpt"
        first = train(out, "run1", sock, ckpt, 100000, 29511, model)
        until(
            lambda: any(e["event"] == "agent_connected" for e in events(out / "run1.out")),
            300,
            "agent_connected",
        )
        time.sleep(3)
        _, text = http(sock, "GET", "/v1/status")
        (out / "status_training.json").write_text(text)
        pids = [pid for gpu in json.loads(text).get("gpus") or [] for pid in gpu.get("compute_pids") or []]
        summary["compute_pids_while_training"] = pids
        summary["checks"]["nvml_sees_the_rank"] = bool(pids)
        status, text = http(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
        summary["drill"] = status
        code = first.wait(timeout=300)
        run1 = events(out / "run1.out")
        saved = [e for e in run1 if e["event"] == "checkpoint" and e.get("emergency")]
        summary["run1"] = {"exit": code, "checkpoint": saved[-1] if saved else None}
        summary["checks"]["flush_exit_75"] = code == 75 and bool(saved)
        if saved:
            again = train(out, "run2", sock, ckpt, saved[-1]["step"] + 5, 29512, model)
            code2 = again.wait(timeout=300)
            run2 = events(out / "run2.out")
            resumed = [e for e in run2 if e["event"] == "resumed"]
            summary["run2"] = {"exit": code2, "resumed": resumed[:1]}
            summary["checks"]["resume_same_digest"] = (
                code2 == 0
                and bool(resumed)
                and resumed[0]["next_step"] == saved[-1]["step"]
                and resumed[0]["digest"] == saved[-1]["digest"]
            )
        _, text = http(sock, "GET", "/v1/status")
        (out / "status_after.json").write_text(text)
    except Exception:
        summary["error"] = traceback.format_exc()
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            summary["agent_exit"] = agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            summary["agent_exit"] = "killed"
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, indent=1, default=str)[:6000])
    ok = "error" not in summary and summary["checks"] and all(summary["checks"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
