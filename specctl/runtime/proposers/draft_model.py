"""DraftModelProposer: a whole small model drafts k tokens, with its own KV cache (arXiv 2211.17192).

The draft is a causal LM run by its own ``TargetRunner`` (one per request slot). Its cache holds draft
ids ``fed[:L]``; each ``propose`` works out the draft-side ids of the request's context (``want``),
keeps the longest common prefix of ``fed`` and ``want`` (KV at position i depends only on tokens
0..i, so that prefix is valid), feeds only the rest, then drafts k tokens one at a time, feeding
the first k-1 back. ``on_verified`` rolls the draft back with the target, in O(1): it keeps the
accepted drafts and drops the rejected ones; nothing is ever re-prefilled.

Worked example (same tokenizer, k = 3): context [p0..p9] (10 tokens) is fed, the draft proposes
d1 d2 d3 and feeds d1 d2 (L = 12). The target accepts d1 and emits the recovered token r:
on_verified rolls the draft back to 10 + 1 = 11 (p0..p9 d1); the next propose feeds just [r].
All three accepted plus a bonus b: the draft keeps 12 (d3 was never fed) and next feeds [d3, b].

How the draft speaks the target's vocabulary:
  same : identical tokenizer fingerprints: draft ids are target ids (a padded head is cut to V_target).
  tli  : token-level intersection (Timor et al., arXiv 2502.05202, as vLLM's and transformers'
         heterogeneous-vocabulary support): the draft reads the target's text re-tokenized with its
         own tokenizer; its distribution is restricted to the draft tokens whose byte string is one
         target token (``specctl.drafts.vocab_map``), renormalised, and moved onto target ids. q is
         exactly the distribution each draft token was sampled from, so verification is lossless.
  text : the draft writes freely, its text is re-tokenized for the target (transformers' universal
         assisted generation). The draft is then deterministic from the target's view (probs None,
         q one-hot), which the verifier handles losslessly whatever produced the tokens.
  auto : (different tokenizers, the default) tli or text, chosen at every step. The intersection can
         only ever propose a target token that the draft's tokenizer cuts at the same bytes, so tli is
         used while the two tokenizations of the last 64 target tokens agree on >= MIN_TLI_AGREEMENT of
         the target's tokens (prose: ~95% for SmolLM2 -> Qwen2.5), text otherwise (code: ~67%, where
         Qwen's '(n' '):\\n' '    ' merges are not SmolLM2 tokens). Both read the same draft cache, so
         switching costs nothing. A vocabulary shared below MIN_TLI_COVERAGE always drafts by text.

Sampling: greedy drafts (probs None) unless the slot samples (``set_sampling``, or the proposer's
``temperature`` attribute); then the draft samples from its own processed distribution and returns
q [batch, k, V_target].

What it does not know: verification, the target's cache, stop handling beyond not drafting past a stop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specctl.config import SpecConfig
from specctl.errors import UsageError
from specctl.runtime.proposers.base import Draft, DraftBatch, DraftRequest, Proposer, unknown_slot, weight_bytes
from specctl.runtime.proposers.base import DraftSampling as _Sampling
from specctl.drafts.vocab_map import VocabMap, build_vocab_map, span_agreement, token_bytes, tokenizer_fingerprint

# Below this fraction of the draft vocabulary inside the intersection, drafting through the
# intersection suppresses too much of the draft; the text-level path takes over.
MIN_TLI_COVERAGE = 0.5
# auto mode: tli while at least this fraction of the recent target tokens are also draft tokens
MIN_TLI_AGREEMENT = 0.9
AGREEMENT_WINDOW = 64  # target tokens
MODES = ("same", "tli", "text", "auto")
_TEXT_ANCHOR = 3  # target tokens of context re-tokenized with the draft text (keeps word boundaries)
CATCH_UP = 256  # draft-side tokens read per step for requests far behind (as a prefill chunk), drafting after




class _Slot:
    """One request's draft state: its runner (KV cache), the ids in that cache, the target context."""

    def __init__(self, runner, max_target_len: int):
        self.runner = runner
        self.fed = np.zeros(runner.max_len, dtype=np.int64)  # [max_len] draft ids in the cache, valid < runner.length
        self.ctx = np.zeros(max_target_len, dtype=np.int64)  # [max_target_len] target ids known so far
        self.n = 0  # valid length of ctx
        self.pieces: list[bytes] = []  # [n] target token byte strings (mapped modes)
        self.base = 0  # draft cache length before the last propose's drafts were fed
        self.num_fed_drafts = 0  # drafts of the last propose that went into the cache
        self.step_mode = "same"  # how the last propose drafted (same, tli or text)
        self.sampling: _Sampling | None = None
        self.active = False
        self.synced = 0  # target tokens of ctx the draft cache reflects (mapped modes; ``backlog``)


