"""The DaemonSet's image (packaging/kubernetes/Dockerfile), built by packaging/kubernetes/build-image.sh and
started with podman the way the DaemonSet starts it: its securityContext, host namespaces, volumes,
environment and arguments read from daemonset.yaml, the ConfigMap's config.toml, and what the kubelet adds
(the service account's token and CA, KUBERNETES_SERVICE_HOST and _PORT) pointed at the Kubernetes API fake.

Where the test departs from a node, and why: the volumes are temporary directories (the RAM tier's on
/dev/shm, a tmpfs as on a node), the metrics listener is on 127.0.0.1 and any free port (port 0; the agent
logs the one it got) instead of the node's address and 9464, DMI says "Amazon EC2" and the AWS endpoint is
the simulator on loopback (nothing reaches 169.254.169.254; its requests may take 5 s, for a busy test
machine), and the limits on descriptors and processes are set (podman's defaults exceed this host's hard
limits, and runc then refuses to start the container).

It needs root (rootful podman with host namespaces) and installs what it lacks with apt-get (mmdebstrap,
buildah, podman, runc); otherwise it skips, saying why. The first build makes the Debian bases (mmdebstrap,
cached for a week by build-image.sh) and fetches the locked wheels; later builds reuse buildah's layers.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from packaging.markers import Marker
from packaging.requirements import Requirement

from tests.k8s_fake import make_certificate
from tests.support import REPO, short_tmp

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

pytestmark = [
    pytest.mark.service,
    pytest.mark.slow,
    pytest.mark.xdist_group("kubernetes_image"),
    # The first build: the bases with mmdebstrap (30 s on a quiet machine, minutes on a busy one), the wheels.
    pytest.mark.timeout(1200),
]

KUBE = REPO / "packaging" / "kubernetes"
LOCK = KUBE / "requirements.lock"
TAG = "localhost/preemptd:image-test"
NODE = "gpu-node-1"
# The tools the test needs, and the Debian packages that have them (root needs no uidmap or slirp4netns).
TOOLS = {"mmdebstrap": "mmdebstrap", "buildah": "buildah", "podman": "podman", "runc": "runc"}
# runc: Debian's podman defaults to crun, which refuses to start containers under hybrid cgroups; cgroupfs
# and a file for events: no systemd needed.
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs", "--events-backend", "file"]
# What the Dockerfile removes from the environment after building the project: the lock's build backend.
BUILD_ONLY = ("setuptools", "wheel", "packaging")
# Warnings right for this container: NVML is missing (no GPU, no driver), and the DaemonSet's NVIDIA
# variables make that a warning (docs/kubernetes.md, "When the agent cannot see the GPU").
EXPECTED_WARNINGS = frozenset({"nvml_unavailable"})
# The image's environment: Debian bookworm's Python.
IMAGE_PYTHON = {
    "python_version": "3.11",
    "python_full_version": "3.11.2",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "sys_platform": "linux",
    "platform_system": "Linux",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock() -> dict[str, tuple[str, str, int]]:
    """The lock's entries: canonical name -> (version, marker, number of hashes)."""
    entries: dict[str, tuple[str, str, int]] = {}
    current = ""
    for line in LOCK.read_text().splitlines():
        pin = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*([^\\]*?))?\s*\\?$", line)
        if pin:
            current = canonical(pin.group(1))
            assert current not in entries, f"{current} pinned twice"
            entries[current] = (pin.group(2), pin.group(3) or "", 0)
        elif line.strip().startswith("--hash=sha256:"):
            version, marker, hashes = entries[current]
            entries[current] = (version, marker, hashes + 1)
        else:
            assert not line.strip() or line.lstrip().startswith("#"), f"unexpected lock line {line!r}"
    return entries


