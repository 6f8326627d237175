"""Configuration: file < environment < flags, and errors that name the file, the key and what was expected."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import pytest
from msgspec import Meta

from agent.actions.registry import REACTORS
from agent.config import Config, load_config, parse_setting
from agent.core.errors import ConfigError
from agent.core.paths import client_socket_path, default_socket_path, default_state_dir, user_socket_path
from agent.core.plugins import Part, Table

# What an interval, timeout or backoff key expects (each has a floor: 1e-9 s would keep a core busy).
SECONDS = r"expected a finite number of seconds >= 0\.1"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def assert_refused(tmp_path: Path, text: str, message: str) -> None:
    """Loading ``text`` from a file fails with ``message``, and the error starts with the file's name."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path, env={})
    assert str(info.value).startswith(f"{path}: ")


def test_defaults_without_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agent.config.DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    config = load_config(None, env={})
    assert isinstance(config, Config)
    assert ("auto", 15.0) == (config.cloud, config.api.heartbeat_s)


def test_file_environment_and_flags_in_increasing_precedence(tmp_path: Path) -> None:
    path = write(tmp_path, 'cloud = "aws"\nlog_level = "debug"\n[api]\nheartbeat_s = 5\nqueue_size = 10\n')
    env = {"PREEMPTD_CLOUD": "gcp", "PREEMPTD_API__HEARTBEAT_S": "7"}
    config = load_config(path, env=env, overrides={"cloud": "azure"})
    assert ("azure", "debug", 7.0, 10) == (
        config.cloud,
        config.log_level,
        config.api.heartbeat_s,
        config.api.queue_size,
    )
    assert path == config.config_file


def test_config_path_from_environment(tmp_path: Path) -> None:
    path = write(tmp_path, 'cloud = "tencent"\n')
    assert "tencent" == load_config(env={"PREEMPTD_CONFIG": str(path)}).cloud


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cloud = 3\n", "key 'cloud': expected one of 'auto', 'none'"),
        ('clod = "aws"\n', "unknown key 'clod' \\(did you mean 'cloud'\\?\\)"),
        ('[api]\nheartbeat_s = "fast"\n', "key 'api.heartbeat_s': expected a number, got 'fast'"),
        ("[api]\nqueue_size = 1.5\n", "key 'api.queue_size': expected an integer"),
        ("api = 3\n", "key 'api': expected a table"),
        ("cloud = \n", "not valid TOML"),
    ],
)
def test_bad_file_names_file_key_and_expectation(tmp_path: Path, text: str, message: str) -> None:
    assert_refused(tmp_path, text, message)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[api]\nheartbeat_s = 0\n", r"key 'api\.heartbeat_s': " + SECONDS + r", got 0$"),
        ("[api]\nheartbeat_s = -1.5\n", r"key 'api\.heartbeat_s': " + SECONDS + r", got -1\.5$"),
        ("[api]\nheartbeat_s = nan\n", r"key 'api\.heartbeat_s': " + SECONDS + r", got nan$"),
        ("[api]\nqueue_size = 0\n", r"key 'api\.queue_size': expected an integer >= 1, got 0$"),
        ("[api]\nmax_subscribers = 0\n", r"key 'api\.max_subscribers': expected an integer >= 1"),
        ("[api]\nmax_body_bytes = -5\n", r"key 'api\.max_body_bytes': expected an integer >= 1, got -5$"),
        ("[aws]\npoll_interval_s = 0\n", r"key 'aws\.poll_interval_s': " + SECONDS),
        ("[gpu]\npoll_interval_s = 0\n", r"key 'gpu\.poll_interval_s': " + SECONDS),
        ("[api]\nbacklog = 1099511627776\n", r"key 'api\.backlog': expected an integer >= 1 and <= 65535"),
        ("socket_mode = 0o7777\n", r"key 'socket_mode': expected a mode from 0o000 to 0o777, got 4095$"),
        (
            '[aws]\nendpoint = "169.254.169.254"\n',
            r"key 'aws\.endpoint': expected an http:// or https:// URL",
        ),
        ('[azure]\nendpoint = "http://x:99999"\n', r"key 'azure\.endpoint': expected an http:// or https://"),
        (
            '[[actions.signals]]\nsignal = "SIGFOO"\ncmdline = ["train"]\n',
            r"actions\.signals \(rule 'signal'\) signal: unknown signal 'SIGFOO'",
        ),
    ],
)
def test_out_of_range_values_are_refused_with_file_key_and_range(
    tmp_path: Path, text: str, message: str
) -> None:
    assert_refused(tmp_path, text, message)


