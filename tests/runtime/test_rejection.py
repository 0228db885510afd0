"""The verifier on hand-made tensors: greedy_verify, rejection_sample, logits_to_probs.

Terms as in specctl.runtime.rejection (arXiv 2211.17192): p = target, q = draft; accepted /
recovered / bonus tokens. The statistical tests follow vLLM's tests/v1/sample/test_rejection_sampler.py:
whatever q is, every emitted token must be distributed as p, and the empirical distribution must
converge to p as the number of samples grows.
"""

from __future__ import annotations

import pytest
import torch

from specctl.runtime.rejection import PAD, greedy_verify, logits_to_probs, rejection_sample


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def one_hot_probs(ids, V: int) -> torch.Tensor:
    """ids [B, n] -> one-hot probabilities [B, n, V]."""
    return torch.nn.functional.one_hot(t(ids), V).float()


# --------------------------------------------------------------------------- greedy_verify


def test_greedy_all_accepted_plus_bonus():
    out, n = greedy_verify(t([[3, 1, 4]]), t([3]), t([[3, 1, 4, 7]]))
    assert out.tolist() == [[3, 1, 4, 7]] and n.tolist() == [4]


def test_greedy_early_mismatch_emits_recovered_token():
    # the module docstring's example: draft [a, b, c], argmax [a, b, d, e] -> [a, b, d], 3 emitted
    out, n = greedy_verify(t([[3, 1, 4]]), t([3]), t([[3, 1, 5, 9]]))
    assert out.tolist() == [[3, 1, 5, PAD]] and n.tolist() == [3]


def test_greedy_first_token_mismatch():
    out, n = greedy_verify(t([[3, 1, 4]]), t([3]), t([[2, 1, 4, 9]]))
    assert out.tolist() == [[2, PAD, PAD, PAD]] and n.tolist() == [1]


def test_greedy_later_match_after_mismatch_is_not_accepted():
    out, n = greedy_verify(t([[3, 1, 4]]), t([3]), t([[3, 0, 4, 9]]))
    assert out.tolist() == [[3, 0, PAD, PAD]] and n.tolist() == [2]


def test_greedy_empty_draft():
    out, n = greedy_verify(torch.empty((2, 0), dtype=torch.long), t([0, 0]), t([[6], [8]]))
    assert out.tolist() == [[6], [8]] and n.tolist() == [1, 1]


def test_greedy_batch_with_padding():
    draft = t([[3, 1, 4], [5, PAD, PAD], [PAD, PAD, PAD], [2, 2, PAD], [9, 9, 9]])
    num = t([3, 1, 0, 2, 3])
    argmax = t([
        [3, 1, 4, 7],  # all accepted + bonus
        [5, 6, 0, 0],  # 1 draft accepted, bonus from position 1 (not position k)
        [8, 0, 0, 0],  # no draft: one token from position 0
        [2, 3, 2, 0],  # mismatch at 1: recovered 3
        [1, 9, 9, 9],  # mismatch at 0
    ])
    out, n = greedy_verify(draft, num, argmax)
    assert n.tolist() == [4, 2, 1, 2, 1]
    assert out.tolist() == [
        [3, 1, 4, 7],
        [5, 6, PAD, PAD],
        [8, PAD, PAD, PAD],
        [2, 3, PAD, PAD],
        [1, PAD, PAD, PAD],
    ]


def test_greedy_padding_never_matches_even_if_argmax_equals_pad_slot():
    # entries past num_draft_tokens are never accepted, whatever they hold and whatever the target says
    out, n = greedy_verify(t([[4, 0, 0]]), t([1]), t([[4, 0, 0, 0]]))
    assert n.tolist() == [2] and out.tolist() == [[4, 0, PAD, PAD]]


# --------------------------------------------------------------------------- rejection_sample: units