@dataclass
class _Drafting:
    """One request's draft in progress (``_propose_many``): where it came from, how it drafts, the
    cache length before its drafts, what it drafted so far and what it feeds next [1, T]."""

    index: int
    slot: _Slot
    k: int
    mode: str
    suppress: torch.Tensor | None
    sampling: _Sampling
    base: int
    feed: torch.Tensor
    draft_ids: list[int] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)


def load_draft(config: SpecConfig, target):
    """The draft model of ``config`` for ``target`` (a LoadedModel), in the target's dtype and device:
    dense, or (``"quantization": "gguf"``) a GGUF run quantized as stored."""
    from specctl.models import resolve_model
    from specctl.runtime.loading import load_model

    from specctl.errors import UsageError

    q = config.own_quantization()
    try:
        path = resolve_model(config.model, dtype="float32" if target.dtype == torch.float32 else "bfloat16",
                             quantization=q)
    except UsageError:
        if q != "gguf":
            raise
        raise UsageError(f'the draft\'s "quantization": "gguf" needs a .gguf file or a catalogue name as its "model", '
                         f"not {config.model}",
                         'set the draft\'s "model" to a .gguf file or a catalogue name, or drop its "quantization"') from None
    return load_model(path, dtype=str(target.dtype).removeprefix("torch."), device=str(target.device))


