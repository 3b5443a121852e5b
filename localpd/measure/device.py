"""The device's ceilings: theoretical peak bandwidth (NVML, else a table of cards), a measured copy bandwidth
(cached per device, driver and torch), and peak tensor FLOP/s (table). Every number says where it came from;
one that is not known is None, never a guess.

On a CPU the copy runs over buffers well past the last-level cache (together four times its size), so the
measured ceiling is DRAM's, not the cache's; a model whose weights fit in that cache can decode above it, and
`cache_note` says so in words."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# name fragment -> (peak GB/s, dense bf16 tensor TFLOP/s), datasheets; longest fragment wins
CARDS = {
    "RTX 3060": (360, 51), "RTX 3070": (448, 81), "RTX 3080": (760, 119), "RTX 3090": (936, 142),
    "RTX 4060 Ti": (288, 88), "RTX 4060": (272, 60), "RTX 4070 Ti": (504, 160), "RTX 4070": (504, 117),
    "RTX 4080": (717, 195), "RTX 4090": (1008, 330), "RTX 5070": (672, 247), "RTX 5080": (960, 225),
    "RTX 5090": (1792, 419), "L4": (300, 121), "L40S": (864, 362), "A100-SXM4-80GB": (2039, 312),
    "A100 80GB PCIe": (1935, 312), "A100-SXM4-40GB": (1555, 312), "A100": (1555, 312),
    "H100 PCIe": (2000, 756), "H100 80GB HBM3": (3350, 989), "H100 SXM": (3350, 989), "H100": (3350, 989),
    "H200": (4800, 989),
}


@dataclass
class DeviceInfo:
    name: str
    kind: str  # "cuda" or "cpu"
    peak_bandwidth: float | None  # bytes/s
    peak_source: str  # "nvml", "table" or "unknown"
    measured_bandwidth: float | None  # bytes/s, read + written by a large copy
    measured_source: str  # "measured", "cache" or "not measured"
    peak_flops: float | None  # dense bf16/fp16 tensor FLOP/s
    flops_source: str
    llc_bytes: int | None = None  # last-level cache (all of a CPU's instances; a GPU's L2), None if unknown
    measured_note: str = ""  # how the copy was measured: buffer size against the cache, threads

    @property
    def bandwidth(self) -> float | None:
        """The ceiling MBU is measured against: what a copy reaches here, else the datasheet."""
        return self.measured_bandwidth or self.peak_bandwidth


def card_entry(name: str) -> tuple[int, int] | None:
    hits = [k for k in CARDS if k.lower() in name.lower()]
    return CARDS[max(hits, key=len)] if hits else None


def nvml_bandwidth(index: int) -> float | None:
    """Memory clock x bus width x 2 (double data rate), from NVML when pynvml is installed."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(h)
        return clock_mhz * 1e6 * bus_bits / 8 * 2
    except Exception:  # noqa: BLE001 - no library, no driver, an old GPU: fall back to the table
        return None


