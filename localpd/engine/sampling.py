"""Turning logits into the next token: greedy, temperature, top-k, top-p, min-p, penalties, seed."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from localpd.engine.speculate import MAX_DRAFT
from localpd.errors import LocalpdError

log = logging.getLogger("localpd.engine.sampling")


@dataclass
class SamplingParams:
    temperature: float = 0.7  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens already in prompt or output (CTRL-style)
    presence_penalty: float = 0.0  # OpenAI-style, over generated tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 512
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: the chosen token's log-probability; k: also the k most likely
    json_object: bool = False  # the reply is one JSON object (localpd.constrain.grammar)
    json_schema: dict | None = None  # with json_object: the reply is one value of this JSON schema
    json_lead: str = ""  # JSON the prompt already opened, which the reply goes on from (a forced tool call's)
    regex: str | None = None  # the whole reply matches this pattern (vLLM's guided_regex/choice)
    grammar: str | None = None  # the whole reply is a sentence of this grammar (GBNF or Lark)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (OpenAI's, -100..100)
    stop_token_ids: list[int] = field(default_factory=list)  # tokens that end the reply as end-of-sequence does
    min_tokens: int = 0  # end-of-sequence and stop_token_ids are held back until the reply has this many tokens
    draft_tokens: int | None = None  # speculative decoding: at most this many drafted tokens a step (0: none; None:
    #   the engine's --draft-tokens, which also bounds this)

    def validate(self) -> "SamplingParams":
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be between 0 and 20"),
            (not (self.json_object and self.ignore_eos), "JSON mode ends the reply with the end-of-sequence token; "
                                                         "it cannot be ignored"),
            (self.json_object or not (self.json_lead or self.json_schema), "json_lead and json_schema are for JSON "
                                                                            "mode (json_object)"),
            (not (self.regex is not None and (self.json_object or self.ignore_eos)), "regex takes neither JSON mode "
                                                                                   "nor ignore_eos"),
            (not (self.grammar is not None and (self.json_object or self.ignore_eos or self.regex is not None)),
             "grammar takes neither JSON mode, regex nor ignore_eos"),
            (all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be between 0 and max_tokens"),
            (self.draft_tokens is None or 0 <= self.draft_tokens <= MAX_DRAFT,
             f"draft_tokens must be between 0 and {MAX_DRAFT}"),
        ]
        for ok, message in checks:
            if not ok:
                name = message.split(" ", 1)[0]
                raise LocalpdError(message, param=name if name in self.__dataclass_fields__ else None)
        return self


class Sampler:
    """Samples one sequence's tokens. Holds its own generator so a seed gives the same output every time.
    constraint: which tokens may come next (allows(token), advance(token), and where it can, mask(logits), which
    sets the refused ones to -inf, and prepare(), which the runner calls during the forward to compute the mask
    ahead; localpd.constrain.grammar's), None for any."""

    REDRAWS = 8  # draws refused by the constraint before taking the most likely token it allows

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu", constraint=None):
        self.params = params.validate()
        self.constraint = constraint
        self._bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        self._bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        self.generator = torch.Generator(device=device)
        # no penalty or bias: greedy sampling reads the logits as they are
        self._plain = params.repetition_penalty == 1.0 and not (params.presence_penalty or params.frequency_penalty
                                                               or params.logit_bias)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    @property
    def plain_greedy(self) -> bool:
        """Whether a draw is the argmax of the logits as they are: greedy, no penalty, bias or constraint."""
        return self.constraint is None and self.params.temperature == 0 and self._plain

    def __call__(self, logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int]) -> int:
        p = self.params
        logits = logits.float()
        if self.plain_greedy:
            return greedy(logits)  # nothing changes the logits: no copy of them
        logits = logits.clone()
        if p.repetition_penalty != 1.0 and (prompt_ids or output_ids):
            seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), device=logits.device)
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and output_ids:
            ids, counts = torch.tensor(output_ids, device=logits.device).unique(return_counts=True)
            logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.float()
        if p.logit_bias:
            logits[self._bias_ids] += self._bias
        if self.constraint is None:
            if p.temperature == 0:
                return greedy(logits)
            return int(sample_from(scaled(logits, p.temperature), p.top_k, p.top_p, p.min_p, self.generator))
        token = self._allowed(logits)
        self.constraint.advance(token)
        return token

    def _allowed(self, logits: torch.Tensor) -> int:
        """A token the constraint allows. Sampled: drawn as usual, and when the constraint refuses it, drawn again
        with the refused tokens out (its mask where it has one, else that token, up to REDRAWS times): exactly a
        draw from the allowed tokens (at a temperature alone), and the same draws as without the constraint wherever
        the model writes what is allowed (a seed gives the reply it gave before).
        Greedy, or after REDRAWS refusals: the most likely allowed token."""
        p, allows, refused = self.params, self.constraint.allows, float("-inf")
        mask = getattr(self.constraint, "mask", None)
        left = True  # some token's logit is above -inf
        if p.temperature == 0 and mask is not None:
            left = mask(logits)
            token = greedy(logits)  # the masked argmax: what the candidates below would find first
            if left and allows(token):
                return token
        elif p.temperature > 0:
            for attempt in range(self.REDRAWS):
                token = int(sample_from(scaled(logits, p.temperature), p.top_k, p.top_p, p.min_p, self.generator))
                if allows(token):
                    return token
                logits[token] = refused
                left = mask(logits) if attempt == 0 and mask is not None else bool(logits.max() > refused)
                if not left:
                    break
        if left:  # the 64 most likely first: the whole sort is rarely needed
            for candidates in (logits.topk(min(64, logits.numel())).indices, logits.argsort(descending=True)):
                for token in candidates.tolist():
                    if logits[token] > refused and allows(token):
                        return token
        ends = sorted(getattr(self.constraint, "eos_ids", ()))
        if ends:  # a dead end (no token continues the reply): this reply ends, the others in the step go on
            log.warning("no token continues the constrained reply; ending it")
            return ends[0]
        raise LocalpdError("no token can continue the constrained reply")


