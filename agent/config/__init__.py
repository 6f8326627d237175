"""The agent's configuration: one frozen :class:`Config`, loaded from a TOML file, ``PREEMPTD_*`` environment
variables and command-line settings, in increasing precedence.

Each subsystem owns one section dataclass below (the built-in clouds' are in agent/config/clouds.py); every
other table is declared by the plug-in registry entry that reads it (agent/config/catalog.py). The loader is
generic and checks every key of every table against the field's type when the file is loaded, so a bad file
fails with the file, the dotted key and what was expected before anything starts.

Environment variables: ``PREEMPTD_<KEY>`` for a top-level key (``PREEMPTD_SOCKET``), and
``PREEMPTD_<SECTION>__<KEY>`` for a key in a section (``PREEMPTD_AWS__POLL_INTERVAL_S=2``). Values are read
as TOML values when they parse as one (numbers, booleans, arrays) and as plain strings otherwise.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from msgspec import Meta

from agent.config.actions import ActionsConfig, HookConfig, ReadyConfig, SignalRuleConfig, WebhookConfig
from agent.config.clouds import (
    BUILTIN_CLOUDS,
    AlibabaConfig,
    AwsConfig,
    AzureAcknowledge,
    AzureConfig,
    GcpConfig,
    TencentConfig,
)
from agent.config.loader import (
    INTERNAL,
    build,
    dotted_to_nested,
    env_table,
    fail,
    field_names,
    merge,
    parse_value,
    read_toml,
    type_hints,
    where,
)
from agent.config.tables import known, take_tables
from agent.config.types import (
    MIN_INTERVAL_S,
    AtLeastOne,
    HttpUrl,
    NonNegative,
    NoticeKindName,
    Seconds,
    SecondsOrOff,
    SecondsUpToADay,
    SecondsUpToAMinute,
    SecondsUpToAYear,
    SeverityName,
)
from agent.core.errors import ConfigError
from agent.core.paths import default_socket_path, default_state_dir

DEFAULT_CONFIG_PATH = Path("/etc/preemptd/config.toml")
ENV_PREFIX = "PREEMPTD_"

# ``cloud``: these, or a cloud of the cloud registry (agent/sources/clouds.py) that is not built in.
CLOUDS: tuple[str, ...] = ("auto", "none", *BUILTIN_CLOUDS)
LogFormat = Literal["auto", "json", "console"]
LogLevel = Literal["debug", "info", "warning", "error"]
# Sections whose sub-tables belong to plug-ins (reactors, scheduler bridges): ``[actions.slurm]`` is checked
# against the schema its bridge declared; a sub-table nobody declared is an error once the reactor registry
# has said which exist (agent/config/tables.py).
EXTENSIBLE = ("actions",)
T = TypeVar("T")


# listen(2)'s backlog is a C int that the kernel caps at net.core.somaxconn (4096 by default).
MAX_BACKLOG = 65535


@dataclass(frozen=True)
class ApiConfig:
    """The Unix-socket API and its event hub."""

    heartbeat_s: Seconds = 15.0
    queue_size: AtLeastOne = 256
    ring_size: AtLeastOne = 1024
    max_subscribers: AtLeastOne = 4096
    max_body_bytes: AtLeastOne = 65536
    backlog: Annotated[int, Meta(ge=1, le=MAX_BACKLOG)] = 4096
    shutdown_timeout_s: Seconds = 3.0
    # A connection must complete a request head (and a body) within this long of being accepted or of its
    # previous answer; event streams being served are exempt (they have heartbeats).
    idle_timeout_s: Seconds = 15.0
    # Connections served at once; past it a connection is answered 503. Lowered to what the descriptor
    # limit allows.
    max_connections: AtLeastOne = 8192


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus metrics beyond the Unix socket's ``/metrics``."""

    # "HOST:PORT" (the node's address, "10.0.0.5:9464"; "127.0.0.1:9464"; "[::1]:9464") to serve GET /metrics
    # and the probes /healthz and /readyz, nothing else, over TCP for Prometheus and the kubelet; "" (the default): off. Idle connections are closed
    # after api.idle_timeout_s, as on the socket.
    listen: str = ""
    # Connections served at once; past it a connection is answered 503.
    max_connections: AtLeastOne = 64
    # GET /healthz on the listener answers 503 when the event loop's watchdog tick is older, or ran later,
    # than this (a loop wedged outright cannot answer at all: the probe's own timeout is the signal).
    stall_s: SecondsUpToAMinute = 10.0


