"""Decode steps replayed as CUDA graphs: one graph per batch-size bucket, captured on first use.

A batch-1 decode step launches a few hundred small kernels; launched one by one from Python it is bound by the
host, not by memory bandwidth. A graph launches them all with one call. Inputs go into static buffers; rows past
the real batch (up to the bucket) decode a dummy token whose key and value land in a scratch page that no
sequence owns (and stage their keys in a scratch stage row), so padding never touches real pages.
"""

from __future__ import annotations

import logging

import torch

from localpd.model.transformer import Batch, Transformer
from localpd.kvcache.formats import KVPool

log = logging.getLogger(__name__)
# batch sizes (rows: a verification's drafted rows count) a graph is captured for; 12 because 9-12 rows replay in
# 2.5-2.7x a one-row step's time where 16 take 3.3x (H100, Llama-3-8B int4-g128: engine.speculate.GPU_STEP_COSTS)
BUCKETS = (1, 2, 4, 8, 12, 16, 32, 64)


class DecodeGraphs:
    def __init__(self, model: Transformer, kv: KVPool, max_pages: int, scratch_page: int, scratch_row: int,
                 max_batch: int):
        dev = model.device
        self.model, self.kv, self.scratch, self.scratch_row = model, kv, scratch_page, scratch_row
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        B = max_batch
        self.tokens = torch.zeros(B, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, dtype=torch.long, device=dev)
        self.slots = torch.zeros(B, dtype=torch.long, device=dev)
        self.stage_slots = torch.zeros(B, dtype=torch.long, device=dev)
        self.page_table = torch.zeros(B, max_pages, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.q_starts = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(B, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.failed = False  # a capture failed once: the engine runs eagerly from then on

    def _batch(self, b: int) -> Batch:
        return Batch(self.tokens[:b], self.positions[:b], self.slots[:b], self.page_table[:b], self.seq_lens[:b],
                     self.q_starts[:b + 1], self.rows[:b], self.stage_slots[:b])

    def _fill(self, b: int, tokens, positions, slots, stage_slots, tables, lens) -> None:
        """Copy one step's inputs into the static buffers, padding rows n .. b - 1 onto the scratch page."""
        n, ps, width = len(tokens), self.kv.page_size, self.page_table.shape[1]
        pad = b - n
        table = torch.full((b, width), self.scratch, dtype=torch.int32)
        for i, pages in enumerate(tables):
            table[i, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.tokens[:b].copy_(torch.tensor(tokens + [0] * pad))
        self.positions[:b].copy_(torch.tensor(positions + [0] * pad))
        self.slots[:b].copy_(torch.tensor(slots + [self.scratch * ps] * pad))
        if self.kv.has_stage:  # one copy less per step without a stage
            self.stage_slots[:b].copy_(torch.tensor(stage_slots + [self.scratch_row * ps] * pad))
        self.seq_lens[:b].copy_(torch.tensor(lens + [1] * pad, dtype=torch.int32))
        self.page_table[:b].copy_(table)

    def _capture(self, b: int) -> None:
        self._fill(b, [], [], [], [], [], [])  # warm-up and capture write only into the scratch page
        batch = self._batch(b)
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # Triton compiles and autotunes here, outside the capture
                self.model.forward(batch, self.kv)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[b] = self.model.forward(batch, self.kv)
        self.pool = graph.pool()
        self.graphs[b] = graph

    def run(self, tokens: list[int], positions: list[int], slots: list[int], stage_slots: list[int],
            tables: list[list[int]], lens: list[int]) -> torch.Tensor | None:
        """Logits [n, vocab] of one decode step (valid until the next run), or None when no graph serves it."""
        n = len(tokens)
        b = next((b for b in self.buckets if b >= n), None)
        if b is None or self.failed:
            return None
        if b not in self.graphs:
            try:
                self._capture(b)
            except Exception:  # noqa: BLE001 - fall back to eager steps, never fail the request
                log.warning("CUDA graph capture failed; decoding without graphs", exc_info=True)
                self.failed = True
                return None
        self._fill(b, tokens, positions, slots, stage_slots, tables, lens)
        self.graphs[b].replay()
        return self.outputs[b][:n]
