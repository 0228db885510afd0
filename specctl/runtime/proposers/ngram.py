"""NgramProposer: prompt-lookup drafting with vLLM's KMP-over-the-reversed-sequence algorithm.

Deterministic (no draft probabilities). The numba kernel in ``specctl/kernels/ngram.py`` does the work for
every request of the batch in one call; this class only holds the config and the output buffers.
"""

from __future__ import annotations

import numpy as np
from specctl.config import SpecConfig
from specctl.kernels.ngram import ngram_propose_batch
from specctl.runtime.proposers.base import Draft, DraftBatch, DraftRequest, Proposer


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, config: SpecConfig, *, target=None, max_model_len: int):
        self.min_n = int(config.prompt_lookup_min)
        self.max_n = int(config.prompt_lookup_max)
        self.max_model_len = int(config.max_model_len or max_model_len)

    def propose(self, requests: list[DraftRequest], ks: list[int]) -> DraftBatch:
        """Every request's lookup in one kernel call (each row to its own k)."""
        B, k = len(requests), max(ks, default=0)
        if k <= 0:
            return DraftBatch([Draft() for _ in requests])
        if B == 1:  # the request's own buffer, no copy
            ctx = requests[0].ctx[None]
        else:
            ctx = np.zeros((B, max(r.n for r in requests)), dtype=np.int32)
            for b, r in enumerate(requests):
                ctx[b, :r.n] = r.tokens
        draft = np.empty((B, k), dtype=np.int32)
        num = np.empty(B, dtype=np.int32)
        ngram_propose_batch(ctx, np.array([r.n for r in requests], dtype=np.int32), self.min_n, self.max_n, k,
                            self.max_model_len, draft, num)
        return DraftBatch([Draft(draft[b, :min(int(num[b]), kb)].tolist()) for b, kb in enumerate(ks)])


PROPOSERS = {"ngram": NgramProposer}
