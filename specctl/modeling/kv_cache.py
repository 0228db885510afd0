"""The preallocated KV cache (``KVCache``), with the attention weights sparse-attention drafting ranks
positions by (``scores``; which positions they cover: ``scored_upto``).

What it does not know: who writes it (the transformer's blocks), its length (the runner's).
"""

from __future__ import annotations

import torch

from specctl.modeling.args import ModelArgs


class KVCache:
    """Preallocated keys and values: k, v [num_layers, B, n_kv, max_len, head_dim].

    The cache itself holds no length: the runner owns it, and rolling back is setting it.

    ``scores`` (None until a forward asks for them: ``scores=True``, which the decoder passes where its
    proposer ranks by attention) [num_layers, 2, n_kv, max_len] fp32: after each verify block or prompt
    written to this cache by such a forward (not after one-row decode steps), the attention
    weights its first and last query rows gave every key, each summed over the query heads of a kv head
    (what sparse-attention drafting ranks positions by, Vegas; ``ranking()`` sums them). On the fused
    CPU path the attention kernel writes them as it goes; elsewhere ``attention_scores`` recomputes
    them. ``scored``: the positions the ranking covers (see ``scored_upto``). It never changes what the
    forward computes.
    """

    def __init__(self, a: ModelArgs, batch: int, max_len: int, dtype, device):
        shape = (a.num_layers, batch, a.num_kv_heads, max_len, a.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.scores: torch.Tensor | None = None
        self.scored = 0

    def ranking(self, n: int) -> torch.Tensor:
        """[num_layers, n]: the recorded weights of positions < n, summed over rows and heads."""
        return self.scores[:, :, :, :n].sum(dim=(1, 2))

    @staticmethod
    def records(T: int, prompt: bool) -> bool:
        """Whether a forward of T rows that asks for scores records them: verify blocks and prompts, not
        one-row decode steps."""
        return T > 1 or prompt

    def scoring(self, start: int, T: int, prompt: bool) -> bool:
        """For a forward that asks for scores: ``records``, and if so, the buffer made (the first time)
        and the first row's weights cleared past where it sees (the forward at ``start`` writes the rest)."""
        if not self.records(T, prompt):
            return False
        if self.scores is None:
            L, _, nkv = self.k.shape[:3]
            self.scores = torch.zeros(L, 2, nkv, self.max_len, dtype=torch.float32, device=self.k.device)
        self.scores[:, 0, :, start + 1:start + T] = 0
        return True


def scored_upto(start: int, T: int, prompt: bool) -> int:
    """The positions a scoring forward of T rows at ``start`` ranks: for a verify block (the last
    emitted token and its drafts), those before and at its first row, the committed context (its
    drafts, once accepted, are recent positions); for a prompt (chunk), all of them."""
    return start + T if prompt else start + 1
