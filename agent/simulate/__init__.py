"""Faithful local simulators of the clouds' metadata services, for rehearsing a preemption and for tests.

``simulator_for("aws")`` builds one from :data:`SIMULATORS`, the simulator registry (agent/core/plugins.py):
the built-in simulators below, then the ``preemptd.simulators`` entry-point group (a cloud added as a
plug-in: ``acme = "module:AcmeSimulator"``), then ``SIMULATORS.register(cls)``; each is named by its
``cloud``. ``await sim.start()`` returns the bound loopback port. See :mod:`agent.simulate.base` for the
control API, faults and scenarios.
"""

from __future__ import annotations

from typing import Any

from agent.core.plugins import Registry
from agent.simulate.aws import AwsSimulator
from agent.simulate.azure import AzureSimulator
from agent.simulate.base import Scenario, Simulator
from agent.simulate.faults import SimulatorError
from agent.simulate.gcp import GcpSimulator
from agent.simulate.spot import AlibabaSimulator, TencentSimulator

ENTRY_POINT_GROUP = "preemptd.simulators"

BUILTIN: tuple[str, ...] = (
    "agent.simulate.aws:AwsSimulator",
    "agent.simulate.gcp:GcpSimulator",
    "agent.simulate.azure:AzureSimulator",
    "agent.simulate.spot:AlibabaSimulator",
    "agent.simulate.spot:TencentSimulator",
)


def _accept(_name: str, loaded: object) -> type[Simulator]:
    if not (isinstance(loaded, type) and issubclass(loaded, Simulator)):
        raise TypeError(f"{loaded!r} is not a Simulator subclass")
    if not loaded.cloud:
        raise TypeError(f"{loaded.__name__} names no cloud (set the class attribute cloud)")
    return loaded


SIMULATORS: Registry[type[Simulator]] = Registry(
    "simulator", BUILTIN, group=ENTRY_POINT_GROUP, accept=_accept, name_of=lambda cls: cls.cloud
)


def simulator_for(cloud: str, **options: Any) -> Simulator:
    found = SIMULATORS.available()
    if cloud not in found:
        raise SimulatorError(f"no simulator for {cloud!r}; choose one of {', '.join(found)}")
    return found[cloud](**options)


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
