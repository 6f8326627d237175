"""The job's process groups end at exit, with the GIL released, before the interpreter finalizes.

A gloo group's worker threads free each finished collective's work (its tensors, and the Python context a
backward pass stashes for it) on their own, just after the caller has its result, and that needs the GIL.
Two ways to lose the process to it, whatever exit status the job meant to give (75: preempted, requeue me):

- The group's last reference dropped by C++ code that holds the GIL (DDP's reducer, when the model goes
  after ``destroy_process_group()``): the group's destructor joins its threads while one waits for the GIL
  to free a work. The process hangs.
- The group alive while the interpreter finalizes: a thread that frees a work then cannot take the GIL and
  the process dies of SIGABRT ("terminate called without an active exception"). Two things keep a destroyed
  group alive that long: ``torch.distributed.nn.functional``'s functions take ``group=group.WORLD`` as a
  default, evaluated when that module is first imported (after ``init_process_group()``: DDP's and FSDP's
  constructors import ``torch._dynamo``, which imports it), and a reference cycle, which the collector
  frees only while the interpreter finalizes.

So the helpers a DDP job calls hold a reference to the group they work on (:func:`hold`: ``Coordinator``,
``agree_load``; the sharded store imports this module for its exit handler alone), and an exit handler,
which runs before the interpreter finalizes, releases what is destroyed by then: it collects the cycles (a
model in one drops its reference, not the last), replaces a destroyed group among ``nn.functional``'s
defaults with None (what ``group.WORLD`` means there at call time: the default group), and drops the last
references from Python, whose release of a group lets go of the GIL while the group's threads are joined.
A group not destroyed by the exit is left alone.
"""

from __future__ import annotations

import atexit
import gc
import sys
import threading
from types import FunctionType, ModuleType
from typing import Any

import torch.distributed as dist

_held: dict[int, Any] = {}  # id -> a process group a helper worked on, released at exit
_lock = threading.Lock()


def hold(group: Any = None) -> None:
    """Keep ``group`` (None: the default group) until the exit handler releases it, so that its last
    reference is dropped from Python, at exit. Cheap enough to call on every collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = group if group is not None else dist.group.WORLD
    if group is not None and id(group) not in _held:
        with _lock:
            _held[id(group)] = group


def _destroyed(group: Any) -> bool:
    return group not in dist.distributed_c10d._world.pg_map


def unpin_default_groups(module: ModuleType) -> list[Any]:
    """Replace every destroyed process group among the defaults of ``module``'s functions with None;
    returns the groups replaced (one entry per default)."""
    unpinned: list[Any] = []

    def pinned(value: object) -> bool:
        return isinstance(value, dist.ProcessGroup) and _destroyed(value)

    for value in list(vars(module).values()):
        if not isinstance(value, FunctionType):
            continue
        if value.__defaults__ and any(pinned(d) for d in value.__defaults__):
            unpinned += [d for d in value.__defaults__ if pinned(d)]
            value.__defaults__ = tuple(None if pinned(d) else d for d in value.__defaults__)
        if value.__kwdefaults__ and any(pinned(d) for d in value.__kwdefaults__.values()):
            unpinned += [d for d in value.__kwdefaults__.values() if pinned(d)]
            value.__kwdefaults__ = {k: None if pinned(d) else d for k, d in value.__kwdefaults__.items()}
    return unpinned


@atexit.register
def _release_at_exit() -> None:
    if not dist.is_available():
        return
    with _lock:
        released = [group for group in _held.values() if _destroyed(group)]
        for group in released:
            del _held[id(group)]
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is not None:
        released += unpin_default_groups(functional)
    if not released:  # nothing of ours to release: spare the exit a full collection
        return
    gc.collect()  # a model in a cycle drops its reference to the group here, not the last one
    # The last references go here, each release joining its group's threads with the GIL released.
    released.clear()
