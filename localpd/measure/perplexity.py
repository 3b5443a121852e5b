"""Perplexity of a model on a text, with a sliding window when the text is longer than the window."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localpd.errors import LocalpdError
from localpd.model.transformer import Batch, Transformer
from localpd.kvcache.formats import new_kv_pool, same_kv

PAGE_SIZE = 16


@dataclass
class PerplexityResult:
    perplexity: float
    tokens_scored: int
    windows: int


def perplexity(model: Transformer, ids: list[int], window: int = 1024, stride: int | None = None,
               chunk: int = 512, kv_dtype: str | None = None) -> PerplexityResult:
    """exp(mean NLL) of ids[1:] given what precedes them. Each window scores only the tokens no earlier window
    scored, so every token but the first is scored exactly once, with up to window - stride tokens of context."""
    if len(ids) < 2:
        raise LocalpdError("the text has fewer than 2 tokens; nothing to score")
    if window < 2:
        raise LocalpdError(f"window must be at least 2 tokens, got {window}")
    stride = stride or window // 2
    c = model.config
    kv_dtype = kv_dtype or same_kv(model.dtype)
    n_pages = -(-window // PAGE_SIZE)
    kv = new_kv_pool(kv_dtype, c.n_layers, n_pages, PAGE_SIZE, c.n_kv_heads, c.head_dim, model.dtype, model.device)
    nll, scored, windows = 0.0, 0, 0
    end_scored = 1  # ids[:end_scored] need no (more) scoring
    start = 0
    while end_scored < len(ids):
        end = min(start + window, len(ids))
        logits = torch.cat([
            model.forward(Batch.single(ids[s:min(s + chunk, end)], s - start, n_pages, PAGE_SIZE, model.device,
                                       all_logits=True), kv)
            for s in range(start, end, chunk)])
        targets = torch.tensor(ids[start + 1:end], device=logits.device)
        first = end_scored - start - 1  # index into logits of the first new prediction
        losses = F.cross_entropy(logits[:-1].float(), targets, reduction="none")[first:]
        nll += losses.sum().item()
        scored += losses.numel()
        windows += 1
        end_scored = end
        start = max(end - (window - stride), start + 1) if end < len(ids) else end
    return PerplexityResult(math.exp(nll / scored), scored, windows)
