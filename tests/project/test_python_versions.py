"""What differs between the Python versions the project supports (``requires-python``, from 3.10; CI runs the
suite on 3.10 and on 3.11): times read alike, and the Kubernetes bridge, whose client library needs 3.11, says so
on 3.10 instead of asking for an install that cannot help."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from agent.client.events import parse_time as client_parse_time
from agent.core.notice import parse_time
from tests.support import REPO

UTC = timezone.utc


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2017-09-18T08:22:00.5Z", datetime(2017, 9, 18, 8, 22, 0, 500000, tzinfo=UTC)),
        ("2017-09-18T08:22:00.25+02:00", datetime(2017, 9, 18, 6, 22, 0, 250000, tzinfo=UTC)),
        ("2017-09-18T08:22:00.123Z", datetime(2017, 9, 18, 8, 22, 0, 123000, tzinfo=UTC)),
        ("2017-09-18T08:22:00.1234567Z", datetime(2017, 9, 18, 8, 22, 0, 123456, tzinfo=UTC)),
        # Go's RFC3339Nano (Kubernetes, GCP): cut to microseconds, as Python 3.11 does
        ("2017-09-18T08:22:00.123456789Z", datetime(2017, 9, 18, 8, 22, 0, 123456, tzinfo=UTC)),
    ],
)
def test_a_fraction_of_a_second_of_any_length_reads_the_same_on_every_supported_python(
    text: str, expected: datetime
) -> None:
    """Python 3.10's ``datetime.fromisoformat`` takes 3 or 6 digits only; the agent's parser and the client's
    (a notice's deadline) read every RFC 3339 fraction."""
    assert (expected, expected) == (parse_time(text), client_parse_time(text))


async def test_the_kubernetes_bridge_without_its_library_says_what_to_do_on_this_python(
    tmp_path: Path,
) -> None:
    """Enabled without lightkube (on 3.10 the kubernetes extra installs nothing; here it is made unimportable
    on every version), the agent stops at start-up (exit 2) with a configuration error: on 3.10 that the
    bridge needs Python 3.11 and where to run it, on 3.11 and newer which extra to install."""
    shadow = tmp_path / "shadow"
    (shadow / "lightkube").mkdir(parents=True)
    (shadow / "lightkube" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'lightkube'\", name='lightkube')\n"
    )
    config = tmp_path / "config.toml"
    config.write_text(
        f'socket = "{tmp_path / "a.sock"}"\nstate_dir = "{tmp_path / "state"}"\ncloud = "none"\n'
        'log_format = "json"\n[actions.kubernetes]\nenabled = true\nnode = "node-1"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), str(REPO)])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "run", "--config", str(config), env=env, cwd=str(REPO),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert 2 == proc.returncode, out.decode()
    [line] = [json.loads(x) for x in out.decode().splitlines() if '"config_invalid"' in x]
    if sys.version_info < (3, 11):
        expected = [
            "actions.kubernetes.enabled: the Kubernetes bridge needs Python 3.11 or newer",
            f"this agent runs on Python {platform.python_version()}",
            "packaging/kubernetes",
        ]
    else:
        expected = [
            "actions.kubernetes.enabled: the Kubernetes bridge needs its client library (lightkube)",
            "pip install 'preemptd[kubernetes]'",
        ]
    assert [] == [part for part in expected if part not in line["error"]], line["error"]