def test_in_range_values_and_an_empty_gcp_endpoint_load(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[api]\nheartbeat_s = 0.5\nqueue_size = 1\n[gcp]\nendpoint = ""\n[detect]\nprobe_retry_s = 0\n',
    )
    config = load_config(path, env={})
    assert (0.5, 1, "") == (config.api.heartbeat_s, config.api.queue_size, config.gcp.endpoint)


def test_an_out_of_range_environment_value_names_the_environment() -> None:
    with pytest.raises(ConfigError, match=r"^environment: key 'api\.heartbeat_s': " + SECONDS):
        load_config(env={"PREEMPTD_API__HEARTBEAT_S": "-1"})


def test_an_explicit_file_that_is_missing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml", env={})


def test_bad_environment_value_names_the_environment() -> None:
    with pytest.raises(ConfigError, match=r"environment: key 'api\.queue_size'"):
        load_config(env={"PREEMPTD_API__QUEUE_SIZE": "many"})


def test_unrelated_preemptd_variables_are_ignored() -> None:
    assert "auto" == load_config(env={"PREEMPTD_SOMETHING_ELSE": "1"}).cloud


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("api.heartbeat_s=5", ("api.heartbeat_s", 5)),
        ("cloud=aws", ("cloud", "aws")),
        ("x=[1, 2]", ("x", [1, 2])),
    ],
)
def test_set_flag_values_are_read_as_toml(text: str, expected: tuple[str, object]) -> None:
    assert expected == parse_setting(text)


def test_set_flag_without_equals_is_an_error() -> None:
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_setting("api.heartbeat_s")


def test_socket_path_discovery_order() -> None:
    assert Path("/x.sock") == default_socket_path({"PREEMPTD_SOCKET": "/x.sock"})
    assert Path("/run/preemptd/preemptd.sock") == default_socket_path({"RUNTIME_DIRECTORY": "/run/preemptd"})
    assert Path("/run/user/1000/preemptd/preemptd.sock") == user_socket_path(
        {"XDG_RUNTIME_DIR": "/run/user/1000"}
    )
    assert Path("/tmp/preemptd-1234/preemptd.sock") == user_socket_path({}, uid=1234)
    assert Path("/y.sock") == client_socket_path({"PREEMPTD_SOCKET": "/y.sock"})


def test_state_dir_prefers_systemd_state_directory() -> None:
    assert Path("/var/lib/preemptd") == default_state_dir({"STATE_DIRECTORY": "/var/lib/preemptd"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[api]\nheartbeat_s = inf\n", r"key 'api\.heartbeat_s': " + SECONDS + r", got inf$"),
        ("[actions.ready]\ngrace_s = -1\n", r"key 'actions\.ready\.grace_s': expected a finite number >= 0"),
        ("[detect]\nprobe_retry_s = inf\n", r"key 'detect\.probe_retry_s': expected a finite number >= 0"),
        ("[api]\nqueue_size = true\n", r"key 'api\.queue_size': expected an integer, got True$"),
        ("[api]\nheartbeat_s = false\n", r"key 'api\.heartbeat_s': expected a number, got False$"),
        ('socket_mode = "0660"\n', r"key 'socket_mode': expected an integer, got '0660'$"),
        ('[gpu]\nkmsg_path = ""\n', r"key 'gpu\.kmsg_path': expected a path, got ''$"),
        ("[gpu]\nlibrary_path = 3\n", r"key 'gpu\.library_path': expected a path, got 3$"),
        (
            '[gpu]\nxid_classes = {x = "fatal"}\n',
            r"key 'gpu\.xid_classes\.x': expected an integer key, got 'x'$",
        ),
        (
            '[gpu]\nxid_classes = {79 = "fatal", 13 = "bad"}\n',
            r"key 'gpu\.xid_classes\.13': expected one of 'fatal', 'degraded', 'info', got 'bad'$",
        ),
        (
            '[host]\ncheckpoint_dirs = ["/a", 3]\n',
            r"key 'host\.checkpoint_dirs\[1\]': expected a path, got 3$",
        ),
        ("[host]\ncheckpoint_dirs = 3\n", r"key 'host\.checkpoint_dirs': expected an array, got 3$"),
        (
            '[[actions.hooks]]\nargv = ["x"]\nenv = {A = 3}\n',
            r"key 'actions\.hooks\[0\]\.env\.A': expected a string, got 3$",
        ),
        (
            '[[actions.hooks]]\nargv = ["x"]\ntimeout = 3\n',
            r"unknown key 'actions\.hooks\[0\]\.timeout' \(did you mean 'actions\.hooks\[0\]\.timeout_s'\?\)$",
        ),
        ("[actions]\nsignals = [3]\n", r"key 'actions\.signals\[0\]': expected a table, got 3$"),
        ('[gpu]\nenabled = "maybe"\n', r"key 'gpu\.enabled': expected true or false, got 'maybe'$"),
        ('[advisor]\nsave_time_s = "soon"\n', r"key 'advisor\.save_time_s': expected a number, got 'soon'$"),
        (
            '[aws]\nendpoint = "ftp://x"\n',
            r"key 'aws\.endpoint': expected an http:// or https:// URL, got 'ftp://x'$",
        ),
        ("tables = {}\n", r"unknown table 'tables'"),
    ],
)
def test_each_kind_of_bad_value_names_file_key_expectation_and_value(
    tmp_path: Path, text: str, message: str
) -> None:
    assert_refused(tmp_path, text, message)