@pytest.mark.parametrize("with_q", [False, True])
def test_target_equal_to_draft_accepts_all(with_q):
    V, draft = 10, [[3, 1, 4], [7, 7, 2]]
    target = one_hot_probs([[3, 1, 4, 9], [7, 7, 2, 0]], V)
    q = torch.softmax(torch.randn(2, 3, V, generator=torch.Generator().manual_seed(0)), -1) if with_q else None
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        out, n = rejection_sample(t(draft), t([3, 3]), q, target, g)
        assert n.tolist() == [4, 4]
        assert out.tolist() == [[3, 1, 4, 9], [7, 7, 2, 0]]


@pytest.mark.parametrize("with_q", [False, True])
def test_zero_target_mass_on_draft_rejects_at_position_0(with_q):
    V, B, k = 6, 500, 3
    g = torch.Generator().manual_seed(1)
    draft = torch.randint(0, V, (B, k), generator=g)
    p = torch.rand(B, k + 1, V, generator=g)
    p[:, 0].scatter_(1, draft[:, :1], 0.0)  # p(x_0) = 0
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1) if with_q else None
    out, n = rejection_sample(draft, torch.full((B,), k), q, p, g)
    assert (n == 1).all()
    assert (out[:, 0] != draft[:, 0]).all()  # the recovered token is never the rejected draft
    assert (out[:, 1:] == PAD).all()
    assert (p[torch.arange(B), 0, out[:, 0]] > 0).all()  # and it has target mass


def test_recovered_token_follows_the_residual():
    """One row, p = [.5, .5, 0], q = [1, 0, 0] at x = 0: reject w.p. 1/2; recovered must be token 1."""
    B = 4000
    p = torch.tensor([0.5, 0.5, 0.0]).expand(B, 2, 3).contiguous()
    q = torch.tensor([1.0, 0.0, 0.0]).expand(B, 1, 3).contiguous()
    draft = torch.zeros(B, 1, dtype=torch.long)
    out, n = rejection_sample(draft, torch.ones(B, dtype=torch.long), q, p, torch.Generator().manual_seed(2))
    rejected = n == 1
    assert (out[rejected, 0] == 1).all()
    assert 0.45 < rejected.float().mean() < 0.55


def test_rejection_sample_padding_rows_use_their_own_bonus_position():
    V = 10
    draft = t([[3, 1, 4], [5, PAD, PAD], [PAD, PAD, PAD]])
    target = one_hot_probs([[3, 1, 4, 9], [5, 6, 0, 0], [8, 0, 0, 0]], V)
    out, n = rejection_sample(draft, t([3, 1, 0]), None, target, torch.Generator().manual_seed(3))
    assert n.tolist() == [4, 2, 1]
    assert out.tolist() == [[3, 1, 4, 9], [5, 6, PAD, PAD], [8, PAD, PAD, PAD]]


def test_rejection_sample_empty_draft_samples_from_p():
    V, B = 5, 20000
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    out, n = rejection_sample(torch.empty((B, 0), dtype=torch.long), torch.zeros(B, dtype=torch.long), None,
                              p.expand(B, 1, V).contiguous(), torch.Generator().manual_seed(4))
    assert out.shape == (B, 1) and (n == 1).all()
    assert _tv(_hist(out[:, 0], V), p) < 0.02


