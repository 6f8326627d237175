"""Shrink, don't stop: after an emergency save that evacuated the notified hosts' shards into the other hosts'
RAM tiers, the notified hosts leave and every other host keeps training at the smaller world size, in the
same processes (no new interpreter, imports or device initialisation).

Under torchrun's elastic mode (``--nnodes MIN:MAX`` with a ``c10d`` or ``etcd-v2`` rendezvous), call
:meth:`Elastic.after_emergency` on every rank once the emergency save of a notice has committed. It is a
collective on the default process group and answers, the same way on every rank of a node:

- ``leave``: this node is notified. Exit with 75 (``EXIT_PREEMPTED``); torchrun on this node is told to stop
  (SIGTERM at this process' exit, which leaves the rendezvous open for the others) instead of restarting its
  workers into the job it is leaving.
- ``continue``: this node stays. The default process group has been rebuilt over the staying ranks (ranks
  renumbered in their old order); rebuild what was bound to the old group (the FSDP model, the optimizer, the
  :class:`~agent.client.dcp.ShardedStore`), load the newest step (the evacuated one, resharded to the new
  world size) and go on from it.
- ``restart`` (:meth:`Elastic.restart_workers` only): this node stays, and its workers exit (75) so that
  torchrun restarts them at the smaller world size; for frameworks that own the process group (Lightning).
- ``stop``: the job cannot shrink (not elastic, fewer than MIN nodes would stay, the c10d rendezvous store is
  on a leaving node, or the re-form failed): every rank exits 75, as without this module, and torchrun is told
  to stop so that the scheduler requeues the job.

The launcher's settings are read from torchrun's own command line (the worker's parent process), parsed by
torchrun's own argument parser; ``PREEMPTD_ELASTIC=0`` turns shrinking off. The new group's store is a
``TCPStore`` served by the lowest staying rank on an ephemeral port, published through the old group before
anyone leaves; a staying rank that does not arrive within ``reform_timeout`` turns the answer into ``stop`` on
every rank that did. See docs/elastic.md for what each step costs and what grows the job back.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import time
import uuid
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from agent.client.events import Trigger
from agent.client.frameworks.torch import Decision
from agent.client.hazard import Siblings
from agent.client.launch import Launch, listens_on, restarts_left
from agent.client.peer.ramtier import RamTier, RamTierError
from agent.client.preempted import stopped_from_outside, withdraw
from agent.client.reporting import client_info
from agent.client.transport import AgentHTTPError, AgentUnavailable, request_json
from agent.client.watcher import WatcherBase

Action = Literal["continue", "leave", "stop", "restart"]
ENV_SWITCH = "PREEMPTD_ELASTIC"


@dataclass(frozen=True)
class Member:
    """One rank as the re-form sees it."""

    rank: int
    node: str  # host name and torchrun's pid: one torchrun agent is one node
    noticed: bool
    store_host: bool
    restarts_left: int = 0  # torchrun's restarts this node has left (--max-restarts less those used)
    pool: str | None = None  # its host's capacity pool (Domain.pool_name), as its agent knows it


@dataclass(frozen=True)
class Reform:
    """The answer of :meth:`Elastic.after_emergency`, the same on every rank of a node."""

    action: Action
    reason: str
    world_size: int
    previous_world_size: int
    nodes: int
    previous_nodes: int
    rank: int
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "reason": self.reason,
            "world_size": self.world_size,
            "previous_world_size": self.previous_world_size,
            "nodes": self.nodes,
            "previous_nodes": self.previous_nodes,
            "seconds": round(self.seconds, 4),
        }


@dataclass(frozen=True)
class View:
    """The members as every rank gathered them, and what follows from them."""

    rank: int
    members: list[Member]
    started: float

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(m.node for m in self.members))

    @property
    def leaving(self) -> set[str]:
        return {m.node for m in self.members if m.noticed}

    @property
    def staying(self) -> list[Member]:
        return [m for m in self.members if m.node not in self.leaving]

    @property
    def staying_nodes(self) -> int:
        return len(self.nodes) - len(self.leaving)

    def answer(
        self,
        action: Action,
        reason: str,
        size: int | None = None,
        nodes: int | None = None,
        rank: int | None = None,
    ) -> Reform:
        """This rank's answer (the old world size and node count unless given; the new rank on ``continue``)."""
        world, count = len(self.members), len(self.nodes)
        return Reform(
            action,
            reason,
            world if size is None else size,
            world,
            count if nodes is None else nodes,
            count,
            self.rank if rank is None else rank,
            time.monotonic() - self.started,
        )