def image_requirements() -> list[Requirement]:
    """What the image installs: the project's dependencies, its kubernetes extra and its build backend,
    those whose markers hold on the image's Python."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    project = pyproject["project"]
    texts = [
        *project["dependencies"],
        *project["optional-dependencies"]["kubernetes"],
        *pyproject["build-system"]["requires"],
    ]
    requirements = [Requirement(text) for text in texts]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({**IMAGE_PYTHON, "extra": ""})]


def test_the_lock_pins_every_requirement_of_the_image_with_hashes() -> None:
    lock = read_lock()
    for requirement in image_requirements():
        name = canonical(requirement.name)
        assert name in lock, f"{requirement} is not in {LOCK.name}: run packaging/kubernetes/lock.sh"
        version = lock[name][0]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"{LOCK.name} pins {name}=={version}, outside pyproject.toml's {requirement}: run lock.sh"
        )
    for name, (version, marker, hashes) in lock.items():
        assert hashes >= 1, f"{name}=={version} has no hash"
        assert not marker or Marker(marker).evaluate(IMAGE_PYTHON), f"{name}: {marker} excludes Python 3.11"
    assert "packaging/kubernetes/lock.sh" in LOCK.read_text().split("\n\n")[0]  # how to refresh it
    assert os.access(KUBE / "lock.sh", os.X_OK)
    # The build-only packages the Dockerfile removes are the lock's, and in its uninstall step.
    dockerfile = (KUBE / "Dockerfile").read_text()
    assert f"uninstall --quiet -y {' '.join(BUILD_ONLY)}" in dockerfile
    assert set(BUILD_ONLY) <= set(lock)


# --- the image --------------------------------------------------------------------------------------------


def run(command: list[str], timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def install_tools() -> None:
    """apt-get install the Debian packages of the tools not on PATH; skip where that cannot be done."""
    missing = sorted({package for tool, package in TOOLS.items() if shutil.which(tool) is None})
    if not missing:
        return
    if shutil.which("apt-get") is None:
        pytest.skip(f"needs {', '.join(missing)} and there is no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    update = run(["apt-get", "update", "-qq"], timeout=600, env=env)
    done = run(
        [
            "apt-get",
            "install",
            "-y",
            "-qq",
            "--no-install-recommends",
            "-o",
            "DPkg::Lock::Timeout=300",
            *missing,
        ],
        timeout=900,
        env=env,
    )
    if done.returncode != 0 or any(shutil.which(tool) is None for tool in TOOLS):
        pytest.skip(f"apt-get could not install {', '.join(missing)}: {tail(update.stderr + done.stderr, 5)}")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The image, built once for the module with build-image.sh's local path (buildah on mmdebstrap bases)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the image is built and run with Linux containers")
    if os.geteuid() != 0:
        pytest.skip("needs root: rootful podman, with the DaemonSet's host namespaces and capabilities")
    install_tools()
    refusal = buildah_refusal()
    if refusal:
        pytest.skip(f"buildah cannot work here: {refusal}")
    log = tmp_path_factory.mktemp("image") / "build.log"
    env = {**os.environ, "PREEMPTD_BUILDER": "local"}
    with log.open("w") as out:
        done = subprocess.run(
            [str(KUBE / "build-image.sh"), TAG],
            check=False,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=1100,
        )
    output = log.read_text()
    if done.returncode == 2:  # the script says this machine cannot build: a tool missing, no mirror
        pytest.skip(tail(output, 3))
    assert done.returncode == 0, f"build-image.sh failed:\n{tail(output)}"
    # Whether podman can start a container here at all: with runc, and descriptor limits under this host's.
    started = run([*PODMAN, "run", "--rm", *ulimits(), TAG, "version"])
    if started.returncode != 0 and re.search(r"OCI runtime|runc|cgroup", started.stderr):
        pytest.skip(f"podman cannot start containers here: {tail(started.stderr, 3)}")
    assert (started.returncode, started.stdout.split()[:1]) == (0, ["preemptd"]), started.stderr
    return TAG


def buildah_refusal() -> str:
    """Why buildah cannot make and mount a container here (its storage, mounts), or ""."""
    made = run(["buildah", "from", "scratch"])
    if made.returncode != 0:
        return tail(made.stderr, 3)
    container = made.stdout.strip().splitlines()[-1]
    try:
        mounted = run(["buildah", "mount", container])
        return "" if mounted.returncode == 0 else tail(mounted.stderr, 3)
    finally:
        run(["buildah", "rm", container])


def ulimits() -> list[str]:
    """A container runtime's usual limits (descriptors: soft 1024, hard up to 524288; the agent raises its
    soft limit to the hard one), within what podman's own process holds: podman's defaults (1048576) exceed
    this host's hard limits, and runc then fails to start the container (setrlimit: EPERM). Podman keeps
    its process limit at most kernel.pid_max."""
    import resource

    def hard(limit: int, fallback: int) -> int:
        return fallback if limit == resource.RLIM_INFINITY else limit

    nofile = min(hard(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 524288), 524288)
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nproc = min(hard(resource.getrlimit(resource.RLIMIT_NPROC)[1], pid_max), pid_max)
    return ["--ulimit", f"nofile={min(1024, nofile)}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def test_the_image_holds_the_locked_packages_and_neither_pip_nor_apt(image: str) -> None:
    probe = (
        "import importlib.metadata as m, importlib.util as u, json, os, shutil, sys;"
        "print(json.dumps({'dists': {d.metadata['Name']: d.version for d in m.distributions()},"
        "'prefix': sys.prefix, 'pip': u.find_spec('pip') is not None,"
        "'tools': [t for t in ('pip', 'pip3', 'apt', 'apt-get') if shutil.which(t)],"
        "'uid': os.getuid()}))"
    )
    done = run(
        [*PODMAN, "run", "--rm", *ulimits(), "--entrypoint", "/opt/preemptd/bin/python", image, "-c", probe]
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    installed = {canonical(name): version for name, version in found["dists"].items()}
    locked = {name: version for name, (version, _, _) in read_lock().items() if name not in BUILD_ONLY}
    version = re.search(r'__version__ = "(.+)"', (REPO / "agent" / "__init__.py").read_text())
    assert version is not None
    assert {**locked, "preemptd": version.group(1)} == installed
    assert (found["prefix"], found["pip"], found["tools"]) == ("/opt/preemptd", False, [])
    assert found["uid"] == 65532  # the image's default user is not root


def test_the_image_has_its_labels_and_runs_the_agent_by_default(image: str) -> None:
    done = run(["podman", "image", "inspect", image])
    assert done.returncode == 0, done.stderr
    [config] = [doc["Config"] for doc in json.loads(done.stdout)]
    labels = config["Labels"]
    version = re.search(r'__version__ = "(.+)"', (REPO / "agent" / "__init__.py").read_text())
    assert version is not None
    oci = "org.opencontainers.image."
    assert labels[oci + "version"] == version.group(1)
    assert labels[oci + "licenses"] == "Apache-2.0"
    assert labels[oci + "title"] == "preemptd"
    assert labels[oci + "source"].startswith("https://")
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", labels[oci + "revision"])
    assert dt.datetime.strptime(labels[oci + "created"], "%Y-%m-%dT%H:%M:%SZ")
    assert labels[oci + "base.name"].startswith("localhost/preemptd-base:runtime-")
    assert (config["User"], config["Entrypoint"], config["Cmd"]) == ("65532:65532", ["preemptd"], ["run"])


# --- the image started as the DaemonSet starts it ---------------------------------------------------------


def daemonset() -> tuple[dict[str, Any], dict[str, Any]]:
    """The DaemonSet's pod spec and its one container."""
    [ds] = [doc for doc in yaml.safe_load_all((KUBE / "daemonset.yaml").read_text()) if doc]
    pod = ds["spec"]["template"]["spec"]
    [container] = pod["containers"]
    return pod, container


