"""The device's ceilings: theoretical peak bandwidth (NVML, else a table of cards), a measured copy bandwidth
(cached per device, driver and torch), and peak tensor FLOP/s (table). Every number says where it came from;
one that is not known is None, never a guess."""

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
    from localpd.registry import cache_dir

    return Path(cache_dir()) / "bandwidth.json"


def device_info(device: torch.device | str = "cpu", measure: bool = True) -> DeviceInfo:
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        key = f"{name}|driver {torch.version.cuda}|torch {torch.__version__}"
        nbytes = 1 << 30
    else:
        index = None
        name = cpu_name()
        key = f"cpu {name}|{os.cpu_count()} cores|torch {torch.__version__}"
        nbytes = 1 << 28
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
                      "table" if entry else "unknown")


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

    return (f"{info.name}: peak {gbs(info.peak_bandwidth)} ({info.peak_source}), "
            f"measured {gbs(info.measured_bandwidth)} ({info.measured_source})")