class Elastic:
    """Shrinks the job at a notice when torchrun runs it elastically (see the module's text).

    ``reform_timeout``: how long the staying ranks wait for each other at the new store before giving up (every
    rank that arrived then answers ``stop``). ``timeout``: the new process group's collective timeout (torch's
    default when None). ``launch``: the launcher's settings (read from the parent process when None).
    ``siblings``: the notices of the hosts that left, which raise the staying hosts' snapshot rate; give it to
    each :class:`~agent.client.torch.Coordinator` (:class:`~agent.client.hazard.Siblings`).
    """

    def __init__(
        self,
        *,
        reform_timeout: timedelta = timedelta(seconds=60),
        timeout: timedelta | None = None,
        launch: Launch | None = None,
        socket_path: str | Path | None = None,
    ) -> None:
        self.reform_timeout = reform_timeout
        self.socket_path = socket_path
        self.timeout = timeout
        enabled = os.environ.get(ENV_SWITCH, "1").lower() not in ("0", "false", "no", "off")
        if launch is None and enabled and "TORCHELASTIC_RUN_ID" in os.environ:
            launch = Launch.of_parent()
        self.launch = launch if enabled else None
        self.generation = 0
        # Notices on hosts that left: they raise the staying hosts' snapshot rate (give it to the Coordinator).
        self.siblings = Siblings()
        self._pool: str | None = None  # this host's capacity pool, once its agent knew it
        self._store: Any = None  # the store the current group was built on (kept alive with the group)

    @property
    def elastic(self) -> bool:
        return self.launch is not None and self.launch.elastic

    def host_leaves(self, trigger: Trigger) -> bool:
        """For :class:`~agent.client.torch.Coordinator`'s ``leaves``: whether this rank's host goes away with
        ``trigger``. A notice: yes. A signal: yes, unless the job is elastic, runs under ``preemptd exec`` and
        exec received no stopping signal: then it was torchrun stopping its workers (a host joins, or a peer
        failed) and the host stays, so the emergency step goes into the hosts' own RAM tiers."""
        if trigger.reason == "notice" or not self.elastic:
            return True
        return stopped_from_outside() is not False

    def after_emergency(
        self, decision: Decision, watcher: WatcherBase | None = None, step: int | None = None
    ) -> Reform:
        """A collective on the default group, after the emergency save ``decision`` asked for committed on
        every rank (call it before exiting for the notice). A rank's node leaves when the rank has a notice
        from its agent (the decision's, or an active one in ``watcher``); a signal alone (torchrun stopping
        its workers, a user's SIGUSR1) makes no node leave. Returns what this rank does next; when a notice
        was behind it, each node's first local rank tells its agent (``preemptd status`` shows it), naming
        ``step``, the step the job goes on from."""
        noticed = decision.notice_id is not None or (watcher is not None and watcher.notice is not None)
        return self._decide(noticed, step, in_place=True)

    def restart_workers(self, noticed: bool, step: int | None = None) -> Reform:
        """:meth:`after_emergency` for a framework that owns the process group (Lightning's strategies): the
        same collective and answers, except that a staying node answers ``restart``: its workers exit (75)
        and torchrun, which still has a restart left on every staying node, restarts them at the smaller
        world size; they resume the evacuated step. The notified nodes ``leave`` and their torchrun stops.
        ``noticed``: this rank's host has a notice (not only a signal)."""
        return self._decide(noticed, step, in_place=False)

    def _decide(self, noticed: bool, step: int | None, in_place: bool) -> Reform:
        reform, view = self._answer(noticed, in_place)
        if view.leaving and os.environ.get("LOCAL_RANK", "0") == "0":
            self._tell_agent(reform, step)
        return reform

    def _answer(self, noticed: bool, in_place: bool = True) -> tuple[Reform, View]:
        view = self._gather(noticed)
        reason = self._why_not(view, in_place)
        if reason is not None:
            if view.leaving:  # the job stops for a notice: torchrun must not restart it in the window
                self._stop_launcher_at_exit()
            return view.answer("stop", reason), view
        if not in_place:
            return self._restart(view), view
        # The lowest staying rank serves the new group's store and publishes its address through the old group.
        master = view.staying[0].rank
        box: list[Any] = [None]
        if view.rank == master:
            self._store = TCPStore(
                "0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=self.reform_timeout
            )
            box = [(self._reachable_address(view.members), self._store.port, uuid.uuid4().hex)]
        dist.broadcast_object_list(box, src=master)
        address, port, token = box[0]
        backend = dist.get_backend_config()
        dist.destroy_process_group()
        size, nodes = len(view.staying), view.staying_nodes
        if view.members[view.rank].node in view.leaving:
            self._stop_launcher_at_exit()
            return view.answer("leave", f"this node has the notice; {nodes} node(s) go on", size, nodes), view
        new_rank = [m.rank for m in view.staying].index(view.rank)
        try:
            self._join(address, port, token, backend, new_rank, size)
        except Exception as exc:  # a staying rank died or hung: every rank that arrived falls back to stop
            self._stop_launcher_at_exit()
            return view.answer("stop", f"re-form at {size} rank(s) failed: {exc}"), view
        withdraw()  # this process goes on: its emergency record no longer means "stopped for a notice"
        self.generation += 1
        pools = {m.pool for m in view.members if m.node in view.leaving and m.pool is not None}
        self.siblings.note(f"{len(view.leaving)} host(s) of the job left with a notice", sorted(pools))
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(new_rank), str(size)
        return view.answer(
            "continue", f"{len(view.leaving)} node(s) left with the notice", size, nodes, new_rank
        ), view

    def _restart(self, view: View) -> Reform:
        """The answer without a re-form in this process: the notified nodes leave, the others' workers exit
        for torchrun to restart them at the staying size (see :meth:`restart_workers`)."""
        size, nodes = len(view.staying), view.staying_nodes
        if view.members[view.rank].node in view.leaving:
            self._stop_launcher_at_exit()
            return view.answer("leave", f"this node has the notice; {nodes} node(s) go on", size, nodes)
        withdraw()  # this node goes on: the worker's exit is a restart, not a stop for a notice
        reason = f"{len(view.leaving)} node(s) left with the notice; torchrun restarts the workers at {size} rank(s)"
        return view.answer("restart", reason, size, nodes)

    def _tell_agent(self, reform: Reform, step: int | None) -> None:
        """One ``membership`` report to this node's agent; a failure is a warning, never the job's."""
        phase = {"continue": "reformed", "restart": "reformed", "leave": "left", "stop": "stopped"}[
            reform.action
        ]
        membership = {k: v for k, v in reform.as_dict().items() if k != "action"}
        membership["seconds"] = float(membership["seconds"])
        if reform.action == "restart":  # the restart's halt is torchrun's, after this process: not known here
            del membership["seconds"]
        membership["reason"] = str(membership["reason"])[:500]
        body = {
            "kind": "membership",
            "phase": phase,
            "step": step,
            "client": client_info(),
            "membership": membership,
        }
        try:
            request_json("POST", "/v1/reports", body, self.socket_path, timeout=2.0)
        except (AgentUnavailable, AgentHTTPError, OSError) as exc:
            warnings.warn(f"cannot tell the agent the job {phase}: {exc}", RuntimeWarning, stacklevel=3)

    def _gather(self, noticed: bool) -> View:
        """Every rank's node, notice and whether its torchrun serves the rendezvous store."""
        started = time.monotonic()
        rank, world = dist.get_rank(), dist.get_world_size()
        launch = self.launch
        member = Member(
            rank=rank,
            node=f"{socket.gethostname()}:{launch.agent_pid if launch else os.getpid()}",
            noticed=noticed,
            store_host=bool(launch and launch.store_port and listens_on(launch.agent_pid, launch.store_port)),
            restarts_left=restarts_left(launch),
            pool=self._host_pool(),
        )
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, member)
        return View(rank, list(gathered), started)

    def _host_pool(self) -> str | None:
        """This host's capacity pool from its agent's RAM tier (its failure domain); None when the agent, its
        tier or its cloud is not known. Asked until it is known, briefly: this runs inside a notice's window."""
        if self._pool is None:
            try:
                domain = RamTier.domain_of(RamTier(self.socket_path, timeout=0.5).info())
            except (RamTierError, OSError):
                domain = None
            self._pool = domain.pool_name if domain is not None else None
        return self._pool

    def _why_not(self, view: View, in_place: bool = True) -> str | None:
        launch = self.launch
        if not view.leaving:
            return "no rank has the notice"
        if launch is None:
            return "not launched by torchrun's elastic agent (or PREEMPTD_ELASTIC=0)"
        if not launch.elastic:
            return f"torchrun --nnodes {launch.max_nodes} with --rdzv-backend {launch.rdzv_backend} is not elastic"
        if view.staying_nodes < launch.min_nodes:
            return f"{view.staying_nodes} node(s) would stay, below --nnodes MIN {launch.min_nodes}"
        if any(m.store_host and m.node in view.leaving for m in view.members):
            return (
                "the c10d rendezvous store is served by a leaving node's torchrun; "
                "a rendezvous that outlives any host needs --rdzv-backend etcd-v2"
            )
        if not in_place and any(m.restarts_left < 1 for m in view.staying):
            return "a staying node's torchrun has no restart left (--max-restarts) to restart its workers"
        return None

    def _reachable_address(self, members: list[Member]) -> str:
        """An address of this host the other hosts reach: the workers' MASTER_ADDR when this host serves it
        (rank 0's node), otherwise the local address of the route to it."""
        master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if members[0].node == next(m.node for m in members if m.rank == dist.get_rank()):
            return master_addr
        port = int(os.environ.get("MASTER_PORT", "29500") or 29500)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_addr, port))  # no packet: only the route is looked up
            return str(probe.getsockname()[0])

    def _join(self, address: str, port: int, token: str, backend: str, rank: int, world: int) -> None:
        if rank != 0:
            self._store = TCPStore(address, port, is_master=False, timeout=self.reform_timeout)
        store = PrefixStore(f"preemptd/reform/{token}", self._store)
        # Every staying rank arrives before any builds the group, so a rank that died or hangs is found within
        # reform_timeout instead of the group's (long) collective timeout.
        store.add("arrived", 1)
        deadline = time.monotonic() + self.reform_timeout.total_seconds()
        while int(store.add("arrived", 0)) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{store.add('arrived', 0)} of {world} rank(s) arrived within {self.reform_timeout}"
                )
            time.sleep(0.005)
        options: dict[str, Any] = {} if self.timeout is None else {"timeout": self.timeout}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **options)

    def _stop_launcher_at_exit(self) -> None:
        """At this process' exit, SIGTERM torchrun on this node: it stops its workers and exits instead of
        counting the exit as a failure and restarting them into the job (a trapped signal also leaves the
        rendezvous open for the nodes that go on). Sent before the process is gone, so torchrun handles the
        signal before it can see the exit."""
        launch = self.launch
        if launch is None or not launch.elastic:
            return
        pid = launch.agent_pid
        atexit.register(_signal_quietly, pid)


def _signal_quietly(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGTERM)
