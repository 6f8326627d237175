"""What a Kubernetes node needs to see of the agent: ``/healthz`` and ``/readyz`` on the metrics listener (a
wedged loop never answers, a stall that just ended answers 503, a starting or stopping agent is not ready,
probes log nothing), the DaemonSet's probes on that port; why the GPU monitor sees no GPU and why the kernel
log is unavailable (status and a warning at start); and no false ``config_table_unused`` warning for the
shipped ConfigMap — against a real agent, the fake NVIDIA driver and real files."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from agent.cli.render import format_status
from agent.config import load_config
from agent.core.plugins import Part
from agent.service.components import build_components
from agent.service.daemon import Agent
from agent.service.metrics import MetricsComponent
from agent.sources.nvml import NvmlSource
from agent.sources.nvml_cause import DOCS, NO_DEVICE, NO_LIBRARY, diagnose
from tests.fake_nvml.build import SCENARIO_ENV, Scenario, fake_nvml_lib, scenario
from tests.fake_nvml.recording import RecordingSink
from tests.sources.nvml import gpu_config
from tests.support import REPO, agent_config, eventually, http_json, running_agent, short_tmp

__all__ = ["fake_nvml_lib", "scenario"]  # fixtures

pytestmark = pytest.mark.timeout(60)

KUBERNETES = REPO / "packaging" / "kubernetes"
QUIET = {"gpu.enabled": False, "host.enabled": False}


def listener_url(agent: Agent) -> str:
    (component,) = [c for c in agent.components if isinstance(c, MetricsComponent)]
    assert component.listener is not None
    host, port = component.listener.bound[0]
    return f"http://{host}:{port}"


async def probe(url: str, path: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(url + path) as response:
        return response.status, json.loads(await response.text())


# ----- /healthz and /readyz -----------------------------------------------------------------------------


async def test_a_started_agent_is_healthy_and_ready_and_probes_log_nothing(base: Path) -> None:
    async with running_agent(base, {**QUIET, "metrics.listen": "127.0.0.1:0"}) as agent:
        url = listener_url(agent)
        with capture_logs() as logs:
            answers = [await probe(url, path) for _ in range(25) for path in ("/healthz", "/readyz")]
    assert {200} == {status for status, _ in answers}
    health, ready = answers[0][1], answers[1][1]
    assert (True, 10.0) == (health["healthy"], health["loop"]["stall_s"])
    assert {"ready": True, "checks": dict.fromkeys(("config", "sources", "socket", "started"), "ok")} == ready
    # 50 probes and not one line: neither an access log nor a line per request at any level.
    assert [] == logs


class Gate:
    """A component that starts and stops only when the test lets it: the agent is caught half started and
    half stopped."""

    name = "gate"

    def __init__(self) -> None:
        self.starting, self.start_now = asyncio.Event(), asyncio.Event()
        self.stopping, self.stop_now = asyncio.Event(), asyncio.Event()

    def setup(self, host: Any) -> None:
        pass

    async def start(self) -> None:
        self.starting.set()
        await self.start_now.wait()

    async def stop(self) -> None:
        self.stopping.set()
        await self.stop_now.wait()


async def test_readyz_is_503_with_why_while_the_agent_starts_and_while_it_stops(base: Path) -> None:
    config = agent_config(base, {**QUIET, "metrics.listen": "127.0.0.1:0"})
    gate = Gate()  # after the metrics listener: started after it, stopped before it
    agent = Agent(config, components=[*build_components(config), gate])
    starting = asyncio.create_task(agent.start())
    try:
        await asyncio.wait_for(gate.starting.wait(), 10)
        url = listener_url(agent)
        while_starting = await probe(url, "/readyz")
        gate.start_now.set()
        await starting
        started = await probe(url, "/readyz")
        stopping = asyncio.create_task(agent.stop())
        await asyncio.wait_for(gate.stopping.wait(), 10)
        while_stopping = await probe(url, "/readyz")
        alive_while_stopping = await probe(url, "/healthz")
        gate.stop_now.set()
        await stopping
    finally:
        gate.start_now.set()
        gate.stop_now.set()
        with suppress(Exception):
            await agent.stop()
    assert (503, ["started: the agent is starting"]) == (while_starting[0], while_starting[1]["why"])
    assert (200, True) == (started[0], started[1]["ready"])
    assert (503, False) == (while_stopping[0], while_stopping[1]["ready"])
    assert {
        "sources: the sources are not running",
        "socket: the API socket is not served (stopping)",
        "started: the agent is stopping",
    } == set(while_stopping[1]["why"])
    assert 200 == alive_while_stopping[0]  # stopping is not being wedged


def blocking_get(url: str, timeout: float, answers: list[Any]) -> None:
    """What a kubelet's probe does: one GET with its own timeout."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            answers.append(response.status)
    except urllib.error.HTTPError as exc:
        answers.append(exc.code)
    except (TimeoutError, urllib.error.URLError) as exc:
        answers.append(type(getattr(exc, "reason", exc)).__name__)