def shipped_config() -> str:
    """config.toml as the ConfigMap the DaemonSet mounts carries it (kustomization.yaml generates it)."""
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    [generator] = kustomization["configMapGenerator"]
    pod, _ = daemonset()
    [volume] = [v for v in pod["volumes"] if "configMap" in v]
    assert (generator["name"], generator["files"]) == (volume["configMap"]["name"], ["config.toml"])
    return (KUBE / "config.toml").read_text()


def podman_run_args(
    pod: Mapping[str, Any], container: Mapping[str, Any], volumes: Mapping[str, Path], env: Mapping[str, str]
) -> list[str]:
    """``podman run`` options for the DaemonSet's pod: ``volumes`` maps each volume's name to the directory
    that stands in for it (emptyDir: a tmpfs instead), ``env`` the values of its downward-API variables."""
    security = container["securityContext"]
    args = [
        "--user",
        f"{security['runAsUser']}:{security['runAsGroup']}",
        "--cap-drop",
        ",".join(security["capabilities"]["drop"]).lower(),
        "--cap-add",
        ",".join(security["capabilities"]["add"]),
    ]
    assert not security.get("privileged", False)
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}  # podman's default profile
    if security["readOnlyRootFilesystem"]:
        args += ["--read-only", "--read-only-tmpfs=false"]  # no tmpfs of podman's own on /tmp, /run
    if security["allowPrivilegeEscalation"] is False:
        args += ["--security-opt", "no-new-privileges"]
    if pod.get("hostNetwork"):
        args += ["--network", "host"]
    if pod.get("hostPID"):
        args += ["--pid", "host"]
    limits = container["resources"]["limits"]
    args += ["--memory", limits["memory"].replace("Mi", "m")]
    args += ["--stop-timeout", str(pod["terminationGracePeriodSeconds"])]
    by_name = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        volume = by_name[mount["name"]]
        if "emptyDir" in volume:
            size = volume["emptyDir"]["sizeLimit"].replace("Mi", "m")
            args += ["--tmpfs", f"{mount['mountPath']}:rw,size={size},mode=1777"]
            continue
        mode = "ro" if mount.get("readOnly") else "rw"
        args += ["--volume", f"{volumes[mount['name']]}:{mount['mountPath']}:{mode}"]
    values: dict[str, str] = {}
    for var in container["env"]:
        if "valueFrom" in var:
            values[var["name"]] = env[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:  # $(NAME) refers to a variable defined before it, as Kubernetes expands it
            values[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], var["value"])
    for name, value in values.items():
        args += ["--env", f"{name}={value}"]
    return args