def test_one_hot_draft_probs_equal_deterministic_drafts():
    """probs=None means q is one-hot at the draft token: the same generator gives the same output."""
    V, B, k = 8, 300, 4
    g = torch.Generator().manual_seed(5)
    draft = torch.randint(0, V, (B, k), generator=g)
    num = torch.randint(0, k + 1, (B,), generator=g)
    draft = torch.where(torch.arange(k)[None] < num[:, None], draft, PAD)
    p = torch.softmax(2 * torch.randn(B, k + 1, V, generator=g), -1)
    q = torch.nn.functional.one_hot(draft.clamp(min=0), V).float()
    a = rejection_sample(draft, num, None, p, torch.Generator().manual_seed(9))
    b = rejection_sample(draft, num, q, p, torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_rejection_sample_seeded_determinism():
    V, B, k = 8, 64, 3
    g = torch.Generator().manual_seed(6)
    draft = torch.randint(0, V, (B, k), generator=g)
    p = torch.softmax(torch.randn(B, k + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1)
    num = torch.full((B,), k)

    def run(seed):
        return rejection_sample(draft, num, q, p, torch.Generator().manual_seed(seed))

    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_output_structure_invariants():
    """Accepted tokens equal the drafts, then exactly one sampled token, then padding."""
    V, B, k = 6, 2000, 4
    g = torch.Generator().manual_seed(10)
    draft = torch.randint(0, V, (B, k), generator=g)
    num = torch.randint(0, k + 1, (B,), generator=g)
    draft = torch.where(torch.arange(k)[None] < num[:, None], draft, PAD)
    p = torch.softmax(torch.randn(B, k + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1)
    out, n = rejection_sample(draft, num, q, p, g)
    assert ((n >= 1) & (n <= num + 1)).all()
    pos = torch.arange(k + 1)[None]
    assert (out[pos >= n[:, None]] == PAD).all()
    assert (out[pos < n[:, None]] >= 0).all()
    acc = pos[:, :k] < (n - 1)[:, None]
    assert torch.equal(out[:, :k][acc], draft[acc])
    assert (n > 1).any() and (n == 1).any() and (n == num + 1).any()


# --------------------------------------------------------------------------- rejection_sample: statistics


def _hist(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(tokens.flatten(), minlength=V).float() / tokens.numel()


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def _emitted_distributions(p, q, N, k, seed, deterministic):
    """N rows at once; p [V] the target at every position, q [V] the draft at every position.

    Returns (first emitted token histogram, histogram of all emitted tokens, of the 2nd emitted one).
    """
    V = p.shape[0]
    g = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(q.expand(N, V), k, replacement=True, generator=g)  # [N, k] x ~ q
    target = p.expand(N, k + 1, V).contiguous()
    draft_probs = None if deterministic else q.expand(N, k, V).contiguous()
    out, n = rejection_sample(draft, torch.full((N,), k), draft_probs, target, g)
    emitted = out[out != PAD]
    second = out[n >= 2, 1]
    return _hist(out[:, 0], V), _hist(emitted, V), _hist(second, V)


@pytest.mark.parametrize("deterministic", [False, True], ids=["q-probs", "q-one-hot"])
def test_emitted_tokens_are_distributed_as_p(deterministic):
    V, k = 8, 3
    g = torch.Generator().manual_seed(11)
    p = torch.softmax(1.5 * torch.randn(V, generator=g), -1)
    q = torch.softmax(1.5 * torch.randn(V, generator=g), -1)
    assert _tv(p, q) > 0.2  # a sampler that just kept the drafts would be far from p

    dists = {}
    for N in (1_000, 10_000, 200_000):
        first, every, second = _emitted_distributions(p, q, N, k, seed=N, deterministic=deterministic)
        dists[N] = (_tv(first, p), _tv(every, p), _tv(second, p))
    # convergence: more samples -> closer to p, and close at the largest N
    assert dists[1_000][0] > dists[10_000][0] > dists[200_000][0]
    assert dists[1_000][1] > dists[200_000][1]
    first_tv, every_tv, second_tv = dists[200_000]
    assert first_tv < 0.01 and every_tv < 0.01 and second_tv < 0.015, dists


def test_statistical_check_catches_a_wrong_recovered_distribution():
    """Sanity check of the check itself: recovering from p instead of norm(max(p - q, 0)) is biased."""
    V, N = 8, 200_000
    g = torch.Generator().manual_seed(12)
    p = torch.softmax(1.5 * torch.randn(V, generator=g), -1)
    q = torch.softmax(1.5 * torch.randn(V, generator=g), -1)
    x = torch.multinomial(q.expand(N, V), 1, replacement=True, generator=g)[:, 0]
    accept = torch.rand(N, generator=g) * q[x] < p[x]
    wrong = torch.where(accept, x, torch.multinomial(p.expand(N, V), 1, generator=g)[:, 0])
    assert _tv(_hist(wrong, V), p) > 0.03  # well above the 0.01 threshold used above


# --------------------------------------------------------------------------- logits_to_probs


def test_logits_to_probs_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    torch.testing.assert_close(logits_to_probs(logits, 1.0), torch.softmax(logits, -1))
    torch.testing.assert_close(logits_to_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))
    hot = logits_to_probs(logits, 0.01)
    assert hot[0, 0] > 0.999
    assert logits_to_probs(logits.half(), 1.0).dtype == torch.float32


def test_logits_to_probs_top_k():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0], [1.0, 0.0, 4.0, 3.0, 2.0]])
    probs = logits_to_probs(logits, 1.0, top_k=2)
    assert (probs > 0).sum(-1).tolist() == [2, 2]
    assert probs[0].nonzero().flatten().tolist() == [1, 3] and probs[1].nonzero().flatten().tolist() == [2, 3]
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    torch.testing.assert_close(probs[0, [1, 3]], torch.softmax(torch.tensor([3.0, 2.0]), -1))
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_k=5), torch.softmax(logits, -1))  # k >= V: no-op
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_k=0), torch.softmax(logits, -1))