class DraftModelProposer(Proposer):
    method = "draft_model"
    reads_prompt = True

    def __init__(self, config: SpecConfig, *, target, max_model_len: int, draft=None, mode: str | None = None,
                 vocab_map: VocabMap | str | None = None):
        """``target``: the LoadedModel drafted for. ``draft`` (a LoadedModel), ``mode`` and ``vocab_map``
        override what the config implies (tests and callers that already hold them)."""
        if target is None:
            raise UsageError("the draft_model method needs the target model it drafts for",
                             "build it through build_proposer(config, max_model_len, target=LOADED_MODEL)")
        self.k = int(config.num_speculative_tokens or 1)
        self.max_model_len = int(config.max_model_len or max_model_len)
        if draft is None:
            draft = load_draft(config, target)
        self.draft, self.target = draft, target
        self.draft_cost = weight_bytes(draft.model) / max(weight_bytes(target.model), 1)
        self.device = target.device
        self.temperature: float = 0.0  # default sampling of slots without set_sampling
        self.top_k: int | None = None
        self.top_p: float | None = None
        self.stop_ids = set(target.stop_token_ids)
        self.Vd, self.Vt = draft.model.args.vocab_size, target.model.args.vocab_size

        same = tokenizer_fingerprint(draft.tokenizer) == tokenizer_fingerprint(target.tokenizer)
        self.vocab_map: VocabMap | None = None
        if same:
            if vocab_map is not None or getattr(config, "vocab_map", None) is not None:
                self._vocab_map(config, vocab_map)  # checked all the same (a wrong file is an error), then not needed
            d2t = torch.arange(self.Vd, dtype=torch.int64)
        else:
            self.vocab_map = self._vocab_map(config, vocab_map)
            d2t = torch.full((self.Vd,), -1, dtype=torch.int64)
            n = min(self.Vd, self.vocab_map.draft_vocab_size)
            d2t[:n] = self.vocab_map.draft_to_target[:n]
        d2t[d2t >= self.Vt] = -1  # a draft head wider than the target's vocabulary
        auto = "same" if same else ("auto" if self.vocab_map.draft_coverage >= MIN_TLI_COVERAGE else "text")
        self.mode = mode or auto
        if self.mode not in MODES or (self.mode == "same") != same:
            fits = ["same"] if same else ["auto", "tli", "text"]
            raise UsageError(f"draft_model mode '{self.mode}' does not fit this draft/target pair", f"use {' or '.join(fits)}")
        self.d2t = d2t.to(self.device)  # [Vd] target id of each draft id, -1 = outside the intersection
        suppress = d2t < 0
        self.suppress_tli = suppress.to(self.device) if bool(suppress.any()) else None  # [Vd] or None
        self.suppress_text = None  # [Vd]: ids the draft's tokenizer cannot spell (a padded head)
        self.identity = same and self.Vd == self.Vt and self.suppress_tli is None
        mapped = torch.nonzero(~suppress).flatten()
        self.mapped_draft_ids = mapped.to(self.device)  # [n_shared]
        self.mapped_target_ids = d2t[mapped].to(self.device)  # [n_shared]
        if not same:
            self.target_bytes = token_bytes(target.tokenizer)
            self.draft_bytes = token_bytes(draft.tokenizer)
            self.draft_lens = [len(b or b"") for b in self.draft_bytes]
            spellable = torch.zeros(self.Vd, dtype=torch.bool)
            spellable[:min(self.Vd, len(self.draft_bytes))] = torch.tensor(
                [b is not None for b in self.draft_bytes[:self.Vd]], dtype=torch.bool)
            if not bool(spellable.all()):
                self.suppress_text = (~spellable).to(self.device)
        # draft tokens per target token can exceed 1 with another tokenizer: room for that
        self.draft_max_len = self.max_model_len + self.k + 1 if same else int(1.5 * self.max_model_len) + self.k + 8
        self.slots: dict[int, _Slot] = {}
        # Draft sampling must be independent of everything else (a draft seeded alike for every request
        # would not be distributed as its q across requests): one stream for the proposer's life, seeded
        # from torch's global generator (reproducible under torch.manual_seed) unless a slot brings its own.
        self._own_generator = torch.Generator(device=self.device).manual_seed(int(torch.randint(2**62, ())))

    # ------------------------------------------------------------------ setup
    def _vocab_map(self, config: SpecConfig, given) -> VocabMap:
        dt, tt = self.draft.tokenizer, self.target.tokenizer
        given = given if given is not None else getattr(config, "vocab_map", None)
        if given is None:
            return build_vocab_map(dt, tt, self.draft.name, self.target.name, self.Vt)
        vmap = given if isinstance(given, VocabMap) else VocabMap.load(given)
        vmap.check_tokenizers(dt, tt, where=f"vocab map {given}" if not isinstance(given, VocabMap) else "the vocab map")
        return vmap

    def set_sampling(self, slot: int, params, generator: torch.Generator | None = None) -> None:
        """How the request in ``slot`` samples (a SamplingParams): the draft samples alike, so q is close to p."""
        self._slot(slot).sampling = _Sampling(float(params.temperature), params.top_k, params.top_p, generator)

    def _slot(self, slot: int) -> _Slot:
        s = self.slots.get(slot)
        if s is None:
            from specctl.runtime.runner import TargetRunner

            s = self.slots[slot] = _Slot(TargetRunner(self.draft.model, self.draft_max_len), self.max_model_len + self.k + 1)
        return s

    # ------------------------------------------------------------------ request life
    def start_request(self, slot: int, prompt_ids: np.ndarray) -> None:
        s = self._slot(slot)
        s.n, s.pieces, s.active, s.synced = 0, [], True, 0
        self._extend(s, np.asarray(prompt_ids, dtype=np.int64))

    def backlog(self, slot: int) -> int:
        """Context tokens not in the draft's cache yet (target tokens): read before the next draft."""
        s = self.slots.get(slot)
        if s is None or not s.active:
            return 0
        if self.mode == "same":
            return s.n - self._common_prefix(s, s.ctx[:s.n])
        return max(s.n - s.synced, 0)

    def on_prefill(self, slot: int, upto: int, batch: int = 1) -> None:
        """The draft reads the prompt in the request's prefill (as vLLM runs the draft's prefill), chunk
        by chunk with the target's, not in its first drafting step: the controller then weighs drafting
        by its steady cost, and no step carries a whole prompt's draft forward."""
        s = self.slots.get(slot)
        if s is None or not s.active:
            return
        want = self._context_ids(s, upto)
        if 0 < len(want) <= s.runner.max_len:
            self._sync(s, want)
            s.synced = min(upto, s.n)

    def end_request(self, slot: int) -> None:
        s = self.slots.get(slot)
        if s is not None:
            s.active = False  # the cache is kept: a later request sharing a prefix reuses it

    def on_verified(self, slot: int, num_accepted: int, emitted: list[int]) -> None:
        s = self.slots.get(slot)
        if s is None:
            return
        self._extend(s, np.asarray(emitted, dtype=np.int64))
        s.synced = min(s.synced + min(num_accepted, s.num_fed_drafts), s.n)  # the accepted drafts it fed
        if s.step_mode in ("same", "tli"):
            # drafts map one to one onto draft ids: keep the accepted ones that were fed, drop the rest (O(1))
            keep = s.base + min(num_accepted, s.num_fed_drafts)
            s.runner.rollback(min(keep, s.runner.length))
        # text: drafts and draft ids do not align; the next propose keeps the longest valid prefix
        s.base, s.num_fed_drafts = s.runner.length, 0  # a step it sits out later rolls nothing back

    def _extend(self, s: _Slot, ids: np.ndarray) -> None:
        """Append target ids to the slot's known context (truncating at its capacity)."""
        ids = ids[: len(s.ctx) - s.n]
        s.ctx[s.n:s.n + len(ids)] = ids
        s.n += len(ids)
        if self.mode != "same":  # mapped: the text of the context, token by token
            tb = self.target_bytes
            s.pieces.extend(tb[i] if 0 <= i < len(tb) and tb[i] is not None else b"" for i in ids.tolist())

    def _slot_for(self, r: DraftRequest) -> _Slot:
        """The request's slot, its known context caught up to the request's (started over from it where
        the context changed under it)."""
        s = self.slots.get(r.slot)
        if s is None or not s.active:
            raise unknown_slot(self, r.slot)
        n, row = r.n, r.ctx
        if s.n > n or not np.array_equal(s.ctx[:s.n], row[:s.n]):
            s.n, s.pieces = 0, []
        self._extend(s, row[s.n:n].astype(np.int64))
        return s

    # ------------------------------------------------------------------ drafting
    def propose(self, requests: list[DraftRequest], ks: list[int]) -> DraftBatch:
        """Every request's draft with one draft forward per drafting step for all of them
        (``runner.forward_batch``: the draft's weights are read once per step, not once per request)."""
        live = [b for b, k in enumerate(ks) if k > 0]
        out = [Draft() for _ in requests]
        drafts = self._propose_many([self._slot_for(requests[b]) for b in live], [ks[b] for b in live])
        for b, (ids, q) in zip(live, drafts):
            out[b] = Draft(ids, q)
        return DraftBatch(out)

    def _context_ids(self, s: _Slot, upto: int | None = None) -> np.ndarray:
        """[n_draft] the draft-side ids of the slot's target context (of its first ``upto`` tokens)."""
        n = s.n if upto is None else min(upto, s.n)
        if self.mode == "same":
            return s.ctx[:n]
        text = b"".join(s.pieces[:n]).decode("utf-8", "replace")
        return np.asarray(self.draft.tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)

    def _sync(self, s: _Slot, want: np.ndarray) -> torch.Tensor:
        """Make the draft cache hold ``want``, feeding only what differs; returns the last logits [Vd].
        A read of READ_TIMED tokens or more is timed (``catch_up_seconds``)."""
        feed = self._sync_tokens(s, want)
        t = time.perf_counter()
        logits = s.runner.forward(feed, logits="last")[0, -1]
        s.base, s.num_fed_drafts = s.runner.length, 0  # context, not drafts: a verification keeps it
        self._timed_read(time.perf_counter() - t, feed.shape[1])
        return logits

    def _step_mode(self, s: _Slot, want: np.ndarray) -> str:
        """same / tli / text for this step (auto: by the recent tokenizations' agreement, see the docstring)."""
        if self.mode != "auto":
            return self.mode
        t_lens = [len(p) for p in s.pieces[-AGREEMENT_WINDOW:]]
        need, d_lens = sum(t_lens), []
        for d in want[::-1].tolist():  # draft tokens covering (at least) the same last bytes
            if need <= 0:
                break
            d_lens.append(self.draft_lens[d] if d < len(self.draft_lens) else 0)
            need -= d_lens[-1]
        return "tli" if span_agreement(t_lens, d_lens[::-1]) >= MIN_TLI_AGREEMENT else "text"

    @staticmethod
    def _common_prefix(s: _Slot, want: np.ndarray) -> int:
        """How many leading tokens of ``want`` the draft cache already holds."""
        m = min(s.runner.length, len(want))
        diff = np.flatnonzero(s.fed[:m] != want[:m])
        return int(diff[0]) if diff.size else m

    def _sync_tokens(self, s: _Slot, want: np.ndarray, common: int | None = None) -> torch.Tensor:
        """Roll the draft cache back to its longest prefix of ``want`` (``common`` tokens, when the caller
        has counted them) and return what is left to feed [1, T >= 1] (the last token at least)."""
        c = min(self._common_prefix(s, want) if common is None else common, len(want) - 1)
        s.runner.rollback(c)
        s.fed[c:len(want)] = want[c:]
        return torch.from_numpy(want[c:]).to(self.device)[None]

    def _propose_many(self, slots: list[_Slot], ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """(target ids, q [n, V_target] or None) per slot; every drafting step one batched draft forward."""
        from specctl.runtime.runner import forward_batch

        results: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * len(slots)
        live: list[_Drafting] = []
        catch_up = CATCH_UP  # draft-side tokens this call may read for requests far behind, all of them together
        for j, (s, k) in enumerate(zip(slots, ks)):
            want = self._context_ids(s)
            if len(want) == 0 or len(want) + k > s.runner.max_len:
                s.base, s.num_fed_drafts = s.runner.length, 0  # on_verified then keeps the cache as it is
                continue  # nothing to read, or no room left in the draft cache: no draft this step
            c = self._common_prefix(s, want)
            if len(want) - c > CATCH_UP:  # far behind (it joined while the batch was not drafting): read a chunk
                if catch_up > 0:
                    self._sync(s, want[:c + catch_up])
                    s.synced = s.n * (c + catch_up) // len(want)  # in target tokens, about
                    catch_up = 0
                s.base, s.num_fed_drafts = s.runner.length, 0
                continue  # no draft until it has caught up: no step carries a whole prompt's draft forward
            mode = s.step_mode = self._step_mode(s, want)
            s.synced = s.n
            live.append(_Drafting(j, s, k, mode, self.suppress_text if mode == "text" else self.suppress_tli,
                                  s.sampling or _Sampling(self.temperature, self.top_k, self.top_p), len(want),
                                  self._sync_tokens(s, want, c)))
        feeding = live
        while feeding:
            logits = forward_batch([e.slot.runner for e in feeding], [e.feed for e in feeding],
                                   last_only=[True] * len(feeding))
            nxt = []
            for e, out in zip(feeding, logits):
                lg = out.logits[0, -1]
                if e.suppress is not None:
                    lg = lg.masked_fill(e.suppress, float("-inf"))
                sp = e.sampling
                d = sp.pick(lg, e.q_rows, self._own_generator)  # [Vd] -> a draft id
                i = len(e.draft_ids)
                e.draft_ids.append(d)
                if i + 1 == e.k or (e.mode != "text" and int(self.d2t[d]) in self.stop_ids):
                    continue  # done: its last draft is not fed
                e.slot.fed[e.base + i] = d
                e.feed = torch.tensor([[d]], device=self.device)
                nxt.append(e)
            feeding = nxt
        for e in live:
            e.slot.base, e.slot.num_fed_drafts = e.base, e.slot.runner.length - e.base
            results[e.index] = self._finish(e.slot, e.mode, e.sampling.temperature > 0, e.draft_ids, e.q_rows, e.k)
        return results

    def _finish(self, s: _Slot, mode: str, sample: bool, draft_ids: list[int], q_rows: list, k: int):
        """Draft ids -> (target ids, q on target ids or None)."""
        if mode == "text":
            return self._text_to_target(s, draft_ids, k), None
        ids = [int(self.d2t[d]) for d in draft_ids]
        if not sample:
            return ids, None
        q = torch.stack(q_rows)  # [n, Vd]
        if self.identity:
            return ids, q
        qt = torch.zeros(len(q_rows), self.Vt, dtype=torch.float32, device=self.device)  # [n, V_target]
        qt.index_add_(1, self.mapped_target_ids, q[:, self.mapped_draft_ids])
        return ids, qt

    def _text_to_target(self, s: _Slot, draft_ids: list[int], k: int) -> list[int]:
        """Re-tokenize the draft's text for the target, reading it after the last few context tokens."""
        db = self.draft_bytes
        text = b"".join(db[d] for d in draft_ids if d < len(db) and db[d] is not None)
        anchor = s.ctx[max(0, s.n - _TEXT_ANCHOR):s.n].tolist()
        head = b"".join(s.pieces[s.n - len(anchor):s.n])
        enc = self.target.tokenizer.encode
        ids = enc((head + text).decode("utf-8", "ignore"), add_special_tokens=False)
        if ids[:len(anchor)] == anchor:
            ids = ids[len(anchor):]
        else:  # the draft's first word merged with the context's last token: read the text alone
            ids = enc(text.decode("utf-8", "ignore"), add_special_tokens=False)
        ids = [i for i in ids if i < self.Vt][:k]
        for j, t in enumerate(ids):
            if t in self.stop_ids:
                return ids[:j + 1]
        return ids


PROPOSERS = {"draft_model": DraftModelProposer}