@asynccontextmanager
async def loopback_services(account: Path) -> AsyncIterator[tuple[Any, Any, str]]:
    """The Kubernetes API fake over TLS, with the node and a service account token it accepts (written to
    ``account`` as the kubelet projects it), and the EC2 metadata simulator, both on 127.0.0.1."""
    from agent.simulate.aws import AwsSimulator
    from tests.k8s_fake import FakeKube

    cert, key = make_certificate(account.parent)
    token = uuid.uuid4().hex
    (account / "ca.crt").write_bytes(cert.read_bytes())
    (account / "namespace").write_text("preemptd")
    (account / "token").write_text(token)
    async with FakeKube(tls=(cert, key), tokens={token}) as kube, AwsSimulator() as sim:
        kube.add_node(NODE)
        yield kube, sim, token


async def podman(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *PODMAN, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
        return response.status, await response.text()


async def container_log(name: str) -> list[dict[str, Any]]:
    """The container's log: with the ConfigMap's log_format = "json", one JSON document a line."""
    code, out, err = await podman("logs", name)
    assert code == 0, err
    lines = [line for line in (out + err).splitlines() if line.strip()]
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"a log line that is not JSON: {line!r}") from None
    return entries


def false_warnings(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        e
        for e in entries
        if e.get("level") in ("warning", "error", "critical") and e.get("event") not in EXPECTED_WARNINGS
    ]


