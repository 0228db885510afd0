"""Exact references for the statistical tests of speculative sampling, and small probes (shared by the test suite).

``exact_marginals``: the distributions of the 1st..depth-th emitted token under plain sampling,
computed exactly by enumerating prefixes (those below ``prune`` are dropped and their mass
returned); ``emitted_histograms``: the empirical side, over seeded runs of a decoder; ``tv``: total
variation distance; ``null_tv_quantile``: how far the empirical histogram
of n samples from the exact distribution itself lands (its q-quantile over many trials), the
threshold a correct sampler stays under (arXiv 2211.17192's claim, checked).
"""

from __future__ import annotations

import torch

from specctl.runtime.rejection import logits_to_probs
from specctl.runtime.runner import TargetRunner


def exact_marginals(model, prompt: list[int], temperature: float, depth: int, prune: float = 1e-6):
    """(list of [V] marginals of emitted tokens 1..depth, mass left out by pruning)."""
    prefixes = [((), 1.0)]
    marginals, dropped = [], 0.0
    for _ in range(depth):
        marginal = torch.zeros(model.args.vocab_size, dtype=torch.float64)
        nxt = []
        for i in range(0, len(prefixes), 256):
            chunk = prefixes[i:i + 256]
            rows = torch.tensor([prompt + list(p) for p, _ in chunk])
            runner = TargetRunner(model, rows.shape[1], batch=len(chunk))
            probs = logits_to_probs(runner.forward(rows, logits="last")[:, 0], temperature).double()
            joint = torch.tensor([m for _, m in chunk], dtype=torch.float64)[:, None] * probs  # [rows, V]
            marginal += joint.sum(0)
            for r, (p, _) in enumerate(chunk):
                nxt += [(p + (t,), float(joint[r, t])) for t in (joint[r] >= prune).nonzero().flatten().tolist()]
                dropped += float(joint[r][joint[r] < prune].sum())
        marginals.append(marginal)
        prefixes = nxt
    return marginals, dropped


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def null_tv_quantile(exact: torch.Tensor, n: int, q: float = 0.999, trials: int = 2000) -> float:
    """The q-quantile of TV(empirical of n exact samples, exact): how far a correct sampler may land."""
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(exact.float().expand(trials, -1), n, replacement=True, generator=g)
    hist = torch.zeros(trials, exact.numel()).scatter_add_(1, draws, torch.ones(draws.shape)) / n
    return float(torch.quantile(0.5 * (hist - exact.float()).abs().sum(1), q))


def emitted_histograms(decoder, prompt: list[int], params, n: int, vocab: int):
    """(histogram of the 2nd emitted token [V], of the 3rd [V], draft tokens, accepted tokens) over n
    runs of ``decoder`` (a SpecDecoder) on ``prompt``, run i seeded with i."""
    seconds, thirds = torch.zeros(vocab), torch.zeros(vocab)
    drafted = accepted = 0
    for i in range(n):
        res = decoder.generate(prompt, params, torch.Generator().manual_seed(i))
        seconds[res.token_ids[1]] += 1
        thirds[res.token_ids[2]] += 1
        drafted += res.stats.num_draft_tokens
        accepted += res.stats.num_accepted_tokens
    return seconds / n, thirds / n, drafted, accepted


def record_draft_sizes(proposer) -> list[int]:
    """Wrap ``proposer.propose`` so that every draft's node count is appended to the returned list (in
    place: clearing it starts again)."""
    sizes: list[int] = []
    propose = proposer.propose

    def spy(requests, ks):
        out = propose(requests, ks)
        sizes.extend(len(d) for d in out.drafts)
        return out

    proposer.propose = spy
    return sizes