def test_values_are_converted_to_the_declared_types(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "[api]\nheartbeat_s = 2\n[gpu]\n"
        'library_path = "/opt/nvml.so"\nxid_classes = {79 = "fatal"}\n'
        '[host]\ncheckpoint_dirs = ["/ckpt"]\n',
    )
    config = load_config(path, env={})
    assert (2.0, float) == (config.api.heartbeat_s, type(config.api.heartbeat_s))
    assert Path("/opt/nvml.so") == config.gpu.library_path
    assert {79: "fatal"} == config.gpu.xid_classes
    assert (Path("/ckpt"),) == config.host.checkpoint_dirs


def test_environment_strings_for_booleans_optionals_and_arrays() -> None:
    env = {
        "PREEMPTD_GPU__ENABLED": "off",
        "PREEMPTD_HOST__CHECKPOINT_DIRS": "/a, /b",
        "PREEMPTD_ADVISOR__SAVE_TIME_S": "none",
        "PREEMPTD_SOCKET_GROUP": "none",
        "PREEMPTD_API__QUEUE_SIZE": "5",
    }
    config = load_config(env=env, overrides={"advisor.prior_mtbp_s": 3600})
    assert config.gpu.enabled is False
    assert (Path("/a"), Path("/b")) == config.host.checkpoint_dirs
    assert (None, None, 3600.0, 5) == (
        config.advisor.save_time_s,
        config.socket_group,
        config.advisor.prior_mtbp_s,
        config.api.queue_size,
    )


def test_a_command_line_value_out_of_range_names_the_command_line() -> None:
    with pytest.raises(
        ConfigError, match=r"^command line: key 'api\.queue_size': expected an integer >= 1, got 0$"
    ):
        load_config(env={}, overrides={"api.queue_size": 0})


def test_a_plug_in_table_declares_its_ranges_and_forms_with_msgspec(tmp_path: Path) -> None:
    @dataclass(frozen=True)
    class Settings:
        retries: Annotated[int, Meta(ge=0, le=10)] = 2
        queue: Annotated[str, Meta(pattern="^[a-z]+$")] = "batch"
        nodes: Annotated[tuple[str, ...], Meta(min_length=1)] = ("n1",)

    path = write(tmp_path, '[actions.pbs]\nretries = 3\nqueue = "gpu"\n')
    with REACTORS.registered(Part("pbs", lambda host: None, (Table("actions.pbs", Settings),))):
        assert Settings(3, "gpu", ("n1",)) == load_config(path, env={}).table("actions.pbs", Settings)
        for text, message in [
            ("retries = 11", r"key 'actions\.pbs\.retries': expected an integer >= 0 and <= 10, got 11$"),
            (
                'queue = "GPU"',
                r"key 'actions\.pbs\.queue': expected a string matching '\^\[a-z\]\+\$', got 'GPU'$",
            ),
            ("queue = 3", r"key 'actions\.pbs\.queue': expected a string, got 3$"),
            ("nodes = []", r"key 'actions\.pbs\.nodes': expected an array of length >= 1, got \[\]$"),
        ]:
            path.write_text(f"[actions.pbs]\n{text}\n")
            with pytest.raises(ConfigError, match=message) as info:
                load_config(path, env={})  # refused when the file is loaded, not when the table is read
            assert str(info.value).startswith(f"{path}: ")


