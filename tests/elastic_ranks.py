"""One rank of tests/client/test_elastic.py: a gloo group of WORLD_SIZE processes on a TCPStore at MASTER_PORT, then
``Elastic.after_emergency`` with a launch whose torchrun is a stand-in process (``--agent-pid``), a notice on
the ranks ``--noticed`` names; prints one JSON line with the answer and, after a re-form, an all_reduce over
the new group (``--restart``: ``Elastic.restart_workers`` instead, with torchrun's restart count from the
environment). ``--die`` names a rank that exits at once instead of joining the new group, ``--hang`` one that stays alive
and silent instead (its sockets open, as a frozen process's)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from agent.client.elastic import Elastic, Member
from agent.client.launch import Launch
from agent.client.torch import Decision


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agent-pid", type=int, required=True)
    parser.add_argument("--noticed", type=int, nargs="*", default=[])
    parser.add_argument("--min-nodes", type=int, default=2)
    parser.add_argument("--max-nodes", type=int, default=3)
    parser.add_argument("--die", type=int, default=None)
    parser.add_argument("--hang", type=int, default=None)
    parser.add_argument("--restart", action="store_true", help="Elastic.restart_workers (Lightning's way)")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    launch = Launch(args.agent_pid, args.min_nodes, args.max_nodes, "etcd-v2", "127.0.0.1:2379", 3)
    elastic = Elastic(launch=launch, reform_timeout=timedelta(seconds=3))
    if rank in (args.die, args.hang):
        # A staying rank that dies during the re-form: it takes part in the agreement over the old group as
        # Elastic does (the gathered members, the new store's address from the lowest staying rank), then is
        # gone before it joins the new group.
        gathered: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(
            gathered, Member(rank, f"{socket.gethostname()}:{args.agent_pid}", False, False)
        )
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=min(set(range(dist.get_world_size())) - set(args.noticed)))
        if rank == args.hang:
            time.sleep(600)  # the test kills it once the others have answered
        os._exit(9)
    decision = Decision(checkpoint=True, emergency=True, notice_id="n-1" if rank in args.noticed else None)
    if args.restart:
        reform = elastic.restart_workers(decision.notice_id is not None)
    else:
        reform = elastic.after_emergency(decision)
    out = {"old_rank": rank, **reform.as_dict(), "rank": reform.rank}
    if reform.action == "continue":
        total = torch.tensor([float(rank)])
        dist.all_reduce(total)
        out.update(sum=total.item(), env=[os.environ["RANK"], os.environ["WORLD_SIZE"]])
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    return 75 if reform.action != "continue" else 0


if __name__ == "__main__":
    sys.exit(main())
