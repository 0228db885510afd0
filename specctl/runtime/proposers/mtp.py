"""MtpProposer: self-speculation with the target's own multi-token-prediction (MTP) modules.

DeepSeek-V3 (arXiv 2412.19437, §2.2), GLM-4.5, MiMo and Qwen3-Next ship MTP modules beside the main
model: no second model and no second tokenizer. The modules, how their depths chain, and their
layouts on disk: ``specctl.drafts.mtp`` and ``specctl.drafts.mtp_files``. When k exceeds the number m of MTP modules, module
(d-1) % m is reused (vLLM does the same and warns; so do we).

KV caches (one per depth, 1 block each) follow the target by *committed lengths*, the same "write by
position, mask by length" rollback the runner uses. Worked example, context t_0..t_9 (n = 10, the
target's cache holds 0..8, so h^0_0..h^0_8 are known), k = 2:
  depth 1 runs positions j = c_1..8 with tokens t_{j+1}; all real -> committed c_1 = 9; the row at
      j = 8 gives draft d1 (a guess of t_10).
  depth 2 runs j = c_2..8 with tokens t_{j+2}: t_2..t_9 are real (j <= 7 -> committed c_2 = 8), j = 8
      reads d1 (speculative); its row gives d2 (a guess of t_11).
  Next propose (after the target accepted some drafts) restarts each depth from its c_d: speculative
  slots are simply overwritten. Nothing is ever recomputed from scratch.

A draft folder with a draft vocabulary (``draft_vocab.json``: train-mtp's loss vocabulary) has its head cut to
those rows when specctl drafts: the full head is most of a draft token's cost (Qwen2.5's 152k rows against a
decoder block's ~15M weights); verification is the target's, so output is unchanged.

What it does not know: verification, the target's cache, stop handling beyond not drafting past a stop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specctl.config import SpecConfig
from specctl.drafts.mtp import MtpStack, mtp_logits, mtp_step, mtp_step_ragged
from specctl.modeling import adopt_kernels, fuse_blocks
from specctl.drafts.mtp_files import load_mtp
from specctl.errors import UsageError
from specctl.models import resolve_draft
from specctl.modeling import VERIFY_ROWS, ModelArgs
from specctl.runtime.proposers.base import READ_TIMED, Draft, DraftBatch, DraftRequest, SlotProposer, target_q, weight_bytes
from specctl.runtime.proposers.base import DraftSampling as _Sampling

log = logging.getLogger("specctl")
_WARNED: set[tuple[int, int]] = set()  # (k, layers) pairs warned about in this process
# vLLM's warning, in substance (vllm/config/speculative.py)
RECURSIVE_WARNING = ("num_speculative_tokens (%d) > num_nextn_predict_layers (%d): the MTP layers will be run "
                     "recursively, which may result in lower acceptance rate")


class _Slot:
    """One request: h^d buffers, per-depth caches and committed lengths (see the module docstring)."""

    def __init__(self, a: ModelArgs, max_len: int, dtype, device):
        self.a, self.max_len, self.dtype, self.device = a, max_len, dtype, device
        self.h = [torch.zeros(max_len, a.hidden_size, dtype=dtype, device=device)]  # h[d]: [max_len, H]
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # kv[d-1]: ([1, n_kv, max_len, hd],) * 2
        self.c = [0]  # c[d]: positions [0, c[d]) of depth d hold real (committed) values; c[0] = target rows
        self.prompt = np.zeros(0, dtype=np.int64)
        self.sampling: _Sampling | None = None
        self.active = False
        self.reading = False  # the next target rows are a prompt chunk the depths read (``MtpProposer.on_prefill``)

    def ensure_depth(self, k: int) -> None:
        a = self.a
        while len(self.kv) < k:
            shape = (1, a.num_kv_heads, self.max_len, a.head_dim)
            self.kv.append((torch.zeros(shape, dtype=self.dtype, device=self.device),
                            torch.zeros(shape, dtype=self.dtype, device=self.device)))
            self.h.append(torch.zeros(self.max_len, a.hidden_size, dtype=self.dtype, device=self.device))
            self.c.append(0)


class MtpProposer(SlotProposer):
    method = "mtp"
    needs_hidden_states = True
    reads_prompt = True  # every depth reads the prompt (``on_prefill``) where the decoder has it, else it catches up

    def __init__(self, config: SpecConfig, *, target, max_model_len: int, stack: MtpStack | None = None):
        """``target``: the LoadedModel drafted for; its folder holds the MTP modules unless ``config.model``
        names a separate draft folder. ``stack`` overrides both (tests, trainers)."""
        if target is None:
            raise UsageError("the mtp method needs the target model whose MTP layers draft",
                             "build it through build_proposer(config, max_model_len, target=LOADED_MODEL)")
        self.target = target
        self.max_model_len = int(config.max_model_len or max_model_len)
        if stack is None:
            source = target.path if config.model is None else resolve_draft(
                config.model, dtype=str(target.dtype).removeprefix("torch."), what="MTP draft", trainer="train-mtp")
            stack = load_mtp(source, target.model)
        self.stack = adopt_kernels(stack, target.model.kernels)  # its blocks on the target's kernels
        fuse_blocks([layer.block for layer in stack.layers], target.model.args, target.model.kernels)  # and fused block
        # unset: one token a module, as vLLM (num_nextn_predict_layers)
        given = config.given("num_speculative_tokens")
        self.k = int(given or stack.num_layers)
        config.num_speculative_tokens = self.k  # what runs (a bench row's k)
        if self.k > stack.num_layers and (self.k, stack.num_layers) not in _WARNED:  # once (bench builds one a pass)
            _WARNED.add((self.k, stack.num_layers))
            log.warning(RECURSIVE_WARNING, self.k, stack.num_layers)
        p = target.model.embed.weight
        self.dtype, self.device = p.dtype, p.device
        # a draft vocabulary (train-mtp's loss vocabulary): the head cut to its rows, ~10x fewer for Qwen's 152k,
        # is most of a draft token's cost otherwise; drafts stay target ids, q rows over the target's vocabulary
        self.vocab_ids = stack.vocab_ids
        self._heads: dict[int, torch.Tensor] = {}  # module index -> the head weight its depths read
        # the controller's prior for a draft token: a module and the head's rows it reads, over the target's weights
        layer, a = stack.layer_for_depth(1), target.model.args
        rows = a.vocab_size if self.vocab_ids is None else len(self.vocab_ids)
        own = sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if not n.startswith("head."))
        self.draft_cost = (own + rows * a.hidden_size * layer.eh_proj.weight.element_size()) / max(weight_bytes(target.model), 1)
        self.stop_ids = set(target.stop_token_ids)
        self.temperature: float = 0.0
        self.slots: dict[int, _Slot] = {}
        self._own_generator = torch.Generator(device=self.device).manual_seed(int(torch.randint(2**62, ())))

    # ------------------------------------------------------------------ request life (SlotProposer)
    def _new_slot(self) -> _Slot:
        return _Slot(self.target.model.args, self.max_model_len + self.k + 2, self.dtype, self.device)

    def _reset_slot(self, s: _Slot) -> None:
        s.c, s.reading = [0] * len(s.c), False

    def _target_len(self, s: _Slot) -> int:
        return s.c[0]

    def on_target_hidden(self, slot: int, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        # hidden: [1, T, H] the target rows now in its cache, at positions [c[0], c[0]+T)
        s = self._slot(slot)
        T = hidden.shape[1]
        if s.c[0] + T > s.max_len:
            raise UsageError(f"mtp: sequence longer than its max length {s.max_len}", "raise --max-model-len")
        s.h[0][s.c[0]:s.c[0] + T] = hidden[0].to(self.dtype)
        s.c[0] += T
        if s.reading:  # a prompt chunk the decoder has the proposer read (``on_prefill``): every depth reads it now
            s.reading = False
            self._catch_up(s, torch.from_numpy(s.prompt[:s.c[0]]).to(self.device))

    def on_prefill(self, slot: int, upto: int, batch: int = 1) -> None:
        # called before the chunk's on_target_hidden, and only where the batch drafts (a batch that does not
        # leaves the reading to a first draft, if one comes)
        self._slot(slot).reading = True

    def backlog(self, slot: int) -> int:
        """Context tokens depth 1 has not read (a prompt it skipped, the steps drafting was off): its next draft
        reads them first, at every depth."""
        s = self.slots.get(slot)
        if s is None or not s.active:
            return 0
        return max(s.c[0] - 1 - (s.c[1] if len(s.c) > 1 else 0), 0)

    @torch.inference_mode()
    def _catch_up(self, s: _Slot, seq: torch.Tensor) -> float:
        """Each depth d over the positions it can commit (j + d within the target's rows: real tokens t_{j+d} and
        h^{d-1} committed), so that a draft runs at most d rows at depth d: reading a prompt (at the prefill, or at
        the first draft where the prefill did not) or the steps drafting was off is priced as reading, not as
        drafting (a controller that timed it as drafting priced a draft token at a plain step: docs/results/
        2026-12-07-qwen-0.5b-mtp.md). ``seq``: the context's tokens (at least the target's rows). Returns its
        seconds; a read of READ_TIMED tokens or more times ``catch_up_seconds``."""
        s.ensure_depth(self.k)
        t, first = time.perf_counter(), s.c[1]
        for d in range(1, self.k + 1):
            start, end = s.c[d], s.c[0] - d  # rows [start, end) read real tokens t_{j+d}, and h^{d-1} committed
            if end - start <= 0 or s.c[d - 1] < end:
                break
            kc, vc = s.kv[d - 1]
            chain, _ = mtp_step(self.stack, self.target.model, d, s.h[d - 1][start:end][None], seq[start + d:end + d][None],
                                start, kc, vc)
            s.h[d][start:end] = chain[0]
            s.c[d] = end
        seconds = time.perf_counter() - t
        self._timed_read(seconds, s.c[1] - first)
        return seconds

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], ks: list[int]) -> DraftBatch:
        """Every depth runs once for all drafting requests (``mtp_step_ragged``: one read of the module's
        weights, one of the LM head)."""
        read = 0.0  # a request with READ_TIMED or more context tokens to read first catches up, timed apart
        for r, k in zip(requests, ks):
            if k > 0 and self.backlog(r.slot) >= READ_TIMED:
                seq = torch.from_numpy(np.asarray(r.tokens, dtype=np.int64)).to(self.device)
                read += self._catch_up(self.slots[r.slot], seq)
        return DraftBatch([Draft(ids, q) for ids, q in self._drafts(requests, ks)], read)

    def _drafts(self, requests: list[DraftRequest], ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Each row's (draft ids, q [n_draft, V] or None). Depth by depth over the requests still drafting;
        a depth with more rows than one verify block runs on its own, as a prefill does."""
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * len(requests)
        live: list[_Drafting] = []
        for i, (r, k) in enumerate(zip(requests, ks)):
            if k < 1:
                continue
            s, n = self._slot_of(r), r.n
            if s is None or n < 2 or n + k > s.max_len:
                continue  # the target's states do not reach this context (or no room): no draft this step
            s.ensure_depth(k)
            seq = torch.from_numpy(np.asarray(r.tokens, dtype=np.int64)).to(self.device)
            live.append(_Drafting(i, s, seq, k, s.sampling or _Sampling(self.temperature)))
        model = self.target.model
        d = 1
        while live:
            parts = [j.depth_input(d, self.device) for j in live]
            small = [i for i, p in enumerate(parts) if p[1].shape[0] <= VERIFY_ROWS]
            res: list = [None] * len(live)
            if small:
                for i, r in zip(small, mtp_step_ragged(self.stack, model, d, [parts[i] for i in small])):
                    res[i] = r
            for i, (h, toks, start, kc, vc) in enumerate(parts):
                if res[i] is None:
                    chain, normed = mtp_step(self.stack, model, d, h[None], toks[None], start, kc, vc)
                    res[i] = chain[0], normed[0]
            logits = self._logits(d, torch.stack([normed[-1] for _, normed in res]))  # [J, V] (V: the draft's vocabulary)
            still = []
            for j, (chain, _), lg in zip(live, res, logits):
                j.keep(d, chain)
                tok = j.sampling.pick(lg, j.q_rows, self._own_generator)
                tok = tok if self.vocab_ids is None else int(self.vocab_ids[tok])
                j.drafts.append(tok)
                if tok in self.stop_ids or d == j.k:
                    out[j.index] = (j.drafts, self._target_q(j.q_rows))
                else:
                    still.append(j)
            live, d = still, d + 1
        return out

    def _logits(self, d: int, normed: torch.Tensor) -> torch.Tensor:
        """[J, H] -> depth d's logits [J, V'] over the draft vocabulary (the whole head where there is none)."""
        if self.vocab_ids is None:
            return mtp_logits(self.stack, self.target.model, d, normed)
        m = (d - 1) % self.stack.num_layers
        if m not in self._heads:
            head = self.stack.layer_for_depth(d).head
            w = self.target.model.head_weight if head is None else head.weight
            self._heads[m] = w[self.vocab_ids].contiguous()
        return self.target.model.kernels.dense(normed, self._heads[m])

    def _target_q(self, q_rows: list[torch.Tensor]) -> torch.Tensor | None:
        """Sampled draft distributions [n, V'] -> over the target's vocabulary [n, V] (none outside the draft's)."""
        if self.vocab_ids is None:
            return torch.stack(q_rows) if q_rows else None
        return target_q(q_rows, self.vocab_ids, self.target.model.head_weight.shape[0])


