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
        # The graph's step inputs are views of one int32 buffer (the 64-bit ones two words an entry), the page table
        # last: a step fills its pinned host twin and copies the prefix up to its rows' table in one transfer,
        # where a tensor copy each cost the host about 0.24 ms a step on an H100 (docs/PERF.md, issue 32).
        P = -(-B // 4) * 4  # each field starts 16-byte aligned (Triton specializes its pointers on that)
        self.width, self.table_at, n = max_pages, 9 * P, 9 * P + B * max_pages
        self.host = torch.zeros(n, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self.buffer = torch.zeros(n, dtype=torch.int32, device=dev)
        self.copied = torch.cuda.Event() if dev.type == "cuda" else None  # the host twin is free again once done

        def fields(buf):
            wide = buf[:8 * P].view(torch.int64)
            return (wide[:B], wide[P:P + B], wide[2 * P:2 * P + B], wide[3 * P:3 * P + B], buf[8 * P:8 * P + B],
                    buf[9 * P:].view(B, max_pages))

        self.tokens, self.positions, self.slots, self.stage_slots, self.seq_lens, self.page_table = fields(self.buffer)
        self.host_fields = [f.numpy() for f in fields(self.host)]
        self.seq_lens.fill_(1)
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
        n, ps = len(tokens), self.kv.page_size
        if self.copied is not None:
            self.copied.synchronize()  # the last step's transfer has read the host twin
        tok, pos, slot, stage, lens_, table = self.host_fields
        tok[:n], pos[:n], slot[:n], lens_[:n] = tokens, positions, slots, lens
        tok[n:b], pos[n:b], slot[n:b], lens_[n:b] = 0, 0, self.scratch * ps, 1
        if self.kv.has_stage:
            stage[:n], stage[n:b] = stage_slots, self.scratch_row * ps
        table[:b] = self.scratch
        for i, pages in enumerate(tables):
            table[i, :len(pages)] = pages
        end = self.table_at + b * self.width
        self.buffer[:end].copy_(self.host[:end], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

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
