"""MedusaProposer: K light heads draft from the target's last hidden state (Cai et al., arXiv 2401.10774).

Chain drafting (what the decode loop verifies): the decoder hands over ``hidden`` [B, H], the
target's final-normed hidden state at the row that produced the last emitted token ``last``; head
k's top-1 is draft token k+1 after ``last`` (head 0 the token right after it). Greedy requests get
deterministic drafts (q one-hot); sampling requests draw draft k from q_k = the processed softmax
of head k's logits at the request's temperature/top-k/top-p, and q is returned with the draft, so
rejection sampling keeps the output distributed as the target's (the heads are conditionally
independent given ``hidden``, so q_k is exactly what draft k was drawn from). Verification is the
decode loop's, lossless; Medusa's "typical acceptance" (lossy) is not offered.

Tree drafting (Medusa's tree attention), with vLLM's ``speculative_token_tree`` key (or
"default", or "auto": the ``speculative_num_draft_tokens`` likeliest paths by the heads' held-out
rank accuracies, which ``specctl train-medusa`` records in the export; see ``auto_tree``): for greedy requests ``propose`` returns a tree (``Draft.parents``) built from the
"choices" (paths of top-i ranks per head) and cut to the draft length; SpecDecoder verifies it in one
forward with a tree mask (``TargetRunner.forward_tree``) and keeps the accepted path's keys/values
(``TargetRunner.compact``). Sampling requests get chains. Worked tree, choices [(0,), (1,), (0, 0)]:

    node 0 = root (``last``), node 1 = head 0 top-1, node 2 = head 0 top-2, node 3 = head 1 top-1 after node 1
    parents [-1, 0, 0, 1], depths [0, 1, 1, 2], mask rows (who each node sees, root..3):
        0: 1 0 0 0      1: 1 1 0 0      2: 1 0 1 0      3: 1 1 0 1

What it does not know: training (``specctl.training.medusa``), the heads and their file layouts (``specctl.drafts.medusa``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from specctl.config import SpecConfig
from specctl.errors import ConfigError, ModelError
from specctl.runtime.proposers.base import Draft, DraftBatch, DraftRequest, Proposer, unknown_slot
from specctl.runtime.proposers.base import DraftSampling as _Sampling
from specctl.runtime.rejection import logits_to_probs
from specctl.runtime.tree_budget import NodeCalibration, with_ancestors, worth

log = logging.getLogger(__name__)

# A 10-node tree for 3 heads (Medusa's sparse trees put the widest fan-out on the first head).
DEFAULT_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0))


def parse_token_tree(tree) -> list[tuple[int, ...]]:
    """vLLM's ``speculative_token_tree``: a string like "[(0,), (1,), (0, 0)]" (paths of top-i
    ranks, one per level), the same as a JSON list of lists, or "default" (DEFAULT_TREE)."""
    import ast

    fix = 'give paths of ranks, e.g. "[(0,), (1,), (0, 0)]", or "default"'
    if isinstance(tree, str):
        if tree.strip() == "default":
            return list(DEFAULT_TREE)
        try:
            tree = ast.literal_eval(tree)
        except (ValueError, SyntaxError):
            raise ConfigError(f"speculative_token_tree {tree!r} is not a list of paths", fix) from None
    if not isinstance(tree, (list, tuple)) or not tree or not all(
            isinstance(p, (list, tuple)) and p and all(isinstance(r, int) and r >= 0 for r in p) for p in tree):
        raise ConfigError(f"speculative_token_tree {tree!r} is not a non-empty list of paths of ranks >= 0", fix)
    return [tuple(p) for p in tree]




class MedusaProposer(Proposer):
    method = "medusa"
    needs_hidden_states = True

    def __init__(self, config: SpecConfig, *, target=None, max_model_len: int, heads=None):
        """``config.model``: the heads folder (vLLM or FasterDecoding layout); ``heads`` overrides it."""
        from specctl.drafts.medusa import load_medusa
        from specctl.models import resolve_draft

        if heads is None:
            heads = load_medusa(resolve_draft(config.model, what="Medusa heads", trainer="train-medusa"))
        given = config.given("num_speculative_tokens")
        self.k = min(int(given or heads.num_heads), heads.num_heads)  # unset: one token a head, as vLLM
        if given and given > heads.num_heads:
            log.warning("num_speculative_tokens (%d) > the %d Medusa heads: drafting %d tokens a step",
                        given, heads.num_heads, heads.num_heads)
        config.num_speculative_tokens = self.k  # what runs (a bench row's k)
        tree = config.vllm_only.get("speculative_token_tree")
        if isinstance(tree, str) and tree.strip() == "auto":
            acc = getattr(heads, "rank_accuracy", None)
            if not acc:
                raise ConfigError(f"speculative_token_tree \"auto\" needs the held-out rank accuracies of the heads in {config.model}",
                                  "use heads exported by `specctl train-medusa` (it records them), or give the "
                                  "tree's paths or \"default\"")
            tree = auto_tree(acc, int(config.speculative_num_draft_tokens or 16), self.k)
        # (paths, parents, depths) over nodes 0..N (node 0 = the last token), or None: chain drafts
        self.tree = None if tree is None else tree_from_choices(parse_token_tree(tree), heads.num_heads)
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
        self.max_model_len = int(config.max_model_len or max_model_len)
        self.stop_ids = set(target.stop_token_ids) if target is not None else set()
        # the target's kernel set: the skinny bf16 GEMV for 1..16 rows where it has it (the heads' LM heads read fast)
        self.linear = target.model.kernels.dense if target is not None else F.linear
        self.temperature, self.top_k, self.top_p = 0.0, None, None  # default for slots never announced
        self.slots: dict[int, _Sampling] = {}  # slot -> how its request samples
        self.calibration = NodeCalibration()  # P(a tree node is accepted) by its heads' probability
        self._trees: dict[int, tuple[list[int], list[int], list[float]]] = {}  # slot -> its last tree, until verified
        self._own_generator = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, ())))

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    # ------------------------------------------------------------------ request life
    def set_sampling(self, slot: int, params, generator: torch.Generator | None = None) -> None:
        self.slots[slot] = _Sampling(float(params.temperature), params.top_k, params.top_p, generator)

    def start_request(self, slot: int, prompt_ids: np.ndarray) -> None:
        self.slots.setdefault(slot, _Sampling(self.temperature, self.top_k, self.top_p))

    def end_request(self, slot: int) -> None:
        self.slots.pop(slot, None)
        self._trees.pop(slot, None)

    def on_verified(self, slot: int, num_accepted: int, emitted: list[int]) -> None:
        """A verified tree calibrates its nodes' probabilities (which were accepted)."""
        tree = self._trees.pop(slot, None)
        if tree is not None:
            self.calibration.observe_tree(tree, emitted, num_accepted)

    def _sampling(self, slot: int) -> _Sampling:
        sp = self.slots.get(slot)
        if sp is None:
            raise unknown_slot(self, slot)
        return sp

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """hidden [B, H] -> [B, n, V'] logits of the first n heads (LM-head rows; see heads.vocab_ids)."""
        return self.heads(hidden.to(self.device, self.dtype), n, self.linear)

    def propose(self, requests: list[DraftRequest], ks: list[int]) -> DraftBatch:
        """The heads run once over every drafting request's hidden state (one read of their weights and
        LM heads); then each request drafts its chain (or greedy tree) from its own row."""
        out = [Draft() for _ in requests]
        live = [b for b, (r, k) in enumerate(zip(requests, ks)) if min(k, self.k) > 0 and r.hidden is not None]
        if not live:
            return DraftBatch(out)
        hidden = torch.cat([requests[b].hidden.reshape(1, -1) for b in live])  # [J, H]
        logits = self.head_logits(hidden, min(max(ks[b] for b in live), self.k))  # [J, n, V']
        for i, b in enumerate(live):
            r = requests[b]
            out[b] = self._draft(logits[i, :min(ks[b], self.k)], self._sampling(r.slot), r.slot, r.row_price)
        return DraftBatch(out)

    def _draft(self, logits: torch.Tensor, sp: _Sampling, slot: int, price: float | None = None) -> Draft:
        """logits [n, V'] of the first n heads -> the request's draft: a greedy tree where one is
        configured (its nodes worth their rows at ``price``), else a chain sampled as ``sp`` says, cut
        after a stop token."""
        n = logits.shape[0]
        if self.tree is not None and sp.temperature <= 0:
            d, probs = self._propose_tree(logits, n, price)
            if d.parents is not None and len(d):
                self._trees[slot] = (d.ids, d.parents, probs)
            return d
        q = None
        if sp.temperature <= 0:
            ids = self.heads.vocab_ids(logits.argmax(-1))  # [n]
        else:
            p = logits_to_probs(logits, sp.temperature, sp.top_k, sp.top_p)  # [n, V']
            ids = self.heads.vocab_ids(torch.multinomial(p, 1, generator=sp.generator or self._own_generator).view(n))
            q = self._to_target_vocab(p[None])[0]  # [n, V_target]
        ids = ids.long().cpu().tolist()
        m = next((i + 1 for i, t in enumerate(ids) if t in self.stop_ids), n)  # nothing after a stop is accepted
        return Draft(ids[:m], None if q is None else q[:m])

    def _propose_tree(self, head_logits: torch.Tensor, depth: int, price: float | None = None) -> tuple[Draft, list[float]]:
        """Greedy tree drafts from the heads' logits [depth, V']: the configured tree cut to ``depth``
        levels (paths are sorted by length, so the kept nodes are a prefix and keep their indices), then
        to the nodes worth their rows at ``price`` (``specctl.runtime.tree_budget``): a node's probability
        is the product of its heads' softmax at its ranks, calibrated on the verified trees. Returns the
        draft and each of its nodes' probabilities."""
        paths, parents, _ = self.tree
        keep = 1 + sum(1 for p in paths[1:] if len(p) <= depth)
        tokens, probs = tree_tokens(head_logits, paths[:keep], self.heads, with_probs=True)  # [keep-1] each
        ids, par = tokens.tolist(), [p - 1 for p in parents[1:keep]]
        if price:
            cal = self.calibration
            order = sorted(range(len(ids)), key=lambda i: -probs[i])
            nodes = sorted(with_ancestors(order[:worth([cal(probs[i]) for i in order], price)], par))  # configured order: parents first
            index = {i: j for j, i in enumerate(nodes)}
            ids, probs, par = [ids[i] for i in nodes], [probs[i] for i in nodes], [-1 if par[i] < 0 else index[par[i]] for i in nodes]
        return (Draft(ids, None, par) if ids else Draft()), probs

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


