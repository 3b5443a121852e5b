"""What an engine step costs in bytes and FLOPs, and how that compares with the device's ceilings.

Bytes are what the kernels must move at least once: every matrix of the body once per step (packed data,
scales and biases: whatever the format stores), the output head when some row needs logits, the embedding rows
of the step's tokens, the keys and values each sequence attends to (its whole context, scales included) and
those it writes (localpd.kvcache.formats.KVTraffic: a per-page format rewrites whole pages). FLOPs are 2 per
multiply-add of the matrices and 4 * head_dim per (query head, attended key) pair of attention (scores and the
weighted sum).
"""

from __future__ import annotations

from dataclasses import dataclass

from localpd.kvcache.formats import KVTraffic


@dataclass
class StepCost:
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes


def step_cost(model, seqs: list[tuple[int, int]], kv: KVTraffic, logit_rows: int) -> StepCost:
    """seqs: (tokens already cached, tokens computed this step) per sequence; logit_rows: rows sent to the head."""
    c = model.config
    tokens = sum(n for _, n in seqs)
    head = logit_rows > 0
    weight_bytes = model.body_bytes + (model.head_bytes if head else 0) + tokens * model.embed_row_bytes
    kv_read = sum(kv.read(ctx + n, n) for ctx, n in seqs)  # each sequence reads its keys and values once
    kv_written = sum(kv.written(ctx, n) for ctx, n in seqs)
    pairs = sum(n * ctx + n * (n + 1) // 2 for ctx, n in seqs)  # causal (query, key) pairs
    flops = (2 * tokens * model.body_params + 2 * logit_rows * model.lm_head.params
             + 4 * c.n_layers * c.n_heads * c.head_dim * pairs)
    return StepCost(weight_bytes, kv_read, kv_written, flops)


def decode_ceiling_tps(model, context: int, kv: KVTraffic, bandwidth: float) -> float:
    """Tokens/s a batch-1 decode at this context could reach if every byte moved at `bandwidth` bytes/s."""
    return bandwidth / step_cost(model, [(context, 1)], kv, 1).bytes


def utilisation(amount: float, seconds: float, peak: float | None) -> float | None:
    """amount/seconds as a fraction of peak (MBU with bytes and bandwidth, MFU with FLOPs and FLOP/s)."""
    if not peak or seconds <= 0:
        return None
    return amount / seconds / peak
