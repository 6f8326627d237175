"""Faithful local simulators of the clouds' metadata services, for rehearsing a preemption and for tests.

``simulator_for("aws")`` builds one (every :class:`Simulator` subclass in this package that names its ``cloud``
is found; :func:`register_simulator` adds one from elsewhere); ``await sim.start()`` returns the bound loopback port. See
:mod:`agent.simulate.base` for the control API, faults and scenarios.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from agent.simulate.aws import AwsSimulator
from agent.simulate.azure import AzureSimulator
from agent.simulate.base import Scenario, Simulator
from agent.simulate.faults import SimulatorError
from agent.simulate.gcp import GcpSimulator
from agent.simulate.spot import AlibabaSimulator, TencentSimulator


def _in_tree() -> dict[str, type[Simulator]]:
    """Every simulator in this package, by the cloud it simulates (its ``cloud``): a simulator added as a
    module here is found without editing this file."""
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_") and info.name not in ("cli", "base", "faults"):
            importlib.import_module(f"{__name__}.{info.name}")
    found: dict[str, type[Simulator]] = {}
    pending: list[type[Simulator]] = list(Simulator.__subclasses__())
    while pending:
        cls = pending.pop(0)
        pending.extend(cls.__subclasses__())
        if cls.cloud and cls.__module__.startswith(__name__ + "."):
            found.setdefault(cls.cloud, cls)
    return dict(sorted(found.items()))


SIMULATORS: dict[str, type[Simulator]] = _in_tree()


def register_simulator(cls: type[Simulator]) -> None:
    """Add a simulator (a cloud added as a plug-in, tests) under its ``cloud``."""
    if not cls.cloud:
        raise ValueError(f"{cls.__name__} names no cloud (set the class attribute cloud)")
    SIMULATORS[cls.cloud] = cls


def unregister_simulator(cloud: str) -> None:
    SIMULATORS.pop(cloud, None)


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
    "register_simulator",
    "simulator_for",
    "unregister_simulator",
]
