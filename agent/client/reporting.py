"""Talking back to the agent: checkpoint reports (``POST /v1/reports``) sent from a background thread so a slow
or absent agent never stalls training, and the advised checkpoint interval (``GET /v1/advice``).
"""

from __future__ import annotations

import collections
import http.client
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agent.client.transport import AgentHTTPError, AgentUnavailable, request_json
from agent.core.paths import client_socket_path

log = logging.getLogger("agent.client")

REPORT_TIMEOUT_S = 2.0
_JOB_VARIABLES = ("PREEMPTD_JOB", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "JOB_ID")
# ``MIN:MAX`` nodes of an elastic launch, set by ``preemptd exec`` for ``torchrun --nnodes MIN:MAX``: the
# registration says so, and a scheduler bridge keeps the job while it shrinks above MIN (docs/slurm.md).
ELASTIC_NODES_ENV = "PREEMPTD_ELASTIC_NODES"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def client_info(
    name: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    participant: bool = True,
) -> dict[str, Any]:
    """Who is reporting: pid, host, rank and world size (from ``RANK``/``WORLD_SIZE`` unless given), the job
    (``PREEMPTD_JOB``, ``SLURM_JOB_ID`` or ``TORCHELASTIC_RUN_ID``) and a name (the script by default).

    ``participant`` tells the agent to wait for this process's emergency checkpoint before it declares a
    notice ready."""
    info: dict[str, Any] = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "name": name or Path(sys.argv[0] or "python").name or "python",
        "participant": participant,
    }
    rank = rank if rank is not None else _env_int("RANK")
    world_size = world_size if world_size is not None else _env_int("WORLD_SIZE")
    if rank is not None:
        info["rank"] = rank
    if world_size is not None:
        info["world_size"] = world_size
    job = next((os.environ[v] for v in _JOB_VARIABLES if os.environ.get(v)), None)
    if job:
        info["job"] = job[:512]
    if os.environ.get("SLURM_JOB_ID"):
        info["slurm_job_id"] = os.environ["SLURM_JOB_ID"][:512]
    info.update(elastic_nodes(os.environ.get(ELASTIC_NODES_ENV, "")))
    return info


def elastic_nodes(value: str) -> dict[str, int]:
    """``{"min_nodes": MIN, "max_nodes": MAX}`` of an elastic launch's ``MIN:MAX`` (empty when it is none)."""
    low, colon, high = value.partition(":")
    if not (colon and low.isdigit() and high.isdigit()) or not 0 < int(low) < int(high):
        return {}
    return {"min_nodes": int(low), "max_nodes": int(high)}


class Reporter:
    """Queues reports and posts them in order on a daemon thread; ``flush()`` waits for delivery.

    The queue is bounded (the oldest report is dropped when it overflows); a report the agent rejects or
    cannot take is logged at debug level and dropped: reports inform the advisor, they never gate training.
    """

    def __init__(
        self,
        socket_path: str | Path | None = None,
        client: Mapping[str, Any] | None = None,
        max_queue: int = 256,
        timeout: float = REPORT_TIMEOUT_S,
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path is not None else client_socket_path()
        self.client = dict(client) if client is not None else client_info()
        self.timeout = timeout
        self._queue: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_queue)
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.failed = 0
        self.last_error: str | None = None

    def checkpoint(
        self,
        phase: str,
        step: int | None = None,
        *,
        duration_s: float | None = None,
        size: int | None = None,
        emergency: bool = False,
        notice_id: str | None = None,
        path: str | Path | None = None,
        flush: Mapping[str, Any] | None = None,
    ) -> None:
        """Queue one checkpoint report (``phase``: started, finished or failed). Never blocks. ``flush``:
        what a sharded store adds (``sharded``, ``world_size``, ``predicted_s``, ``time_left_s``,
        ``predicted_miss``, ``async``)."""
        body: dict[str, Any] = {"kind": "checkpoint", "phase": phase, "emergency": emergency}
        if step is not None:
            body["step"] = step
        if duration_s is not None:
            body["duration_s"] = round(max(0.0, duration_s), 6)
        if size is not None:
            body["bytes"] = size
        if notice_id:
            body["notice_id"] = notice_id
        if path is not None:
            body["path"] = str(path)[:4096]
        if flush:
            body["flush"] = {k: v for k, v in flush.items() if v is not None}
        body["client"] = dict(self.client)
        self.send(body)

    def register(self) -> None:
        """Queue a registration (``{"kind": "participant", "phase": "registered"}``) when ``client`` says
        this process is a participant: from then on a notice waits for its emergency checkpoint, even one that
        comes before its first checkpoint report. Never blocks; an agent without registrations drops it."""
        if self.client.get("participant") is True:
            self.send({"kind": "participant", "phase": "registered", "client": dict(self.client)})

    def send(self, body: dict[str, Any]) -> None:
        with self._cond:
            if self._closed:
                return
            self._queue.append(body)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="preemptd-reporter", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float = REPORT_TIMEOUT_S) -> bool:
        """Wait until every queued report was sent (or given up on); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = REPORT_TIMEOUT_S) -> None:
        """Deliver what is queued (bounded by ``timeout``) and end the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                body = self._queue.popleft()
                self._busy = True
            try:
                request_json("POST", "/v1/reports", body, socket_path=self.socket_path, timeout=self.timeout)
                self.sent += 1
            except (AgentUnavailable, AgentHTTPError, OSError, http.client.HTTPException) as exc:
                self.failed += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.debug("preemptd client: report not delivered: %s", self.last_error)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def fetch_advice(socket_path: str | Path | None = None, timeout: float = 1.0) -> Mapping[str, Any] | None:
    """The agent's advice document, or None when there is no agent or no advice endpoint (404)."""
    try:
        doc = request_json("GET", "/v1/advice", socket_path=socket_path, timeout=timeout)
    except (AgentUnavailable, AgentHTTPError, OSError, http.client.HTTPException) as exc:
        log.debug("preemptd client: no advice: %s", exc)
        return None
    return doc if isinstance(doc, Mapping) else None


