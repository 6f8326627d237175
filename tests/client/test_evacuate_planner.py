"""The tier planner (issue 24 items 5 and 6): ``ShardedStore(tier="auto")`` saves an emergency step to the
durable root when the durable save's predicted duration times the margin fits the time left before the
deadline, else evacuates it into the RAM tiers of the hosts without a notice; every checkpoint report says
which tier was used, the predicted and the actual duration and the slack, and why the peer tier was not used
when it was not (``fallback``); ``preemptd status`` shows the newest emergency save. Real agents on temporary
sockets, real gloo process groups on CPU: of one rank, and of three ranks on three simulated hosts for the
buddy host that has a notice too."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from agent.cli import format_status
from agent.client.peer.ramtier import RamTier
from agent.core.errors import ReportError
from agent.core.reports import Report, parse_report
from agent.ramtier import RamTierComponent
from agent.service.daemon import Agent
from tests.client.support import tier_agent
from tests.lazy import Lazy
from tests.support import REPO, agent_config, http_json, short_tmp

# torch and the modules that import it are imported by the first test that uses them (tests/lazy.py).
torch = Lazy("torch")
choose_tier = Lazy("agent.client.dcp._peer", "choose_tier")


JOB = "job-plan"


@pytest.mark.parametrize(
    ("predicted", "left", "margin", "tier"),
    [
        (10.0, 60.0, 1.5, "durable"),  # 15 s of 60: fits
        (10.0, 15.0, 1.5, "durable"),  # exactly the margin
        (10.0, 14.9, 1.5, "peer"),
        (94.0, 120.0, 1.5, "peer"),  # the 70B host on AWS: fits bare, not with the margin
        (94.0, 120.0, 1.0, "durable"),
        (None, 30.0, 1.5, "peer"),  # nothing predicts the durable save: the fast tier
        (500.0, None, 1.5, "durable"),  # no deadline to race
        (1.0, 0.0, 1.5, "peer"),  # the deadline has passed
    ],
)
def test_auto_saves_durable_when_the_prediction_times_the_margin_fits_the_time_left_else_peer(
    predicted: float | None, left: float | None, margin: float, tier: str
) -> None:
    chosen, why = choose_tier(predicted, left, margin)
    assert tier == chosen, why


def test_reports_carry_the_tier_the_fallback_and_a_slack_that_may_be_negative() -> None:
    now = datetime.now(timezone.utc)
    doc = {"kind": "checkpoint", "phase": "finished", "step": 3, "emergency": True, "duration_s": 2.0,
           "flush": {"tier": "durable", "fallback": "no_room", "predicted_s": 1.5, "slack_s": -0.25}}  # fmt: skip
    assert {"tier": "durable", "fallback": "no_room", "predicted_s": 1.5, "slack_s": -0.25} == dict(
        parse_report(doc, now).flush
    )
    with pytest.raises(ReportError, match=r"flush\.slack_s"):
        parse_report({**doc, "flush": {"slack_s": "late"}}, now)
    with pytest.raises(ReportError, match=r"flush\.slack_s"):
        parse_report({**doc, "flush": {"slack_s": -1e30}}, now)


def test_auto_needs_a_job_id_and_a_margin_of_at_least_one(group_of_one: None, tmp_path: Path) -> None:
    from agent.client.dcp import ShardedStore

    environ = {k: v for k, v in os.environ.items() if k not in ("PREEMPTD_JOB_ID", "SLURM_JOB_ID")}
    environ["TORCHELASTIC_RUN_ID"] = "none"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", environ)
        with pytest.raises(ValueError, match="no job id for the RAM tier"):
            ShardedStore(tmp_path / "ckpt", report=False, tier="auto")
    with pytest.raises(ValueError, match="margin must be at least 1"):
        ShardedStore(tmp_path / "ckpt", report=False, tier="auto", job=JOB, margin=0.5)


def _state(value: float = 1.0) -> dict[str, Any]:
    return {"weights": torch.full((1 << 12,), value)}


def _emergency(store: Any, step: int, deadline_s: float, noticed: tuple[int, ...] = ()) -> Any:
    deadline = datetime.now(timezone.utc) + timedelta(seconds=deadline_s)
    return store.save(step, _state(step), emergency=True, notice_id="n-1", deadline=deadline, noticed=noticed)


@asynccontextmanager
async def reporting_agent(cap_bytes: int = 1 << 24) -> AsyncIterator[tuple[Path, Path, list[Report]]]:
    """A real agent with its RAM tier on: (its socket, the tier's directory, the reports it received)."""
    base = short_tmp()
    settings = {"ram_tier.enabled": True, "ram_tier.path": str(base / "ram"), "ram_tier.cap_bytes": cap_bytes}
    agent = Agent(agent_config(base, settings))
    received: list[Report] = []
    agent.hooks.on_report(received.append)
    await agent.start()
    try:
        tier = next(c for c in agent.components if isinstance(c, RamTierComponent))
        await asyncio.wait_for(tier.loaded.wait(), 30)
        yield base / "a.sock", base / "ram", received
    finally:
        await agent.stop()
        shutil.rmtree(base, ignore_errors=True)


async def _status(sock: Path, store: Any) -> dict[str, Any]:
    """The agent's status once the store's reports are in."""
    assert await asyncio.to_thread(store.reporter.flush, 10.0)
    status, doc = await http_json(sock, "GET", "/v1/status")
    assert status == 200, doc
    return dict(doc)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("margin", "deadline_s", "tier"), [(1.5, 3600.0, "durable"), (1e6, 60.0, "peer")])
