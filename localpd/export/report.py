"""What an export changed: each tensor's error against the weights as localpd held them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TensorLoss:
    name: str
    stored_as: str       # the format's type: Q4_1, Q8_0, Q4_K, F32, int4 group 32 asymmetric, ...
    exact: bool          # the file decodes to exactly localpd's values
    rel_error: float     # ||decoded - localpd's|| / ||localpd's||


@dataclass
class ExportReport:
    path: str = ""
    tensors: list[TensorLoss] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the format could not hold, and what would fit it

    def add(self, name: str, stored_as: str, held: torch.Tensor, decoded: torch.Tensor) -> None:
        """held, decoded: localpd's values and the file's, both float32."""
        exact = torch.equal(held, decoded)
        err = 0.0 if exact else ((decoded - held).norm() / held.norm().clamp_min(1e-30)).item()
        self.tensors.append(TensorLoss(name, stored_as, exact, err))

    @property
    def lossy(self) -> list[TensorLoss]:
        return [t for t in self.tensors if not t.exact]

    def lines(self) -> list[str]:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.stored_as] = counts.get(t.stored_as, 0) + 1
        out = [f"{self.path}: {len(self.tensors)} tensors ({', '.join(f'{k} {n}' for k, n in counts.items())}); "
               f"{len(self.tensors) - len(self.lossy)} exact"]
        if self.lossy:
            worst = max(self.lossy, key=lambda t: t.rel_error)
            mean = sum(t.rel_error for t in self.lossy) / len(self.lossy)
            out.append(f"{len(self.lossy)} re-quantized: relative error mean {mean:.2e}, worst {worst.rel_error:.2e} "
                       f"({worst.name} as {worst.stored_as})")
        return out + self.notes
