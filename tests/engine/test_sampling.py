import pytest
import torch

from localpd.errors import LocalpdError
from localpd.engine.sampling import Sampler, SamplingParams, greedy, greedy_rows, sample_from


def draws(logits, n=400, **kw):
    g = torch.Generator().manual_seed(0)
    p = dict(top_k=0, top_p=1.0, min_p=0.0) | kw
    return {int(sample_from(logits, p["top_k"], p["top_p"], p["min_p"], g)) for _ in range(n)}


def test_greedy_picks_argmax():
    logits = torch.randn(1000)
    assert Sampler(SamplingParams(temperature=0))(logits, [], []) == int(logits.argmax())


def test_greedy_takes_torchs_argmax_row_by_row_or_all_rows_at_once():
    """greedy (numpy's argmax on the CPU) and greedy_rows (a step's plain greedy rows in one operation) pick what
    torch's argmax picks, the first of tied maxima included, in float32 and bfloat16 rows."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(6, 49152, generator=g).to(dtype)
        logits[2, 77] = logits[2, 30000] = logits[2].max() + 1  # a tie: the first wins
        want = logits.float().argmax(-1).tolist()
        assert want[2] == 77 and greedy_rows(logits) == want == [greedy(row) for row in logits]
    assert not Sampler(SamplingParams(temperature=0, logit_bias={3: 1.0})).plain_greedy
    assert Sampler(SamplingParams(temperature=0)).plain_greedy


def test_top_k_restricts_to_k_best():
    logits = torch.randn(50)
    best = set(logits.topk(3).indices.tolist())
    seen = draws(logits, top_k=3)
    assert seen <= best and len(seen) == 3


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert draws(logits, top_p=0.7) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    assert draws(logits, top_p=0.4) == {0}
    assert draws(logits, top_p=1.0) == {0, 1, 2, 3}


def test_a_nucleus_wider_than_the_first_tokens_looked_at_is_whole():
    """top-p over a flat vocabulary needs far more than the 256 most likely tokens: the draws reach the nucleus's
    last token and never pass it."""
    logits = -torch.arange(5000, dtype=torch.float32) * 1e-3  # nearly flat, most likely first: 687 in the nucleus
    probs = torch.softmax(logits, -1)
    nucleus = int(((probs.cumsum(0) - probs) < 0.5).sum())  # tokens whose mass before them is under top_p
    assert nucleus > 256  # past the tokens looked at first
    g = torch.Generator().manual_seed(3)
    drawn = torch.tensor([int(sample_from(logits, 0, 0.5, 0.0, g)) for _ in range(4000)])
    assert drawn.max().item() < nucleus and drawn.max().item() > nucleus - 40


def test_min_p_drops_tokens_below_fraction_of_best():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert draws(logits, min_p=0.25) == {0, 1, 2}  # 0.05 < 0.25 * 0.5


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample_from(probs.log(), 0, 1.0, 0.0, g)] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_same_seed_same_tokens_different_seed_differs():
    logits = [torch.randn(500) for _ in range(30)]

    def run(seed):
        s = Sampler(SamplingParams(temperature=1.0, top_p=1.0, seed=seed))
        return [s(l, [], []) for l in logits]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_repetition_penalty_lowers_seen_tokens():
    logits = torch.tensor([2.0, 1.9, -1.0, -1.1])
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=1.5))
    assert s(logits, [0], []) == 1  # 2.0 / 1.5 < 1.9
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=1.5))
    assert s(torch.tensor([-5.0, -1.0, -1.2]), [], [1]) == 2  # negative logits are multiplied


def test_frequency_and_presence_penalties():
    logits = torch.tensor([3.0, 2.5, 0.0])
    s = Sampler(SamplingParams(temperature=0, frequency_penalty=0.3))
    assert s(logits, [], [0]) == 0 and s(logits, [], [0, 0]) == 1
    s = Sampler(SamplingParams(temperature=0, presence_penalty=1.0))
    assert s(logits, [0], []) == 0 and s(logits, [], [0]) == 1


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
                                 dict(top_k=-1), dict(max_tokens=0), dict(repetition_penalty=0)])
def test_bad_values_are_refused(bad):
    with pytest.raises(LocalpdError):
        SamplingParams(**bad).validate()


class EvenTokens:
    """A constraint that allows even token ids only, and records what it was told."""

    def __init__(self):
        self.taken = []

    def allows(self, token):
        return token % 2 == 0

    def advance(self, token):
        self.taken.append(token)


def test_a_constraint_takes_the_best_allowed_token_greedy_or_sampled():
    logits = torch.randn(1001)
    best_even = int(torch.where(torch.arange(1001) % 2 == 0, logits, float("-inf")).argmax())
    greedy = EvenTokens()
    assert Sampler(SamplingParams(temperature=0), constraint=greedy)(logits, [], []) == best_even
    assert greedy.taken == [best_even]
    sampled = EvenTokens()
    sampler = Sampler(SamplingParams(temperature=1.5, seed=0), constraint=sampled)
    tokens = [sampler(logits, [], []) for _ in range(200)]
    assert all(t % 2 == 0 for t in tokens) and len(set(tokens)) > 20 and sampled.taken == tokens
    narrow = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=0), constraint=EvenTokens())
    assert narrow(logits.clone(), [], []) == best_even  # every draw refused: the most likely allowed token


def test_json_mode_cannot_ignore_the_end():
    with pytest.raises(LocalpdError, match="end-of-sequence"):
        SamplingParams(json_object=True, ignore_eos=True).validate()


def test_a_constraint_dead_end_ends_the_reply():
    """No token allowed (which JSON mode should never reach): the reply ends with its end-of-sequence token rather
    than failing the engine step that also carries other requests."""

    class Nothing(EvenTokens):
        eos_ids = {7, 3}

        def allows(self, token):
            return False

    assert Sampler(SamplingParams(temperature=0.8, seed=1), constraint=Nothing())(torch.randn(50), [], []) == 3


def test_logit_bias_shifts_the_named_tokens_before_sampling():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    best = int(logits.argmax())
    banned = Sampler(SamplingParams(temperature=0, logit_bias={best: -100}))
    assert banned(logits.clone(), [], []) == int(logits.topk(2).indices[1])
    forced = Sampler(SamplingParams(temperature=1.0, seed=0, logit_bias={7: 100}))
    assert {forced(logits.clone(), [], []) for _ in range(20)} == {7}
    with pytest.raises(LocalpdError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101}).validate()


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-12])
def test_a_tiny_temperature_is_greedy_not_an_error(temperature):
    """Found by the server fuzz: logits / 1e-300 overflowed to inf - inf in the softmax."""
    logits = torch.randn(500, generator=torch.Generator().manual_seed(3))
    for seed in range(3):
        assert Sampler(SamplingParams(temperature=temperature, seed=seed))(logits, [], []) == int(logits.argmax())
