"""Which job a process on this host belongs to, as the parts of the agent that know it say (issue 24 item 1: a
job is identified by an explicit id or one taken from the launcher or the scheduler).

A client takes its job's id from its own environment first (``PREEMPTD_JOB_ID``, torchrun's rendezvous id,
``SLURM_JOB_ID``: :func:`agent.client.peer.ramtier.job_id`). What a process cannot see from inside, such as the
owner of the pod it runs in, a part that knows it offers through the ``job_names`` capability:
``job_name_registry(host).add(name, source)``, where ``source`` is an async callable taking the process's pid
(in the agent's PID namespace, from SO_PEERCRED) and returning a :class:`JobName`, or raising
:class:`UnknownJob` with the reason it knows none. The RAM tier's ``GET /v1/ram-tier/job-id`` asks them.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agent.core.offers import Capabilities, SourceRegistry, provided, withdraw

JOB_NAMES = "job_names"
# A source that takes longer than this (an API server that does not answer) is passed over.
SOURCE_TIMEOUT_S = 5.0
# What the RAM tier accepts as a job id (agent/ramtier/inventory.py checks the same).
VALID = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclass(frozen=True)
class JobName:
    """A job's id and, for a person, where it was found (``pod ml/train-0's controller PyTorchJob ...``)."""

    job: str
    source: str


class UnknownJob(Exception):
    """A source knows no job for this process; the message says why (``pid 412 runs in no pod``)."""


JobNameSource = Callable[[int], Awaitable[JobName]]


class JobNameRegistry(SourceRegistry[JobNameSource]):
    """The sources parts offer, by name (agent/core/offers.py)."""

    async def name_of(self, pid: int, timeout: float = SOURCE_TIMEOUT_S) -> tuple[JobName | None, list[str]]:
        """The first source's (by name) job for ``pid``, and why each source asked before it had none."""
        why: list[str] = []
        for name, source in sorted(self.sources.items()):
            try:
                found = await asyncio.wait_for(source(pid), timeout)
            except UnknownJob as exc:
                why.append(f"{name}: {exc}")
                continue
            except asyncio.TimeoutError:
                why.append(f"{name}: no answer in {timeout:g} s")
                continue
            except Exception as exc:  # a source's failure is its reason, not the agent's
                why.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            if not VALID.fullmatch(found.job):
                why.append(f"{name}: {found.job!r} ({found.source}) is not a valid job id")
                continue
            return found, why
        return None, why


def withdraw_job_names(host: Capabilities, name: str) -> None:
    """Take back the job-name source ``name`` offered (a bridge a reload turned off)."""
    withdraw(host, JOB_NAMES, name)


def job_name_registry(host: Capabilities) -> JobNameRegistry:
    """The host's registry of job-name sources, provided now if nobody did yet."""
    return provided(host, JOB_NAMES, JobNameRegistry)