# Every interval, timeout and backoff key of the built-in sections (tiny values once pinned a core).
INTERVAL_KEYS = [
    "api.heartbeat_s",
    "api.idle_timeout_s",
    "api.shutdown_timeout_s",
    "aws.poll_interval_s",
    "aws.timeout_s",
    "aws.backoff_max_s",
    "gcp.timeout_s",
    "gcp.backoff_max_s",
    "azure.poll_interval_s",
    "azure.first_call_timeout_s",
    "alibaba.poll_interval_s",
    "tencent.poll_interval_s",
    "detect.probe_timeout_s",
    "gpu.poll_interval_s",
    "gpu.call_timeout_s",
    "host.poll_interval_s",
    "host.call_timeout_s",
]


@pytest.mark.parametrize("key", INTERVAL_KEYS)
def test_an_interval_below_the_floor_is_refused_with_file_key_and_floor(tmp_path: Path, key: str) -> None:
    section, _, name = key.rpartition(".")
    escaped = key.replace(".", r"\.")
    assert_refused(tmp_path, f"[{section}]\n{name} = 1e-9\n", f"key '{escaped}': {SECONDS}, got 1e-09$")


# Keys the agent adds to a date (timedelta): a ceiling, so that 1e308 fails the load, not a task at run time.
UP_TO_A_DAY = ["expire_grace_s", "drill_linger_s", "gcp.preempt_notice_s", "gcp.maintenance_notice_s"]
DAY = r"expected a number of seconds from 0 to 86400 \(a day\)"
YEAR = r"expected a number of seconds from 0\.1 to 31536000 \(a year\)"


def toml_key(key: str, value: str) -> str:
    section, _, name = key.rpartition(".")
    return f"[{section}]\n{name} = {value}\n" if section else f"{name} = {value}\n"


@pytest.mark.parametrize("key", UP_TO_A_DAY)
@pytest.mark.parametrize("value", ["1e308", "86401", "-1"])
def test_a_grace_or_notice_window_past_a_day_is_refused(tmp_path: Path, key: str, value: str) -> None:
    """Or below 0: a notice whose deadline is already past when it is raised."""
    escaped = key.replace(".", r"\.")
    assert_refused(tmp_path, toml_key(key, value), f"key '{escaped}': {DAY}, got ")


@pytest.mark.parametrize("key", UP_TO_A_DAY)
def test_a_grace_or_notice_window_of_a_day_is_taken(tmp_path: Path, key: str) -> None:
    config = load_config(write(tmp_path, toml_key(key, "86400")), env={})
    section = config.gcp if key.startswith("gcp.") else config
    assert 86400.0 == getattr(section, key.rpartition(".")[2])


@pytest.mark.parametrize("value", ["0.1", "31536000"])
def test_the_participant_ttl_takes_the_interval_floor_to_a_year(tmp_path: Path, value: str) -> None:
    config = load_config(write(tmp_path, toml_key("actions.ready.participant_ttl_s", value)), env={})
    assert float(value) == config.actions.ready.participant_ttl_s


@pytest.mark.parametrize("value", ["1e-9", "31536001", "1e308"])
def test_a_participant_ttl_below_the_floor_or_past_a_year_is_refused(tmp_path: Path, value: str) -> None:
    text = toml_key("actions.ready.participant_ttl_s", value)
    assert_refused(tmp_path, text, rf"key 'actions\.ready\.participant_ttl_s': {YEAR}, got ")


# The AWS paths read less often than the spot path, and the ceiling that keeps their notice's lead.
AWS_SLOW_PATHS = {
    "aws.rebalance_interval_s": ("60", "60.5", r"expected a number of seconds from 0\.1 to 60 \(a minute\)"),
    "aws.lifecycle_interval_s": ("60", "61", r"expected a number of seconds from 0\.1 to 60 \(a minute\)"),
    "aws.maintenance_interval_s": (
        "3600",
        "3601",
        r"expected a number of seconds from 0\.1 to 3600 \(an hour\)",
    ),
}


@pytest.mark.parametrize("key", sorted(AWS_SLOW_PATHS))
def test_an_aws_path_interval_takes_the_floor_to_its_ceiling(tmp_path: Path, key: str) -> None:
    for value in ("0.1", AWS_SLOW_PATHS[key][0]):
        config = load_config(write(tmp_path, toml_key(key, value)), env={})
        assert float(value) == getattr(config.aws, key.rpartition(".")[2])


@pytest.mark.parametrize("key", sorted(AWS_SLOW_PATHS))
def test_an_aws_path_interval_below_the_floor_or_past_its_ceiling_is_refused(
    tmp_path: Path, key: str
) -> None:
    _, over, expected = AWS_SLOW_PATHS[key]
    escaped = key.replace(".", r"\.")
    for value in ("1e-9", over, "1e308"):
        assert_refused(tmp_path, toml_key(key, value), f"key '{escaped}': {expected}, got ")