async def test_a_wedged_loop_never_answers_and_a_stall_that_ended_is_503_until_the_loop_keeps_time(
    base: Path,
) -> None:
    settings = {**QUIET, "metrics.listen": "127.0.0.1:0", "metrics.stall_s": 0.5}
    async with running_agent(base, settings) as agent:
        url = listener_url(agent)
        assert 200 == (await probe(url, "/healthz"))[0]
        answers: list[Any] = []
        kubelet = threading.Thread(target=blocking_get, args=(url + "/healthz", 0.4, answers))
        with capture_logs() as logs:
            kubelet.start()
            time.sleep(1.5)  # noqa: ASYNC251 - the loop wedged: a blocking call on it, as a bug would make
            kubelet.join(5)
            status, after = await probe(url, "/healthz")
            for _ in range(100):
                recovered = await probe(url, "/healthz")
                if recovered[0] == 200:
                    break
                await asyncio.sleep(0.05)
    assert ["TimeoutError"] == answers  # the probe's own timeout: the loop could not answer at all
    assert (503, False) == (status, after["healthy"])
    assert after["why"].startswith(("the event loop stalled for", "the event loop's watchdog last ran"))
    assert (200, True) == (recovered[0], recovered[1]["healthy"])
    stalls = [r for r in logs if r["event"] == "event_loop_stalled"]
    assert (1, "warning", True) == (len(stalls), stalls[0]["log_level"], stalls[0]["stalled_s"] > 1.0)


# ----- the DaemonSet's probes ---------------------------------------------------------------------------


