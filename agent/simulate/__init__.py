"""Faithful local simulators of the clouds' metadata services, for rehearsing a preemption and for tests.

``simulator_for("aws")`` builds one; ``await sim.start()`` returns the bound loopback port. See
:mod:`agent.simulate.base` for the control API, faults and scenarios.
"""

from __future__ import annotations

from typing import Any

from agent.simulate.aws import AwsSimulator
from agent.simulate.azure import AzureSimulator
from agent.simulate.base import Scenario, Simulator
from agent.simulate.faults import SimulatorError
from agent.simulate.gcp import GcpSimulator
from agent.simulate.spot import AlibabaSimulator, TencentSimulator

SIMULATORS: dict[str, type[Simulator]] = {
    "aws": AwsSimulator,
    "gcp": GcpSimulator,
    "azure": AzureSimulator,
    "alibaba": AlibabaSimulator,
    "tencent": TencentSimulator,
}


def simulator_for(cloud: str, **options: Any) -> Simulator:
    try:
        cls = SIMULATORS[cloud]
    except KeyError:
        raise SimulatorError(f"no simulator for {cloud!r}; choose one of {', '.join(SIMULATORS)}") from None
    return cls(**options)


__all__ = [
    "SIMULATORS",
    "AlibabaSimulator",
    "AwsSimulator",
    "AzureSimulator",
    "GcpSimulator",
    "Scenario",
    "Simulator",
    "SimulatorError",
    "TencentSimulator",
    "simulator_for",
]