def test_the_aws_paths_default_to_the_cadence_their_notices_need() -> None:
    """The interruption notice every second; rebalance and Auto Scaling (minutes ahead) every 10 s;
    scheduled maintenance (days ahead) every minute (docs/clouds.md, "How often each path is read")."""
    aws = load_config(env={}).aws
    assert (1.0, 10.0, 10.0, 60.0) == (
        aws.poll_interval_s,
        aws.rebalance_interval_s,
        aws.lifecycle_interval_s,
        aws.maintenance_interval_s,
    )


def test_run_refuses_a_drill_linger_past_a_day_at_load(capsys: pytest.CaptureFixture[str]) -> None:
    """drill_linger_s = 1e308 once loaded and then failed the expiry task (timedelta overflow) at run time."""
    from agent.cli import main

    code = main(["run", "--print-config", "--set", "drill_linger_s=1e308"])
    assert (
        2,
        "preemptd: configuration error: command line: key 'drill_linger_s': "
        "expected a number of seconds from 0 to 86400 (a day), got 1e+308",
    ) == (code, capsys.readouterr().err.strip())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[actions.hooks]]\nargv = ["x"]\ntimeout_s = 0.001\n', r"key 'actions\.hooks\[0\]\.timeout_s': "),
        (
            '[[actions.webhooks]]\nurl = "http://x"\nbackoff_s = 0\n',
            r"key 'actions\.webhooks\[0\]\.backoff_s': ",
        ),
    ],
)
def test_hook_and_webhook_intervals_have_the_same_floor(tmp_path: Path, text: str, message: str) -> None:
    assert_refused(tmp_path, text, message + SECONDS)


def test_the_nvml_event_wait_has_a_floor(tmp_path: Path) -> None:
    assert_refused(
        tmp_path, "[gpu]\nevent_wait_ms = 0\n", r"key 'gpu\.event_wait_ms': expected an integer >= 100"
    )


def test_an_interval_that_can_be_off_takes_0_but_not_a_tiny_value(tmp_path: Path) -> None:
    assert (
        0.0
        == load_config(
            write(tmp_path, "[advisor]\nrecord_interval_s = 0\n"), env={}
        ).advisor.record_interval_s
    )
    assert_refused(
        tmp_path,
        "[advisor]\nrecord_interval_s = 1e-9\n",
        r"key 'advisor\.record_interval_s': expected 0 \(off\) or a finite number >= 0\.1, got 1e-09$",
    )


@pytest.mark.parametrize(
    "overrides",
    [{"api": 5, "api.heartbeat_s": 1}, {"api.heartbeat_s": 1, "api": 5}],
    ids=["value-first", "table-first"],
)
def test_a_key_set_both_as_a_value_and_as_a_table_is_a_clear_error(overrides: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=r"^command line: key 'api' is set to 5 and .* 'api' is a table"):
        load_config(env={}, overrides=overrides)


def test_a_variable_set_both_as_a_value_and_as_a_table_names_the_environment() -> None:
    env = {"PREEMPTD_API": "5", "PREEMPTD_API__HEARTBEAT_S": "1"}
    with pytest.raises(ConfigError, match=r"^environment: key 'api' is set to 5 and .* 'api' is a table"):
        load_config(env=env)


def test_a_fifo_as_the_config_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=f"^{fifo}: is a FIFO, not a regular file; point the configuration"):
        load_config(fifo, env={})


def test_a_device_as_the_config_file_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^/dev/null: is a device, not a regular file"):
        load_config(Path("/dev/null"), env={})


def test_a_config_file_over_1_mib_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "# padding\n" * (1 << 17))
    with pytest.raises(ConfigError, match=f"^{path}: is larger than 1024 KiB"):
        load_config(path, env={})


@pytest.mark.parametrize("key", ["eviction_retry_s", "retry_max_s", "request_timeout_s"])
def test_the_kubernetes_bridges_retry_intervals_have_the_same_floor(tmp_path: Path, key: str) -> None:
    """A plug-in table that declares its intervals as ``agent.config.Seconds`` gets the floor and the error."""
    from agent.bridges.kubernetes.config import KubernetesConfig

    path = write(tmp_path, f"[actions.kubernetes]\n{key} = 1e-9\n")
    with pytest.raises(
        ConfigError, match=rf"^{path}: key 'actions\.kubernetes\.{key}': {SECONDS}, got 1e-09$"
    ):
        load_config(path, env={}).table("actions.kubernetes", KubernetesConfig)