def advised_interval(advice: Mapping[str, Any] | None) -> float | None:
    """``interval_s`` from an advice document when it is a positive number, else None (not enough data)."""
    if advice is None:
        return None
    value = advice.get("interval_s")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return None
    return float(value) if value != float("inf") else None


def advised_snapshot_steps(advice: Mapping[str, Any] | None) -> int | None:
    """The steps between peer snapshots the agent advises (``two_level.peer.steps`` when two levels pay), or
    None: no advice, one level, or no step time measured yet."""
    two = advice.get("two_level") if advice is not None else None
    peer = two.get("peer") if isinstance(two, Mapping) and two.get("levels") == 2 else None
    steps = peer.get("steps") if isinstance(peer, Mapping) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1 else None


class CheckpointSchedule:
    """When the next periodic checkpoint is due: the agent's advised interval when it has one, the fixed
    interval otherwise. Advice is refreshed every ``refresh_s`` on a short-lived thread, never in the caller.

    ``min_interval_s`` and ``max_interval_s`` bound whatever the agent advises.
    """

    def __init__(
        self,
        fixed_interval_s: float,
        socket_path: str | Path | None = None,
        *,
        refresh_s: float = 300.0,
        min_interval_s: float = 0.0,
        max_interval_s: float | None = None,
        use_advice: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if fixed_interval_s <= 0:
            raise ValueError(f"fixed_interval_s must be positive, got {fixed_interval_s!r}")
        self.fixed_interval_s = fixed_interval_s
        self.socket_path = Path(socket_path) if socket_path is not None else client_socket_path()
        self.refresh_s = refresh_s
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self.use_advice = use_advice
        self._clock = clock
        self._advised: float | None = None
        self._last_checkpoint = clock()
        self._next_refresh = clock()
        self._refreshing = threading.Lock()
        self.advice: Mapping[str, Any] | None = None

    @property
    def interval_s(self) -> float:
        advised = self._advised
        interval = advised if advised is not None else self.fixed_interval_s
        interval = max(interval, self.min_interval_s)
        if self.max_interval_s is not None:
            interval = min(interval, self.max_interval_s)
        return interval

    @property
    def advised(self) -> bool:
        return self._advised is not None

    def due(self) -> bool:
        """Whether a periodic checkpoint is due now; starts an advice refresh in the background if stale."""
        now = self._clock()
        if self.use_advice and now >= self._next_refresh:
            self._next_refresh = now + self.refresh_s
            self.refresh(block=False)
        return now - self._last_checkpoint >= self.interval_s

    def mark(self) -> None:
        """A checkpoint was just taken (periodic or emergency)."""
        self._last_checkpoint = self._clock()

    def refresh(self, block: bool = True) -> None:
        """Ask the agent for advice now; ``block=False`` does it on a daemon thread."""
        if not self._refreshing.acquire(blocking=False):
            return
        if block:
            self._refresh()
        else:
            threading.Thread(target=self._refresh, name="preemptd-advice", daemon=True).start()

    def _refresh(self) -> None:
        try:
            self.advice = fetch_advice(self.socket_path)
            self._advised = advised_interval(self.advice)
        finally:
            self._refreshing.release()
