"""Draft-model drafting for speculative decoding (`--draft MODEL`): a small model of the target's vocabulary proposes
each decoding sequence's next tokens, greedily, one of its own decode steps a token, and the target checks them in
one step as it checks prompt-lookup drafts (engine.speculate.accept: exact for greedy and sampled replies alike,
the draft a point mass).

The draft keeps its keys and values in a pool of its own shape indexed by the target's page ids: the one PagePool
hands out, shares through the prefix cache and rolls back a page of both. The draft runs every step's batch after
the target (follow), so its cache holds every position the target's does, prompts and prefix-cached pages
included; its drafting steps write positions past them, which the next step's verification writes again."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localpd.engine.runner import batch_of, slot_of
from localpd.engine.scheduler import Sequence
from localpd.errors import LocalpdError
from localpd.model.transformer import Batch, Transformer
from localpd.kvcache.formats import KVPool, kv_bytes_per_token, new_kv_pool
from localpd.text.tokenizer import Tokenizer


@dataclass
class DraftModel:
    name: str
    model: Transformer
    kv: KVPool
    cost: float  # a draft decode step's time over the target's (their weights' bytes: a decode step reads them all)
    graphs: object = None  # engine.cuda_graph.DecodeGraphs of the draft on a GPU: its decode-shaped steps replay

    def follow(self, batch: Batch) -> None:
        """The target's step over the draft: its keys and values for the same positions."""
        self.model.forward(batch, self.kv, logits=False)

    def follow_decode(self, inputs: tuple) -> None:
        """follow() for a step the target replayed from a CUDA graph: its decode inputs (ModelRunner._decode_inputs,
        every row one sequence's), replayed by the draft's own graph where one serves them."""
        self.step(inputs, self.model.device)

    def step(self, inputs: tuple, device: torch.device) -> torch.Tensor:
        """The draft's logits for decode inputs (tokens, positions, slots, stage slots, page lists, lengths): a
        graph's replay where one serves them, else the eager forward."""
        logits = None if self.graphs is None else self.graphs.run(*inputs)
        if logits is None:
            tokens, positions, slots, _, tables, lens = inputs
            rows = list(range(len(tokens)))
            logits = self.model.forward(batch_of(tokens, positions, slots, tables, lens, rows + [len(rows)], rows,
                                                 device), self.kv)
        return logits

    def propose(self, seqs: list[Sequence], ks: list[int], device: torch.device) -> list[list[int]]:
        """Up to ks[i] greedy tokens after decoding sequence i's pending token (its pages must hold positions
        computed .. computed + ks[i] - 1), in max(ks) steps of the draft over the sequences still drafting."""
        drafts: list[list[int]] = [[] for _ in seqs]
        ps = self.kv.page_size
        for j in range(max(ks, default=0)):
            live = [i for i, k in enumerate(ks) if k > j]
            tokens = [seqs[i].tokens[-1] if j == 0 else drafts[i][-1] for i in live]
            positions = [seqs[i].computed + j for i in live]
            pages = [seqs[i].table.pages for i in live]
            slots = [slot_of(p, pos, ps) for p, pos in zip(pages, positions)]
            inputs = (tokens, positions, slots, [0] * len(live), pages, [pos + 1 for pos in positions])
            for i, token in zip(live, self.step(inputs, device).argmax(-1).tolist()):
                drafts[i].append(token)
        return drafts


def check_vocabulary(draft: Tokenizer | None, target: Tokenizer | None, draft_vocab: int, target_vocab: int,
                     name: str) -> None:
    """A draft must spell every token id as the target does: its drafts are the target's token ids."""
    same = draft_vocab == target_vocab
    if same and draft is not None and target is not None:
        same = draft.vocab_size == target.vocab_size and all(
            draft.id_to_token(i) == target.id_to_token(i) for i in range(target.vocab_size))
    if not same:
        raise LocalpdError(f"draft model {name} has another vocabulary than the target's ({draft_vocab} tokens, the "
                           f"target {target_vocab}, or the same ids spelled differently)")


def draft_token_bytes(model: Transformer, kv_dtype: str, page_size: int) -> int:
    """Storage bytes of one token's keys and values in the draft's pool (new_draft_pool's), over all its layers."""
    c = model.config
    return kv_bytes_per_token(kv_dtype, c.n_layers, c.n_kv_heads, c.head_dim, page_size)


def new_draft_pool(model: Transformer, target: KVPool, kv_dtype: str, compute_dtype, device) -> KVPool:
    """The draft's keys and values in the target's format, a page for each of the target's pages (the same ids)."""
    c = model.config
    return new_kv_pool(kv_dtype, c.n_layers, target.n_pages, target.page_size, c.n_kv_heads, c.head_dim,
                       compute_dtype, device)
