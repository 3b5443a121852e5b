"""Speculative decoding: the n-gram drafts, the adaptive k, the verification's sampling (its distribution is the
target's), and on the real default model, replies identical to plain decoding."""

import random
from collections import Counter

import pytest
import torch

from localpd.engine.sampling import Sampler, SamplingParams
from localpd.engine.speculate import (MAX_DRAFT, DraftState, Estimate, NgramIndex, SpeculateConfig, Speculator, accept,
                                      best_k, matched)
from localpd.errors import LocalpdError


def test_the_draft_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix (1, 2, 3) occurred at 0..2, followed by 4 5 9 ...; (2, 3) later at 6..7, but 3 tokens match first
    assert index.draft(tokens, 4) == [4, 5, 9, 2]
    tokens += [6, 2, 3]  # now (2, 3, ...) : (6, 2, 3) never occurred, (2, 3) last at 11..12, followed by 6
    assert index.draft(tokens, 3) == [6, 2, 3]
    assert index.draft(tokens + [0], 3) == []  # (3, 0) and (2, 3, 0) never occurred
    assert NgramIndex().draft([5, 5], 4) == []  # too short for any earlier occurrence


def test_the_index_grown_step_by_step_drafts_what_a_fresh_one_does():
    rng = random.Random(0)
    tokens, grown = [], NgramIndex()
    for _ in range(300):
        tokens.append(rng.randrange(6))
        assert grown.draft(tokens, 5) == NgramIndex().draft(tokens, 5)


def test_k_follows_the_acceptance_rate_and_drafting_stops_where_it_loses():
    assert best_k(0.95, 8) >= 2
    assert best_k(0.05, 8) == 0
    assert best_k(0.95, 1) <= 1  # bounded by the room
    assert matched([1, 2, 3], [1, 2, 9]) == (2, 3) and matched([1, 2], [1, 2, 5]) == (2, 2)
    spec = Speculator(SpeculateConfig("ngram", 8))
    state, text = DraftState(), [7, 8, 9] * 20
    for _ in range(10):  # a text that repeats: every drafted token is kept
        Speculator.verified(state, len(spec.propose(state, text, 10, 100)), 8)
    assert len(spec.propose(state, text, 10, 100)) >= 2
    for _ in range(20):  # drafts the model never takes: drafting switches off
        Speculator.verified(state, 8, 0)
    assert spec.propose(state, text, 10, 100) == [] and state.shadow == [7]
    before = state.rate
    spec.propose(state, text + [7], 11, 100)  # the model wrote the shadow draft's token: it counts as kept
    assert state.rate > before
    assert Speculator(SpeculateConfig("ngram", 8, adaptive=False)).propose(DraftState(), text, 10, 3) == [7, 8, 9]


def test_drafts_found_by_a_2_token_suffix_keep_their_own_acceptance_estimate():
    """Drafts found by only a 2-token suffix failing switch those off, not the drafts of 3-token matches; a
    verification's outcome goes to the estimate of the suffix length its draft was found by."""
    spec, state = Speculator(SpeculateConfig("ngram", 8)), DraftState()
    short, long = [1, 2, 3, 5, 2, 3], [7, 8, 9] * 20  # (5, 2, 3) never occurred before, (2, 3) did; (8, 9, 7) did
    assert NgramIndex().lookup(short, 4) == ([5, 2, 3], 2) and NgramIndex().lookup(long, 2) == ([7, 8], 3)
    state.estimates[2], state.estimates[3] = Estimate(0.0, 10.0), Estimate(9.5, 10.0)
    assert spec.propose(state, short, 0, 100) == []
    draft = spec.propose(state, long, 0, 100)
    assert len(draft) >= 2
    Speculator.verified(state, len(draft), 0)
    assert state.estimates[3].rate < 0.9 and state.estimates[2].rate == 0.0


def test_a_whole_verification_stays_on_the_cpu_kernels_decode_path():
    """k + 1 rows under GEMM_ROWS: from 16 rows on a step takes the float products (kernels/cpu.py), whose sums
    are not decode's, and a greedy reply drafted 15 tokens at a time could move."""
    from localpd.kernels.cpu import GEMM_ROWS

    assert MAX_DRAFT + 1 < GEMM_ROWS


