"""``preemptd watch``'s view of the jobs' membership: the re-forms of elastic jobs (``shrank 3→2 in 0.47 s at
step 1234``), which the agent keeps in the status document's ``jobs`` section rather than in the event stream
(whose event types are the v1 contract). A thread asks for the status every ``interval`` seconds and passes on
each change it has not shown, as ``("membership", {"type": "membership", "job": …, "what": …, …})``; what the
agent had before watch started is not repeated.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

from agent.client.transport import AgentHTTPError, AgentUnavailable, request_json

INTERVAL_S = 2.0


class JobsPoller(threading.Thread):
    def __init__(
        self, socket_path: Path | None, out: queue.Queue[tuple[str, Any]], interval: float = INTERVAL_S
    ) -> None:
        super().__init__(daemon=True, name="preemptd-watch-jobs")
        self.socket_path = socket_path
        self.out = out
        self.interval = interval
        self.stop = threading.Event()
        self.seen: set[tuple[str, ...]] | None = None  # None until the first answer: that one is history

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        """Ask once (watch asks before it starts the thread: what is there then is history)."""
        try:
            doc = request_json("GET", "/v1/status", socket_path=self.socket_path)
        except (OSError, AgentUnavailable, AgentHTTPError, ValueError):
            return  # the event stream's reader says when the agent is away
        if isinstance(doc, dict):
            self.take(doc.get("jobs"))

    def take(self, jobs: Any) -> None:
        """Pass on each change in ``jobs`` (the status section) not seen before."""
        first = self.seen is None
        seen = self.seen if self.seen is not None else set()
        for job, entry in (jobs if isinstance(jobs, dict) else {}).items():
            history = entry.get("history") if isinstance(entry, dict) else None
            for change in history if isinstance(history, list) else []:
                if not isinstance(change, dict):
                    continue
                key = (str(job), str(change.get("time")), str(change.get("phase")), str(change.get("step")))
                if key in seen:
                    continue
                seen.add(key)
                if not first:
                    self.out.put(("membership", {"type": "membership", "job": str(job), **change}))
        self.seen = seen
