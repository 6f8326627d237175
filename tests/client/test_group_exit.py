"""A DDP job's default process group ends at exit, before the interpreter finalizes, with the GIL released
(agent/client/group_exit.py): not when DDP's reducer drops it (a join under the GIL: the rank hung), not while
the interpreter finalizes (a gloo worker freeing a finished collective then aborts the rank: "terminate
called without an active exception", its exit status lost). Two real gloo ranks over loopback; the
process's native threads are counted in /proc."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.client.support import dcp_job
from tests.lazy import HAS_TORCH

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_mp,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed"),
]

_RANK = """
import atexit, json, os, sys, types

def threads():
    return len(os.listdir("/proc/self/task"))

def pinned():  # nn.functional's defaults that hold a process group
    functional = sys.modules.get("torch.distributed.nn.functional")
    return sum(
        isinstance(d, torch.distributed.ProcessGroup)
        for f in vars(functional or types).values() if isinstance(f, types.FunctionType)
        for d in f.__defaults__ or ()
    )

mode = sys.argv[1]
out = {"bare": threads()}
# Registered before agent.client is imported, so it runs after agent.client's own exit handler.
atexit.register(lambda: print(json.dumps({"at_exit": threads(), "pinned_at_exit": pinned()}), flush=True))
import torch, torch.distributed as dist
from torch import nn
if mode == "early":  # nn.functional imported before the group exists: its defaults hold none
    import torch.distributed.nn.functional
from agent.client.torch import Coordinator
dist.init_process_group("gloo")
out["job"] = threads()
model = nn.Linear(8, 1)
ddp = nn.parallel.DistributedDataParallel(model)  # imports torch._dynamo, and with it nn.functional
out["pinned"] = pinned()
ddp(torch.randn(4, 8)).sum().backward()
if mode != "no_helpers":
    out["checkpoint"] = Coordinator().check(1).checkpoint  # one all_reduce on the job's group
if mode == "cycle":  # only a reference cycle holds the model, and through DDP the group
    holder = {"ddp": ddp}
    holder["self"] = holder
    del holder
del ddp, model  # DDP's reducer drops its reference to the group, not the last one
dist.destroy_process_group()
out["destroyed"] = threads()
print(json.dumps(out), flush=True)
"""


async def test_a_ddp_jobs_group_is_joined_at_exit_not_by_ddps_reducer(tmp_path: Path) -> None:
    for rank in await dcp_job(tmp_path, "late", rank_script=_RANK):
        assert rank["job"] > rank["bare"], rank  # the default group's gloo threads
        # If this fails, torch no longer pins the group in nn.functional's defaults: the unpinning can go.
        assert rank["pinned"] > 0, rank
        assert rank["checkpoint"] is False, rank
        assert rank["destroyed"] > rank["bare"], rank  # not joined when the reducer went, under the GIL
        assert (rank["at_exit"], rank["pinned_at_exit"]) == (rank["bare"], 0), rank


async def test_the_group_is_held_past_ddp_when_nothing_pins_it(tmp_path: Path) -> None:
    # Without the hold, DDP's reducer dropped the last reference, and joined the threads holding the GIL.
    for rank in await dcp_job(tmp_path, "early", rank_script=_RANK):
        assert rank["pinned"] == 0, rank
        assert rank["destroyed"] > rank["bare"], rank
        assert rank["at_exit"] == rank["bare"], rank


async def test_a_group_held_only_by_a_cycle_is_released_before_the_interpreter_finalizes(
    tmp_path: Path,
) -> None:
    for rank in await dcp_job(tmp_path, "cycle", rank_script=_RANK):
        assert rank["destroyed"] > rank["bare"], rank
        assert rank["at_exit"] == rank["bare"], rank  # the exit handler's collection freed the cycle


async def test_a_job_that_uses_no_helper_has_its_pinned_group_released_at_exit(tmp_path: Path) -> None:
    for rank in await dcp_job(tmp_path, "no_helpers", rank_script=_RANK):
        assert rank["pinned"] > 0, rank
        assert (rank["at_exit"], rank["pinned_at_exit"]) == (rank["bare"], 0), rank
