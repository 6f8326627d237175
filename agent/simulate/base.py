"""What every cloud simulator shares: an aiohttp server on loopback, the ``/_sim/`` control API, fault
injection and named scenarios.

Control API (JSON; never part of any cloud's protocol):

- ``GET /_sim/state``: the simulated cloud state, active faults, request counts (in all and by path) and the
  publication log
- ``POST /_sim/event``: apply one event now (cloud-specific, e.g. ``{"type": "spot", "action": "terminate"}``);
  the answer says when it was published (``published_unix`` is ``time.time()``, for latency measurements)
- ``POST /_sim/fault``: inject a fault, ``DELETE /_sim/fault``: remove them all
- ``GET /_sim/scenarios``, ``POST /_sim/scenario`` (``{"name": ..., "after_s": 5}``): play a named scenario
- ``POST /_sim/reset``: back to a quiet cloud, no faults, no scenario

Faults (``agent/simulate/faults.py``): latency, hang, 5xx, 429, garbage, oversized, reset, token-expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, ClassVar

from aiohttp import web

from agent.core.notice import format_time, utcnow
from agent.simulate.faults import Fault, SimulatorError, parse_fault

SIM_PREFIX = "/_sim/"


@dataclass(frozen=True)
class Step:
    at_s: float
    event: Mapping[str, Any]


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    steps: tuple[Step, ...] = field(default_factory=tuple)


def in_s(doc: Mapping[str, Any], default: float) -> timedelta:
    value = doc.get("in_s", default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise SimulatorError(f"event field 'in_s' must be a number of seconds, got {value!r}")
    return timedelta(seconds=float(value))


class Simulator:
    """Base class. Subclasses set ``cloud``, ``scenarios``, add their routes in :meth:`routes` and apply
    events in :meth:`apply`. Use as ``async with AwsSimulator() as sim:`` or ``port = await sim.start()``."""

    cloud: ClassVar[str] = ""
    scenarios: ClassVar[Mapping[str, Scenario]] = {}
    # Headers every answer of the cloud carries (not the control API's).
    server_headers: ClassVar[Mapping[str, str]] = {}
    # How the cloud's own SDKs are pointed at the simulator ("{url}", "{hostport}"); "" when there is no way.
    client_hint: ClassVar[str] = ""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, seed: int | None = None) -> None:
        self.host = host
        self.port = port
        self.requests = 0
        self.requests_by_path: Counter[str] = Counter()  # cadence checks count one endpoint's requests
        self.faults: list[Fault] = []
        self.published: deque[dict[str, Any]] = deque(maxlen=200)
        self.publications = 0
        self._published_signal = asyncio.Event()
        self._rng = random.Random(seed)
        self._runner: web.AppRunner | None = None
        self._scenario_task: asyncio.Task[None] | None = None
        self._scenario_name: str | None = None
        self._release = asyncio.Event()  # set to let hanging requests go
        self.app = web.Application(middlewares=[self._fault_middleware])
        self.app.router.add_get(SIM_PREFIX + "state", self._h_state)
        self.app.router.add_post(SIM_PREFIX + "event", self._h_event)
        self.app.router.add_post(SIM_PREFIX + "fault", self._h_fault)
        self.app.router.add_delete(SIM_PREFIX + "fault", self._h_clear_faults)
        self.app.router.add_get(SIM_PREFIX + "scenarios", self._h_scenarios)
        self.app.router.add_post(SIM_PREFIX + "scenario", self._h_scenario)
        self.app.router.add_post(SIM_PREFIX + "reset", self._h_reset)
        self.routes(self.app.router)
        self.app.on_response_prepare.append(self._add_server_headers)

    # --- lifecycle ---

    async def start(self) -> int:
        """Listen on ``host:port`` (port 0 picks a free one) and return the bound port."""
        self._release = asyncio.Event()
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        self._release.set()
        await self._stop_scenario()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Simulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # --- to override ---

    def routes(self, router: web.UrlDispatcher) -> None:
        raise NotImplementedError

    def apply(self, event: Mapping[str, Any]) -> None:
        """Change the simulated state for one event; raise SimulatorError for a bad one."""
        raise NotImplementedError

    def reset_state(self) -> None:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        return {}

    def expire_tokens(self) -> None:
        """Make every issued token invalid (clouds with tokens override this)."""

    def changed(self) -> None:
        """Called after every state change (GCP wakes its hanging GETs here)."""

    # --- the library API ---

    def trigger(self, event: Mapping[str, Any]) -> dict[str, Any]:
        """Apply ``event`` now; returns the publication record (``published_at``, ``published_unix``)."""
        if not isinstance(event, Mapping) or not isinstance(event.get("type"), str):
            raise SimulatorError('an event must be a JSON object with a "type"')
        if event["type"] == "reset":
            self.reset_state()
        else:
            self.apply(event)
        record = {"type": event["type"], "published_at": format_time(utcnow()), "published_unix": time.time()}
        self.published.append(record)
        self.publications += 1
        self.changed()
        signal, self._published_signal = self._published_signal, asyncio.Event()
        signal.set()
        return record

    async def wait_publications(self, count: int, timeout: float = 10.0) -> None:
        """Wait until ``count`` events have been published in all (scenarios publish in the background)."""

        async def reached() -> None:
            while self.publications < count:
                await self._published_signal.wait()

        await asyncio.wait_for(reached(), timeout)

    def inject(self, fault: Mapping[str, Any]) -> Fault:
        parsed = parse_fault(fault, time.monotonic())
        if parsed.type == "token-expiry":
            self.expire_tokens()
            return parsed
        if parsed.type == "hang" and self._release.is_set():
            self._release = asyncio.Event()
        self.faults.append(parsed)
        return parsed

    def clear_faults(self) -> None:
        self.faults.clear()
        self._release.set()
        self._release = asyncio.Event()

    def play(self, name: str, after_s: float = 5.0) -> Scenario:
        """Start scenario ``name`` in the background (a running one is replaced); its first step comes
        ``after_s`` seconds from now."""
        scenario = self.scenarios.get(name)
        if scenario is None:
            raise SimulatorError(
                f"unknown scenario {name!r}; {self.cloud} has: {', '.join(sorted(self.scenarios))}"
            )
        if self._scenario_task is not None:
            self._scenario_task.cancel()
        self._scenario_name = name
        self._scenario_task = asyncio.ensure_future(self._run_scenario(scenario, after_s))
        return scenario

    async def _run_scenario(self, scenario: Scenario, after_s: float) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time() + after_s
        for step in scenario.steps:
            await asyncio.sleep(max(0.0, start + step.at_s - loop.time()))
            self.trigger(step.event)

    async def _stop_scenario(self) -> None:
        task, self._scenario_task = self._scenario_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # --- serving ---

    async def _add_server_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        if not request.path.startswith(SIM_PREFIX):
            for name, value in self.server_headers.items():
                response.headers[name] = value

    @web.middleware
    async def _fault_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith(SIM_PREFIX):
            return await handler(request)  # type: ignore[no-any-return]
        self.requests += 1
        self.requests_by_path[request.path] += 1
        now = time.monotonic()
        self.faults = [f for f in self.faults if f.until is None or f.until > now]
        for fault in list(self.faults):
            if not fault.matches(request.path, now):
                continue
            if fault.count is not None:
                fault.count -= 1
                if fault.count <= 0:
                    self.faults.remove(fault)
            if fault.type == "latency":
                await asyncio.sleep(fault.ms / 1000.0)
                continue
            return await self._faulty(fault, request)
        return await handler(request)  # type: ignore[no-any-return]

    async def _faulty(self, fault: Fault, request: web.Request) -> web.StreamResponse:
        if fault.type == "hang":
            release = self._release
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(release.wait(), fault.hang_s)
            self._reset_connection(request)
            return web.Response(status=500)
        if fault.type == "reset":
            self._reset_connection(request)
            return web.Response(status=500)
        if fault.type == "5xx":
            return web.Response(status=fault.status, text=f"{fault.status} simulated server error\n")
        if fault.type == "429":
            return web.Response(status=429, text="Too Many Requests\n", headers={"Retry-After": "1"})
        if fault.type == "garbage":
            body = bytes(self._rng.randrange(256) for _ in range(64)) + b"\x00{\xff<"
            return web.Response(status=200, body=body, content_type="application/octet-stream")
        return web.Response(status=200, body=b"A" * fault.size, content_type="text/plain")

    @staticmethod
    def _reset_connection(request: web.Request) -> None:
        transport = request.transport
        if transport is None:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Linger 0: close() sends a TCP RST instead of a FIN, as a crashing server would.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()

    # --- control handlers ---

    async def _json_body(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except ValueError as exc:
            raise web.HTTPBadRequest(
                text=json.dumps({"error": f"body is not JSON: {exc}"}), content_type="application/json"
            ) from exc

    @staticmethod
    def _bad(exc: Exception) -> web.Response:
        return web.json_response({"error": str(exc)}, status=400)

    async def _h_state(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "cloud": self.cloud,
                "port": self.port,
                "requests": self.requests,
                "requests_by_path": dict(self.requests_by_path),
                "faults": [f.to_json() for f in self.faults],
                "scenario": self._scenario_name,
                "state": self.state(),
                "published": list(self.published),
            }
        )

    async def _h_event(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(self.trigger(await self._json_body(request)))
        except SimulatorError as exc:
            return self._bad(exc)

    async def _h_fault(self, request: web.Request) -> web.Response:
        try:
            fault = self.inject(await self._json_body(request))
        except SimulatorError as exc:
            return self._bad(exc)
        return web.json_response({"injected": fault.to_json(), "faults": [f.to_json() for f in self.faults]})

    async def _h_clear_faults(self, request: web.Request) -> web.Response:
        self.clear_faults()
        return web.json_response({"faults": []})

    async def _h_scenarios(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                name: {"description": s.description, "steps": len(s.steps)}
                for name, s in sorted(self.scenarios.items())
            }
        )

    async def _h_scenario(self, request: web.Request) -> web.Response:
        doc = await self._json_body(request)
        if not isinstance(doc, Mapping) or not isinstance(doc.get("name"), str):
            return self._bad(SimulatorError('expected {"name": "<scenario>", "after_s": 5}'))
        after = doc.get("after_s", 5.0)
        if not isinstance(after, (int, float)) or isinstance(after, bool) or after < 0:
            return self._bad(SimulatorError("after_s must be a number >= 0"))
        try:
            scenario = self.play(doc["name"], float(after))
        except SimulatorError as exc:
            return self._bad(exc)
        return web.json_response({"playing": scenario.name, "after_s": after})

    async def _h_reset(self, request: web.Request) -> web.Response:
        await self._stop_scenario()
        self._scenario_name = None
        self.clear_faults()
        self.trigger({"type": "reset"})
        return web.json_response({"reset": True})


def raw(
    text: str | bytes, content_type: str, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A response whose Content-Type is exactly ``content_type`` (aiohttp would append a charset, which the
    clouds do not send)."""
    body = text.encode() if isinstance(text, str) else text
    return web.Response(status=status, body=body, headers={**(headers or {}), "Content-Type": content_type})


def scenario(name: str, description: str, *steps: tuple[float, Mapping[str, Any]]) -> tuple[str, Scenario]:
    return name, Scenario(name, description, tuple(Step(at, dict(event)) for at, event in steps))


def rfc3339_seconds(value: datetime) -> str:
    """``2017-09-18T08:22:00Z``: the second-precision layout the clouds use."""
    return value.strftime("%Y-%m-%dT%H:%M:%SZ")


def listing(paths: Sequence[str], prefix: str) -> list[str] | None:
    """Directory listing of ``prefix`` over leaf ``paths``: children, sub-directories with a trailing slash.
    None if nothing lives under ``prefix``."""
    children: dict[str, None] = {}
    for path in sorted(paths):
        if not path.startswith(prefix):
            continue
        rest = path[len(prefix) :]
        if not rest:
            continue
        head, sep, _ = rest.partition("/")
        children[head + ("/" if sep else "")] = None
    return list(children) if children else None