async def test_auto_picks_the_tier_and_every_report_and_status_say_which_with_the_prediction_and_the_slack(
    group_of_one: None, tmp_path: Path, margin: float, deadline_s: float, tier: str
) -> None:
    """A periodic save first (the prediction); then an emergency save: to the root when it fits, into the
    host's RAM tier when it does not (nothing under the root then)."""
    from agent.client.dcp import ShardedStore

    async with reporting_agent() as (sock, ram, reports):
        store = await asyncio.to_thread(
            ShardedStore, tmp_path / "ckpt", socket_path=sock, tier="auto", job=JOB, margin=margin
        )
        await asyncio.to_thread(store.save, 1, _state())
        saved = await asyncio.to_thread(_emergency, store, 2, deadline_s)
        doc = await _status(sock, store)
        held = await asyncio.to_thread(lambda: [s["step"] for s in RamTier(sock).job(JOB)["steps"]])
        await asyncio.to_thread(store.close)
    emergency = [(r.phase, r.flush) for r in reports if r.step == 2]
    assert [("started", tier), ("finished", tier)] == [(phase, flush["tier"]) for phase, flush in emergency]
    finished = emergency[-1][1]
    assert finished["predicted_s"] > 0 and "fallback" not in finished
    assert 0 < finished["slack_s"] <= deadline_s
    lines = format_status(doc).splitlines()
    start = next(i for i, text in enumerate(lines) if text.startswith("Last emergency save"))
    row = [lines[start], *itertools.takewhile(lambda text: text.startswith(" "), lines[start + 1 :])]
    line = " ".join(text.strip() for text in row)  # the row, wrapped at 80 columns, as one line
    assert f"Last emergency save: step 2 to {tier} in " in line and "slack" in line, line
    assert (tier, finished["slack_s"]) == (doc["emergency_save"]["tier"], doc["emergency_save"]["slack_s"])
    if tier == "durable":
        assert (store.path_of(2), [], [2, 1]) == (saved.path, held, store.steps())
    else:
        assert (ram / str(os.getuid()) / JOB / "2", [2], [1]) == (saved.path, held, store.steps())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("cap_bytes", "noticed", "reachable", "fallback"),
    [
        (1024, (), True, "no_room"),  # RAM tier full
        (1 << 24, (0,), True, "all_hosts_noticed"),
        (1 << 24, (), False, "agent_unreachable"),
    ],
)
async def test_when_the_peer_tier_cannot_be_used_the_durable_save_is_reported_with_the_fallback(
    group_of_one: None,
    tmp_path: Path,
    cap_bytes: int,
    noticed: tuple[int, ...],
    reachable: bool,
    fallback: str,
) -> None:
    """``tier="auto"`` choosing the peer tier (no prediction yet): a full RAM tier, every host with a notice,
    an agent whose RAM tier cannot be reached: the step goes to the root with a warning, its reports and
    ``preemptd status`` say so, and nothing stays in the RAM tier."""
    from agent.client.dcp import CheckpointWarning, ShardedStore

    async with reporting_agent(cap_bytes=cap_bytes) as (sock, ram, reports):
        tiers = RamTier(sock if reachable else tmp_path / "none.sock")
        store = await asyncio.to_thread(
            ShardedStore, tmp_path / "ckpt", socket_path=sock, tier="auto", job=JOB, ram_tier=tiers
        )
        with pytest.warns(CheckpointWarning, match="saving it to"):
            saved = await asyncio.to_thread(_emergency, store, 3, 60.0, noticed)
        doc = await _status(sock, store)
        left = list(ram.glob(f"{os.getuid()}/{JOB}/*"))
        await asyncio.to_thread(store.close)
    assert (store.path_of(3), []) == (saved.path, left)
    finished = [r.flush for r in reports if r.step == 3 and r.phase == "finished"]
    assert [("durable", fallback)] == [(f["tier"], f["fallback"]) for f in finished]
    assert f"to durable (fallback: {fallback}) in " in format_status(doc)