@dataclass(frozen=True)
class DetectConfig:
    """How ``cloud = "auto"`` finds the cloud: DMI strings, then one short metadata probe."""

    dmi_dir: Path = Path("/sys/class/dmi/id")
    probe_timeout_s: Seconds = 1.0
    # Without a DMI answer, keep probing (with backoff) this long before concluding there is no cloud: the
    # network may not be up yet at boot.
    probe_retry_s: NonNegative = 60.0


# --- GPU and host health (agent/sources/nvml.py, agent/sources/host.py) ---------------------------------

XidClassName = Literal["fatal", "degraded", "info"]


@dataclass(frozen=True)
class GpuConfig:
    """The NVML GPU health monitor (source ``nvml``); see docs/gpu-health.md."""

    enabled: bool = True
    # None: the system's libnvidia-ml.so.1 (or LD_LIBRARY_PATH); a path loads that library instead.
    library_path: Path | None = None
    poll_interval_s: Seconds = 5.0
    # An NVML call that has not returned after this long is itself a gpu_fault ("NVML call hung").
    call_timeout_s: Seconds = 10.0
    # How long one NVML event wait lasts (milliseconds): the events thread loops on it.
    event_wait_ms: Annotated[int, Meta(ge=100, le=60_000)] = 500
    # Hysteresis: a non-fatal condition is raised after raise_after bad readings in a row (fatal ones at
    # once) and cleared after clear_after good ones.
    raise_after: AtLeastOne = 2
    clear_after: AtLeastOne = 3
    # Consecutive polls with NVML "Unknown Error" before the GPU counts as lost.
    unknown_after: AtLeastOne = 3
    # How long a notice for an XID or a driver event (which never "clear" by themselves) stays active.
    xid_hold_s: float = 600.0
    # XID number -> "fatal" / "degraded" / "info", on top of the built-in table (agent/sources/gpu_xid.py).
    xid_classes: dict[int, XidClassName] = field(default_factory=dict)
    xid_default: XidClassName = "degraded"
    temperature_shutdown_margin_c: float = 3.0
    power_tolerance: float = 0.05
    # Clock event reasons that count as a slowdown: HW slowdown, SW/HW thermal, HW power brake.
    clock_event_mask: int = 0x8 | 0x20 | 0x40 | 0x80
    kmsg: bool = True
    kmsg_path: Path = Path("/dev/kmsg")


@dataclass(frozen=True)
class HostConfig:
    """The psutil host monitor (source ``host``): memory pressure and checkpoint/state disk space."""

    enabled: bool = True
    poll_interval_s: Seconds = 10.0
    raise_after: AtLeastOne = 2
    clear_after: AtLeastOne = 3
    memory_available_min_percent: float = 5.0
    checkpoint_dirs: tuple[Path, ...] = ()
    # Free space needed on a checkpoint directory, as a multiple of the last checkpoint's size.
    checkpoint_headroom: float = 1.1
    state_dir_min_free_bytes: int = 256 * 1024 * 1024
    state_dir_min_free_percent: float = 1.0
    # A psutil read (statvfs on a dead network mount) that takes longer than this is a finding.
    call_timeout_s: Seconds = 10.0


@dataclass(frozen=True)
class AdvisorConfig:
    """The checkpoint interval advisor (``GET /v1/advice``, ``preemptd advise``); see docs/advisor.md."""

    enabled: bool = True
    # Checkpoint save time to assume until clients report their own (seconds; none: wait for reports).
    save_time_s: float | None = None
    # Prior mean time between work-losing interruptions (e.g. from a published interruption-frequency
    # bucket) and its weight in pseudo-observations; observed losses and uptime are added to it.
    prior_mtbp_s: float | None = None
    prior_weight: float = 1.0
    # The periodic interval the training jobs use now (seconds of compute between checkpoints), when known;
    # otherwise it is inferred from the times of periodic checkpoint reports.
    current_interval_s: float | None = None
    # Restart and restore time R after an interruption (scales the waste, does not move the optimum).
    restart_s: float = 0.0
    # Fewer observed losses than this, and no prior: no advice (interval_s is null).
    min_losses: int = 3
    # Fewer finished periodic checkpoints than this, and no save_time_s: no advice.
    min_reports: int = 1
    # The save time is the median of the last this many checkpoints.
    report_window: int = 200
    # Losses closer together than this count as one interruption (a host's GPUs often fail together).
    coalesce_s: float = 300.0
    # Notice kinds that take the host away at their deadline.
    interrupting_kinds: tuple[str, ...] = ("termination", "maintenance")
    # Probability mass of the credible range reported for M and the interval.
    credible_level: float = 0.9
    # How often the advisor appends an ``advice`` record to the history log (it also bounds how much uptime
    # an unclean stop can hide); 0 disables.
    record_interval_s: SecondsOrOff = 3600.0
    # Share of the unannounced losses that also destroy every RAM copy of some shard (host and peer lost
    # together): nothing measures it yet. The two-level advice takes λ2 = share·λ for durable checkpoints and
    # λ1 = (1 - share)·λ for peer snapshots; 0.2 is a same-pool peer's co-loss within ±3 min (docs/advisor.md).
    ram_loss_share: float = 0.2


