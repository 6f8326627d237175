"""The cloud payload parsers, table-tested with the shapes the clouds (and the popular mocks) really send."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from agent.core.notice import Kind, Severity
from agent.sources import alibaba, aws, azure, gcp, tencent
from agent.sources.cloud_http import ParseError
from agent.sources.detect import AZURE_ASSET_TAG, cloud_from_dmi, read_dmi

UTC = timezone.utc
NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


# --- AWS -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "action", "deadline"),
    [
        (b'{"action": "terminate", "time": "2017-09-18T08:22:00Z"}', "terminate", at("2017-09-18T08:22:00")),
        (b'{"action":"stop","time":"2017-09-18T08:22:00Z"}', "stop", at("2017-09-18T08:22:00")),
        (
            b'{"action": "hibernate", "time": "2017-09-18T08:22:00Z"}\n',
            "hibernate",
            at("2017-09-18T08:22:00"),
        ),
        (
            b'{"action": "terminate", "time": "2017-09-18T08:22:00+00:00"}',
            "terminate",
            at("2017-09-18T08:22:00"),
        ),
    ],
)
def test_aws_instance_action(body: bytes, action: str, deadline: datetime) -> None:
    obs = aws.parse_instance_action(body)
    assert (obs.key, obs.kind, obs.deadline, obs.detail["action"]) == (
        "spot/instance-action",
        Kind.TERMINATION,
        deadline,
        action,
    )


def test_aws_hibernate_starts_at_once() -> None:
    obs = aws.parse_instance_action(b'{"action": "hibernate", "time": "2026-03-01T12:02:00Z"}', NOW)
    assert obs.deadline == NOW


def test_aws_terminate_keeps_the_stated_time() -> None:
    obs = aws.parse_instance_action(b'{"action": "terminate", "time": "2026-03-01T12:02:00Z"}', NOW)
    assert obs.deadline == at("2026-03-01T12:02:00")


def test_aws_instance_action_key_does_not_depend_on_time() -> None:
    """The popular mock answers now + 2 min on every poll: the key must stay the same."""
    first = aws.parse_instance_action(b'{"action": "terminate", "time": "2026-03-01T12:02:00Z"}')
    second = aws.parse_instance_action(b'{"action": "terminate", "time": "2026-03-01T12:02:01Z"}')
    assert (first.key, first.reason) == (second.key, second.reason)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"<html>404</html>",
        b'{"action": "terminate"}',
        b'{"action": "terminate", "time": "18 Sep 2017"}',
        b"[]",
        b"\xff\xfe",
    ],
)
def test_aws_instance_action_rejects_malformed(body: bytes) -> None:
    with pytest.raises(ParseError):
        aws.parse_instance_action(body)


def test_aws_rebalance() -> None:
    obs = aws.parse_rebalance(b'{"noticeTime": "2020-10-27T08:22:00Z"}')
    assert (obs.key, obs.kind, obs.deadline, obs.detail["noticeTime"]) == (
        "events/recommendations/rebalance",
        Kind.REBALANCE,
        None,
        "2020-10-27T08:22:00Z",
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("21 Jan 2019 09:00:43 GMT", at("2019-01-21T09:00:43")),
        ("1 Feb 2019 09:00:43 GMT", at("2019-02-01T09:00:43")),
        ("01 Feb 2019 09:00:43 GMT", at("2019-02-01T09:00:43")),
        ("5 dec 2026 23:59:59 UTC", at("2026-12-05T23:59:59")),
        ("2019-01-21T09:00:43Z", at("2019-01-21T09:00:43")),
    ],
)
def test_aws_maintenance_time_layouts(text: str, expected: datetime) -> None:
    assert aws.parse_maintenance_time(text) == expected


@pytest.mark.parametrize(
    "text", ["", "21 Foo 2019 09:00:43 GMT", "32 Jan 2019 09:00:43 GMT", "yesterday", None]
)
def test_aws_maintenance_time_rejects(text: str | None) -> None:
    with pytest.raises(ParseError):
        aws.parse_maintenance_time(text)


MAINTENANCE_DOC = b"""[
  {
    "NotBefore" : "21 Jan 2019 09:00:43 GMT",
    "Code" : "system-reboot",
    "Description" : "scheduled reboot",
    "EventId" : "instance-event-0d59937288b749b32",
    "NotAfter" : "21 Jan 2019 09:17:23 GMT",
    "State" : "active"
  },
  {
    "NotBefore" : "3 Feb 2019 09:00:00 GMT",
    "Code" : "system-maintenance",
    "Description" : "network maintenance",
    "EventId" : "instance-event-0aaaaaaaaaaaaaaa1",
    "NotAfter" : "3 Feb 2019 10:00:00 GMT",
    "NotBeforeDeadline" : "10 Feb 2019 09:00:00 GMT",
    "State" : "active"
  },
  {
    "NotBefore" : "1 Jan 2019 09:00:00 GMT",
    "Code" : "instance-stop",
    "Description" : "old",
    "EventId" : "instance-event-0ccccccccccccccc2",
    "NotAfter" : "1 Jan 2019 10:00:00 GMT",
    "State" : "canceled"
  },
  {
    "NotBefore" : "1 Jan 2019 09:00:00 GMT",
    "Code" : "instance-reboot",
    "Description" : "done",
    "EventId" : "instance-event-0ddddddddddddddd3",
    "NotAfter" : "1 Jan 2019 10:00:00 GMT",
    "State" : "completed"
  }
]"""


def test_aws_maintenance_keeps_active_events_only() -> None:
    observations = aws.parse_maintenance(MAINTENANCE_DOC)
    assert [(o.key, o.severity, o.deadline) for o in observations] == [
        (
            "events/maintenance/scheduled/instance-event-0d59937288b749b32",
            Severity.CRITICAL,
            at("2019-01-21T09:00:43"),
        ),
        (
            "events/maintenance/scheduled/instance-event-0aaaaaaaaaaaaaaa1",
            Severity.WARNING,
            at("2019-02-03T09:00:00"),
        ),
    ]


@pytest.mark.parametrize("body", [b"[]", b"", b"  \n", b"[ ]"])
def test_aws_maintenance_empty_shapes(body: bytes) -> None:
    assert aws.parse_maintenance(body) == []


@pytest.mark.parametrize(
    ("body", "terminated"),
    [(b"InService", False), (b"Terminated", True), (b"Warmed:Stopped", False), (b"Standby\n", False)],
)
def test_aws_lifecycle_state(body: bytes, terminated: bool) -> None:
    obs = aws.parse_lifecycle_state(body)
    assert (obs is not None and obs.kind is Kind.TERMINATION) == terminated


def test_aws_lifecycle_state_rejects_garbage() -> None:
    with pytest.raises(ParseError):
        aws.parse_lifecycle_state(b"<html><body>oops</body></html>")


# --- Google Cloud ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "preempted"), [(b"TRUE", True), (b"FALSE", False), (b"true\n", True)])
def test_gcp_preempted(body: bytes, preempted: bool) -> None:
    obs = gcp.parse_preempted(body, NOW)
    assert (obs.deadline if obs else None) == (NOW + timedelta(seconds=30) if preempted else None)


@pytest.mark.parametrize("body", [b"", b"YES", b"\x8f\x00"])
def test_gcp_preempted_rejects(body: bytes) -> None:
    with pytest.raises(ParseError):
        gcp.parse_preempted(body, NOW)


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (b"NONE", None),
        (b"MIGRATE_ON_HOST_MAINTENANCE", Kind.MAINTENANCE),
        (b"TERMINATE_ON_HOST_MAINTENANCE", Kind.TERMINATION),
    ],
)
def test_gcp_maintenance_event(body: bytes, kind: Kind | None) -> None:
    obs = gcp.parse_maintenance_event(body, NOW)
    assert (obs.kind if obs else None) == kind


def test_gcp_maintenance_event_deadline_is_a_minute_out() -> None:
    obs = gcp.parse_maintenance_event(b"TERMINATE_ON_HOST_MAINTENANCE", NOW)
    assert obs is not None and obs.deadline == NOW + timedelta(seconds=60)


@pytest.mark.parametrize("body", [b"{}", b"", b"NONE", b'{"maintenance_status": "COMPLETE"}'])
def test_gcp_upcoming_maintenance_none(body: bytes) -> None:
    assert gcp.parse_upcoming_maintenance(body) is None


def test_gcp_upcoming_maintenance_window() -> None:
    body = (
        b'{"can_reschedule": "true", "latest_window_start_time": "2026-03-02T10:00:00Z", '
        b'"maintenance_status": "PENDING", "type": "SCHEDULED", "window_end_time": "2026-03-02T14:00:00Z", '
        b'"window_start_time": "2026-03-02T10:00:00Z"}'
    )
    obs = gcp.parse_upcoming_maintenance(body)
    assert obs is not None
    assert (obs.key, obs.severity, obs.deadline) == (
        "instance/upcoming-maintenance",
        Severity.CRITICAL,
        at("2026-03-02T10:00:00"),
    )


def test_gcp_endpoint_honours_gce_metadata_host() -> None:
    assert gcp.gcp_endpoint("", {"GCE_METADATA_HOST": "127.0.0.1:8080"}) == "http://127.0.0.1:8080"


def test_gcp_endpoint_configured_wins() -> None:
    assert gcp.gcp_endpoint("http://x:1/", {"GCE_METADATA_HOST": "y"}) == "http://x:1"


def test_gcp_last_segment() -> None:
    assert gcp.parse_last_segment(b"projects/123/zones/us-central1-a") == "us-central1-a"


# --- Azure ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Mon, 19 Sep 2016 18:29:47 GMT", at("2016-09-19T18:29:47")),
        ("Tue, 3 Mar 2026 07:05:00 GMT", at("2026-03-03T07:05:00")),
        ("2016-09-19T18:29:47Z", at("2016-09-19T18:29:47")),
        ("2016-09-19T18:29:47", at("2016-09-19T18:29:47")),
        ("", None),
        (None, None),
    ],
)
def test_azure_not_before(text: str | None, expected: datetime | None) -> None:
    assert azure.parse_not_before(text) == expected


@pytest.mark.parametrize("text", ["Mon, 99 Sep 2016 18:29:47 GMT", "soon", 5])
def test_azure_not_before_rejects(text: object) -> None:
    with pytest.raises(ParseError):
        azure.parse_not_before(text)


AZURE_DOC = b"""{
  "DocumentIncarnation": 4,
  "Events": [
    {"EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123", "EventStatus": "Scheduled", "EventType": "Preempt",
     "ResourceType": "VirtualMachine", "Resources": ["vm-a"], "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
     "Description": "", "EventSource": "Platform", "DurationInSeconds": -1},
    {"EventId": "11111111-AFDC-4513-B24B-AA5F13A16123", "EventStatus": "Scheduled", "EventType": "Reboot",
     "ResourceType": "VirtualMachine", "Resources": ["vm-b"], "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"},
    {"EventId": "22222222-AFDC-4513-B24B-AA5F13A16123", "EventStatus": "Scheduled", "EventType": "Freeze",
     "ResourceType": "VirtualMachine", "Resources": ["VM-A", "vm-c"], "NotBefore": "2016-09-19T18:40:00Z",
     "DurationInSeconds": 9}
  ]
}"""


def test_azure_events_filtered_to_this_vm() -> None:
    events = azure.parse_scheduled_events(AZURE_DOC, "vm-a", NOW)
    assert [(o.key, o.kind, o.severity) for o in events.observations] == [
        ("scheduledevents/C7061BAC-AFDC-4513-B24B-AA5F13A16123", Kind.TERMINATION, Severity.CRITICAL),
        ("scheduledevents/22222222-AFDC-4513-B24B-AA5F13A16123", Kind.MAINTENANCE, Severity.WARNING),
    ]


def test_azure_events_counts_ignored_peers() -> None:
    assert azure.parse_scheduled_events(AZURE_DOC, "vm-a", NOW).ignored == 1


def test_azure_incarnation() -> None:
    assert azure.parse_scheduled_events(AZURE_DOC, "vm-a", NOW).incarnation == 4


def test_azure_unknown_vm_name_keeps_every_event() -> None:
    assert len(azure.parse_scheduled_events(AZURE_DOC, None, NOW).observations) == 3


@pytest.mark.parametrize(
    ("event_type", "kind", "severity"),
    [
        ("Preempt", Kind.TERMINATION, Severity.CRITICAL),
        ("Terminate", Kind.TERMINATION, Severity.CRITICAL),
        ("Reboot", Kind.MAINTENANCE, Severity.CRITICAL),
        ("Redeploy", Kind.MAINTENANCE, Severity.CRITICAL),
        ("Freeze", Kind.MAINTENANCE, Severity.WARNING),
    ],
)
def test_azure_event_types(event_type: str, kind: Kind, severity: Severity) -> None:
    body = (
        b'{"DocumentIncarnation": 1, "Events": [{"EventId": "E1", "EventStatus": "Scheduled", "EventType": "'
        + event_type.encode()
        + b'", "Resources": ["vm"], "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"}]}'
    )
    (obs,) = azure.parse_scheduled_events(body, "vm", NOW).observations
    assert (obs.kind, obs.severity) == (kind, severity)


def test_azure_started_event_keeps_the_scheduled_deadline() -> None:
    body = (
        b'{"DocumentIncarnation": 2, "Events": [{"EventId": "E1", "EventStatus": "Started", '
        b'"EventType": "Preempt", "Resources": ["vm"], "NotBefore": ""}]}'
    )
    known = {"E1": at("2026-03-01T11:59:30")}
    (obs,) = azure.parse_scheduled_events(body, "vm", NOW, known).observations
    assert obs.deadline == at("2026-03-01T11:59:30")


def test_azure_started_event_without_history_is_due_now() -> None:
    body = (
        b'{"DocumentIncarnation": 2, "Events": [{"EventId": "E1", "EventStatus": "Started", '
        b'"EventType": "Preempt", "Resources": ["vm"], "NotBefore": ""}]}'
    )
    (obs,) = azure.parse_scheduled_events(body, "vm", NOW).observations
    assert obs.deadline == NOW


@pytest.mark.parametrize(
    ("status", "not_before", "known", "expected"),
    [
        # Approved early (StartRequests): the 15 minutes are gone, it is happening now.
        ("Started", "", at("2026-03-01T12:15:00"), NOW),
        # Started at its NotBefore, seen a poll later: the scheduled deadline stays.
        ("Started", "", at("2026-03-01T11:59:59"), at("2026-03-01T11:59:59")),
        # A mock that keeps NotBefore once started: still now, not the scheduled time.
        ("Started", "Sun, 01 Mar 2026 12:15:00 GMT", None, NOW),
        ("Started", "Sun, 01 Mar 2026 11:59:00 GMT", None, at("2026-03-01T11:59:00")),
        ("Scheduled", "Sun, 01 Mar 2026 12:15:00 GMT", at("2026-03-01T12:20:00"), at("2026-03-01T12:15:00")),
    ],
)
def test_azure_started_event_is_due_by_the_time_it_started(
    status: str, not_before: str, known: datetime | None, expected: datetime
) -> None:
    """A Started event's deadline: the earliest of NotBefore, the deadline known from earlier reads and now."""
    body = json.dumps(
        {
            "DocumentIncarnation": 3,
            "Events": [
                {"EventId": "E1", "EventStatus": status, "EventType": "Reboot", "Resources": ["vm"],
                 "NotBefore": not_before}
            ],
        }
    ).encode()  # fmt: skip
    (obs,) = azure.parse_scheduled_events(body, "vm", NOW, {"E1": known} if known else None).observations
    assert obs.deadline == expected