@pytest.fixture
def host_dirs() -> Iterator[dict[str, Path]]:
    """Directories for the DaemonSet's volumes: the hostPaths (the RAM tier's on /dev/shm, a tmpfs as on
    a node), the ConfigMap, the optional Secret (absent: empty), the service account, the DMI strings."""
    base = short_tmp("pd-image-")
    shm = Path(tempfile.mkdtemp(prefix="preemptd-image-test-", dir="/dev/shm"))
    dirs = {name: base / name for name in ("run", "state", "config", "secrets", "account", "dmi")}
    for path in dirs.values():
        path.mkdir()
    dirs["ram-tier"] = shm
    yield dirs
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)


async def wait_for(session: aiohttp.ClientSession, url: str, name: str, limit_s: float) -> None:
    """Poll ``url`` as a probe would, until 200; fail early if the container stopped."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    last = "no answer"
    while loop.time() < end:
        try:
            status, body = await get(session, url)
            if status == 200:
                return
            last = f"{status} {body}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            last = repr(exc)
        _, out, _ = await podman("inspect", "--format", "{{.State.Running}}", name)
        if out.strip() != "true":
            _, logs, errors = await podman("logs", name)
            raise AssertionError(f"the container stopped:\n{tail(logs + errors)}")
        await asyncio.sleep(0.5)
    raise AssertionError(f"{url} did not answer 200 within {limit_s:g} s: {last}")


async def test_the_image_runs_as_the_daemonset_starts_it(image: str, host_dirs: dict[str, Path]) -> None:
    pod, container = daemonset()
    (host_dirs["config"] / "config.toml").write_text(shipped_config())
    (host_dirs["dmi"] / "sys_vendor").write_text("Amazon EC2\n")
    name = f"preemptd-image-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    async with loopback_services(host_dirs["account"]) as (kube, sim, token):
        args = podman_run_args(
            pod,
            container,
            {
                "run": host_dirs["run"],
                "state": host_dirs["state"],
                "config": host_dirs["config"],
                "secrets": host_dirs["secrets"],
                "ram-tier": host_dirs["ram-tier"],
            },
            {"spec.nodeName": NODE, "status.podIP": "127.0.0.1"},
        )
        listen = [a for a in args if a.startswith("PREEMPTD_METRICS__LISTEN=")]
        assert listen == ["PREEMPTD_METRICS__LISTEN=127.0.0.1:9464"]  # the pod's IP: the node's own address
        args += ["--env", "PREEMPTD_METRICS__LISTEN=127.0.0.1:0"]  # any free port: the agent logs it
        # What the kubelet adds: the service account (automountServiceAccountToken) and the API's address.
        assert pod["automountServiceAccountToken"] is True
        args += [
            "--volume",
            f"{host_dirs['account']}:/var/run/secrets/kubernetes.io/serviceaccount:ro",
            "--env",
            "KUBERNETES_SERVICE_HOST=127.0.0.1",
            "--env",
            f"KUBERNETES_SERVICE_PORT={kube.port}",
        ]
        # The test's cloud: DMI says EC2 (config.toml's cloud = "auto" finds it), the metadata service is the
        # simulator on loopback.
        args += [
            "--volume",
            f"{host_dirs['dmi']}:/etc/preemptd-test-dmi:ro",
            "--env",
            "PREEMPTD_DETECT__DMI_DIR=/etc/preemptd-test-dmi",
            "--env",
            f"PREEMPTD_AWS__ENDPOINT={sim.url}",
            # The simulator shares a test machine that may be busy: not the link-local service's 1 s.
            "--env",
            "PREEMPTD_AWS__TIMEOUT_S=5",
        ]
        run_args = ["run", "--detach", "--name", name, "--log-driver", "k8s-file", *ulimits(), *args]
        code, _, err = await podman(*run_args, image, *container["args"])
        assert code == 0, err
        try:
            await check_the_running_agent(name, kube, token)
            assert sim.requests > 0  # the agent's cloud is the simulator
            # A spot interruption: the agent taints and cordons its node through the API, as the DaemonSet's
            # service account.
            sim.apply({"type": "spot", "action": "terminate", "in_s": 120})
            await wait_until(
                lambda: kube.nodes[NODE]["spec"].get("unschedulable") is True, "the node cordoned"
            )
            taints = {t["key"] for t in kube.nodes[NODE]["spec"].get("taints", [])}
            assert "preemptd.io/notice" in taints
            code, out, err = await podman("exec", name, "preemptd", "status", "--json")
            notices = json.loads(out)["notices"]
            assert [n["kind"] for n in notices] == ["termination"], out
            # The kubelet's stop: SIGTERM, then the grace period.
            code, _, err = await podman("stop", name, timeout=pod["terminationGracePeriodSeconds"] + 30)
            assert code == 0, err
            code, out, _ = await podman("inspect", "--format", "{{.State.ExitCode}}", name)
            entries = await container_log(name)
            assert out.strip() == "0", tail("\n".join(json.dumps(e) for e in entries))
            errors = [e for e in entries if e.get("level") in ("error", "critical")]
            assert errors == [], tail("\n".join(json.dumps(e) for e in errors))
        finally:
            await podman("rm", "--force", "--time", "0", name)


async def wait_until(predicate: Callable[[], bool], what: str, limit_s: float = 30) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"{what}: not within {limit_s:g} s")
        await asyncio.sleep(0.1)


async def metrics_address(name: str, limit_s: float) -> str:
    """Where the agent's metrics listener is, as its log says (``metrics_listening``)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while loop.time() < end:
        for entry in await container_log(name):
            if entry.get("event") == "metrics_listening":
                [address] = entry["address"]
                return str(address)
        _, out, _ = await podman("inspect", "--format", "{{.State.Running}}", name)
        if out.strip() != "true":
            _, logs, errors = await podman("logs", name)
            raise AssertionError(f"the container stopped:\n{tail(logs + errors)}")
        await asyncio.sleep(0.5)
    raise AssertionError(f"no metrics_listening in the log within {limit_s:g} s")