@dataclass(frozen=True)
class Config:
    socket: Path = field(default_factory=default_socket_path)
    socket_group: str | None = None
    socket_mode: Annotated[int, Meta(ge=0, le=0o777, description="a mode from 0o000 to 0o777")] = 0o660
    admin_group: str | None = None
    state_dir: Path = field(default_factory=default_state_dir)
    cloud: str = "auto"
    log_format: LogFormat = "auto"
    log_level: LogLevel = "info"
    # How long after its deadline a notice whose source is not running (a drill, a notice restored from a
    # source no longer configured) stays active.
    expire_grace_s: SecondsUpToADay = 30.0
    # How long a drill notice stays after its deadline before it clears by itself.
    drill_linger_s: SecondsUpToADay = 10.0
    history_max_bytes: AtLeastOne = 16 * 1024 * 1024
    api: ApiConfig = field(default_factory=ApiConfig)
    actions: ActionsConfig = field(default_factory=ActionsConfig)
    aws: AwsConfig = field(default_factory=AwsConfig)
    gcp: GcpConfig = field(default_factory=GcpConfig)
    azure: AzureConfig = field(default_factory=AzureConfig)
    alibaba: AlibabaConfig = field(default_factory=AlibabaConfig)
    tencent: TencentConfig = field(default_factory=TencentConfig)
    detect: DetectConfig = field(default_factory=DetectConfig)
    advisor: AdvisorConfig = field(default_factory=AdvisorConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    host: HostConfig = field(default_factory=HostConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    config_file: Path | None = None
    # Plug-in tables by dotted name (``"actions.slurm"``), as written; read them with :meth:`table`.
    tables: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, metadata=INTERNAL)
    # The declared tables (agent/config/tables.py), checked and built when the file was loaded.
    built: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False, metadata=INTERNAL)
    # Where each dotted key was set (a file, "environment", "command line"), for the errors of table().
    origins: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False, metadata=INTERNAL)

    def table(self, name: str, schema: type[T]) -> T:
        """The table ``name`` (dotted: ``"actions.slurm"``) checked against the frozen dataclass ``schema``
        with the loader's rules and errors (file, dotted key, what was expected); the schema's defaults when
        the table was not set. A built-in section (``"actions"``, ``"aws"``) is returned as loaded, and so
        is a declared table (already checked when the file was loaded)."""
        section: Any = self
        for part in name.split("."):
            section = getattr(section, part, None) if part in field_names(type(section)) else None
            if section is None or not dataclasses.is_dataclass(section):
                section = None
                break
        if section is not None:
            if not isinstance(section, schema):
                raise TypeError(f"[{name}] is a {type(section).__name__}, not a {schema.__name__}")
            return section
        declared = self.built.get(name)
        if isinstance(declared, schema):
            return declared
        built: T = build(schema, self.tables.get(name, {}), name + ".", self.origins)
        return built

    def has_table(self, name: str) -> bool:
        """Whether anything was set under ``name`` (a plug-in table or a built-in section)."""
        return name in self.tables or any(k == name or k.startswith(name + ".") for k in self.origins)

    def extension_tables(self) -> tuple[str, ...]:
        """The dotted names of the plug-in tables that were set."""
        return tuple(sorted(self.tables))


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration: defaults, then the file, then the environment, then ``overrides``; every
    table is checked: the core sections, and each table the plug-in registries' entries read (the clouds',
    the reactors', the components': agent/config/catalog.py).

    ``path`` None means the file named by ``PREEMPTD_CONFIG`` or the default path, which may be absent; an
    explicit path must exist. ``overrides`` maps dotted keys (``"api.heartbeat_s"``) to values.
    """
    environ = dict(os.environ if env is None else env)
    explicit = path is not None or bool(environ.get(ENV_PREFIX + "CONFIG"))
    file_path = path or Path(environ.get(ENV_PREFIX + "CONFIG") or DEFAULT_CONFIG_PATH)
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if file_path.exists() or explicit:
        file_doc = read_toml(file_path)
        merge(merged, file_doc, origin, str(file_path))
    merge(merged, env_table(environ, ENV_PREFIX, Config), origin, "environment")
    merge(merged, dotted_to_nested(overrides or {}), origin, "command line")
    merged.pop("config_file", None)
    hints = type_hints(Config)
    core = {name: dataclasses.is_dataclass(hints[name]) for name in field_names(Config)}
    found = known()
    plugins = {name: item for name, item in found.declared.items() if name not in core}
    clouds = (*CLOUDS, *(name for name in found.clouds() if name not in CLOUDS))
    if "cloud" in merged and merged["cloud"] not in clouds:
        raise fail(origin, "cloud", "one of " + ", ".join(repr(c) for c in clouds), merged["cloud"])
    extensible = {name: field_names(hints[name]) for name in EXTENSIBLE}
    tables = take_tables(
        merged, dataclasses.replace(found, declared=plugins), core, extensible, lambda n: where(origin, n)
    )
    config: Config = build(Config, merged, "", origin)
    built = {name: _table(item.schema, name, tables, origin) for name, item in plugins.items()}
    loaded_from = file_path if file_path.exists() else None
    return dataclasses.replace(
        config, config_file=loaded_from, tables=tables, built=built, origins=dict(origin)
    )


def _table(schema: type[Any], name: str, tables: Mapping[str, Any], origin: Mapping[str, str]) -> Any:
    """A declared table as loaded; its defaults (as cheap as a constructor call) when it was not set."""
    if name not in tables:
        try:
            return schema()
        except TypeError:  # a key without a default: the loader says which
            pass
    return build(schema, tables.get(name, {}), name + ".", origin)


def parse_setting(text: str) -> tuple[str, Any]:
    """Parse a ``--set section.key=value`` argument; the value is read as TOML where it parses as one."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE (for example api.heartbeat_s=5), got {text!r}")
    return key.strip(), parse_value(raw)