@pytest.mark.parametrize("k", [0, MAX_DRAFT + 1])
def test_draft_tokens_out_of_bounds_is_an_error(k):
    with pytest.raises(LocalpdError, match="draft tokens"):
        SpeculateConfig("ngram", k).validate()


def sampled_run(params, rows, draft, seed):
    sampler = Sampler(params)
    sampler.generator.manual_seed(seed)
    return [t for t, *_ in accept(draft, lambda i, written: (sampler(rows[i].clone(), [], list(written)),))]


PARAMS = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
          SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5)]


@pytest.mark.parametrize("params", PARAMS)
def test_verified_samples_follow_the_target_distribution(params):
    """The first token of a verified draft is distributed as the target's sample (chi-square over 4000 draws, a
    fixed seed), and the second, given the first confirmed the draft, as the target's next row. Drafted tokens are
    a likely and an unlikely one, so both acceptance and rejection happen often."""
    g = torch.Generator().manual_seed(1)
    vocab = 12
    rows = torch.randn(3, vocab, generator=g) * 2
    draft = [int(rows[0].argmax()), int(rows[1].argmin())]
    n = 4000
    first, second = Counter(), Counter()
    for s in range(n):
        out = sampled_run(params, rows, draft, s)
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    for row, counts, prior in ((0, first, []), (1, second, [draft[0]])):
        target = target_probs(params, rows[row], prior)
        total = sum(counts.values())
        expected = target * total
        keep = expected >= 5  # chi-square's usual rule; the rest pooled
        chi = float((((torch.tensor([counts[i] for i in range(vocab)], dtype=torch.float64) - expected) ** 2)
                     / expected.clamp_min(1e-12))[keep].sum())
        dof = int(keep.sum()) - 1
        assert chi < dof + 5 * (2 * dof) ** 0.5 + 5, (row, chi, dof)  # ~5 sigma of chi-square(dof)
        assert all(counts[i] == 0 for i in range(vocab) if target[i] == 0)


def target_probs(params, logits, output):
    """The target's sampling distribution of one row, by counting the plain sampler's draws over many seeds."""
    sampler = Sampler(params)
    counts = Counter(sampler(logits.clone(), [], list(output)) for _ in range(20000))
    return torch.tensor([counts[i] / 20000 for i in range(logits.numel())], dtype=torch.float64)


@pytest.mark.parametrize("params", PARAMS)
def test_a_seeded_verification_draws_what_plain_sampling_draws(params):
    """Each written token is one draw of the sampler from its row, as in plain decoding: with a seed, the tokens a
    verification writes are those plain sampling writes from the same rows (whatever the draft)."""
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(6, 30, generator=g) * 3
    for seed in range(50):
        plain = Sampler(params)
        plain.generator.manual_seed(seed)
        expected = []
        for r in rows:
            expected.append(plain(r.clone(), [], list(expected)))
        draft = expected[:seed % 6]
        if seed % 2:
            draft = draft + [(t + 1) % 30 for t in expected[len(draft):5]]  # a wrong continuation
        got = sampled_run(params, rows, draft, seed)
        assert got == expected[:len(got)]
        kept = next((i for i, (d, e) in enumerate(zip(draft, expected)) if d != e), len(draft))
        assert len(got) == min(kept, len(draft)) + 1


def test_a_gpu_draft_fills_a_graph_bucket():
    """On a GPU a verification replays the decode graph of its bucket of rows (engine.cuda_graph.BUCKETS), whose
    time the table holds: the draft length that pays best fills a bucket (k + 1 rows one of them), grows with the
    rate, and at one in twenty no draft pays."""
    from localpd.engine.cuda_graph import BUCKETS
    from localpd.engine.speculate import best_k, step_costs

    gpu = step_costs("cuda")
    ks = [best_k(rate, MAX_DRAFT, gpu) for rate in (0.3, 0.5, 0.7, 0.8, 0.9, 0.97)]
    assert all(k + 1 in BUCKETS for k in ks) and ks == sorted(ks) and ks[0] < ks[-1], ks
    assert best_k(0.05, MAX_DRAFT, gpu) == 0
