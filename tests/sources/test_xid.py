"""XID classification and kernel-log parsing (pure), and the hysteresis that keeps flapping quiet."""

from __future__ import annotations

import pytest

from agent.core.notice import Kind, Observation
from agent.sources.gpu_health import Finding, GpuIdentity, HeldFindings, Hysteresis, merge, observation
from agent.sources.gpu_xid import KmsgXid, XidClass, classify_xid, parse_kmsg_xid, pci_key


@pytest.mark.parametrize(
    ("xid", "expected"),
    [
        (79, XidClass.FATAL),
        (48, XidClass.FATAL),
        (64, XidClass.FATAL),
        (95, XidClass.FATAL),
        (119, XidClass.FATAL),
        (61, XidClass.FATAL),
        (150, XidClass.FATAL),
        (94, XidClass.DEGRADED),
        (13, XidClass.INFO),
        (43, XidClass.INFO),
        (63, XidClass.INFO),
    ],
)
def test_builtin_table_follows_nvidias_catalog(xid: int, expected: XidClass) -> None:
    assert classify_xid(xid) == expected


def test_config_override_wins_over_the_table() -> None:
    assert classify_xid(109, {109: "info"}) == XidClass.INFO


def test_unlisted_xid_takes_the_default_class() -> None:
    assert (classify_xid(1234), classify_xid(1234, default="fatal")) == (XidClass.DEGRADED, XidClass.FATAL)


def test_kmsg_record_with_an_xid_is_parsed() -> None:
    line = "3,1234,5678901,-;NVRM: Xid (PCI:0000:2b:00): 79, pid=1234, GPU has fallen off the bus."
    expected = KmsgXid(pci=(0, 0x2B, 0), xid=79, text="pid=1234, GPU has fallen off the bus.")
    assert parse_kmsg_xid(line) == expected


def test_plain_kernel_log_line_with_a_function_number_is_parsed() -> None:
    parsed = parse_kmsg_xid("[ 12.3] NVRM: Xid (PCI:0001:c1:00.0): 48, An uncorrectable double bit error")
    assert parsed == KmsgXid(pci=(1, 0xC1, 0), xid=48, text="An uncorrectable double bit error")


def test_other_kernel_lines_are_ignored() -> None:
    assert parse_kmsg_xid("6,99,1,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15") is None


def test_nvml_and_kernel_bus_ids_map_to_the_same_device() -> None:
    assert pci_key("00000000:2B:00.0") == pci_key("0000:2b:00") == (0, 0x2B, 0)


def obs(key: str = "k", kind: Kind = Kind.GPU_DEGRADED) -> Observation:
    return Observation(key=key, kind=kind, reason="r")


def test_a_condition_is_raised_only_after_raise_after_bad_readings() -> None:
    h = Hysteresis(raise_after=3, clear_after=2)
    seen = []
    for _ in range(3):
        h.bad(obs())
        seen.append(h.is_active("k"))
    assert seen == [False, False, True]


def test_an_urgent_condition_is_raised_on_the_first_reading() -> None:
    h = Hysteresis(raise_after=3, clear_after=2)
    h.bad(obs(), urgent=True)
    assert h.is_active("k")


def test_a_flapping_condition_is_neither_raised_nor_cleared() -> None:
    quiet = Hysteresis(raise_after=2, clear_after=2)
    for _ in range(10):
        quiet.bad(obs())
        quiet.good("k")
    raised = Hysteresis(raise_after=2, clear_after=2)
    raised.bad(obs())
    raised.bad(obs())
    flips = []
    for _ in range(10):
        raised.good("k")
        raised.bad(obs())
        flips.append(raised.is_active("k"))
    assert (quiet.is_active("k"), flips) == (False, [True] * 10)


def test_a_condition_clears_after_clear_after_good_readings() -> None:
    h = Hysteresis(raise_after=1, clear_after=3)
    h.bad(obs())
    seen = []
    for _ in range(3):
        h.good("k")
        seen.append(h.is_active("k"))
    assert seen == [True, True, False]


def test_held_findings_expire_after_their_hold() -> None:
    held = HeldFindings()
    held.add(obs("x"), now=100.0, hold_s=5.0)
    assert (list(held.active(104.9)), list(held.active(105.0))) == (["x"], [])


def test_merge_keeps_the_most_severe_observation_per_key() -> None:
    degraded, fatal = obs("k", Kind.GPU_DEGRADED), obs("k", Kind.GPU_FAULT)
    assert merge({"k": fatal}, {"k": degraded}) == [fatal]


def test_observation_key_is_stable_per_uuid_and_condition_and_reason_carries_no_value() -> None:
    gpu = GpuIdentity(uuid="GPU-1", index=3, name="H200", pci_bus_id="00000000:2B:00.0")
    hot = observation(gpu, "temperature", Finding(XidClass.DEGRADED, "too hot", {"temperature_c": 90}))
    hotter = observation(gpu, "temperature", Finding(XidClass.DEGRADED, "too hot", {"temperature_c": 91}))
    assert (
        (hot.key, hot.reason)
        == (hotter.key, hotter.reason)
        == ("GPU-1/temperature", "GPU 3 (GPU-1): too hot")
    )
