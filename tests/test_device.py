"""Device ceilings: the card table, the CPU fallbacks, the measured bandwidth and its cache."""

import pytest

from localpd.device import card_entry, describe, device_info


@pytest.mark.parametrize("name, gbs", [
    ("NVIDIA GeForce RTX 4090", 1008), ("NVIDIA GeForce RTX 4060 Ti", 288), ("NVIDIA GeForce RTX 4060", 272),
    ("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA H100 PCIe", 2000), ("NVIDIA A100-SXM4-80GB", 2039),
    ("NVIDIA GeForce RTX 3090", 936),
])
def test_card_table_picks_the_most_specific_name(name, gbs):
    assert card_entry(name)[0] == gbs


def test_unknown_card_has_no_entry():
    assert card_entry("Some Future Accelerator 9000") is None


def test_cpu_has_no_datasheet_but_a_measured_and_cached_bandwidth(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALPD_HOME", str(tmp_path))
    first = device_info("cpu")
    assert first.kind == "cpu" and first.peak_bandwidth is None and first.peak_source == "unknown"
    assert first.measured_source == "measured" and first.measured_bandwidth > 1e8
    assert first.bandwidth == first.measured_bandwidth and first.peak_flops is None
    again = device_info("cpu")
    assert again.measured_source == "cache" and again.measured_bandwidth == first.measured_bandwidth
    assert "measured" in describe(first) and "unknown" in describe(first)
    (tmp_path / "bandwidth.json").write_text("{not json")  # a damaged cache is measured again, not a crash
    assert device_info("cpu").measured_source == "measured"
    assert device_info("cpu", measure=False).measured_bandwidth is None