def test_azure_started_deadline_stays_at_the_first_sighting() -> None:
    """Later reads of a started event keep the time it was first seen started, not each read's now."""
    body = (
        b'{"DocumentIncarnation": 2, "Events": [{"EventId": "E1", "EventStatus": "Started", '
        b'"EventType": "Reboot", "Resources": ["vm"], "NotBefore": ""}]}'
    )
    (first,) = azure.parse_scheduled_events(body, "vm", NOW, {"E1": at("2026-03-01T12:15:00")}).observations
    assert first.deadline is not None
    later = NOW + timedelta(seconds=5)
    (again,) = azure.parse_scheduled_events(body, "vm", later, {"E1": first.deadline}).observations
    assert (first.deadline, again.deadline) == (NOW, NOW)


def test_azure_no_events() -> None:
    events = azure.parse_scheduled_events(b'{"DocumentIncarnation": 1, "Events": []}', "vm", NOW)
    assert (events.incarnation, events.observations) == (1, ())


@pytest.mark.parametrize(
    "body", [b"", b"[]", b'{"Foo": 1}', b'{"DocumentIncarnation": 1, "Events": {}}', b"\x00garbage"]
)
def test_azure_rejects_malformed(body: bytes) -> None:
    with pytest.raises(ParseError):
        azure.parse_scheduled_events(body, "vm", NOW)


