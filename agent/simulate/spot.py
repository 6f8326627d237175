"""Simulated metadata services of clouds that publish one spot termination time (Alibaba ECS, Tencent CVM):
404 while nothing is pending, the time in the cloud's own format once it is."""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

from aiohttp import web

from agent.core.notice import utcnow
from agent.simulate.base import Scenario, Simulator, in_s, listing, raw, rfc3339_seconds, scenario
from agent.simulate.faults import SimulatorError

_NOT_FOUND = (
    "<html>\r\n<head><title>404 Not Found</title></head>\r\n<body>\r\n"
    "<center><h1>404 Not Found</h1></center>\r\n<hr><center>{server}</center>\r\n</body>\r\n</html>\r\n"
)


class SpotTimeSimulator(Simulator):
    """Subclasses set ``termination_path`` (under /latest/meta-data/), ``identity``, :meth:`format_time`."""

    termination_path: ClassVar[str] = ""
    notice_s: ClassVar[float] = 120.0
    server_name: ClassVar[str] = "nginx"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, seed: int | None = None) -> None:
        super().__init__(host, port, seed)
        self.reset_state()

    def reset_state(self) -> None:
        self.termination: datetime | None = None

    def state(self) -> dict[str, Any]:
        return {"termination_time": self.format_time(self.termination) if self.termination else None}

    def format_time(self, value: datetime) -> str:
        raise NotImplementedError

    def identity(self) -> dict[str, str]:
        raise NotImplementedError

    def apply(self, event: Mapping[str, Any]) -> None:
        kind = event["type"]
        if kind == "termination":
            self.termination = utcnow() + in_s(event, self.notice_s)
        elif kind == "clear":
            self.termination = None
        else:
            raise SimulatorError(f"unknown {self.cloud} event {kind!r}; expected termination, clear or reset")

    def not_found(self) -> web.Response:
        return web.Response(
            status=404, text=_NOT_FOUND.format(server=self.server_name), content_type="text/html"
        )

    def authorise(self, request: web.Request) -> web.Response | None:
        return None

    def routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/latest/meta-data", self._h_meta)
        router.add_get("/latest/meta-data/{tail:.*}", self._h_meta)

    async def _h_meta(self, request: web.Request) -> web.Response:
        denied = self.authorise(request)
        if denied:
            return denied
        leaves = self.identity()
        if self.termination is not None:
            leaves[self.termination_path] = self.format_time(self.termination)
        tail = request.match_info.get("tail", "")
        key = tail.rstrip("/")
        if key in leaves and not tail.endswith("/"):
            return raw(leaves[key], "text/plain")
        children = listing(list(leaves), key + "/" if key else "")
        if children is None:
            return self.not_found()
        return raw("\n".join(children), "text/plain")


class AlibabaSimulator(SpotTimeSimulator):
    """Alibaba ECS at 100.100.100.200, with the optional hardened mode (tokens)."""

    cloud = "alibaba"
    termination_path = "instance/spot/termination-time"
    notice_s = 300.0
    server_name = "Tengine"
    server_headers: ClassVar[Mapping[str, str]] = {"Server": "Tengine"}
    scenarios: ClassVar[Mapping[str, Scenario]] = dict(
        [
            scenario("quiet", "no notices; identity only"),
            scenario(
                "spot-termination",
                "the spot instance is reclaimed in five minutes",
                (0, {"type": "termination", "in_s": 300}),
            ),
        ]
    )

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, seed: int | None = None, hardened: bool = False
    ):
        """``hardened``: every GET must carry a token from ``PUT /latest/api/token``."""
        self.hardened = hardened
        self.tokens: dict[str, float] = {}
        super().__init__(host, port, seed)

    def format_time(self, value: datetime) -> str:
        return rfc3339_seconds(value)

    def identity(self) -> dict[str, str]:
        return {
            "instance-id": "i-bp67acfmxazb4ph3e8q1",
            "instance/instance-type": "ecs.gn7i-c8g1.2xlarge",
            "region-id": "cn-hangzhou",
            "zone-id": "cn-hangzhou-i",
            "hostname": "iZbp67acfmxazb4ph3e8q1Z",
        }

    def expire_tokens(self) -> None:
        self.tokens.clear()

    def routes(self, router: web.UrlDispatcher) -> None:
        router.add_put("/latest/api/token", self._h_token)
        super().routes(router)

    async def _h_token(self, request: web.Request) -> web.Response:
        if "X-Forwarded-For" in request.headers:
            return raw("403 Forbidden\n", "text/plain", 403)
        try:
            ttl = int(request.headers.get("X-aliyun-ecs-metadata-token-ttl-seconds", ""))
        except ValueError:
            return raw("400 Bad Request\n", "text/plain", 400)
        if not 1 <= ttl <= 21600:
            return raw("400 Bad Request\n", "text/plain", 400)
        token = secrets.token_urlsafe(32)
        self.tokens[token] = time.monotonic() + ttl
        return raw(token, "text/plain")

    def authorise(self, request: web.Request) -> web.Response | None:
        token = request.headers.get("X-aliyun-ecs-metadata-token")
        if token is None and not self.hardened:
            return None
        if token is None or self.tokens.get(token, 0.0) <= time.monotonic():
            return raw("401 Unauthorized\n", "text/plain", 401)
        return None


class TencentSimulator(SpotTimeSimulator):
    """Tencent CVM at metadata.tencentyun.com; the termination time is China Standard Time without a zone."""

    cloud = "tencent"
    termination_path = "spot/termination-time"
    notice_s = 120.0
    scenarios: ClassVar[Mapping[str, Scenario]] = dict(
        [
            scenario("quiet", "no notices; identity only"),
            scenario(
                "spot-termination",
                "the spot instance is reclaimed in two minutes",
                (0, {"type": "termination", "in_s": 120}),
            ),
        ]
    )

    def format_time(self, value: datetime) -> str:
        return value.astimezone(timezone(timedelta(hours=8))).strftime("%Y-%m-%d %H:%M:%S")

    def identity(self) -> dict[str, str]:
        return {
            "instance-id": "ins-5q2lz1pj",
            "instance/instance-type": "GN10Xp.2XLARGE40",
            "placement/region": "ap-guangzhou",
            "placement/zone": "ap-guangzhou-3",
            "uuid": "8f2d7c4e-1f3a-4b8e-9c1d-2e5f6a7b8c9d",
        }
