"""Where a model hands an int4 matrix to torch's tinygemm kernel instead of localpd's GEMV (issue 32's per-shape
fallback; the layout is quant/tinygemm.py's): only where a measured table says tinygemm ran that shape faster on
that card than the GEMV the card would run (the K-major integer GEMV, or the one over strips where a card holds
them: kernels/gemv_strip.holds_strips), in the same run.

The table (TABLE; LOCALPD_TINYGEMM_TABLE names another) is {card name (torch.cuda.get_device_name): {GEMV
("kmajor" or "strip"): ["N:K:group", ...]}}, written by `localpd bench kernels --tinygemm-table` on that card
(wins). No card has been measured since the K-major and strip GEMVs were built, so none is shipped: every
shape stays on localpd's GEMV until one is.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

TABLE = Path(os.environ.get("LOCALPD_TINYGEMM_TABLE") or Path(__file__).with_name("tinygemm_faster.json"))
GEMVS = {"int4-g128 K-major": "kmajor", "int4-g128 strips": "strip"}  # bench kernels' labels of the two GEMVs
PEER = "tinygemm int4-g128"  # bench kernels' label of tinygemm
MARGIN = 0.03  # at one row tinygemm must take at least 3% less time: a shape that ties stays on localpd's GEMV


@functools.lru_cache(maxsize=None)
def _table(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # no table (or an unreadable one): no shape falls back
        return {}


def measured_faster(card: str, gemv: str, shape: tuple[int, int], group: int) -> bool:
    """Whether the table says tinygemm ran this int4 shape faster than `gemv` on this card."""
    n, k = shape
    return f"{n}:{k}:{group}" in _table(TABLE).get(card, {}).get(gemv, [])


def holds(card: str, gemv: str, w, dtype) -> bool:
    """Whether a model on this card holds int4 weight w for tinygemm (quant/tinygemm.py) in place of `gemv`'s layout:
    the table says so for its shape and torch's kernel takes it with activations of this dtype."""
    from localpd.quant.tinygemm import takes
    from localpd.quant.weights import Int4Weight

    return (isinstance(w, Int4Weight) and measured_faster(card, gemv, w.shape, w.group)
            and takes(w.shape, w.group, dtype, w.packed.device))


def wins(rows: list[dict], group: int = 128) -> dict[str, list[str]]:
    """The table's entries for one card from bench kernels' rows of one run ({"n", "k", "m", "cells": {label:
    (seconds, bytes) or a string where it did not run}}): per GEMV the shapes where tinygemm took at least MARGIN
    less time at one row and no more at every other row count timed (a shape held for tinygemm runs it for
    prefill's rows too)."""
    by_shape: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        by_shape.setdefault((r["n"], r["k"]), []).append(r)
    out: dict[str, list[str]] = {}
    for label, gemv in GEMVS.items():
        for (n, k), shape_rows in by_shape.items():
            times = [(r["m"], _seconds(r["cells"].get(label)), _seconds(r["cells"].get(PEER))) for r in shape_rows]
            if any(ours is None or peer is None for _, ours, peer in times) or 1 not in [m for m, *_ in times]:
                continue
            if all(peer <= ours * (1 - MARGIN) if m == 1 else peer <= ours for m, ours, peer in times):
                out.setdefault(gemv, []).append(f"{n}:{k}:{group}")
    return out


def _seconds(cell) -> float | None:
    return cell[0] if isinstance(cell, (tuple, list)) else None


def write(path: Path, card: str, entries: dict[str, list[str]]) -> None:
    """The table at path with this card's entries replaced by these (other cards' kept)."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table[card] = entries
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
