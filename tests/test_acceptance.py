"""Acceptance as pure tensor functions (table cases), and Gumbel-max picking, whose picks follow
the distribution over seeds and over positions (and a wrong distribution fails the test)."""

from __future__ import annotations

import torch

from batchspec import SamplingParams
from batchspec.core.acceptance import accept
from batchspec.core.sampling import choose, gumbel, probabilities


def logits_with_argmax(argmax: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """[B, k+1, V] logits whose argmax at each position is given."""
    out = torch.randn(len(argmax), len(argmax[0]), vocab, generator=torch.Generator().manual_seed(0))
    for b, row in enumerate(argmax):
        for i, t in enumerate(row):
            out[b, i, t] = 10.0
    return out


def test_table_cases():
    target = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [0, 6, 7], [9, 9, 9]])
    out = accept(drafts, logits_with_argmax(target).argmax(-1))
    assert out.num_accepted.tolist() == [3, 1, 0, 3]  # all + bonus, mixed, first rejected, all
    assert out.rows() == [[1, 2, 3, 4], [1, 2], [5], [9, 9, 9, 9]]


def test_limit_caps_acceptance():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3]])
    out = accept(drafts, torch.tensor([[1, 2, 3, 4]] * 2), limit=torch.tensor([1, 3]))
    assert out.rows() == [[1, 2], [1, 2, 3, 4]]


def test_k_zero_is_plain_decoding():
    out = accept(torch.zeros(2, 0, dtype=torch.long), torch.tensor([[4], [7]]))
    assert out.rows() == [[4], [7]]


def _chi2(observed_freq, expected, trials):
    mask = expected > 0
    return float((((observed_freq - expected) ** 2 / expected)[mask]).sum() * trials)


def chi2_critical(df: int, z: float = 4.75) -> float:
    """Upper critical value of chi-square at about 1e-6 significance (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _picks(p: torch.Tensor, seeds, position: int) -> torch.Tensor:
    noise = torch.stack([gumbel(s, position, p.shape[-1]) for s in seeds])
    return choose(p.expand(len(seeds), -1), noise)


def test_gumbel_max_picks_follow_the_distribution():
    trials = 20_000
    for vocab in (8, 32):
        with torch.random.fork_rng():
            torch.manual_seed(vocab)
            p = torch.distributions.Dirichlet(torch.full((vocab,), 0.5)).sample()
        p[0] = 0.0  # a zero-probability token is never picked
        p = p / p.sum()
        critical = chi2_critical(int((p > 0).sum()) - 1)
        for position in (0, 7):  # over seeds at a fixed position, and across positions below
            freq = torch.bincount(_picks(p, range(trials), position), minlength=vocab).double() / trials
            assert freq[0] == 0
            assert _chi2(freq, p.double(), trials) < critical, f"V={vocab}: not the distribution"
        across = torch.stack([choose(p, gumbel(3, t, vocab)) for t in range(trials)])
        freq = torch.bincount(across, minlength=vocab).double() / trials
        assert _chi2(freq, p.double(), trials) < critical, "positions of one seed are not independent draws"
        skewed = torch.bincount(_picks(p.sqrt() / p.sqrt().sum(), range(trials), 0), minlength=vocab).double() / trials
        assert _chi2(skewed, p.double(), trials) > critical, "the test must fail a wrong distribution"


def test_noise_is_a_function_of_seed_and_position():
    assert torch.equal(gumbel(5, 11, 50), gumbel(5, 11, 50))
    assert not torch.equal(gumbel(5, 11, 50), gumbel(5, 12, 50))
    assert not torch.equal(gumbel(5, 11, 50), gumbel(6, 11, 50))
    one_hot = torch.tensor([[0.0, 1.0, 0.0]])
    assert choose(one_hot, gumbel(1, 0, 3)[None]).item() == 1  # a greedy row: the argmax, any noise


def test_processed_distributions():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).to(torch.bfloat16)
    logits[0, 4] = float("-inf")
    for params in (
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.8),
    ):
        probs = probabilities(logits, params)
        assert not probs.isnan().any() and torch.allclose(probs.sum(-1), torch.tensor(1.0))
    assert (probabilities(logits, SamplingParams(temperature=1.0, top_k=2))[0, 2:] == 0).all()
    top_p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))[0]
    assert top_p[0] > 0 and top_p[1] > 0 and (top_p[2:] == 0).all()  # 0.67 < 0.8 <= 0.67 + 0.24
    tiny_p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.01))[0]
    assert tiny_p.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]  # the top token is always kept