def auto_tree(rank_accuracy, num_nodes: int, depth: int) -> list[tuple[int, ...]]:
    """Medusa's tree construction (Cai et al., sec. 2.3.1): with a[k][r] the held-out probability that
    head k's rank-r token is the target's choice, a path (r1, .., rd) is accepted whole with probability
    ~ a[0][r1] * .. * a[d-1][rd] (heads taken as independent), and a tree's expected acceptance length
    is 1 + the sum of its nodes' probabilities. Best-first from the root, the ``num_nodes`` most likely
    paths of at most ``depth`` levels: a connected tree, each node's path no likelier than its parent's.
    """
    import heapq

    acc = [[float(x) for x in row] for row in rank_accuracy[:depth]]
    heap = [(-a, (r,)) for r, a in enumerate(acc[0]) if a > 0]
    heapq.heapify(heap)
    paths: list[tuple[int, ...]] = []
    while heap and len(paths) < num_nodes:
        neg, p = heapq.heappop(heap)
        paths.append(p)
        if len(p) < len(acc):
            for r, a in enumerate(acc[len(p)]):
                if a > 0:
                    heapq.heappush(heap, (neg * a, p + (r,)))
    return paths


def tree_tokens(head_logits: torch.Tensor, paths: list[tuple[int, ...]], heads, with_probs: bool = False):
    """head_logits [K, V'] (one request) -> [N] draft token of each non-root node: a node at depth d with
    rank r in its path takes head (d-1)'s r-th best token. ``with_probs``: also each node's probability,
    the product of its heads' softmax at its path's ranks (a list of N floats)."""
    depth = max(len(p) for p in paths)
    width = max((max(p) for p in paths if p), default=0) + 1
    best = head_logits[:depth].float().topk(width, -1)
    top = heads.vocab_ids(best.indices)  # [depth, width]
    tokens = torch.tensor([int(top[len(p) - 1, p[-1]]) for p in paths[1:]], dtype=torch.long)
    if not with_probs:
        return tokens
    sm = (best.values - torch.logsumexp(head_logits[:depth].float(), -1, keepdim=True)).exp().tolist()  # [depth, width]
    probs = []
    for p in paths[1:]:
        v = 1.0
        for level, rank in enumerate(p):
            v *= sm[level][rank]
        probs.append(v)
    return tokens, probs


PROPOSERS = {"medusa": MedusaProposer}
