"""NgramProposer: prompt-lookup drafting with vLLM's KMP-over-the-reversed-sequence algorithm.

Deterministic (no draft probabilities). The numba kernel in ``specctl/kernels/ngram.py`` does the work for
every request of the batch in one call; this class only holds the config and the output buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from specctl.config import SpecConfig
from specctl.kernels.ngram import ngram_propose_batch
from specctl.runtime.proposers.base import DraftOutput, Proposer


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, config: SpecConfig, *, target=None, max_model_len: int):
        self.min_n = int(config.prompt_lookup_min)
        self.max_n = int(config.prompt_lookup_max)
        self.max_model_len = int(config.max_model_len or max_model_len)

    def propose(self, token_ids, num_tokens, k, hidden_states=None, slots=None) -> DraftOutput:
        batch = token_ids.shape[0]
        draft = np.empty((batch, k), dtype=np.int32)
        num = np.empty(batch, dtype=np.int32)
        ngram_propose_batch(token_ids, num_tokens, self.min_n, self.max_n, k, self.max_model_len, draft, num)
        return DraftOutput(torch.from_numpy(draft).long(), torch.from_numpy(num).long(), None)


PROPOSERS = {"ngram": NgramProposer}