# Three ranks, each on its own simulated host (its own agent and RAM tier); hosts 1 and 2 have a notice.
_BUDDY = textwrap.dedent(
    """
    import json, os, sys
    from datetime import datetime, timedelta, timezone
    import torch, torch.distributed as dist
    from agent.client.dcp import ShardedStore

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root, sockets = sys.argv[1], sys.argv[2:]
    store = ShardedStore(root, report=False, socket_path=sockets[rank], tier="auto", job="buddy", margin=1e6)
    state = {"weights": torch.arange(1 << 14, dtype=torch.float32) + rank}
    store.save(1, state)  # a prediction on every rank: rank 0's decides for all
    deadline = datetime.now(timezone.utc) + timedelta(seconds=60)
    saved = store.save(2, state, emergency=True, deadline=deadline, noticed=(1, 2))
    said = {"rank": rank, "path": str(saved.path), "tier": saved.checkpoint.metadata.get("tier")}
    os.write(1, (json.dumps(said) + "\\n").encode())  # one write: the ranks share stdout
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.torch_mp
@pytest.mark.timeout(180)
async def test_when_the_buddy_host_has_a_notice_too_the_next_host_without_one_takes_both_shards(
    tmp_path: Path,
) -> None:
    """Hosts 1 and 2 of three have a notice: host 2, host 1's buddy in the ring, is skipped, and host 0 takes
    both their shards (host 2's too, the ring wrapping); the step is complete in host 0's RAM alone and the
    notified hosts keep nothing."""
    script = tmp_path / "buddy.py"
    script.write_text(_BUDDY)
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    async with AsyncExitStack() as stack:
        agents = [await stack.enter_async_context(tier_agent()) for _ in range(3)]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
        proc = await asyncio.create_subprocess_exec(
            *command, str(script), str(tmp_path / "ckpt"), *(str(sock) for sock, _ in agents), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 150)
        assert 0 == proc.returncode, err.decode()[-3000:]
        doc = json.loads((agents[0][1] / str(os.getuid()) / "buddy" / "2" / "tier.json").read_text())
        left = [sorted(p.name for p in ram.glob(f"{os.getuid()}/buddy/*")) for _, ram in agents]
    said = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    assert [("peer", str(agents[0][1] / str(os.getuid()) / "buddy" / "2"))] * 3 == [
        (s["tier"], s["path"]) for s in said
    ]
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"} == set(doc["files"])
    assert set(doc["files"]) == set(doc["step_files"])
    assert [["2"], [], []] == left
