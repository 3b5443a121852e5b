"""Where a GGUF load on the CPU makes its matrices' fields: in one arena (kernels.cpu.Arena, on huge pages), in
the order the file holds them, the parts of a matrix the model fuses (q/k/v, gate/up) as row ranges of one tensor a
field. The C import (gguf_import.py) writes each matrix there once; the model's fuse then joins the parts without a
copy (quant.weights.cat_rows) and cpu.gather_weights has nothing left to move: each weight byte is written once,
where loads before wrote it, copied it into the fused matrix and copied that into the huge pages (docs/PERF.md,
"Start-up").
"""

from __future__ import annotations

import torch

from localpd.kernels import cpu
from localpd.load.gguf_import import field_specs

FUSED_PARTS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))  # in the order the model fuses them


def _nbytes(specs) -> int:
    return sum((dtype.itemsize * torch.Size(shape).numel() + 63) // 64 * 64 for dtype, shape in specs)


class Placement:
    """`fields(name)`: the tensors the import of GGUF matrix `name` writes, or None (made where they fall)."""

    def __init__(self, tensors: dict[str, tuple[str, tuple[int, int]]]):
        """tensors: each matrix the C import takes, GGUF name -> (type, (N, K))."""
        self.parts: dict[str, tuple[str, int]] = {}  # part's name -> (its group's first part, its first row)
        self.groups: dict[str, list] = {}  # a group's first part -> the fused fields' (dtype, shape)
        self.made: dict[str, list[torch.Tensor]] = {}  # a group's first part -> its fields, once a part is met
        for name in tensors:
            head, layer, part = (name.removesuffix(".weight").split(".", 2) + ["", ""])[:3]
            for group in FUSED_PARTS:
                names = [f"blk.{layer}.{p}.weight" for p in group]
                if head != "blk" or part != group[0] or not all(n in tensors for n in names):
                    continue
                kinds = {tensors[n][0] for n in names}
                widths = {tensors[n][1][1] for n in names}
                if len(kinds) > 1 or len(widths) > 1:
                    continue  # the model keeps them apart (or fuses them by a copy)
                rows = [tensors[n][1][0] for n in names]
                self.groups[name] = field_specs(kinds.pop(), (sum(rows), widths.pop()))
                for n, first in zip(names, [sum(rows[:i]) for i in range(len(rows))]):
                    self.parts[n] = (name, first)
        alone = [field_specs(*tensors[n]) for n in tensors if n not in self.parts]
        self.arena = cpu.Arena(sum(_nbytes(s) for s in alone) + sum(_nbytes(s) for s in self.groups.values()))
        self.tensors = tensors

    def fields(self, name: str) -> list[torch.Tensor] | None:
        if name not in self.tensors:
            return None
        if name not in self.parts:
            return [self.arena.empty(shape, dtype) for dtype, shape in field_specs(*self.tensors[name])]
        group, first = self.parts[name]
        if group not in self.made:  # the group's first part met (in the file's order): its fields made now
            self.made[group] = [self.arena.empty(shape, dtype) for dtype, shape in self.groups[group]]
        made, n = self.made[group], self.tensors[name][1][0]
        return [f[first:first + n] for f in made]