def test_logits_to_probs_top_p_keeps_smallest_prefix_reaching_p():
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = base.log()[[2, 0, 3, 1]][None]  # shuffled order: [0.15, 0.5, 0.05, 0.3]
    kept = {tp: (logits_to_probs(logits, 1.0, top_p=tp)[0] > 0).nonzero().flatten().tolist()
            for tp in (0.4, 0.7, 0.9, 0.99)}
    assert kept == {0.4: [1], 0.7: [1, 3], 0.9: [0, 1, 3], 0.99: [0, 1, 2, 3]}
    probs = logits_to_probs(logits, 1.0, top_p=0.7)[0]
    torch.testing.assert_close(probs[[1, 3]], torch.tensor([0.5, 0.3]) / 0.8)
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_p=1.0), torch.softmax(logits, -1))
    # the most likely token always survives, however small top_p is
    assert (logits_to_probs(logits, 1.0, top_p=1e-6)[0] > 0).nonzero().flatten().tolist() == [1]


def test_logits_to_probs_top_k_then_top_p_on_the_renormalised_distribution():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top-k 3 renormalises to [.444, .333, .222]; top-p .75 then keeps 2 (on the raw p it would keep 3)
    probs = logits_to_probs(logits, 1.0, top_k=3, top_p=0.75)
    assert (probs[0] > 0).nonzero().flatten().tolist() == [0, 1]


def test_logits_to_probs_batched_shapes():
    logits = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(13))
    probs = logits_to_probs(logits, 0.7, top_k=5, top_p=0.9)
    assert probs.shape == (2, 3, 16)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
    assert ((probs > 0).sum(-1) <= 5).all()


def test_per_row_generators_draw_what_each_row_draws_alone():
    """A batch verified in one call, each row with its request's generator, gives every row exactly what
    that row verified alone gives (the decoder verifies a batch's sampled drafts in one call)."""
    g = torch.Generator().manual_seed(0)
    B, k, V = 4, 5, 12
    nums = [5, 2, 0, 3]
    p = torch.softmax(torch.randn(B, k + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, k, V, generator=g), -1)
    draft = torch.randint(0, V, (B, k), generator=g)
    for b, n in enumerate(nums):
        draft[b, n:] = -1
        q[b, n:] = 0
    out, n_emit = rejection_sample(draft, torch.tensor(nums), q, p, [torch.Generator().manual_seed(10 + b) for b in range(B)])
    for b, n in enumerate(nums):
        alone, m = rejection_sample(draft[b:b + 1, :n], torch.tensor([n]), q[b:b + 1, :n], p[b:b + 1, :n + 1],
                                    torch.Generator().manual_seed(10 + b))
        assert int(n_emit[b]) == int(m[0]) and out[b, :int(m[0])].tolist() == alone[0, :int(m[0])].tolist(), b