def parse_cache_size(text: str) -> int:
    """sysfs's cache size ("491520K", "32M", "1024") in bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def llc_bytes(root: str | Path = "/sys/devices/system/cpu") -> int | None:
    """The CPU's last-level cache in bytes: the highest-level data or unified cache in sysfs, times its instances
    (one per socket, or per CCX on AMD: distinct shared_cpu_list sets); else glibc's sysconf; else None."""
    root = Path(root)
    best = None  # (level, size, index directory name)
    for d in sorted((root / "cpu0" / "cache").glob("index*")):
        try:
            if (d / "type").read_text().strip() == "Instruction":
                continue
            level, size = int((d / "level").read_text()), parse_cache_size((d / "size").read_text())
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, size, d.name)
    if best is not None:
        shared = set()
        for d in root.glob(f"cpu[0-9]*/cache/{best[2]}/shared_cpu_list"):
            try:
                shared.add(d.read_text().strip())
            except OSError:
                pass
        return best[1] * max(1, len(shared))
    for name in ("SC_LEVEL4_CACHE_SIZE", "SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            value = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if value and value > 0:
            return value
    return None


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def cpu_copy_bytes(llc: int | None, available: int | None) -> tuple[int, str]:
    """Bytes of each of the two buffers the CPU copy runs over, and a note on what that measures: together four
    times the last-level cache (so the copy streams from DRAM), at least 256 MiB each, at most a quarter of the
    available memory each. A note says so where that cap leaves them within twice the cache."""
    nbytes = max(2 * llc if llc else 0, 256 << 20)
    nbytes -= nbytes % (1 << 20)
    if available and nbytes > available // 4:  # a power of two, so that the cache key stays put as memory drifts
        nbytes = 1 << max(20, (available // 4).bit_length() - 1)
    if llc is None:
        return nbytes, f"{nbytes >> 20} MiB buffers, last-level cache unknown"
    if nbytes < llc:
        return nbytes, (f"{nbytes >> 20} MiB buffers, too little free memory to pass the {llc >> 20} MiB "
                        f"last-level cache: may be a cache bandwidth")
    return nbytes, f"2 x {nbytes >> 20} MiB, past the {llc >> 20} MiB last-level cache: DRAM"


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (sched_getaffinity, each CPU's package and core id
    in sysfs); torch's own default is the machine's physical cores, affinity aside. Falls back to torch's."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return torch.get_num_threads()
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return min(len(cpus), torch.get_num_threads()) or 1
    return len(cores) or 1


def measure_copy_bandwidth(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """Best (read + write) bytes/s of copying a buffer of nbytes into another."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def cache_file() -> Path:
    from localpd.load.registry import cache_dir

    return Path(cache_dir()) / "bandwidth.json"


def device_info(device: torch.device | str = "cpu", measure: bool = True) -> DeviceInfo:
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        key = f"{name}|driver {torch.version.cuda}|torch {torch.__version__}"
        nbytes = 1 << 30
        props = torch.cuda.get_device_properties(index)
        llc, note = getattr(props, "L2_cache_size", None) or None, "1 GiB buffers"
    else:
        index = None
        name = cpu_name()
        llc = llc_bytes()
        nbytes, note = cpu_copy_bytes(llc, available_memory()) if measure else (0, "")
        threads = torch.get_num_threads()
        note += f", {threads} thread" + ("s" if threads > 1 else "")
        key = f"cpu {name}|{os.cpu_count()} cpus|{threads} threads|copy {nbytes >> 20} MiB|torch {torch.__version__}"
    entry = card_entry(name) if device.type == "cuda" else None
    peak, peak_source = (nvml_bandwidth(index), "nvml") if index is not None else (None, "unknown")
    if peak is None and entry:
        peak, peak_source = entry[0] * 1e9, "table"
    if peak is None:
        peak_source = "unknown"
    measured, measured_source = None, "not measured"
    if measure:
        measured, measured_source = cached_or_measured(key, device, nbytes)
    flops = entry[1] * 1e12 if entry else None
    return DeviceInfo(name, device.type, peak, peak_source, measured, measured_source, flops,
                      "table" if entry else "unknown", llc, note if measure else "")


def cached_or_measured(key: str, device: torch.device, nbytes: int) -> tuple[float, str]:
    path = cache_file()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if isinstance(cache.get(key), (int, float)):
        return float(cache[key]), "cache"
    value = measure_copy_bandwidth(device, nbytes)
    cache[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time
    return value, "measured"


def describe(info: DeviceInfo) -> str:
    def gbs(x):
        return "?" if x is None else f"{x / 1e9:.0f} GB/s"

    how = f"{info.measured_source}, {info.measured_note}" if info.measured_note else info.measured_source
    return (f"{info.name}: peak {gbs(info.peak_bandwidth)} ({info.peak_source}), "
            f"measured {gbs(info.measured_bandwidth)} ({how})")


def fits_in_cache(weight_bytes: int, info: DeviceInfo | None) -> bool:
    """Whether the weights a decode step reads fit in the device's last-level cache (then they can be served from
    it, and decode can pass the measured ceiling, which is DRAM's on a CPU)."""
    return info is not None and bool(info.llc_bytes) and 0 < weight_bytes <= info.llc_bytes


def cache_note(weight_bytes: int, info: DeviceInfo | None) -> str:
    """'' unless the weights fit in the last-level cache; then a sentence saying so, and what it does to MBU."""
    if not fits_in_cache(weight_bytes, info):
        return ""
    memory = "DRAM" if info.kind == "cpu" else "memory"
    return (f"weights ({weight_bytes / 2**20:.0f} MiB) fit in the {info.llc_bytes / 2**20:.0f} MiB last-level "
            f"cache: served from cache, so decode can run above the {memory} ceiling (MBU over 100%)")
