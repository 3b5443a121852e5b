"""Speculative decoding by prompt lookup: guess the next tokens of a decoding sequence from its own text, and let
the model check them all in one step.

The draft is the continuation of the latest earlier occurrence of the sequence's last n tokens (n = 3, else 2) in
its prompt and output: a reply that repeats or edits a text it was given, or code it already wrote, repeats long
spans. The model runs the sequence's own token and the k drafted ones as k + 1 rows of one step (one pass over
the weights), and the runner samples each row in turn (`accept`): a drafted token is kept while it is the token
the sampler drew, so the output is the one plain decoding gives, greedy token for token. Sampled, drawing x from
the target and keeping the drafted t when x == t is the standard rejection scheme for a draft that is a point mass:
t is kept with probability p(t), and otherwise x follows p without t, renormalised, so the reply's distribution
is exactly the target's (after temperature, top-k/top-p/min-p, penalties and constraints).

K adapts per sequence (`DraftState`): an estimate of the chance that a drafted token is kept, from the drafts
verified and, while drafting is off, from the drafts that would have been proposed (checked against the tokens
the model then wrote, at no cost), picks the k that maximises tokens per unit of step time, with a (k + 1)-row
step's time over a one-row step's from the device's table (step_costs); where no k gains, the sequence decodes
plainly. A sequence keeps one estimate for drafts found by a 3-token suffix and one for those found by only 2
(on the default model's greedy replies a draft's first token held 78-96% of the time after a 3+ token match,
36-57% after a 2-token one, docs/PERF.md): one estimate for both let the short matches' failures cut the long
ones' drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from localpd.errors import LocalpdError

MODES = ("ngram", "off")  # --speculate's; "draft" is --draft MODEL's (engine.draft_model)
MAX_DRAFT = 14  # --draft-tokens' bound: k + 1 rows (15) stay under the CPU kernels' GEMM_ROWS and TILE_ROWS (16),
# so a verification's rows take decode's int8 products and attention (at 15 drafted, its 16 rows took the float ones)
DRAFT_TOKENS = 8  # --draft-tokens' default
NGRAMS = (3, 2)  # the suffix lengths looked up, longest first
# A step's time with r rows of one sequence over a one-row decode step's, r = 1, 2, ...: on the CPU's kernels
# (SmolLM2-135M Q4_1 at 400 tokens of context, the 2-core Zen 4 VM, one thread: docs/PERF.md, "a verification
# step's rows in one tile", the mean of two runs of `scripts/bench_speculate.py --parts`) each row's integer
# products are its own work (two multiplies per 64 weights and row), so a row costs about half a one-row step in
# the products; the attention walks a sequence's keys once for its rows, and the weights' loads and the output
# head's are shared. 2 to 15 rows take one tile of all the rows a weight row, so every row from the second adds
# 0.43 to 0.60 (the tiles of four rows made the 5th and the 9th add 0.94 and 1.09); 16 rows take prefill's float
# products and attention tiles. On a GPU a verification replays the decode graph of its bucket of rows (engine.runner,
# engine.cuda_graph.BUCKETS), whose time follows the integer GEMV's programs of 4 rows: measured on an H100
# (Llama-3-8B shapes, int4-g128, 1k tokens of context, scripts/gpu_speculate.py, 2026-11-26), exactly r rows over
# one: 2: 1.10, 3-4: 1.55-1.58, 5-8: 2.00-2.13, 9-12: 2.52-2.68, 13-16: 3.18-3.29; the table holds each r's
# bucket's time.
CPU_STEP_COSTS = (1.0, 1.53, 2.04, 2.61, 3.01, 3.51, 4.11, 4.54, 5.05, 5.60, 6.03, 6.55, 7.09, 7.62, 7.90, 12.79)
GPU_STEP_COSTS = (1.0, 1.10, 1.58, 1.58, 2.13, 2.13, 2.13, 2.13, 2.68, 2.68, 2.68, 2.68, 3.29, 3.29, 3.29, 3.29)
MIN_GAIN = 1.05  # drafting runs where the best k's expected tokens per unit of time passes this (1: plain decode)
DECAY = 0.85  # weight of the earlier evidence at each update of the acceptance estimate
PRIOR = (1.5, 2.5)  # (kept, checked) drafted tokens assumed before any evidence: 0.6, worth a couple of drafts


@dataclass
class SpeculateConfig:
    mode: str = "off"  # "ngram": prompt-lookup drafts; "draft": a draft model's; "off": plain decoding
    draft_tokens: int = DRAFT_TOKENS  # K: the most tokens drafted for a sequence in a step
    adaptive: bool = True  # k follows the acceptance rate, and drafting switches off where it loses

    def validate(self) -> "SpeculateConfig":
        if self.mode not in (*MODES, "draft"):
            raise LocalpdError(f"unknown speculation mode {self.mode!r}; expected one of {', '.join(MODES)}")
        if not 1 <= self.draft_tokens <= MAX_DRAFT:
            raise LocalpdError(f"draft tokens must be between 1 and {MAX_DRAFT}, got {self.draft_tokens}")
        return self

    @property
    def on(self) -> bool:
        return self.mode != "off"


class NgramIndex:
    """Where each n-gram of a sequence's tokens last occurred with a token after it: n-gram -> the position that
    follows it. Indexed as the tokens grow, so a lookup costs a few dict operations."""

    def __init__(self, sizes: tuple[int, ...] = NGRAMS):
        self.sizes = sizes
        self.after: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # positions j < indexed have their preceding n-grams recorded

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found."""
        return self.lookup(tokens, k)[0]

    def lookup(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """draft's tokens and the length of the suffix they were found by (0: none found)."""
        for j in range(max(self.indexed, 1), len(tokens)):  # the n-grams that end before position j
            for n in self.sizes:
                if j >= n:
                    self.after[tuple(tokens[j - n:j])] = j
        self.indexed = max(self.indexed, len(tokens))
        for n in self.sizes:
            at = self.after.get(tuple(tokens[-n:])) if len(tokens) > n else None
            if at is not None:
                return tokens[at:at + k], n
        return [], 0


@dataclass
class Estimate:
    """How often a drafted token is kept: decayed counts of drafted tokens kept and checked."""

    kept: float = PRIOR[0]
    checked: float = PRIOR[1]

    @property
    def rate(self) -> float:
        return self.kept / self.checked

    def observe(self, kept: int, checked: int) -> None:
        self.kept = DECAY * self.kept + kept
        self.checked = DECAY * self.checked + checked


@dataclass
class DraftState:
    """One sequence's drafting: its n-gram index, the estimates of how often a drafted token is kept (one for each
    suffix length a draft is found by; a draft model's drafts have one, 0), which of them the latest draft was
    found by, and the draft proposed while drafting was off (scored against what the model wrote instead)."""

    index: NgramIndex = field(default_factory=NgramIndex)
    estimates: dict[int, Estimate] = field(default_factory=dict)
    match: int = 0  # the suffix length the latest draft was found by: its estimate takes the draft's outcome
    shadow: list[int] = field(default_factory=list)  # the draft not run last step
    shadow_at: int = 0  # the output length when it was proposed

    @property
    def estimate(self) -> Estimate:
        return self.estimates.setdefault(self.match, Estimate())

    @property
    def rate(self) -> float:
        return self.estimate.rate

    def observe(self, kept: int, checked: int) -> None:
        self.estimate.observe(kept, checked)


def expected_kept(rate: float, k: int) -> float:
    """Drafted tokens kept on average of k, each kept with probability rate once those before it are."""
    return sum(rate ** i for i in range(1, k + 1))


def step_costs(device: str) -> tuple[float, ...]:
    """A step's time by its rows (r = 1 .. MAX_DRAFT + 1) over a one-row step's, on this kind of device."""
    return CPU_STEP_COSTS if device == "cpu" else GPU_STEP_COSTS


def best_k(rate: float, limit: int, costs: tuple[float, ...] = CPU_STEP_COSTS) -> int:
    """The draft length that maximises tokens per unit of step time (0: plain decoding gains most)."""
    gain = [(1 + expected_kept(rate, k)) / costs[k] for k in range(1, limit + 1)]
    k = max(range(limit), key=gain.__getitem__)
    return k + 1 if gain[k] >= MIN_GAIN else 0


def matched(draft: list[int], written: list[int]) -> tuple[int, int]:
    """(kept, checked) of a draft against the tokens written in its place: kept while they agree, and checked up
    to the first disagreement."""
    kept = 0
    for d, w in zip(draft, written):
        if d != w:
            return kept, kept + 1
        kept += 1
    return kept, kept


class Speculator:
    def __init__(self, config: SpeculateConfig, device: str = "cpu"):
        self.config = config.validate()
        self.costs = step_costs(device)

    def propose(self, state: DraftState, tokens: list[int], n_output: int, room: int, constraint=None) -> list[int]:
        """The draft for a decoding sequence's next step: tokens its prompt and output (`tokens`, n_output of them
        output) suggest, at most room of them (what its budget and KV pages allow), cut where a constraint refuses
        one; empty where the adaptive k is 0 (that draft is kept aside and scored later)."""
        if state.shadow:  # a draft not run: how much of it the model wrote anyway
            state.observe(*matched(state.shadow, tokens[len(tokens) - n_output + state.shadow_at:]))
            state.shadow = []
        limit = min(self.config.draft_tokens, room)
        if limit <= 0:
            return []
        draft, state.match = state.index.lookup(tokens, limit)
        if draft and constraint is not None:
            draft = draft[:allowed_prefix(constraint, draft)]
        k = best_k(state.rate, limit, self.costs) if self.config.adaptive else limit
        if k == 0:
            state.shadow, state.shadow_at = draft[:1], n_output
            return []
        return draft[:k]

    def draft_length(self, state: DraftState, room: int, draft_cost: float) -> int:
        """How many tokens a draft model drafts for a sequence this step (at most room): the k with the most tokens
        per unit of time, where each drafted token costs a draft step (draft_cost of a target step) and the draft
        also runs the step's rows (as plain decoding with a draft does, so that is the baseline); at least 1, since
        a draft not run cannot be scored."""
        limit = min(self.config.draft_tokens, room)
        if limit <= 0 or not self.config.adaptive:
            return max(limit, 0)
        costs = tuple(c + k * draft_cost / (1 + draft_cost) for k, c in enumerate(self.costs))
        return max(best_k(state.rate, limit, costs), 1)

    @staticmethod
    def verified(state: DraftState, drafted: int, kept: int) -> None:
        state.observe(kept, kept + (kept < drafted))


def allowed_prefix(constraint, draft: list[int]) -> int:
    """How many of the draft's first tokens the constraint takes in a row (its prefix_allowed where it has one,
    else the first token's allows())."""
    prefix = getattr(constraint, "prefix_allowed", None)
    if prefix is not None:
        return prefix(draft)
    return len(draft) if constraint.allows(draft[0]) else 0


def accept(draft: list[int], sample_row) -> list:
    """Sample the rows of a verification step in order: sample_row(i, tokens so far this step) -> (token, ...) for
    row i. Row i's token follows drafted token i - 1, so the rows go on while the drafted token is the one sampled;
    the first that differs (or the row after the last drafted token) ends the step with the sampled token. Returns
    each row's outcome, the last one the token the model wrote where the draft went wrong."""
    outcomes, written = [], []
    for i in range(len(draft) + 1):
        outcome = sample_row(i, written)
        outcomes.append(outcome)
        written.append(outcome[0])
        if i == len(draft) or outcome[0] != draft[i]:
            break
    return outcomes