@pytest.mark.parametrize(
    ("body", "incarnation"),
    [(b'{"DocumentIncarnation": "7", "Events": []}', 7), (b'{"Events": []}', 0)],
)
def test_azure_tolerates_mock_incarnations(body: bytes, incarnation: int) -> None:
    assert azure.parse_scheduled_events(body, "vm", NOW).incarnation == incarnation


def test_azure_instance_identity() -> None:
    body = (
        b'{"compute": {"name": "vm-a", "vmId": "abc", "vmSize": "Standard_ND96asr_v4", "priority": "Spot"}}'
    )
    assert azure.parse_instance(body) == {
        "name": "vm-a",
        "vm_id": "abc",
        "vm_size": "Standard_ND96asr_v4",
        "priority": "Spot",
    }


# --- Alibaba and Tencent ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"2015-01-05T18:02:00Z", at("2015-01-05T18:02:00")),
        (b"2015-01-05T18:02:00Z\n", at("2015-01-05T18:02:00")),
    ],
)
def test_alibaba_termination_time(body: bytes, expected: datetime) -> None:
    assert alibaba.parse_alibaba_time(body) == expected


@pytest.mark.parametrize("body", [b"", b"2015-01-05 18:02:00", b"\xff"])
def test_alibaba_termination_time_rejects(body: bytes) -> None:
    with pytest.raises(ParseError):
        alibaba.parse_alibaba_time(body)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"2018-08-18 12:05:33", at("2018-08-18T04:05:33")),
        (b"2018-08-18 02:05:33\n", at("2018-08-17T18:05:33")),
        (b"2018-08-18T12:05:33+08:00", at("2018-08-18T04:05:33")),
    ],
)
def test_tencent_termination_time_is_utc_plus_8(body: bytes, expected: datetime) -> None:
    assert tencent.parse_tencent_time(body) == expected


