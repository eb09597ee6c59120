"""Acceptance as pure tensor functions: greedy table cases, and rejection sampling whose output
follows the target distribution (and a planted wrong rule that does not)."""

from __future__ import annotations

import torch

from batchspec import SamplingParams
from batchspec.acceptance import greedy_accept, rejection_sample
from batchspec.sampling import probabilities, sample


def logits_with_argmax(argmax: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """[B, k+1, V] logits whose argmax at each position is given."""
    out = torch.randn(len(argmax), len(argmax[0]), vocab, generator=torch.Generator().manual_seed(0))
    for b, row in enumerate(argmax):
        for i, t in enumerate(row):
            out[b, i, t] = 10.0
    return out


def test_greedy_table_cases():
    target = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [0, 6, 7], [9, 9, 9]])
    out = greedy_accept(drafts, logits_with_argmax(target))
    assert out.num_accepted.tolist() == [3, 1, 0, 3]  # all + bonus, mixed, first rejected, all
    assert out.rows() == [[1, 2, 3, 4], [1, 2], [5], [9, 9, 9, 9]]


def test_greedy_limit_caps_acceptance():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3]])
    out = greedy_accept(drafts, logits_with_argmax([[1, 2, 3, 4]] * 2), limit=torch.tensor([1, 3]))
    assert out.rows() == [[1, 2], [1, 2, 3, 4]]


def test_k_zero_is_plain_decoding():
    out = greedy_accept(torch.zeros(2, 0, dtype=torch.long), logits_with_argmax([[4], [7]]))
    assert out.rows() == [[4], [7]]


def _first_token_histogram(p, q, trials, k=1, rule=rejection_sample, seed=0):
    """Empirical distribution of the first output token over `trials` independent rows."""
    gen = torch.Generator().manual_seed(seed)
    vocab = p.shape[-1]
    draft_probs = q.expand(trials, k, vocab)
    target_probs = p.expand(trials, k + 1, vocab)
    drafts = torch.stack(
        [sample(draft_probs[:, i], torch.rand(trials, generator=gen, dtype=torch.float64)) for i in range(k)], 1
    )
    u_accept = torch.rand(trials, k, generator=gen, dtype=torch.float64)
    u_final = torch.rand(trials, generator=gen, dtype=torch.float64)
    out = rule(drafts, draft_probs, target_probs, u_accept, u_final)
    return torch.bincount(out.tokens[torch.arange(trials), 0], minlength=vocab).double() / trials


def _chi2(observed_freq, expected, trials):
    mask = expected > 0
    return float((((observed_freq - expected) ** 2 / expected)[mask]).sum() * trials)


def chi2_critical(df: int, z: float = 4.75) -> float:
    """Upper critical value of chi-square at about 1e-6 significance (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _wrong_rule(drafts, draft_probs, target_probs, u_accept, u_final):
    """Planted bug: accept with probability `target` instead of min(1, target / draft)."""
    k = drafts.shape[1]
    p = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1).double()
    keep = (u_accept < p).long().cumprod(-1).sum(-1)
    always = torch.zeros_like(u_accept)  # pass every draft the real test, then cap at the wrong count
    return rejection_sample(drafts, draft_probs, target_probs, always, u_final, limit=keep)


def test_rejection_sampling_matches_the_target_distribution():
    gen = torch.Generator().manual_seed(1)
    trials = 40_000
    for vocab in (8, 32):
        dirichlet = torch.distributions.Dirichlet(torch.full((vocab,), 0.5))
        with torch.random.fork_rng():
            torch.manual_seed(vocab)
            p, q = dirichlet.sample().float(), dirichlet.sample().float()
        critical = chi2_critical(int((p > 0).sum()) - 1)
        for k in (1, 3):
            seed = int(torch.randint(10**6, (1,), generator=gen))
            freq = _first_token_histogram(p, q, trials, k=k, seed=seed)
            tv = 0.5 * (freq - p.double()).abs().sum().item()
            assert tv < 0.02, f"V={vocab} k={k}: total variation {tv:.4f} from the target"
            assert _chi2(freq, p.double(), trials) < critical, f"V={vocab} k={k}: not the target distribution"
            wrong = _first_token_histogram(p, q, trials, k=k, rule=_wrong_rule, seed=seed)
            assert _chi2(wrong, p.double(), trials) > critical, "the test must fail a wrong acceptance rule"


def test_zero_draft_probability_and_empty_residual():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    q = torch.tensor([[[0.0, 0.0, 1.0]]])  # draft token 2 has target prob 0: always rejected
    out = rejection_sample(torch.tensor([[2]]), q, p, torch.tensor([[0.0]]), torch.tensor([0.7]))
    assert out.num_accepted.item() == 0 and out.tokens[0, 0].item() in (0, 1)
    q_over = p[:, :1] * 1.01  # slightly unnormalised (rounding): the residual is empty everywhere
    out = rejection_sample(torch.tensor([[1]]), q_over, p, torch.tensor([[0.999]]), torch.tensor([0.3]))
    assert out.num_accepted.item() == 0 and p[0, 0, out.tokens[0, 0]].item() > 0
    out = rejection_sample(
        torch.tensor([[1]]), torch.tensor([[[0.5, 0.0, 0.5]]]), p, torch.tensor([[0.1]]), torch.tensor([0.3])
    )
    assert out.num_accepted.item() == 1  # draft prob 0 but target prob 0.5 > 0: accepted, no division


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


def test_inverse_cdf_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 5)
    u = torch.tensor([0.0, 0.25, 0.5, 0.75, 1 - 2**-53], dtype=torch.float64)
    assert sample(probs, u).tolist() == [1, 1, 3, 3, 3]