@dataclass
class _Drafting:
    """One request's draft in progress: its row, slot, context [n], draft length, what it drafted."""

    index: int
    slot: _Slot
    seq: torch.Tensor  # [n] the context
    k: int
    sampling: _Sampling
    drafts: list[int] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)

    def depth_input(self, d: int, device) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor]:
        """Depth d runs positions j in [start, n-1) with tokens t_{j+d} (real below n, then the drafts
        so far); its last row gives this depth's draft. (h^{d-1} [T, H], tokens [T], start, caches)."""
        s, n = self.slot, self.seq.shape[0]
        end = n - 1
        start = min(s.c[d], end - 1)
        real = self.seq[start + d:n]
        spec = torch.tensor(self.drafts[max(0, start + d - n):], dtype=torch.long, device=device)
        kc, vc = s.kv[d - 1]
        return s.h[d - 1][start:end], torch.cat([real, spec]), start, kc, vc

    def keep(self, d: int, chain: torch.Tensor) -> None:
        """h^d of the rows just run, and the positions of depth d now committed (real tokens only)."""
        s, n = self.slot, self.seq.shape[0]
        end = n - 1
        s.h[d][end - chain.shape[0]:end] = chain
        s.c[d] = max(0, n - d)


PROPOSERS = {"mtp": MtpProposer}