async def check_the_running_agent(name: str, kube: Any, token: str) -> None:
    """The probes, the CLI in the container, the metrics, the API calls and the log of a started agent."""
    address = await metrics_address(name, 120)  # the startup probe's two minutes
    assert address.startswith("127.0.0.1:")
    async with aiohttp.ClientSession() as session:
        base = f"http://{address}"
        await wait_for(session, base + "/healthz", name, 120)
        await wait_for(session, base + "/readyz", name, 60)
        status, metrics = await get(session, base + "/metrics")
        assert status == 200
        assert re.search(r"^preemptd_\w+", metrics, re.MULTILINE), metrics[:2000]
        status, body = await get(session, base + "/healthz")
        assert (status, json.loads(body)["healthy"]) == (200, True)
    # `kubectl exec ds/preemptd -- preemptd status`: the socket from PREEMPTD_SOCKET, as root.
    code, out, err = await podman("exec", name, "preemptd", "status")
    assert code == 0, out + err
    assert "overall: OK" in out, out
    code, out, err = await podman("exec", name, "preemptd", "status", "--json")
    doc = json.loads(out)
    assert doc["sources"]["aws"]["state"] == "ok", doc["sources"]
    # The bridge reached the API with the service account's token over TLS, and was answered.
    await wait_until(lambda: any(r.status == 200 for r in kube.requests), "a request the API fake answered")
    assert {r.authorization for r in kube.requests} == {f"Bearer {token}"}
    entries = await container_log(name)
    events = {e.get("event") for e in entries}
    assert "agent_started" in events
    assert "config_table_unused" not in events  # the kubernetes extra is installed: [actions.kubernetes] used
    assert false_warnings(entries) == [], tail("\n".join(json.dumps(e) for e in false_warnings(entries)))
    [nvml] = [e for e in entries if e.get("event") == "nvml_unavailable"]
    assert nvml["problem"] == "library_not_found"  # no GPU here: the one expected warning
