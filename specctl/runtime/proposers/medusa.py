"""MedusaProposer: K light heads draft from the target's last hidden state (Cai et al., arXiv 2401.10774).

Chain drafting (what the decode loop verifies): the decoder hands over ``hidden`` [B, H], the
target's final-normed hidden state at the row that produced the last emitted token ``last``; head
k's top-1 is draft token k+1 after ``last`` (head 0 the token right after it). Greedy requests get
deterministic drafts (q one-hot); sampling requests draw draft k from q_k = the processed softmax
of head k's logits at the request's temperature/top-k/top-p, and q is returned with the draft, so
rejection sampling keeps the output distributed as the target's (the heads are conditionally
independent given ``hidden``, so q_k is exactly what draft k was drawn from). Verification is the
decode loop's, lossless; Medusa's "typical acceptance" (lossy) is not offered.

Tree drafting (Medusa's tree attention): pure functions below build the tree from "choices" (paths
of top-i ranks per head), its attention mask and depths, and verify it greedily. The decode loop
and the runner verify chains only, so ``tree_generate`` runs a greedy tree decode of its own: it
feeds the tree through ``tree_forward`` (the runtime's Transformer with per-token positions and the
tree mask over the runner's cache) and compacts the accepted path's keys/values in the cache. It is
an opt-in function; nothing else calls it. Worked tree, choices [(0,), (1,), (0, 0)]:

    node 0 = root (``last``), node 1 = head 0 top-1, node 2 = head 0 top-2, node 3 = head 1 top-1 after node 1
    parents [-1, 0, 0, 1], depths [0, 1, 1, 2], mask rows (who each node sees, root..3):
        0: 1 0 0 0      1: 1 1 0 0      2: 1 0 1 0      3: 1 1 0 1

What it does not know: training (``specctl.training.medusa``), file layouts (``specctl.training.export``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specctl.config import SpecConfig
from specctl.errors import ConfigError, ModelError
from specctl.runtime.proposers.base import DraftOutput, Proposer
from specctl.runtime.proposers.base import DraftSampling as _Sampling
from specctl.runtime.rejection import logits_to_probs

# A 10-node tree for 3 heads (Medusa's sparse trees put the widest fan-out on the first head).
DEFAULT_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0))




class MedusaProposer(Proposer):
    method = "medusa"
    needs_hidden_states = True

    def __init__(self, config: SpecConfig, *, target=None, max_model_len: int, heads=None):
        """``config.model``: the heads folder (vLLM or FasterDecoding layout); ``heads`` overrides it."""
        from specctl.training.export import load_medusa

        if config.vllm_only.get("speculative_token_tree") is not None:
            raise ConfigError("medusa tree verification is not in the decode loop yet",
                              "drop speculative_token_tree (chain drafting), or call "
                              "specctl.runtime.proposers.medusa.tree_generate for greedy tree decoding")
        if heads is None:
            heads = load_medusa(Path(str(config.model)).expanduser())
        dtype = target.dtype if target is not None else next(heads.parameters()).dtype
        device = target.device if target is not None else torch.device("cpu")
        if target is not None:
            a = target.model.args
            if heads.hidden_size != a.hidden_size:
                raise ModelError(f"Medusa heads read hidden size {heads.hidden_size}, the target has {a.hidden_size}",
                                 "use heads trained for this target (specctl train-medusa --model TARGET)")
            if heads.vocab_size > a.vocab_size:
                raise ModelError(f"Medusa heads score {heads.vocab_size} tokens, the target has {a.vocab_size}",
                                 "use heads trained for this target")
        self.heads = heads.to(device=device, dtype=dtype).eval()
        self.vocab_size = target.model.args.vocab_size if target is not None else heads.vocab_size
        self.device, self.dtype = device, dtype
        self.k = min(int(config.num_speculative_tokens or heads.num_heads), heads.num_heads)
        self.max_model_len = int(config.max_model_len or max_model_len)
        self.stop_ids = set(target.stop_token_ids) if target is not None else set()
        self.linear = F.linear
        if device.type == "cpu" and dtype == torch.bfloat16:
            from kernels import skinny_linear  # bf16 GEMV for 1..16 rows: the heads' LM heads read fast

            self.linear = skinny_linear.linear
        self.temperature, self.top_k, self.top_p = 0.0, None, None  # default for slots never announced
        self.slots: dict[int, _Sampling] = {}
        self._buffers: dict[int, int] = {}  # id(decoder's token buffer) -> slot
        self._own_generator = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, ())))

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    # ------------------------------------------------------------------ request life
    def set_sampling(self, slot: int, params, generator: torch.Generator | None = None) -> None:
        self.slots[slot] = _Sampling(float(params.temperature), params.top_k, params.top_p, generator)

    def start_request(self, slot: int, prompt_ids: np.ndarray) -> None:
        buf = prompt_ids.base if isinstance(prompt_ids, np.ndarray) and prompt_ids.base is not None else None
        if buf is not None:
            self._buffers[id(buf)] = slot

    def end_request(self, slot: int) -> None:
        self._buffers = {b: s for b, s in self._buffers.items() if s != slot}

    def _sampling(self, token_ids: np.ndarray) -> _Sampling:
        slot = self._buffers.get(id(token_ids))
        if slot is None and len(self.slots) == 1:
            slot = next(iter(self.slots))
        return self.slots.get(slot) or _Sampling(self.temperature, self.top_k, self.top_p)

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """hidden [B, H] -> [B, n, V'] logits of the first n heads (LM-head rows; see heads.vocab_ids)."""
        return self.heads(hidden.to(self.device, self.dtype), n, self.linear)

    def propose(self, token_ids, num_tokens, k, hidden_states=None) -> DraftOutput:
        B = token_ids.shape[0]
        n = min(k, self.k)
        if hidden_states is None or n <= 0:
            return DraftOutput(torch.full((B, max(k, 0)), -1, dtype=torch.long), torch.zeros(B, dtype=torch.long))
        logits = self.head_logits(hidden_states, n)  # [B, n, V']
        sp = self._sampling(token_ids)
        probs = None
        if sp.temperature <= 0:
            ids = self.heads.vocab_ids(logits.argmax(-1))  # [B, n]
        else:
            q = logits_to_probs(logits, sp.temperature, sp.top_k, sp.top_p)  # [B, n, V']
            rows = torch.multinomial(q.reshape(B * n, -1), 1, generator=sp.generator or self._own_generator).view(B, n)
            ids = self.heads.vocab_ids(rows)
            probs = self._to_target_vocab(q)  # [B, n, V_target]
        ids = ids.long().cpu()
        num = torch.full((B,), n, dtype=torch.long)
        if self.stop_ids:  # nothing after a stop token can be accepted: cut the draft there
            for b in range(B):
                for i, t in enumerate(ids[b].tolist()):
                    if t in self.stop_ids:
                        num[b] = i + 1
                        break
        out = torch.full((B, k), -1, dtype=torch.long)
        out[:, :n] = ids
        pos = torch.arange(k)[None]
        out = torch.where(pos < num[:, None], out, torch.full_like(out, -1))
        if probs is not None and k > n:
            probs = torch.cat([probs, probs.new_zeros(B, k - n, probs.shape[-1])], 1)
        return DraftOutput(out, num, probs)

    def _to_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """q over LM-head rows [B, n, V'] -> over the target's vocabulary [B, n, V] (zeros elsewhere)."""
        B, n, _ = q.shape
        full = q.new_zeros(B, n, self.vocab_size)
        idx = self.heads.token_map if self.heads.token_map is not None else torch.arange(q.shape[-1], device=q.device)
        full[..., idx] = q
        return full


# --------------------------------------------------------------------------- tree drafting (pure functions)

def tree_from_choices(choices, num_heads: int | None = None) -> tuple[list[tuple[int, ...]], list[int], list[int]]:
    """Medusa choices (paths of top-i ranks, one rank per head) -> (paths, parents, depths) over nodes
    0..N, node 0 the root; paths sorted by (length, ranks). Every prefix of a path must be a path."""
    paths = sorted({tuple(c) for c in choices if num_heads is None or len(c) <= num_heads}, key=lambda p: (len(p), p))
    index = {(): 0}
    for i, p in enumerate(paths, 1):
        index[p] = i
    parents, depths = [-1], [0]
    for p in paths:
        if p[:-1] not in index:
            raise ConfigError(f"tree path {p} has no parent {p[:-1]}", "list every prefix of a path in the tree")
        parents.append(index[p[:-1]])
        depths.append(len(p))
    return [()] + paths, parents, depths


def tree_attention_mask(parents: list[int]) -> torch.Tensor:
    """[N+1, N+1] bool: node i attends to node j iff j is i or an ancestor of i (the root included)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def tree_tokens(head_logits: torch.Tensor, paths: list[tuple[int, ...]], heads) -> torch.Tensor:
    """head_logits [K, V'] (one request) -> [N] draft token of each non-root node: a node at depth d with
    rank r in its path takes head (d-1)'s r-th best token."""
    depth = max(len(p) for p in paths)
    width = max((max(p) for p in paths if p), default=0) + 1
    top = heads.vocab_ids(head_logits[:depth].topk(width, -1).indices)  # [depth, width]
    return torch.tensor([int(top[len(p) - 1, p[-1]]) for p in paths[1:]], dtype=torch.long)


def greedy_tree_verify(tokens: list[int], parents: list[int], target_argmax: list[int]) -> tuple[list[int], list[int]]:
    """tokens [N+1] (root first), target_argmax [N+1] (the target's choice after each node) ->
    (accepted path of node indices starting at the root, emitted tokens = accepted drafts + the next one).

    From the root, move to the child whose token is the target's choice there, while one exists.
    """
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(i)
    path = [0]
    while True:
        want = target_argmax[path[-1]]
        nxt = next((c for c in children.get(path[-1], []) if tokens[c] == want), None)
        if nxt is None:
            break
        path.append(nxt)
    return path, [tokens[i] for i in path[1:]] + [target_argmax[path[-1]]]


# --------------------------------------------------------------------------- greedy tree decoding (opt-in)

@torch.inference_mode()
def tree_forward(runner, tokens: torch.Tensor, depths: list[int], mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed a tree (tokens [1, N+1], root first) at cache slots [L, L+N] with positions L + depth, node
    i seeing the whole prefix and its tree ancestors. Returns (logits [1, N+1, V], hidden [1, N+1, H]).
    Same math as the runtime's Block.forward, with a mask and per-token positions (the runner's
    forward takes neither); advances runner.length by N+1."""
    from specctl.runtime.model import lin, rotate_half

    m = runner.model
    a = m.args
    start, T = runner.length, tokens.shape[1]
    if start + T > runner.max_len:
        raise ValueError("tree does not fit in the runner's cache")
    pos = start + torch.tensor(depths, dtype=torch.float32, device=runner.device)
    freqs = torch.outer(pos, m.inv_freq)
    emb = torch.cat((freqs, freqs), -1)  # [T, head_dim]
    x = m.embed(tokens.to(runner.device))  # [1, T, H]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    full = torch.ones(T, start + T, dtype=torch.bool, device=runner.device)  # [T, L+T]: the prefix, then the tree
    full[:, start:] = mask.to(runner.device)
    nq, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
    for i, blk in enumerate(m.layers):
        kc, vc = runner.cache.k[i], runner.cache.v[i]  # [1, n_kv, max_len, hd]
        q, k, v = lin(blk.input_norm(x), blk.qkv).split([nq * hd, nkv * hd, nkv * hd], -1)
        q = q.view(1, T, nq, hd).transpose(1, 2)
        k = k.view(1, T, nkv, hd).transpose(1, 2)
        v = v.view(1, T, nkv, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        kc[:, :, start:start + T] = k
        vc[:, :, start:start + T] = v
        att = F.scaled_dot_product_attention(q, kc[:, :, :start + T], vc[:, :, :start + T], attn_mask=full,
                                             enable_gqa=nkv != nq)  # [1, nq, T, hd]
        x = x + lin(att.transpose(1, 2).reshape(1, T, nq * hd), blk.o)
        gate, up = lin(blk.post_norm(x), blk.gate_up).chunk(2, -1)
        x = x + lin(F.silu(gate) * up, blk.down)
    h = m.norm(x)
    runner.length = start + T
    return F.linear(h, m.head_weight), h  # [1, T, V], [1, T, H]


def compact_path(runner, start: int, path: list[int]) -> None:
    """Move the accepted nodes' keys/values (slots start+path[j]) to slots start+j; length = start+len(path)."""
    src = torch.tensor([start + i for i in path], device=runner.device)
    dst = torch.arange(start, start + len(path), device=runner.device)
    for cache in (runner.cache.k, runner.cache.v):  # [layers, B, n_kv, max_len, hd]
        cache[:, :, :, dst] = cache[:, :, :, src].clone()
    runner.length = start + len(path)


@torch.inference_mode()
def tree_generate(runner, proposer: MedusaProposer, prompt_ids: list[int], max_new_tokens: int,
                  stop_token_ids=(), choices=DEFAULT_TREE):
    """Greedy decoding with Medusa tree drafts, verified losslessly (the output is the target's greedy
    output). Returns (token_ids, SpecStats with one observation per step: depth drafted, accepted)."""
    from specctl.runtime.metrics import SpecStats

    paths, parents, depths = tree_from_choices(choices, proposer.num_heads)
    mask = tree_attention_mask(parents)
    stats, stop = SpecStats(), set(stop_token_ids)
    runner.reset()
    logits = runner.forward(torch.tensor([prompt_ids]), logits="last")
    hidden = runner.last_hidden[:, -1]  # [1, H]
    out = [int(runner.greedy(logits)[0, -1])]
    while len(out) < max_new_tokens and out[-1] not in stop:
        drafts = tree_tokens(proposer.head_logits(hidden)[0], paths, proposer.heads)  # [N]
        tokens = torch.cat([torch.tensor([out[-1]]), drafts])[None]  # [1, N+1]
        start = runner.length
        lg, h = tree_forward(runner, tokens, depths, mask)
        runner.last_hidden = h  # runner.greedy re-scores bf16 near-ties in fp32 from these rows
        path, emitted = greedy_tree_verify(tokens[0].tolist(), parents, runner.greedy(lg)[0].tolist())
        compact_path(runner, start, path)
        hidden = h[:, path[-1]]
        stats.observe(max(depths), len(path) - 1)
        for t in emitted:
            if len(out) >= max_new_tokens:
                break
            out.append(int(t))
            if t in stop:
                break
    return out, stats


PROPOSERS = {"medusa": MedusaProposer}