@pytest.mark.parametrize("body", [b"", b"18/08/2018 12:05", b"2018-08-18 12:05:33 garbage"])
def test_tencent_termination_time_rejects(body: bytes) -> None:
    with pytest.raises(ParseError):
        tencent.parse_tencent_time(body)


# --- detection -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dmi", "cloud"),
    [
        ({"sys_vendor": "Amazon EC2", "product_name": "p4d.24xlarge"}, "aws"),
        ({"sys_vendor": "Xen", "bios_version": "4.11.amazon"}, "aws"),
        ({"sys_vendor": "Google", "product_name": "Google Compute Engine"}, "gcp"),
        ({"sys_vendor": "Microsoft Corporation", "chassis_asset_tag": AZURE_ASSET_TAG}, "azure"),
        ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine"}, None),
        ({"sys_vendor": "Alibaba Cloud", "product_name": "Alibaba Cloud ECS"}, "alibaba"),
        ({"sys_vendor": "Tencent Cloud", "product_name": "CVM"}, "tencent"),
        ({"sys_vendor": "LENOVO", "product_name": "20XW"}, None),
        ({}, None),
    ],
)
def test_cloud_from_dmi(dmi: dict[str, str], cloud: str | None) -> None:
    assert cloud_from_dmi(dmi) == cloud


def test_read_dmi_skips_missing_files(tmp_path: Path) -> None:
    (tmp_path / "sys_vendor").write_text("Amazon EC2\n")
    assert read_dmi(tmp_path) == {"sys_vendor": "Amazon EC2"}
