"""Compile the fake ``libnvidia-ml.so.1`` and write the scenario files that drive it.

Test modules import the fixtures from here (``from fake_nvml.build import fake_nvml_lib, scenario``), so no
shared ``conftest.py`` is needed. The library reads ``$FAKE_NVML_SCENARIO`` on every call and re-reads the
file when it changes; :class:`Scenario` rewrites it atomically (write, then rename) so the fake never sees a
half-written file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

SOURCE = Path(__file__).with_name("fake_nvml.c")
SCENARIO_ENV = "FAKE_NVML_SCENARIO"


def build_fake_nvml(out_dir: Path) -> Path:
    """Compile the fake driver into ``out_dir/libnvidia-ml.so.1``; no unresolved symbols (ctypes uses
    RTLD_NOW)."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler (gcc) to build the fake NVIDIA driver")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "libnvidia-ml.so.1"
    command = [
        gcc,
        "-shared",
        "-fPIC",
        "-pthread",
        "-O1",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-Wl,-soname,libnvidia-ml.so.1",
        "-Wl,--no-undefined",
        "-o",
        str(target),
        str(SOURCE),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"building the fake NVML failed: {' '.join(command)}\n{result.stderr}")
    return target


class Scenario:
    """The scenario file the fake driver reads; ``set``/``unset`` rewrite it atomically."""

    def __init__(self, path: Path, values: Mapping[str, object] | None = None) -> None:
        self.path = path
        self.values: dict[str, str] = {}
        self._version = 0
        # The fake remembers which event ids it delivered until the session token changes.
        self.session = uuid.uuid4().hex
        self.write(values or {})

    def write(self, values: Mapping[str, object]) -> None:
        """Replace the whole scenario."""
        self.values = {key: _text(value) for key, value in values.items()}
        self._flush()

    def set(self, **values: object) -> None:
        """Add or change keys; a ``__`` in a keyword stands for a dot (``gpu__0__temp=95``)."""
        for key, value in values.items():
            self.values[key.replace("__", ".")] = _text(value)
        self._flush()

    def update(self, values: Mapping[str, object]) -> None:
        for key, value in values.items():
            self.values[key] = _text(value)
        self._flush()

    def unset(self, *keys: str) -> None:
        for key in keys:
            self.values.pop(key.replace("__", "."), None)
        self._flush()

    def _flush(self) -> None:
        self._version += 1
        tmp = self.path.with_name(f".{self.path.name}.{self._version}")
        body = f"session={self.session}\n" + "".join(f"{key}={value}\n" for key, value in self.values.items())
        tmp.write_text(f"# version {self._version}\n{body}")
        os.replace(tmp, self.path)


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The fake ``libnvidia-ml.so.1``, compiled once per test session.

    ``$FAKE_NVML_SCENARIO`` is set once for the whole session (and each test rewrites that one file):
    changing the environment while a thread of an earlier test may still be inside the fake (``getenv``)
    would be a data race in C."""
    directory = tmp_path_factory.mktemp("fake-nvml")
    library = build_fake_nvml(directory)
    previous = os.environ.get(SCENARIO_ENV)
    os.environ[SCENARIO_ENV] = str(directory / "scenario.txt")
    yield library
    if previous is None:
        os.environ.pop(SCENARIO_ENV, None)
    else:
        os.environ[SCENARIO_ENV] = previous


@pytest.fixture
def scenario(fake_nvml_lib: Path) -> Iterator[Scenario]:
    """A fresh scenario (one GPU, all healthy) that the fake driver reads for this test.

    At teardown the scenario is reset to a healthy one, so a thread stuck in a hung fake call returns."""
    sc = Scenario(Path(os.environ[SCENARIO_ENV]))
    yield sc
    sc.write({})
