"""Device ceilings: the card table, the CPU fallbacks, the measured bandwidth and its cache."""

import pytest

from localpd.measure.device import card_entry, describe, device_info


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
    from localpd.measure import device

    monkeypatch.setenv("LOCALPD_HOME", str(tmp_path))
    monkeypatch.setattr(device, "llc_bytes", lambda: 16 * 2**20)  # the real copy is past the real LLC: too slow here
    first = device_info("cpu")
    assert first.kind == "cpu" and first.peak_bandwidth is None and first.peak_source == "unknown"
    assert first.measured_source == "measured" and first.measured_bandwidth > 1e8
    assert first.llc_bytes == 16 * 2**20 and "past the 16 MiB last-level cache" in first.measured_note
    assert "thread" in describe(first)
    assert first.bandwidth == first.measured_bandwidth and first.peak_flops is None
    again = device_info("cpu")
    assert again.measured_source == "cache" and again.measured_bandwidth == first.measured_bandwidth
    assert "measured" in describe(first) and "unknown" in describe(first)
    (tmp_path / "bandwidth.json").write_text("{not json")  # a damaged cache is measured again, not a crash
    assert device_info("cpu").measured_source == "measured"
    assert device_info("cpu", measure=False).measured_bandwidth is None


def fake_sysfs(root, caches, cpus=2, shared=("0-1", "0-1")):
    """caches: (level, type, size) per index, as cpu0 (and every cpu) shows them; shared: the last index's
    shared_cpu_list for each cpu."""
    for cpu in range(cpus):
        for i, (level, kind, size) in enumerate(caches):
            d = root / f"cpu{cpu}" / "cache" / f"index{i}"
            d.mkdir(parents=True)
            (d / "level").write_text(f"{level}\n")
            (d / "type").write_text(f"{kind}\n")
            (d / "size").write_text(f"{size}\n")
            (d / "shared_cpu_list").write_text(f"{shared[cpu] if i == len(caches) - 1 else cpu}\n")
    return root


def test_cache_sizes_parse_as_sysfs_writes_them():
    from localpd.measure.device import parse_cache_size

    assert parse_cache_size("491520K\n") == 480 * 2**20
    assert parse_cache_size("32M") == 32 * 2**20 and parse_cache_size("1G") == 2**30
    assert parse_cache_size("48k") == 48 * 1024 and parse_cache_size("1024") == 1024


def test_last_level_cache_is_the_highest_level_times_its_instances(tmp_path, monkeypatch):
    from localpd.measure.device import llc_bytes

    intel = [(1, "Data", "48K"), (1, "Instruction", "64K"), (2, "Unified", "2048K"), (3, "Unified", "491520K")]
    assert llc_bytes(fake_sysfs(tmp_path / "one", intel)) == 480 * 2**20  # one L3 shared by both CPUs
    # two sockets (or AMD CCXs): two distinct sets of CPUs share an L3 each, and the copy's threads use both
    two = fake_sysfs(tmp_path / "two", intel, cpus=4, shared=("0-1", "0-1", "2-3", "2-3"))
    assert llc_bytes(two) == 2 * 480 * 2**20
    no_l3 = [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K")]
    assert llc_bytes(fake_sysfs(tmp_path / "l2", no_l3)) == 2**20  # an instruction cache never counts
    (tmp_path / "none").mkdir()  # no sysfs: glibc's sysconf, else unknown
    monkeypatch.setattr("os.sysconf", lambda name: 12 * 2**20 if name == "SC_LEVEL3_CACHE_SIZE" else 0)
    assert llc_bytes(tmp_path / "none") == 12 * 2**20
    monkeypatch.setattr("os.sysconf", lambda name: (_ for _ in ()).throw(ValueError(name)))
    assert llc_bytes(tmp_path / "none") is None


def test_cpu_copy_buffers_pass_the_cache_or_say_they_could_not():
    from localpd.measure.device import cpu_copy_bytes

    llc = 480 * 2**20
    nbytes, note = cpu_copy_bytes(llc, 22 * 2**30)
    assert nbytes == 2 * llc and "DRAM" in note  # two buffers of twice the cache: four times it in all
    small, note = cpu_copy_bytes(llc, 1 * 2**30)  # a quarter of 1 GiB each: within the cache
    assert small == 256 * 2**20 and "may be a cache bandwidth" in note
    assert cpu_copy_bytes(llc, 1 * 2**30 + 12345)[0] == small  # capped sizes are powers of two: the key stays put
    nbytes, note = cpu_copy_bytes(None, None)
    assert nbytes == 256 * 2**20 and "unknown" in note
    assert cpu_copy_bytes(8 * 2**20, 22 * 2**30)[0] == 256 * 2**20  # a small cache: at least 256 MiB anyway


def test_weights_in_the_last_level_cache_are_said_to_be_served_from_it():
    from localpd.measure.device import DeviceInfo, cache_note, fits_in_cache

    cpu = DeviceInfo("cpu", "cpu", None, "unknown", 14e9, "cache", None, "unknown", llc_bytes=480 * 2**20)
    note = cache_note(92 * 2**20, cpu)
    assert note.startswith("weights (92 MiB) fit in the 480 MiB last-level cache: served from cache")
    assert "above the DRAM ceiling" in note and fits_in_cache(92 * 2**20, cpu)
    assert cache_note(540 * 2**20, cpu) == "" and not fits_in_cache(540 * 2**20, cpu)  # fp32 weights: DRAM
    unknown = DeviceInfo("cpu", "cpu", None, "unknown", 14e9, "cache", None, "unknown")
    assert cache_note(1, unknown) == "" and cache_note(1, None) == ""
    gpu = DeviceInfo("H100", "cuda", 3.35e12, "table", 3e12, "cache", 989e12, "table", llc_bytes=50 * 2**20)
    assert "above the memory ceiling" in cache_note(40 * 2**20, gpu) and cache_note(92 * 2**20, gpu) == ""


def test_physical_cores_counts_cores_this_process_may_use():
    import os

    from localpd.measure.device import physical_cores

    n = physical_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))
