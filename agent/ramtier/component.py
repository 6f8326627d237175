"""The RAM tier as an agent component: a tmpfs directory on this host that holds jobs' checkpoint steps for
them (issue 24), its inventory rebuilt from the directory at start, its cap, its routes under
``/v1/ram-tier``, the ``ram_tier`` status section and its metrics. docs/ram-tier.md is the user's guide.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from agent.core.ratelog import ClientMistakes, Tally
from agent.ramtier.config import RamTierConfig
from agent.ramtier.drains import Drains
from agent.ramtier.errors import TierError
from agent.ramtier.holdings import Holdings, Key, Overrun, Reservation
from agent.ramtier.inventory import (
    Root,
    Scan,
    job_dir,
    make_step_dir,
    measure,
    prepare_root,
    remove_tree,
    scan,
    step_dir,
)
from agent.ramtier.ports import RamTierHost
from agent.ramtier.routes import routes

State = Literal["off", "loading", "ready", "unavailable"]


class RamTierComponent:
    name = "ram_tier"

    def __init__(self, config: RamTierConfig | None = None) -> None:
        self._config = config
        self._host: RamTierHost | None = None
        self.state: State = "off"
        self.error: str | None = None
        self.root: Root | None = None
        self.holdings = Holdings(0, 600.0)
        self._mistakes: ClientMistakes | None = None
        self._requests: Tally | None = None
        self.removed = 0
        # Set once the inventory is read back (or the tier found unusable): tests and tools wait on it.
        self.loaded = asyncio.Event()
        self._load: asyncio.Task[Any] | None = None
        self.drains: Drains | None = None
        self._drain: asyncio.Task[Any] | None = None
        self._usage: asyncio.Task[Any] | None = None

    @property
    def config(self) -> RamTierConfig:
        if self._config is None:
            raise RuntimeError("the RAM tier component was not set up")
        return self._config

    @property
    def host(self) -> RamTierHost:
        if self._host is None:
            raise RuntimeError("the RAM tier component was not set up")
        return self._host

    @property
    def mistakes(self) -> ClientMistakes:
        if self._mistakes is None:
            raise RuntimeError("the RAM tier component was not set up")
        return self._mistakes

    @property
    def requests(self) -> Tally:
        if self._requests is None:
            raise RuntimeError("the RAM tier component was not set up")
        return self._requests

    # ----- component contract -----

    def setup(self, host: RamTierHost) -> None:
        self._host = host
        self._mistakes = ClientMistakes(host.log)
        self._requests = Tally(host.log, "ram_tier_requests")
        if self._config is None:
            self._config = host.config.table("ram_tier", RamTierConfig)
        self.holdings = Holdings(0, self.config.reservation_ttl_s, self.config.max_reservations_per_uid)
        self.drains = Drains(
            self.holdings,
            lambda: self.root,
            self.host_id,
            self.config.drain_rate_mb_s,
            host.log,
            self._superseded,
            timeout_s=self.config.drain_timeout_s,
            concurrency=self.config.drain_concurrency,
        )
        self.state = "loading" if self.config.enabled else "off"
        for method, path, handler in routes(self):
            host.hooks.add_route(method, path, handler)
        host.hooks.add_status_section("ram_tier", self.status)
        host.hooks.add_metrics_collector(RamTierCollector(self))

    async def start(self) -> None:
        if self.state == "off":
            self.loaded.set()
            return
        self._load = self.host.tasks.spawn(self._read_back(), "ram-tier-load")
        if self.drains is not None:
            self._drain = self.host.tasks.spawn(self.drains.run(), "ram-tier-drain")
        self._usage = self.host.tasks.spawn(self._watch_usage(), "ram-tier-usage")

    async def stop(self) -> None:
        for task in (self._usage, self._drain, self._load):
            if task is not None:
                await self.host.tasks.cancel(task, timeout=1.0)
        self._load = self._drain = self._usage = None
        if self._requests is not None:
            self._requests.close()
        if self.root is not None:
            self.root.close()

    async def _read_back(self) -> None:
        log = self.host.log
        config = self.config
        try:
            root, found = await asyncio.to_thread(_open, config.path)
        except TierError as exc:
            self.state, self.error = "unavailable", str(exc)
            log.error("ram_tier_unavailable", path=str(config.path), error=str(exc))
            return
        finally:
            self.loaded.set()  # also when it failed: waiting for it ends either way
        if not root.in_ram:
            log.warning(
                "ram_tier_not_ram",
                path=str(root.path),
                filesystem=root.filesystem,
                effect="not RAM: what the tier holds is written to that file system's disk and may outlive the "
                "host; use a directory on tmpfs (/dev/shm)",
            )
        for name, why in found.ignored:
            log.warning("ram_tier_entry_ignored", path=str(root.path / name), why=why)
        for uid, job, step, why in found.removed:
            log.warning("ram_tier_step_removed", uid=uid, job=job, step=step, why=why)
        cap = config.cap_bytes or int(config.cap_fraction * psutil.virtual_memory().available)
        if root.in_ram and cap > root.size_bytes:
            log.warning(
                "ram_tier_cap_above_filesystem",
                cap_bytes=cap,
                filesystem_bytes=root.size_bytes,
                effect="the file system's size is the cap",
            )
            cap = root.size_bytes
        self.root = root
        self.holdings.cap_bytes = cap
        self.holdings.records.update(found.records)
        self.removed += len(found.removed)
        self.state = "ready"
        log.info(
            "ram_tier_ready",
            path=str(root.path),
            filesystem=root.filesystem,
            cap_bytes=cap,
            steps=len(found.records),
            used_bytes=self.holdings.used_bytes,
            removed=len(found.removed),
        )

    # ----- used by the routes -----

    async def ready_root(self) -> Root:
        """The root of a tier that serves, once the reservations whose time is up are dropped (and the steps
        nobody committed for them removed); else the refusal that says why the tier does not serve."""
        if self.state == "off":
            raise TierError(
                404,
                "the RAM tier is off on this host: set [ram_tier] enabled = true in the agent's configuration "
                "(see docs/ram-tier.md)",
            )
        if self.state == "loading":
            raise TierError(
                503, "the RAM tier is being read back (its CRCs checked) after a start: try again"
            )
        if self.state == "unavailable" or self.root is None:
            raise TierError(503, f"the RAM tier is unavailable on this host: {self.error}")
        for reservation in self.holdings.expire(self.host.now()):
            await self._let_go(reservation, "ram_tier_reservation_expired")
        return self.root

    async def _let_go(self, reservation: Reservation, event: str, **more: Any) -> None:
        """A reservation gone (expired, revoked): its step is removed when nothing else holds it."""
        abandoned = reservation.key not in self.holdings.records and not self.holdings.has(*reservation.key)
        self.host.log.warning(
            event,
            uid=reservation.uid,
            job=reservation.job,
            step=reservation.step,
            bytes=reservation.bytes,
            effect="released; the uncommitted step is removed" if abandoned else "released",
            **more,
        )
        if abandoned and self.root is not None:
            await asyncio.to_thread(remove_tree, step_dir(self.root.path, *reservation.key))

    async def reserve(self, key: Key, nbytes: int, gid: int, durable_root: str | None) -> tuple[Path, str]:
        """Room for a step, counted against what the tier holds now (measured first), and its directory."""
        root = await self.ready_root()
        self.holdings.measure(await asyncio.to_thread(measure, root))
        reservation, revoked = self.holdings.reserve(key, nbytes, gid, self.host.now(), durable_root)
        for other in revoked:
            await self._let_go(
                other, "ram_tier_reservation_revoked", for_uid=key[0], share=self.holdings.fair_share(key[0])
            )
        try:
            path = await asyncio.to_thread(make_step_dir, root, key[0], gid, key[1], key[2])
        except BaseException:
            self.holdings.reservations.pop(reservation.id, None)
            raise
        return path, reservation.id

    async def _watch_usage(self) -> None:
        """Measure what the jobs' directories hold every ``usage_interval_s``; evict what nothing accounts for
        while the tier is over its cap."""
        await self.loaded.wait()
        while self.root is not None:
            await self.enforce_cap()
            await asyncio.sleep(self.config.usage_interval_s)

    async def enforce_cap(self) -> list[Overrun]:
        """One measurement, and the evictions it calls for (docs/ram-tier.md, "How much memory")."""
        root = self.root
        if root is None:
            return []
        self.holdings.measure(await asyncio.to_thread(measure, root))
        evicted = self.holdings.over_cap()
        for overrun in evicted:
            where = job_dir(root.path, overrun.uid, overrun.job) / overrun.name
            if overrun.step is not None:
                self.holdings.forget(overrun.uid, overrun.job, overrun.step)
                self.holdings.release(overrun.uid, overrun.job, overrun.step)
                self.forget_drains(overrun.uid, overrun.job, overrun.step)
            await asyncio.to_thread(_remove_entry, where)
            self.host.log.warning(
                "ram_tier_overrun_evicted",
                uid=overrun.uid,
                job=overrun.job,
                entry=overrun.name,
                bytes=overrun.bytes,
                accounted_bytes=overrun.accounted,
                cap_bytes=self.holdings.cap_bytes,
                effect="removed: it held more than was reserved or committed for it while the tier was over its "
                "cap",
            )
        if evicted:
            self.holdings.measure(await asyncio.to_thread(measure, root))
        return evicted

    def host_id(self) -> str:
        """This host's name among the hosts that drain one step: its host name and where its tier lives (the
        tests run several simulated hosts on one machine)."""
        where = hashlib.sha256(str(self.config.path).encode()).hexdigest()[:8]
        return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] + "-" + where

    def drain(self, key: Key, durable_root: str, gid: int | None) -> None:
        if self.drains is not None:
            self.drains.request(key, durable_root, gid)

    def forget_drains(self, uid: int, job: str, step: int | None) -> None:
        if self.drains is not None:
            self.drains.forget(uid, job, step)

    async def _superseded(self, uid: int, job: str, step: int) -> None:
        """A durable step ``step`` of ``job`` exists now: the RAM copies of its older steps are of no use."""
        if self.root is None:
            return
        for record in [r for r in self.holdings.steps_of(uid, job) if r.step < step]:
            self.holdings.forget(uid, job, record.step)
            await asyncio.to_thread(remove_tree, step_dir(self.root.path, uid, job, record.step))
            self.host.log.info(
                "ram_tier_freed",
                uid=uid,
                job=job,
                step=record.step,
                bytes=record.bytes,
                why=f"step {step} is durable",
            )

    # ----- status and metrics -----

    def summary(self, uid: int | None = None, every_uid: bool = False) -> dict[str, Any]:
        """``GET /v1/ram-tier``: the tier and what it holds, by job: ``uid``'s jobs (and with ``every_uid``
        every uid's, as ``<uid>/<job>``); every uid's in the status."""
        holdings = self.holdings
        doc = {
            "enabled": self.config.enabled,
            "path": str(self.config.path),
            "cap_bytes": holdings.cap_bytes,
            "used_bytes": holdings.used_bytes,
            "reserved_bytes": holdings.reserved_bytes,
            "free_bytes": holdings.free_bytes,
            "overrun_bytes": holdings.overrun_bytes,
            "jobs": holdings.jobs(uid),
        }
        if every_uid and uid is not None:
            doc["all_jobs"] = holdings.jobs(None)
        return doc

    def status(self) -> dict[str, Any]:
        if self.state == "off":
            return {"enabled": False, "state": "off"}
        doc = self.summary()
        doc.update(
            state=self.state,
            error=self.error,
            filesystem=self.root.filesystem if self.root else None,
            in_ram=self.root.in_ram if self.root else None,
            reservations=len(self.holdings.reservations),
            refusals=self.holdings.refusals,
            removed_steps=self.removed,
        )
        if self.drains is not None:
            doc["drains"] = {
                f"{u}/{j}/{s}": d.to_json() for (u, j, s), d in sorted(self.drains.records.items())
            }
            doc["drained_bytes"] = self.drains.drained_bytes
        return doc


def _open(path: Path) -> tuple[Root, Scan]:
    root = prepare_root(path)
    return root, scan(root)


def _remove_entry(path: Path) -> None:
    """A step's directory or a stray file under a job's directory (never through a link)."""
    try:
        os.unlink(path)
    except IsADirectoryError:
        remove_tree(path)
    except OSError:
        pass


class RamTierCollector:
    """``preemptd_ram_tier_*``: bytes used, reserved and capped, steps held, refusals and removed steps."""

    def __init__(self, tier: RamTierComponent) -> None:
        self._tier = tier

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        tier = self._tier
        if tier.state == "off":
            return
        holdings = tier.holdings
        size = GaugeMetricFamily(
            "preemptd_ram_tier_bytes", "Bytes of the RAM tier: used, reserved and its cap", labels=["kind"]
        )
        for kind, value in (
            ("used", holdings.used_bytes),
            ("reserved", holdings.reserved_bytes),
            ("cap", holdings.cap_bytes),
        ):
            size.add_metric([kind], float(value))
        yield size
        yield GaugeMetricFamily(
            "preemptd_ram_tier_steps", "Steps the RAM tier holds", value=len(holdings.records)
        )
        yield GaugeMetricFamily(
            "preemptd_ram_tier_up",
            "1 when the RAM tier serves, 0 while it loads or is unavailable",
            value=1.0 if tier.state == "ready" else 0.0,
        )
        yield CounterMetricFamily(
            "preemptd_ram_tier_refusals",
            "Reservations and commits refused because the tier was full",
            value=holdings.refusals,
        )
        if tier.drains is not None:
            yield CounterMetricFamily(
                "preemptd_ram_tier_drained_bytes",
                "Bytes copied from the RAM tier into durable roots",
                value=tier.drains.drained_bytes,
            )
            drains = GaugeMetricFamily(
                "preemptd_ram_tier_drains", "Drains of RAM-tier steps by state", labels=["state"]
            )
            for state in ("queued", "copying", "waiting", "committed", "failed"):
                count = sum(1 for d in tier.drains.records.values() if d.state == state)
                drains.add_metric([state], float(count))
            yield drains
        yield CounterMetricFamily(
            "preemptd_ram_tier_removed_steps",
            "Incomplete or damaged steps removed when the tier was read back",
            value=tier.removed,
        )
