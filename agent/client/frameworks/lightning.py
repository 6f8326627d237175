"""PyTorch Lightning integration: a callback that saves a durable checkpoint through the store when the host
gets a notice (or the process a signal) and stops training, plus periodic checkpoints at the advised interval.

    callback = PreemptdCallback("/ckpt")
    trainer = Trainer(callbacks=[callback], ...)
    trainer.fit(model, ckpt_path=callback.resume_path())

All ranks agree through the strategy's own ``reduce_boolean_decision`` (the job's process group). Global rank
zero writes the checkpoint (``trainer.save_checkpoint``, the usual case for single-device and DDP training).
Under a strategy that writes a sharded checkpoint on every rank (``FSDPStrategy(state_dict_type="sharded")``,
``ModelParallelStrategy``) every rank writes its shard in Lightning's own format into one shared step
directory, committed once for all ranks by :class:`~agent.client.dcp.ShardedStore`; ``ckpt_path`` resumes it,
at any world size. ``tier="peer"``: a full-state emergency save goes into the RAM of the hosts without a
notice (:class:`~agent.client.peer.store.PeerCheckpointStore`, docs/client.md); under a sharded strategy it
does not apply (a warning says so): Lightning writes its sharded checkpoint into the one directory rank 0
names for every rank (``strategy.save_checkpoint`` broadcasts the path), not into each host's own RAM.

Under torchrun's elastic mode (``--nnodes MIN:MAX``), after the emergency save of a notice the job shrinks
instead of stopping (:meth:`~agent.client.elastic.Elastic.restart_workers`; ``elastic=False`` turns it off):
the notified nodes leave (exit 75, their torchrun stops), and the other nodes' workers stop with
``preempted`` set, so that the script's exit 75 makes their torchrun restart them at the smaller world size,
where ``resume_path()`` finds the step in the staying hosts' RAM (``tier="peer"``) or the durable root.
Lightning owns its process group, so the workers restart rather than re-form in place (docs/elastic.md).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy

from agent.checkpoint.manifest import CheckpointError
from agent.client.dcp import ShardedStore, latest_committed
from agent.client.elastic import Elastic, Reform
from agent.client.events import Trigger
from agent.client.frameworks.callbacks import FollowsNotices, WatchOptions
from agent.client.peer.ramtier import RamTier, RamTierError, resolve_job_id
from agent.client.peer.store import PeerCheckpointStore, newest_held
from agent.client.store import Checkpoint, CheckpointStore

if TYPE_CHECKING:
    from typing_extensions import Unpack

CHECKPOINT_FILE = "lightning.ckpt"


class PreemptdCallback(FollowsNotices, Callback):
    """Emergency (and optionally periodic) checkpoints into a :class:`CheckpointStore` at ``dirpath``.

    ``keep`` newest checkpoints are kept; ``filename`` is the checkpoint's name inside a step directory.
    Options (:class:`~agent.client.frameworks.callbacks.WatchOptions`): ``every``, ``interval_s`` (None turns periodic
    checkpoints off), ``stop_on_notice`` (sets ``trainer.should_stop``), ``socket_path``, ``watcher``
    (otherwise one is started in ``setup`` and stopped in ``teardown``), ``policy``. ``tier`` (``"durable"``
    or ``"peer"``) and ``job`` are passed to the store made in ``setup`` (see the module's docstring);
    ``drain=True`` (full-state, ``tier="peer"``): the agents then drain each peer step into ``dirpath`` as an
    ordinary step, which ``resume_path()`` finds on any host. ``elastic``: shrink an elastic torchrun job at
    a notice (see the module's docstring); ``reform`` is then the answer.
    """

    def __init__(
        self,
        dirpath: str | Path,
        *,
        keep: int = 3,
        filename: str = CHECKPOINT_FILE,
        tier: str = "durable",
        job: str | None = None,
        drain: bool = False,
        elastic: bool = True,
        **options: Unpack[WatchOptions],
    ) -> None:
        Callback.__init__(self)
        FollowsNotices.__init__(self, **options)
        self.store = CheckpointStore(dirpath, keep, socket_path=self.socket_path)
        self.keep = keep
        # Made in setup() when the strategy writes on every rank (it needs the process group).
        self.sharded_store: ShardedStore | None = None
        self.peer_store: PeerCheckpointStore | None = None
        if tier not in ("durable", "peer"):
            raise ValueError(f"tier must be 'durable' or 'peer', got {tier!r}")
        if drain and tier != "peer":
            raise ValueError("drain=True drains the peer tier's steps: it needs tier='peer'")
        # No job id: an error before training, not at the emergency.
        self.tier, self.job = tier, resolve_job_id(job, self.socket_path) if tier == "peer" else job
        self.drain = drain
        self.elastic: Elastic | None = None  # made in setup() when torchrun runs the job elastically
        self._want_elastic = elastic
        self.reform: Reform | None = None
        self._resumed: tuple[int, int] | None = None  # (run, step) resume_path() chose
        self.filename = filename
        self.saved: list[Checkpoint] = []
        self._handled: list[str | None] = []

    def resume_path(self) -> str | None:
        """The newest valid checkpoint file in the store, for ``trainer.fit(ckpt_path=...)``; None if none.

        The notice that checkpoint was saved for (if any) will not stop the resumed run again."""
        # Read by this process alone (no process group yet); a sharded step verifies as any other, with the
        # CRCs its ranks added after an emergency commit.
        latest = latest_committed(self.store.root, require_dcp=False)
        durable = (latest.checkpoint.run, latest.checkpoint.step) if latest is not None else None
        held = None
        if self.tier == "peer":  # this host's newest whole copy in its RAM tier, when newer (setup checks)
            try:
                held = newest_held(RamTier(self.socket_path), str(self.job), durable)
            except RamTierError:
                held = None
        if held is not None:
            self._resumed = (held.run, held.step)
            self._handled.append(held.notice_id)
            return str(held.file(self.filename))
        self._resumed = durable
        if latest is None:
            return None
        self._handled.append(latest.notice_id)
        return str(latest.checkpoint.file(self.filename))

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.start_watching().mark_handled(self._handled)
        if self._want_elastic and self.elastic is None:
            elastic = Elastic(socket_path=self.socket_path)
            self.elastic = elastic if elastic.elastic else None
        if self.sharded_store is None and writes_on_every_rank(trainer.strategy):
            if self.tier == "peer" and trainer.is_global_zero:
                warnings.warn(
                    f"tier='peer' does not apply under {type(trainer.strategy).__name__}: Lightning writes its "
                    "sharded checkpoint into one directory that rank 0 names for every rank, not into each "
                    f"host's RAM tier, so emergency checkpoints go to {self.store.root} (docs/client.md)",
                    UserWarning,
                    stacklevel=2,
                )
            self.sharded_store = ShardedStore(
                self.store.root, self.keep, socket_path=self.socket_path
            )  # a collective on every rank; checks that the directory is shared
        elif self.peer_store is None and self.tier == "peer":
            tiers = RamTier(self.socket_path, drain_to=self.store.root) if self.drain else None
            self.peer_store = PeerCheckpointStore(
                self.store.root, self.keep, job=self.job, socket_path=self.socket_path, ram_tier=tiers
            )  # a collective on every rank
            self._agree_on_resume(self.peer_store)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.stop_watching()
        self.store.close()
        for store in (self.sharded_store, self.peer_store):
            if store is not None:
                store.close()  # its process groups end with it: the next setup() makes a new one
        self.sharded_store = self.peer_store = None

    def _agree_on_resume(self, store: PeerCheckpointStore) -> None:
        """Every rank chose in ``resume_path()``, alone, from its host's RAM and the root: when they chose
        differently (a host without the RAM copy), the newest RAM step is sent to every host and every rank
        raises, so that the next start resumes it everywhere, never from different steps."""
        chosen = store.ranks.gather(self._resumed)
        if len(set(chosen)) > 1:
            store.load_latest(lambda checkpoint: None)  # spreads the newest RAM step to every host
            raise CheckpointError(
                f"the ranks chose different steps to resume from ({', '.join(map(str, chosen))}: run, step): "
                "the newest step held in RAM is now on every host; start the job again to resume it"
            )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step % self.every or self.watcher is None:
            return
        trigger = self.watcher.trigger
        emergency = trainer.strategy.reduce_boolean_decision(trigger is not None, all=False)
        periodic = False
        if self.schedule is not None:
            periodic = trainer.strategy.reduce_boolean_decision(self.schedule.due(), all=False)
        if not (emergency or periodic):
            return
        notice_id = trigger.notice_id if trigger is not None else None
        self._save(trainer, step, emergency, notice_id, self.watcher.deadline if emergency else None)
        if emergency:
            self.watcher.acknowledge()
            if self.elastic is not None and self._shrinks(trainer, step, trigger):
                return
            if self.stop_on_notice:
                self.preempted = True
                trainer.should_stop = True
        if self.schedule is not None:
            self.schedule.mark()

    def _shrinks(self, trainer: Trainer, step: int, trigger: Trigger | None) -> bool:
        """After an emergency save under elastic torchrun (a collective): whether the job shrinks. Then every
        rank stops with ``preempted`` set: a notified node's to leave, a staying node's for its torchrun to
        restart it at the smaller world size."""
        assert self.elastic is not None and self.watcher is not None
        noticed = (trigger is not None and trigger.reason == "notice") or self.watcher.notice is not None
        self.reform = self.elastic.restart_workers(noticed, step)
        if self.reform.action not in ("leave", "restart"):
            return False
        self.preempted = True
        trainer.should_stop = True
        return True

    def _save(
        self, trainer: Trainer, step: int, emergency: bool, notice_id: str | None, deadline: Any = None
    ) -> None:
        if self.sharded_store is not None:
            sharded = self.sharded_store.save_files(
                step,
                lambda directory: trainer.save_checkpoint(directory / self.filename),
                emergency=emergency,
                notice_id=notice_id,
                metadata={"epoch": trainer.current_epoch},
                deadline=deadline,
            )
            self.saved.append(sharded.checkpoint)
            return
        if self.peer_store is not None and emergency:
            self.saved.append(self._save_peer(trainer, step, notice_id))
            return
        if not trainer.is_global_zero:
            # Other ranks take part in the save's collectives; the strategy writes nothing for them.
            trainer.save_checkpoint(self.store.root / f".rank-{trainer.global_rank}-{self.filename}")
            return

        def write(directory: Path) -> None:
            trainer.save_checkpoint(directory / self.filename)

        self.saved.append(
            self.store.save(
                step,
                write,
                emergency=emergency,
                notice_id=notice_id,
                metadata={"epoch": trainer.current_epoch},
            )
        )

    def _save_peer(self, trainer: Trainer, step: int, notice_id: str | None) -> Checkpoint:
        """On every rank: the checkpoint Lightning would save, written by the lowest rank of each host
        without a notice into its RAM tier (or by rank 0 into the root, when that cannot be done)."""
        assert self.peer_store is not None and self.watcher is not None
        flags = self.peer_store.ranks.gather(self.watcher.trigger is not None)
        # What trainer.save_checkpoint does, without its rank-zero-only write and its barrier: any one rank
        # may have to write it here.
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(False)

        def write(directory: Path) -> None:
            trainer.strategy.checkpoint_io.save_checkpoint(checkpoint, directory / self.filename)

        noticed = {rank for rank, flag in enumerate(flags) if flag}
        metadata = {"epoch": trainer.current_epoch}
        return self.peer_store.save(
            step, write, emergency=True, notice_id=notice_id, metadata=metadata, noticed=noticed
        )


def writes_on_every_rank(strategy: Strategy) -> bool:
    """Whether ``trainer.save_checkpoint`` writes a sharded checkpoint from every rank under ``strategy``."""
    if isinstance(strategy, ModelParallelStrategy):
        return bool(getattr(strategy, "_save_distributed_checkpoint", True))
    if isinstance(strategy, FSDPStrategy):
        return getattr(strategy, "_state_dict_type", "full") == "sharded"
    return False


__all__ = [
    "CHECKPOINT_FILE",
    "PreemptdCallback",
    "writes_on_every_rank",
]
