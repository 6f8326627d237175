"""The shipped service unit as systemd reads it: ``systemd-analyze verify`` accepts it (the RAM tier's
capabilities and system calls included), and the exit status ``preemptd run`` gives a bad configuration is one
the unit does not restart on."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "systemd"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")

pytestmark = [pytest.mark.service, pytest.mark.timeout(60)]


def unit_values(path: Path, key: str) -> list[str]:
    """Every value of ``key=`` in a unit file (systemd allows a key more than once)."""
    pattern = re.compile(rf"^{re.escape(key)}=(.*)$")
    return [m.group(1).strip() for line in path.read_text().splitlines() if (m := pattern.match(line))]


def throwaway_root(tmp: Path, service_text: str) -> Path:
    """A root with the host's unit directory, the given preemptd.service and preemptd.socket, and executable
    stubs for the programs the Exec*= lines name (verify checks that they exist)."""
    system_units = next(
        (
            d
            for d in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
            if (d / "sysinit.target").exists()
        ),
        None,
    )
    if system_units is None:
        pytest.skip("no systemd unit directory with sysinit.target on this machine")
    root = tmp / "root"
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    etc = root / "etc/systemd/system"
    etc.mkdir(parents=True)
    (etc / "preemptd.service").write_text(service_text)
    shutil.copy(UNITS / "preemptd.socket", etc / "preemptd.socket")
    for program in set(re.findall(r"^Exec[A-Za-z]+=[-@:+!]*(/\S+)", service_text, re.MULTILINE)):
        stub = root / program.lstrip("/")
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    return root


def verify(root: Path) -> str:
    assert SYSTEMD_ANALYZE is not None
    done = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", f"--root={root}", "--man=no", "preemptd.socket", "preemptd.service"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return (done.stdout + done.stderr).strip()


@pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)"
)
def test_systemd_analyze_verify_accepts_the_service_unit(tmp_path: Path) -> None:
    service = (UNITS / "preemptd.service").read_text()
    assert "" == verify(throwaway_root(tmp_path, service))


@pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)"
)
def test_systemd_analyze_verify_would_catch_a_bad_restart_prevent_status(tmp_path: Path) -> None:
    """The check above can fail: verify does read RestartPreventExitStatus= and complains about nonsense."""
    service = (UNITS / "preemptd.service").read_text()
    broken = re.sub(r"^RestartPreventExitStatus=.*$", "RestartPreventExitStatus=config", service, flags=re.M)
    line = 1 + broken.splitlines().index("RestartPreventExitStatus=config")
    assert f"preemptd.service:{line}: Failed to parse value" in verify(throwaway_root(tmp_path, broken))


@pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)"
)
def test_systemd_analyze_verify_reads_the_system_calls_the_ram_tier_lets_through(tmp_path: Path) -> None:
    """The SystemCallFilter= line that lets the RAM tier's calls back in is read: a group systemd does not
    know is reported (tests/ramtier/test_unit.py checks what the groups hold)."""
    service = (UNITS / "preemptd.service").read_text()
    [tier_line] = [v for v in unit_values(UNITS / "preemptd.service", "SystemCallFilter") if "@setuid" in v]
    broken = service.replace(f"SystemCallFilter={tier_line}", "SystemCallFilter=@chown @setuidd capset")
    line = 1 + broken.splitlines().index("SystemCallFilter=@chown @setuidd capset")
    assert f"preemptd.service:{line}: Unknown system call group, ignoring: @setuidd" in verify(
        throwaway_root(tmp_path, broken)
    )


def test_config_error_exit_status_is_not_restarted(tmp_path: Path) -> None:
    bad = tmp_path / "config.toml"
    bad.write_text('cloud = "moon"\n')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PREEMPTD_CONFIG", None)
    done = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--config", str(bad), "--socket", str(tmp_path / "a.sock")],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    prevented = [int(v) for values in unit_values(UNITS / "preemptd.service", "RestartPreventExitStatus")
                 for v in values.split() if v.isdigit()]  # fmt: skip
    assert (True, True) == (done.returncode in prevented, "configuration error" in done.stderr)
    assert ["on-failure"] == unit_values(UNITS / "preemptd.service", "Restart")