def config_to_json(config: Config) -> dict[str, Any]:
    """The effective configuration as JSON-able data (for status and ``preemptd run --print-config``)."""

    def convert(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {
                f.name: convert(getattr(value, f.name))
                for f in dataclasses.fields(value)
                if not f.metadata.get("internal")
            }
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, Mapping):
            return {str(k): convert(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        return value

    result = convert(config)
    assert isinstance(result, dict)
    # A plug-in table as loaded (its defaults filled in): a top-level one always, as the sections are; one
    # under a section (a bridge's) when it was set; one read unchecked, as written.
    for dotted in sorted({*config.tables, *config.built}):
        section, _, name = dotted.rpartition(".")
        if section and dotted not in config.tables:
            continue
        shown = config.built.get(dotted, config.tables.get(dotted))
        (result.setdefault(section, {}) if section else result)[name] = convert(shown)
    for hook in result.get("actions", {}).get("webhooks", ()):  # what came from secret files is not shown
        if hook.get("url_file"):
            hook["url"] = f"(read from {hook['url_file']})"
        for header, path in hook.get("header_files", {}).items():
            hook["headers"][header] = f"(read from {path})"
    return result


# The public face: the sections, the value types plug-in tables use, the table registry, the loader.
__all__ = [
    "CLOUDS",
    "MIN_INTERVAL_S",
    "ActionsConfig",
    "AdvisorConfig",
    "AlibabaConfig",
    "ApiConfig",
    "AtLeastOne",
    "AwsConfig",
    "AzureAcknowledge",
    "AzureConfig",
    "Config",
    "DetectConfig",
    "GcpConfig",
    "GpuConfig",
    "HookConfig",
    "HostConfig",
    "HttpUrl",
    "MetricsConfig",
    "NonNegative",
    "NoticeKindName",
    "ReadyConfig",
    "Seconds",
    "SecondsOrOff",
    "SecondsUpToADay",
    "SecondsUpToAYear",
    "SeverityName",
    "SignalRuleConfig",
    "TencentConfig",
    "WebhookConfig",
    "config_to_json",
    "load_config",
    "parse_setting",
]