def daemonset_container() -> tuple[dict[str, Any], dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    [ds] = [d for d in yaml.safe_load_all((KUBERNETES / "daemonset.yaml").read_text()) if d]
    spec = ds["spec"]["template"]["spec"]
    [container] = spec["containers"]
    return spec, container


def test_the_daemonsets_probes_ask_the_metrics_listener_the_agent_opens() -> None:
    """The probes name the port the agent listens on (PREEMPTD_METRICS__LISTEN on the pod's IP, which the
    kubelet probes), with a timeout that is the wedged loop's signal, and restart only after several misses."""
    from agent.service.metrics import parse_listen

    _, container = daemonset_container()
    env = {e["name"]: e for e in container["env"]}
    listen = load_config(
        path=None, env={"PREEMPTD_METRICS__LISTEN": env["PREEMPTD_METRICS__LISTEN"]["value"]}
    )
    host, port = parse_listen(listen.metrics.listen) or ("", 0)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    live, ready = container["livenessProbe"], container["readinessProbe"]
    assert ("$(POD_IP)", port, "status.podIP") == (
        host,
        ports["metrics"],
        env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"],
    )
    assert ({"path": "/healthz", "port": "metrics"}, {"path": "/readyz", "port": "metrics"}) == (
        live["httpGet"],
        ready["httpGet"],
    )
    # Slower to kill than to mark unready; the probe's timeout above the agent's stall bound (10 s) would
    # make a stall a timeout rather than a 503: both are failures, so either way a wedged agent restarts.
    assert live["failureThreshold"] * live["periodSeconds"] >= 30
    assert 1 <= live["timeoutSeconds"] <= 10 and 1 <= ready["timeoutSeconds"] <= 10
    assert {"type": "RuntimeDefault"} == container["securityContext"]["seccompProfile"]


@pytest.mark.service
@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not installed (its kustomize builds the base)"
)
def test_the_kustomized_base_keeps_the_probes() -> None:
    yaml = pytest.importorskip("yaml")
    kubectl = shutil.which("kubectl")
    assert kubectl is not None
    built = subprocess.run(
        [kubectl, "kustomize", str(KUBERNETES)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    [ds] = [d for d in yaml.safe_load_all(built) if d and d["kind"] == "DaemonSet"]
    [container] = ds["spec"]["template"]["spec"]["containers"]
    assert ("/healthz", "/readyz") == (
        container["livenessProbe"]["httpGet"]["path"],
        container["readinessProbe"]["httpGet"]["path"],
    )


# ----- the kernel log ------------------------------------------------------------------------------------


async def kmsg_state(library: Path, kmsg: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    config = dataclasses.replace(gpu_config(library), kmsg=True, kmsg_path=kmsg)
    source = NvmlSource(config)
    sink = RecordingSink("nvml")
    with capture_logs() as logs:
        task = asyncio.create_task(source.run(sink))
        try:
            await sink.wait_for(lambda: source.status()["kmsg"].get("state") is not None, what="kmsg state")
        finally:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 5.0)
    return source.status()["kmsg"], [r for r in logs if r["event"] == "kmsg_unavailable"]


async def test_a_missing_kernel_log_is_one_warning_with_errno_and_cause_and_shown_in_status(
    fake_nvml_lib: Path, scenario: Scenario, tmp_path: Path
) -> None:
    missing = tmp_path / "kmsg"
    shown, warned = await kmsg_state(fake_nvml_lib, missing)
    assert ("unavailable", f"cannot open {missing}: ENOENT (errno 2): No such file or directory") == (
        shown["state"],
        shown["why"],
    )
    assert (
        "mount the node's /dev/kmsg (a hostPath of type CharDevice); see docs/kubernetes.md" in shown["cause"]
    )
    assert [("warning", shown["why"], shown["cause"])] == [
        (r["log_level"], r["why"], r["cause"]) for r in warned
    ]
    text = format_status({"sources": {"nvml": {"state": "ok", "detail": {}, "kmsg": shown}}}, width=400)
    assert f"kernel log: {shown['why']}; {shown['cause']}" in text


UNPRIVILEGED = textwrap.dedent(
    """
    import asyncio, contextlib, dataclasses, json, os, sys
    import pynvml
    from structlog.testing import capture_logs
    from agent.config import GpuConfig
    from agent.sources.nvml import NvmlSource
    from tests.fake_nvml.recording import RecordingSink

    os.setgid(65534); os.setuid(65534)  # after the imports: the interpreter may live under /root

    async def main():
        config = GpuConfig(library_path=sys.argv[1], poll_interval_s=0.05, kmsg=True, kmsg_path=sys.argv[2])
        source, sink = NvmlSource(config), RecordingSink("nvml")
        with capture_logs() as logs:
            task = asyncio.create_task(source.run(sink))
            await sink.wait_for(lambda: source.status()["kmsg"].get("state") is not None, what="kmsg", timeout=20)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        warned = [r["log_level"] for r in logs if r["event"] == "kmsg_unavailable"]
        print(json.dumps({"kmsg": source.status()["kmsg"], "warned": warned}))

    asyncio.run(main())
    """
)


@pytest.mark.timeout(90)
def test_a_kernel_log_the_agents_user_may_not_read_is_a_permission_warning(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    """A real EACCES: the monitor runs as nobody, the log is a root file of mode 000."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the monitor as another user")
    place = short_tmp()
    try:
        place.chmod(0o755)
        library = Path(shutil.copy(fake_nvml_lib, place / "libnvidia-ml.so.1"))
        Scenario(place / "scenario.txt").path.chmod(0o644)
        kmsg = place / "kmsg"
        kmsg.write_text("")
        kmsg.chmod(0)
        done = subprocess.run(
            [sys.executable, "-c", UNPRIVILEGED, str(library), str(kmsg)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), SCENARIO_ENV: str(place / "scenario.txt")},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        shutil.rmtree(place, ignore_errors=True)
    assert 0 == done.returncode, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert ("unavailable", f"cannot open {kmsg}: EACCES (errno 13): Permission denied", ["warning"]) == (
        found["kmsg"]["state"],
        found["kmsg"]["why"],
        found["warned"],
    )
    assert found["kmsg"]["cause"].startswith("the agent's user may not read it")


# ----- why NVML sees no GPU ------------------------------------------------------------------------------


async def test_a_library_without_a_device_says_why_in_status(fake_nvml_lib: Path, scenario: Scenario) -> None:
    scenario.set(device_count=0)
    source = NvmlSource(gpu_config(fake_nvml_lib))
    sink = RecordingSink("nvml")
    with capture_logs() as logs:
        await asyncio.wait_for(source.run(sink), 10)
    cause = source.status()["cause"]
    expected = (
        "NVML loaded but no GPU device node (/dev/nvidia0…) is visible here"
        if not any(re.fullmatch(r"nvidia\d+", name) for name in os.listdir("/dev"))
        else "NVML loaded and the device nodes are here, but the driver lists no GPU"
    )
    assert (NO_DEVICE, True, DOCS, [str(fake_nvml_lib)]) == (
        cause["problem"],
        cause["cause"].startswith(expected),
        cause["docs"],
        cause["tried"],
    )
    [line] = [r for r in logs if r["event"] == "nvml_unavailable"]
    assert ("warning", cause["cause"]) == (
        line["log_level"],
        line["cause"],
    )  # a driver here: a GPU was expected


async def test_a_pod_without_the_library_warns_at_start_with_the_path_tried_and_shows_it_in_status(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    empty = tmp_path / "empty"
    empty.mkdir()
    library = empty / "libnvidia-ml.so.1"
    with capture_logs() as logs:
        async with running_agent(base, {"gpu.library_path": str(library), "host.enabled": False}) as agent:
            await eventually(lambda: agent.sources["nvml"].status()["cause"] is not None, what="nvml cause")
            _, doc = await http_json(agent.socket_path, "GET", "/v1/status")
    nvml = doc["sources"]["nvml"]
    assert ("disabled", NO_LIBRARY, [str(library)], DOCS) == (
        nvml["state"],
        nvml["cause"]["problem"],
        nvml["cause"]["tried"],
        nvml["cause"]["docs"],
    )
    assert nvml["cause"]["cause"] == f"no loadable NVML library at gpu.library_path {library}"
    [line] = [r for r in logs if r["event"] == "nvml_unavailable"]
    assert ("warning", [str(library)]) == (line["log_level"], line["tried"])
    assert f"probable cause: {nvml['cause']['cause']} (see {DOCS})" in format_status(doc, width=400)


def test_the_library_where_the_loader_does_not_look_is_named_and_a_cpu_host_is_not_warned(
    fake_nvml_lib: Path, tmp_path: Path
) -> None:
    gke = tmp_path / "home/kubernetes/bin/nvidia/lib64"
    gke.mkdir(parents=True)
    shutil.copy(fake_nvml_lib, gke / "libnvidia-ml.so.1")
    dev = tmp_path / "dev"
    dev.mkdir()
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "LD_LIBRARY_PATH": str(tmp_path / "nowhere")}
    found = diagnose(NO_LIBRARY, None, pod, dev=dev, dirs=(str(tmp_path / "usr/lib64"), str(gke)))
    assert (
        f"the driver's library is at {gke}/libnvidia-ml.so.1, where the loader does not look: set gpu.library_path",
        (
            f"{tmp_path}/nowhere/libnvidia-ml.so.1",
            f"{tmp_path}/usr/lib64/libnvidia-ml.so.1",
            f"{gke}/libnvidia-ml.so.1",
        ),
        True,
    ) == (found.cause, found.tried, found.expected)
    bare = diagnose(NO_LIBRARY, None, {}, dev=dev, dirs=(str(tmp_path / "usr/lib64"),))
    assert (bare.cause.startswith("no NVIDIA driver on this host"), bare.expected) == (True, False)
    (dev / "nvidia0").write_text("")
    listed = diagnose(NO_DEVICE, None, {"NVIDIA_VISIBLE_DEVICES": "all"}, dev=dev, dirs=())
    assert ((str(dev / "nvidia0"),), True) == (
        listed.devices,
        listed.cause.startswith("NVML loaded and the device"),
    )


# ----- the shipped ConfigMap starts without a false warning ---------------------------------------------


@asynccontextmanager
async def agent_from(path: Path, base: Path, **overrides: Any) -> AsyncIterator[Agent]:
    settings = {
        "socket": str(base / "a.sock"),
        "state_dir": str(base / "state"),
        "cloud": "none",
        **QUIET,
        **overrides,
    }
    agent = Agent(load_config(path, env={}, overrides=settings))
    await agent.start()
    try:
        yield agent
    finally:
        await agent.stop()


async def test_the_shipped_configmap_starts_without_an_unused_table_warning(base: Path) -> None:
    pytest.importorskip("lightkube", reason="the kubernetes extra is not installed")
    path = base / "config.toml"
    shutil.copy(KUBERNETES / "config.toml", path)
    # The node name comes from the downward API in the DaemonSet; the RAM tier's directory is made here.
    overrides = {"actions.kubernetes.node": "gpu-node-1", "ram_tier.path": str(base / "tier")}
    with capture_logs() as logs:
        async with agent_from(path, base, **overrides) as agent:
            tables = agent.config.extension_tables()
    assert ("actions.kubernetes", "ram_tier") == tables
    assert [] == [r for r in logs if r["event"] == "config_table_unused"]


async def test_a_table_no_reactor_reads_still_warns(base: Path) -> None:
    """``[actions.widget]`` was read while a reactor named widget was there (an entry point at load time);
    the agent starts without it: the table is unused, and says so."""
    from agent.actions.registry import REACTORS

    path = base / "config.toml"
    path.write_text("[actions.widget]\nsize = 3\n")
    with REACTORS.registered(Part("widget", lambda host: None)):
        config = load_config(
            path, env={}, overrides={"socket": str(base / "a.sock"), "state_dir": str(base / "s"), **QUIET}
        )
    with capture_logs() as logs:
        agent = Agent(dataclasses.replace(config, cloud="none"))
        await agent.start()
        await agent.stop()
    assert [("warning", "actions.widget")] == [
        (r["log_level"], r["table"]) for r in logs if r["event"] == "config_table_unused"
    ]
