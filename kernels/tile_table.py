"""Measured launch tiles: per card (torch.cuda.get_device_name) and one-row shape ("bits:N:K"), the fastest tile a
sweep script timed (scripts/sweep_dp4a.py --table, scripts/bench_strip.py --table), in a JSON table beside the
kernel it tunes; the kernel's launches read it."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch


@functools.lru_cache(maxsize=None)
def _card_tiles(table: Path, card: str) -> dict:
    try:
        return json.loads(table.read_text()).get(card, {})
    except (OSError, ValueError):  # no table (or an unreadable one): the defaults
        return {}


def measured_tile(table: Path, default: dict, device: torch.device, bits: int, n: int, k: int) -> dict:
    """default with the table's tile for this card and shape over it (a CUDA device; else default)."""
    if device.type != "cuda":
        return dict(default)
    return {**default, **_card_tiles(table, torch.cuda.get_device_name(device)).get(f"{bits}:{n}:{k}", {})}