def greedy_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's first largest logit ([n, vocab]), as torch's argmax picks it, in one operation (one
    wait for a GPU, not one a row); on the CPU through numpy, whose argmax is about ten times faster than torch's
    (4 against 43 us over 49k float32 logits on the 2-core VM)."""
    logits = logits.float()
    if logits.device.type == "cpu":
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def greedy(logits: torch.Tensor) -> int:
    """greedy_rows of one row of logits [vocab]."""
    return greedy_rows(logits[None])[0]


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, the largest first brought to 0 and the temperature to at least 1e-6 (below, float32
    divides by zero), so that a tiny temperature is greedy in effect, never inf - inf or 0 / 0."""
    return (logits - logits.max()) / max(temperature, 1e-6)


def draw(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index drawn with probability proportional to weights (>= 0, not all 0): the first whose running sum
    passes a uniform draw over the total (torch.multinomial took 4 ms over a 49k vocabulary on the CPU, this 0.4)."""
    cdf = weights.cumsum(0)
    at = torch.searchsorted(cdf, torch.rand((), generator=generator, device=weights.device) * cdf[-1], right=True)
    return at.clamp_max(weights.numel() - 1)


def sample_from(logits: torch.Tensor, top_k: int, top_p: float, min_p: float, generator: torch.Generator) -> torch.Tensor:
    """Draw one index from softmax(logits) restricted by top-k, then top-p (nucleus), then min-p. Only the most
    likely tokens are sorted: top-k's k, or for top-p alone as many as first hold top_p of the mass (256, then 4x
    more while they fall short); without top-k and top-p nothing is sorted. A whole 49k vocabulary's sort (14 ms)
    and torch.multinomial (4 ms) cost more than a CPU decode step."""
    probs = torch.softmax(logits, dim=-1)
    n = probs.numel()
    if top_k <= 0 and top_p >= 1.0:  # min-p alone, or nothing: a mask over the whole vocabulary
        if min_p > 0:
            probs = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
        return draw(probs, generator)
    k = min(top_k, n) if top_k > 0 else min(256, n)
    top, order = probs.topk(k)  # sorted, most likely first
    while top_k <= 0 and k < n and float(top.sum()) < top_p:  # the tokens past these hold what top-p needs
        k = min(4 * k, n)
        top, order = probs.topk(k)
    keep = torch.ones_like(top, dtype=torch.bool)
    if top_p < 1.0:
        before = top.cumsum(-1) - top  # mass strictly before each token
        keep &= before < top_p
    if min_p > 0:
        keep &= top >= min_p * top[0]
    keep[0] = True  # the most likely token always survives
    return order[draw(torch.where(keep, top, torch.zeros_like(top)), generator)]
