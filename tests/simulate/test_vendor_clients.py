"""The clouds' own client libraries against the simulators: botocore's IMDSv2 fetchers, google-auth's
metadata client and azure-identity's managed identity. Neither is a dependency of preemptd; each test runs where the library is installed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from agent.simulate import AwsSimulator, AzureSimulator, GcpSimulator

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def aws_sim() -> AsyncIterator[AwsSimulator]:
    async with AwsSimulator() as sim:
        yield sim


@pytest.fixture
async def gcp_sim() -> AsyncIterator[GcpSimulator]:
    async with GcpSimulator() as sim:
        yield sim


@pytest.fixture
def gce_env(gcp_sim: GcpSimulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """google-auth's metadata module, pointed at the simulator the way its documentation says."""
    pytest.importorskip("google.auth")
    import importlib

    from google.auth.compute_engine import _metadata

    host = f"127.0.0.1:{gcp_sim.port}"
    monkeypatch.setenv("GCE_METADATA_HOST", host)
    monkeypatch.setenv("GCE_METADATA_IP", host)
    yield importlib.reload(_metadata)
    monkeypatch.delenv("GCE_METADATA_HOST")
    monkeypatch.delenv("GCE_METADATA_IP")
    importlib.reload(_metadata)


async def test_botocore_reads_the_region(aws_sim: AwsSimulator) -> None:
    utils = pytest.importorskip("botocore.utils")
    fetcher = utils.InstanceMetadataRegionFetcher(timeout=2, num_attempts=1, base_url=aws_sim.url)
    assert await asyncio.to_thread(fetcher.retrieve_region) == "us-east-1"


async def test_botocore_finds_no_role_credentials(aws_sim: AwsSimulator) -> None:
    utils = pytest.importorskip("botocore.utils")
    fetcher = utils.InstanceMetadataFetcher(timeout=2, num_attempts=1, base_url=aws_sim.url)
    assert await asyncio.to_thread(fetcher.retrieve_iam_role_credentials) == {}


async def test_botocore_reads_the_spot_notice_with_its_token(aws_sim: AwsSimulator) -> None:
    utils = pytest.importorskip("botocore.utils")
    fetcher = utils.IMDSFetcher(timeout=2, num_attempts=1, base_url=aws_sim.url)
    aws_sim.trigger({"type": "spot", "action": "terminate"})

    def read() -> tuple[int, str]:
        token = fetcher._fetch_metadata_token()
        response = fetcher._get_request("latest/meta-data/spot/instance-action", lambda r: False, token)
        return response.status_code, response.text

    status, body = await asyncio.to_thread(read)
    assert (status, '"action": "terminate"' in body) == (200, True)


async def test_google_auth_detects_gce(gce_env: Any) -> None:
    import google.auth.transport.requests

    request = google.auth.transport.requests.Request()
    assert await asyncio.to_thread(gce_env.is_on_gce, request) is True


async def test_google_auth_reads_project_and_preemption(gce_env: Any, gcp_sim: GcpSimulator) -> None:
    import google.auth.transport.requests

    request = google.auth.transport.requests.Request()
    gcp_sim.trigger({"type": "preempted"})
    project = await asyncio.to_thread(gce_env.get_project_id, request)
    preempted = await asyncio.to_thread(gce_env.get, request, "instance/preempted")
    assert (project, preempted) == ("sim-project", "TRUE")


async def test_google_auth_compute_credentials_refresh(gce_env: Any) -> None:
    import google.auth.transport.requests
    from google.auth import compute_engine

    credentials = compute_engine.Credentials()
    await asyncio.to_thread(credentials.refresh, google.auth.transport.requests.Request())
    assert credentials.token == "ya29.simulated-token"


async def test_azure_identity_gets_a_managed_identity_token(monkeypatch: pytest.MonkeyPatch) -> None:
    identity = pytest.importorskip("azure.identity")
    async with AzureSimulator() as sim:
        monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", sim.url)
        credential = identity.ManagedIdentityCredential()
        token = await asyncio.to_thread(credential.get_token, "https://management.azure.com/.default")
        assert token.token.startswith("eyJ")
