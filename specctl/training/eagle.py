"""EAGLE-3 / EAGLE-1 training: target states, training-time test (TTT), losses, and the trainer.

Index convention (the proposer's, see ``specctl.runtime.proposers.eagle``): for a sequence x[0:T]
the target gives, at each position t, its aux states a_t (EAGLE-3), final-normed hidden f_t and its
distribution p_t over x[t+1]. Draft row t at TTT step i reads token x[t+1+i] and (step 0) the
target's feature at t, or (step i > 0) its own output of step i-1 at row t; it is scored against
the target's distribution at position t+1+i (which predicts x[t+2+i]).

TTT attention, worked for T = 3 and step i = 1 (keys of step 0 rows 0..2, then step 1 rows 0..2):
    query row 0 (position 1): [1 0 0 | 1 0 0]
    query row 1 (position 2): [1 1 0 | 0 1 0]
    query row 2 (position 3): [1 1 1 | 0 0 1]
i.e. causal over the target-feature keys, and the diagonal of every later step: exactly what row t
sees when the proposer drafts a chain from position t (its cache holds feature rows 0..t, then
its own chain rows). ``ttt_mask`` builds it; rope positions of step j rows are t + j.

Losses: EAGLE-3: sum_i 0.8^i * softCE(draft logits over the draft vocabulary, p restricted to the
draft vocabulary and renormalised), rows whose target argmax is outside the draft vocabulary
masked (as SpecForge). EAGLE-1: sum_i 0.8^i * (smoothL1(out, f_{t+1+i}) + 0.1 * softCE(head(out), p)).

Evaluation (greedy, teacher-forced): step i at row t is accepted when steps 0..i all predict the
target's argmax; per-position acceptance = P(accepted at i), simulated acceptance length =
1 + sum_i P(accepted at i). Exact for chain drafting when the data is the target's greedy output.

What it does not know: the CLI, the network and its files (``specctl.drafts.eagle``), verification.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specctl.drafts.eagle import EagleDraft, export_eagle, rope_cos_sin, spec_from_target
from specctl.errors import DataError, UsageError
from specctl.runtime.model import rotate_half

CKPT = "checkpoint"


@dataclass
class EagleTrainConfig:
    """Every setting of a train-eagle run (saved as train_config.json beside every checkpoint)."""

    model: str
    """Target model folder."""
    output: str
    """Run folder: checkpoint/, and the exported draft (a folder whose name contains eagle3/eagle)."""
    data: str | list[str] | None = None
    """Training data: .jsonl / .json (text, prompt+response, messages, ShareGPT conversations) or text; one path or several."""
    version: int = 3
    """3 = EAGLE-3, 1 = EAGLE-1."""
    draft_vocab_size: int | None = None
    """EAGLE-3 reduced draft vocabulary N (default min(32000, V))."""
    ttt_steps: int | None = None
    """Training-time-test steps (default 4 for EAGLE-3, 1 for EAGLE-1)."""
    aux_layers: tuple[int, ...] | None = None
    """EAGLE-3 target layers whose inputs feed fc (default (2, L//2, L-3))."""
    epochs: int = 1
    """Passes over the training split (ignored once ``steps`` is reached)."""
    steps: int | None = None
    """Stop after this many optimizer steps."""
    lr: float = 3e-4
    """AdamW peak learning rate (linear warmup over 5% of steps, then cosine)."""
    batch_size: int = 4
    """Sequences per optimizer step (per process)."""
    seq_len: int = 512
    """Sequences are cut to this many tokens."""
    seed: int = 0
    """Seed for the split, shuffling and initialisation."""
    eval_split: float = 0.05
    """Fraction of sequences held out for evaluation (at least 1 when > 0)."""
    resume: bool = False
    """Continue from output/checkpoint."""
    self_distill: str | list[str] | None = None
    """Prompts (a workload name such as code-edit or chat, a .jsonl or .txt file; one or several): the target answers them (greedy)."""
    distill_max_prompts: int | None = None
    """Self-distillation: answer at most the first N prompts of each source."""
    hold_out: int = 0
    """With a workload name for self_distill: leave its first N prompts out (those `bench -n N` runs)."""
    max_new_tokens: int = 256
    """Self-distillation: tokens generated per prompt."""
    cache_hidden_states: str | None = None
    """Folder of safetensors shards with the target's states, computed once and reused."""
    dtype: str = "float32"
    """Target dtype while computing states (the draft trains in fp32)."""
    eval_every: int = 50
    """Optimizer steps between evaluations and checkpoints."""
    prompt_rows: float = 1.0
    """Fraction of the non-answer rows (prompt tokens of chat records) unrolled and learnt each step;
    answer rows (and all of a plain text) always are. < 1 spends the compute on the answers."""
    fc_init: str = "random"
    """EAGLE-3 fc initialisation: random, or last (the identity on the deepest aux layer, zeros elsewhere)."""
    autocast: bool = False
    """Run the draft's matmuls in bfloat16 (autocast; weights and optimizer stay fp32)."""

    def validated(self) -> "EagleTrainConfig":
        if self.version not in (1, 3):
            raise UsageError(f"--version must be 3 or 1, got {self.version}", "use --version 3 (EAGLE-3) or --version 1")
        if self.ttt_steps is None:
            self.ttt_steps = 4 if self.version == 3 else 1
        for name, v, lo in (("ttt-steps", self.ttt_steps, 1), ("epochs", self.epochs, 1), ("batch-size", self.batch_size, 1),
                            ("seq-len", self.seq_len, 8), ("max-new-tokens", self.max_new_tokens, 1)):
            if v < lo:
                raise UsageError(f"--{name} must be >= {lo}, got {v}", f"pass --{name} {lo} or more")
        if self.steps is not None and self.steps < 1:
            raise UsageError(f"--steps must be >= 1, got {self.steps}", "pass --steps 1 or more")
        if not 0.0 <= self.eval_split < 1.0:
            raise UsageError(f"--eval-split must be in [0, 1), got {self.eval_split}", "e.g. --eval-split 0.05")
        if self.lr <= 0:
            raise UsageError(f"--lr must be positive, got {self.lr}", "e.g. --lr 3e-4")
        if self.data is None and self.self_distill is None:
            raise UsageError("no training data", "pass --data FILE or --self-distill PROMPTS")
        if self.fc_init not in ("random", "last"):
            raise UsageError(f"--fc-init must be random or last, got {self.fc_init}", "use --fc-init last or random")
        if not 0.0 <= self.prompt_rows <= 1.0:
            raise UsageError(f"--prompt-rows must be in [0, 1], got {self.prompt_rows}", "e.g. --prompt-rows 0.2")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise UsageError(f"--draft-vocab-size must be positive, got {self.draft_vocab_size}", "e.g. --draft-vocab-size 32000")
        return self


# --------------------------------------------------------------------------- data (specctl.training.data)

def _paths(x) -> list[str]:
    return [] if not x else [x] if isinstance(x, (str, Path)) else [str(p) for p in x]


def load_examples(cfg: EagleTrainConfig, loaded, log: Callable[[str], None]) -> tuple[list[list[int]], list[list[int]]]:
    """Training sequences (token ids, at most seq_len) and their learnt-token masks: --data records,
    then the target's answers to --self-distill prompts (``specctl.training.data``: formats, chat
    templates, the answer cache; records that carry exact ``prompt_ids``/``response_ids`` keep them).

    Every position has a target distribution (EAGLE's loss is against it), prompts included; the
    mask says which tokens are answers, the rows ``--prompt-rows`` < 1 concentrates on.
    """
    from specctl.training import data as D

    records = [r for path in _paths(cfg.data) for r in D.read_records(path)]
    if cfg.self_distill:
        requests, seen = [], set()
        for spec in _paths(cfg.self_distill):
            for r in D.load_prompts(spec, cfg.hold_out)[:cfg.distill_max_prompts]:
                if r.id not in seen:
                    seen.add(r.id)
                    requests.append(r)
        records += D.self_distill(loaded, requests, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                                  seq_len=cfg.seq_len, cache=Path(cfg.output) / "self_distill.jsonl", log=log)
    ex = [e for r in records for e in D.encode(loaded.tokenizer, r, cfg.seq_len, loaded.stop_token_ids)]
    if len(ex) < 2:
        raise DataError("fewer than 2 usable sequences in the training data", "pass more data (each record needs >= 4 tokens)")
    seqs, masks = [e.input_ids for e in ex], [list(e.loss_mask) for e in ex]
    log(f"{len(seqs)} sequences, {sum(map(len, seqs))} tokens ({sum(map(sum, masks))} answer tokens)")
    return seqs, masks


def load_sequences(cfg: EagleTrainConfig, loaded, log: Callable[[str], None]) -> list[list[int]]:
    """The token ids of ``load_examples``."""
    return load_examples(cfg, loaded, log)[0]


def batches(idx: list[int], lengths: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """One epoch's batches: a seeded shuffle, then sequences of similar length grouped (sorted within
    windows of 32 batches, so little padding), the batches in a seeded random order."""
    rng = random.Random(seed)
    perm = list(idx)
    rng.shuffle(perm)
    win = 32 * batch_size
    out = []
    for w in range(0, len(perm), win):
        chunk = sorted(perm[w:w + win], key=lambda i: lengths[i])
        out += [chunk[s:s + batch_size] for s in range(0, len(chunk), batch_size)]
    rng.shuffle(out)
    return out


# --------------------------------------------------------------------------- target states

def pad_batch(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [B, T] (right-padded with 0), lengths [B]."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s, dtype=torch.long)
    return ids, torch.tensor([len(s) for s in seqs])


@torch.no_grad()
def target_states(model, ids: torch.Tensor, aux_layers: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """The target over ids [B, T]: hidden [B, T, H] (final-normed), argmax [B, T], and with
    ``aux_layers`` aux [B, T, A*H] (the inputs of those layers, EAGLE-3). The model is left as found."""
    from specctl.runtime.model import KVCache

    B, T = ids.shape
    dev = model.embed.weight.device
    cache = KVCache(model.args, B, T, model.embed.weight.dtype, dev)
    mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    saved = model.aux_layers
    model.aux_layers = tuple(aux_layers)
    try:
        _, h = model(ids.to(dev), 0, cache, mask if T > 1 else None, logits="none")
        aux = model.aux_out
    finally:
        model.aux_layers = saved
    out = {"hidden": h.float(), "argmax": F.linear(h, model.head_weight).argmax(-1).cpu()}
    if aux_layers:
        out["aux"] = aux.float()
    return out


class StateSource:
    """Target states for a batch of sequence indices: computed online, or read from a disk cache.

    ``masks`` (one 0/1 list per sequence, 1 on learnt tokens): row t is an answer row when the token
    it reads, x[t+1], is learnt; ``batch`` unrolls those rows and a random ``prompt_rows`` fraction
    of the others (1.0: every row, None masks: every row is an answer row).
    """

    def __init__(self, model, seqs: list[list[int]], aux_layers: tuple[int, ...], cache_dir: str | None, key: dict, log,
                 masks: list[list[int]] | None = None):
        self.model, self.seqs, self.aux_layers = model, seqs, tuple(aux_layers)
        self.masks = masks
        self.need_aux = bool(aux_layers)
        self.cache: dict[int, dict[str, torch.Tensor]] | None = None
        if cache_dir:
            self.cache = _cached_states(model, seqs, self.aux_layers, Path(cache_dir), key, log)

    def batch(self, idx: list[int], prompt_rows: float = 1.0, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        ids, lengths = pad_batch([self.seqs[i] for i in idx])
        if self.cache is None:
            st = target_states(self.model, ids, self.aux_layers)
        else:
            T = ids.shape[1]
            st = {}
            for name in ("hidden", "argmax") + (("aux",) if self.need_aux else ()):
                rows = [self.cache[i][name] for i in idx]
                buf = torch.zeros((len(idx), T) + rows[0].shape[1:], dtype=torch.float32 if name != "argmax" else torch.long)
                for b, r in enumerate(rows):
                    buf[b, :r.shape[0]] = r.to(buf.dtype)
                st[name] = buf
        st.update(ids=ids, lengths=lengths)
        st.update(self._rows(idx, ids.shape[1], prompt_rows, generator))
        return st

    def _rows(self, idx: list[int], T: int, prompt_rows: float, generator) -> dict[str, torch.Tensor]:
        B = len(idx)
        if self.masks is None or prompt_rows >= 1.0:
            return {"rows": all_rows(B, T).contiguous(), "row_mask": torch.ones(B, T, dtype=torch.bool)}
        chosen = []
        for i in idx:
            m = torch.tensor(self.masks[i][1:] + [0], dtype=torch.bool)  # row t: x[t+1] is learnt
            if prompt_rows > 0:
                m = m | (torch.rand(m.shape, generator=generator) < prompt_rows)
            chosen.append(m.nonzero()[:, 0])
        R = max(1, max(len(c) for c in chosen))
        rows = torch.zeros(B, R, dtype=torch.long)
        row_mask = torch.zeros(B, R, dtype=torch.bool)
        for b, c in enumerate(chosen):
            rows[b, :len(c)] = c
            row_mask[b, :len(c)] = True
        return {"rows": rows, "row_mask": row_mask}


def _cached_states(model, seqs, aux_layers: tuple[int, ...], folder: Path, key: dict, log) -> dict[int, dict[str, torch.Tensor]]:
    """Load the shards in ``folder`` when their index matches ``key``, else compute and write them."""
    from safetensors.torch import load_file, save_file

    index = folder / "index.json"
    need_aux = bool(aux_layers)
    key = dict(key, num_sequences=len(seqs), tokens=sum(len(s) for s in seqs), aux=list(aux_layers))
    if index.exists():
        meta = json.loads(index.read_text())
        if meta.get("key") == key:
            out: dict[int, dict[str, torch.Tensor]] = {}
            for shard in meta["shards"]:
                for name, t in load_file(str(folder / shard)).items():
                    i, field_ = name.split(".", 1)
                    out.setdefault(int(i), {})[field_] = t
            log(f"reusing cached target states from {folder} ({len(out)} sequences)")
            return out
        log(f"cached states in {folder} were made for other data or settings: recomputing")
    folder.mkdir(parents=True, exist_ok=True)
    out, shards, cur, per_shard = {}, [], {}, 64
    for start in range(0, len(seqs), 8):
        idx = list(range(start, min(start + 8, len(seqs))))
        ids, lengths = pad_batch([seqs[i] for i in idx])
        st = target_states(model, ids, aux_layers)
        for b, i in enumerate(idx):
            n = int(lengths[b])
            row = {"hidden": st["hidden"][b, :n].to(torch.bfloat16), "argmax": st["argmax"][b, :n].cpu()}
            if need_aux:
                row["aux"] = st["aux"][b, :n].to(torch.bfloat16)
            out[i] = row
            cur.update({f"{i}.{k}": v.contiguous().cpu() for k, v in row.items()})
        if len(cur) >= per_shard * len(row) or idx[-1] == len(seqs) - 1:
            name = f"shard-{len(shards):05d}.safetensors"
            save_file(cur, str(folder / (name + ".tmp")))
            os.replace(folder / (name + ".tmp"), folder / name)
            shards.append(name)
            cur = {}
        log(f"cached target states: {min(start + 8, len(seqs))}/{len(seqs)} sequences")
    tmp = folder / "index.json.tmp"
    tmp.write_text(json.dumps({"key": key, "shards": shards}, indent=1))
    os.replace(tmp, index)
    return out


# --------------------------------------------------------------------------- TTT forward and losses

def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """[T, (step+1)*T] bool: step-0 keys causal, keys of steps 1..step on the diagonal (see the docstring)."""
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([torch.ones(T, T, dtype=torch.bool, device=device).tril()] + [eye] * step, dim=1)


def shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, n:] padded at the end back to x's length: row t holds x[:, t+n]."""
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def all_rows(B: int, T: int, device=None) -> torch.Tensor:
    """[B, T] the row positions 0..T-1 of every sequence (``ttt_forward``'s default)."""
    return torch.arange(T, device=device).expand(B, T)


def _gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...], rows [B, R] (positions, clamped to T-1) -> x at those rows [B, R, ...]."""
    idx = rows.clamp(max=x.shape[1] - 1)
    return x.gather(1, idx.view(idx.shape + (1,) * (x.dim() - 2)).expand(idx.shape + x.shape[2:]))


def ttt_forward(draft: EagleDraft, embed_weight: torch.Tensor, ids: torch.Tensor, feat: torch.Tensor,
                steps: int, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """ids [B, T], feat [B, T, H] (the target's features) -> [out_i [B, R, H] for i < steps].

    ``rows`` [B, R]: the row positions t whose chains are unrolled (default all T). Every position
    still gives its step-0 key/value (a chain from row t attends to the feature rows 0..t), but the
    queries, the MLP and the later steps run on the chosen rows only: on a long prompt the rows
    that matter (the answer) cost what they cost, the rest only fc and the k/v projections.

    Attention is what ``ttt_mask`` draws, computed without materialising it: scores against the
    step-0 keys (causal) plus, for each earlier step j >= 1, one score per row against that step's
    key on the diagonal (q_t . k_j[t]); one softmax over both.
    """
    lay, a = draft.midlayer, draft.spec.args
    B, T = ids.shape
    if rows is None:
        rows = all_rows(B, T, ids.device)
    attn = lay.self_attn
    nh, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
    rep = nh // nkv
    scale = 1.0 / math.sqrt(hd)

    def heads(x, n):  # [B, R, n*hd] -> [B, n, R, hd]
        return x.view(x.shape[0], x.shape[1], n, hd).transpose(1, 2)

    def rope(x, cos, sin):
        return x * cos + rotate_half(x) * sin

    def expand_kv(x):
        return x.repeat_interleave(rep, 1) if rep > 1 else x

    # step 0 over every position: the keys/values all chains attend to
    emb0 = embed_weight[shift(ids, 1)].float()  # [B, T, H] token x[t+1]
    x0 = draft.layer_input(emb0, feat)
    xin0 = lay.attn_input(emb0, x0)  # [B, T, in]
    cos, sin = rope_cos_sin(draft.inv_freq, torch.arange(T, device=ids.device))
    k0 = expand_kv(rope(heads(attn.k_proj(xin0), nkv), cos, sin))  # [B, nh, T, hd]
    v0 = expand_kv(heads(attn.v_proj(xin0), nkv))
    visible = torch.arange(T, device=ids.device)[None, None, :] <= rows[:, :, None]  # [B, R, T]
    keys, vals, outs = [], [], []
    h, x, xin = None, _gather_rows(x0, rows), _gather_rows(xin0, rows)
    for i in range(steps):
        cos, sin = rope_cos_sin(draft.inv_freq, rows + i)  # [B, R, hd]
        cos, sin = cos[:, None], sin[:, None]
        if i > 0:
            emb = embed_weight[ids.gather(1, (rows + 1 + i).clamp(max=T - 1))].float()  # [B, R, H] token x[t+1+i]
            x = draft.layer_input(emb, h)
            xin = lay.attn_input(emb, x)
            keys.append(expand_kv(rope(heads(attn.k_proj(xin), nkv), cos, sin)))  # [B, nh, R, hd]
            vals.append(expand_kv(heads(attn.v_proj(xin), nkv)))
        q = rope(heads(attn.q_proj(xin), nh), cos, sin)  # [B, nh, R, hd]
        s0 = torch.matmul(q, k0.transpose(-1, -2)).mul(scale).masked_fill(~visible[:, None], float("-inf"))  # [B, nh, R, T]
        if i == 0:
            att = torch.matmul(torch.softmax(s0, -1), v0)
        else:
            sd = torch.stack([(q * kj).sum(-1) for kj in keys], -1) * scale  # [B, nh, R, i]
            w = torch.softmax(torch.cat([s0, sd], -1), -1)
            att = torch.matmul(w[..., :T], v0)
            for j, vj in enumerate(vals):
                att = att + w[..., T + j, None] * vj
        h = lay.finish(att, x)  # [B, R, H]
        outs.append(h)
    return outs


def step_valid(lengths: torch.Tensor, T: int, i: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[B, R] bool: row t has a target position t+1+i inside the sequence (rows default: all T)."""
    if rows is None:
        rows = all_rows(lengths.shape[0], T, lengths.device)
    return (rows + 1 + i) < lengths[:, None]


def eagle_losses(draft: EagleDraft, outs: list[torch.Tensor], st: dict, head_weight: torch.Tensor,
                 decay: float = 0.8) -> tuple[torch.Tensor, dict]:
    """The weighted TTT loss and per-step accuracy counts (see the module docstring).

    ``st`` may carry ``rows`` [B, R] (the rows ``ttt_forward`` unrolled) and ``row_mask`` [B, R]
    (False on padding rows); default every row.
    """
    lengths, hidden, targmax = st["lengths"], st["hidden"], st["argmax"]
    B, T = targmax.shape
    rows = st.get("rows")
    if rows is None:
        rows = all_rows(B, T, targmax.device)
    row_mask = st.get("row_mask")
    tids = draft.target_ids.to(hidden.device)
    w_draft = head_weight[tids].float() if draft.version == 3 else None
    total = hidden.new_zeros(())
    stats = {"loss": [], "correct": [], "rows": []}
    ok_chain = torch.ones(rows.shape, dtype=torch.bool, device=targmax.device)
    for i, o in enumerate(outs):
        valid = step_valid(lengths, T, i, rows)
        if row_mask is not None:
            valid = valid & row_mask
        am_next = _gather_rows(targmax, rows + 1 + i)  # [B, R] the target's argmax at t+1+i
        h_next = _gather_rows(hidden, rows + 1 + i)  # [B, R, H] the target's state at t+1+i
        logits = draft.logits(o, head_weight)  # [B, R, N]
        if draft.version == 3:
            with torch.no_grad():
                p = torch.softmax(F.linear(h_next.float(), w_draft), -1)  # [B, R, N] over the draft vocabulary
            m = valid & draft.t2d[am_next]
            lf = logits.float()
            loss_i = _masked_mean(torch.logsumexp(lf, -1) - (p * lf).sum(-1), m)  # soft CE (sum p = 1)
        else:
            p = torch.softmax(F.linear(h_next.to(head_weight.dtype), head_weight).float(), -1)  # [B, R, V]
            ce = _masked_mean(-(p * torch.log_softmax(logits.float(), -1)).sum(-1), valid)
            reg = _masked_mean(F.smooth_l1_loss(o.float(), h_next.float(), reduction="none").mean(-1), valid)
            loss_i = reg + 0.1 * ce
        total = total + decay ** i * loss_i
        with torch.no_grad():
            ok_chain = ok_chain & (tids[logits.argmax(-1)] == am_next)
            stats["loss"].append(float(loss_i))
            stats["correct"].append(int((ok_chain & valid).sum()))
            stats["rows"].append(int(valid.sum()))
    return total, stats


def _to(st: dict, device) -> dict:
    return {k: v.to(device) for k, v in st.items()}


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    m = m.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


@torch.no_grad()
def evaluate(draft, embed_weight, head_weight, source: "StateSource", idx: list[int], steps: int, batch: int) -> dict:
    """Per-position acceptance and simulated acceptance length on rows with all ``steps`` positions
    inside, among the rows that are learnt (the answers of chat records; all of a text)."""
    correct = [0] * steps
    rows_n = 0
    losses = []
    for s in range(0, len(idx), batch):
        st = _to(source.batch(idx[s:s + batch], prompt_rows=0.0), draft.fc.weight.device)
        outs = ttt_forward(draft, embed_weight, st["ids"], draft.feature(st["hidden"], st.get("aux")), steps, st["rows"])
        loss, _ = eagle_losses(draft, outs, st, head_weight)
        losses.append(float(loss))
        T = st["ids"].shape[1]
        full = step_valid(st["lengths"], T, steps - 1, st["rows"]) & st["row_mask"]  # rows where every step is scored
        tids = draft.target_ids
        ok = torch.ones_like(full)
        for i, o in enumerate(outs):
            ok = ok & (tids[draft.logits(o, head_weight).argmax(-1)] == _gather_rows(st["argmax"], st["rows"] + 1 + i))
            correct[i] += int((ok & full).sum())
        rows_n += int(full.sum())
    acc = [c / rows_n if rows_n else 0.0 for c in correct]
    return {"eval_loss": sum(losses) / max(len(losses), 1), "acceptance_per_position": acc,
            "simulated_acceptance_length": 1.0 + sum(acc), "eval_rows": rows_n}


# --------------------------------------------------------------------------- trainer

def build_draft(target, cfg: EagleTrainConfig, seqs: list[list[int]], tok) -> EagleDraft:
    """A fresh draft: lm_head rows and norm from the target's (EAGLE-3), d2t/t2d from token frequencies."""
    from specctl.runtime.vocab_map import reduced_vocab_from_counts

    a = target.args
    n = min(cfg.draft_vocab_size or 32000, a.vocab_size) if cfg.version == 3 else a.vocab_size
    spec = spec_from_target(a, cfg.version, n, cfg.aux_layers)
    draft = EagleDraft(spec)
    if cfg.version == 3:
        counts = torch.zeros(a.vocab_size, dtype=torch.int64)
        for s in seqs:
            t = torch.tensor([i for i in s if i < a.vocab_size], dtype=torch.int64)
            counts.index_add_(0, t, torch.ones_like(t))
        always = [i for i in (getattr(tok, "all_special_ids", None) or []) if i < a.vocab_size]
        vocab = reduced_vocab_from_counts(counts, n, always)
        with torch.no_grad():
            draft.d2t.copy_(vocab.d2t)
            draft.t2d.copy_(vocab.t2d)
            draft.lm_head.weight.copy_(target.head_weight[vocab.target_ids].float())
            draft.norm.weight.copy_(target.norm.weight.float())
            if cfg.fc_init == "last":  # start from the deepest aux state: already in the space the LM head reads
                H = a.hidden_size
                draft.fc.weight.zero_()
                draft.fc.weight[:, -H:] = torch.eye(H)
    return draft


def _atomic_save_dir(folder: Path, write: Callable[[Path], None]) -> None:
    """Write into folder.tmp, then swap it in for folder (a crash leaves the old or the new one whole)."""
    tmp, old = folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def export_dir(cfg: EagleTrainConfig) -> Path:
    """Where the draft goes: output itself when its name says eagle3 (eagle), else output/<target>-eagle3."""
    out, tag = Path(cfg.output), "eagle3" if cfg.version == 3 else "eagle"
    if tag in out.name.lower():
        return out
    return out / f"{Path(cfg.model).name}-{tag}"


def train(cfg: EagleTrainConfig, loaded=None, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> dict:
    """Run a whole training; returns the summary (metrics, export folder, timings)."""
    from specctl.runtime.runner import load_model

    cfg.validated()
    t_start = time.perf_counter()
    try:
        from accelerate import Accelerator

        acc = Accelerator(cpu=not torch.cuda.is_available())
    except ImportError:  # accelerate is optional: one process
        acc = None
    main = acc is None or acc.is_main_process
    log = log if main else (lambda m: None)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if loaded is None:
        log(f"loading target {cfg.model}")
        loaded = load_model(cfg.model, dtype=cfg.dtype, device=str(acc.device) if acc else "cpu")
    target = loaded.model
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / CKPT
    resume_state = None
    if cfg.resume:
        if not (ckpt / "state.pt").exists():
            raise UsageError(f"--resume: no checkpoint in {ckpt}", "drop --resume to start a new run")
        resume_state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False)
        seqs = resume_state["seqs"]
        masks = resume_state.get("masks") or [[1] * len(x) for x in seqs]
        log(f"resuming from step {resume_state['step']}")
    else:
        seqs, masks = load_examples(cfg, loaded, log)
    rng = random.Random(cfg.seed)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    n_eval = 0 if cfg.eval_split == 0 else max(1, int(round(cfg.eval_split * len(seqs))))
    eval_idx, train_idx = sorted(order[:n_eval]), order[n_eval:]
    if acc is not None and acc.num_processes > 1:
        train_idx = train_idx[acc.process_index::acc.num_processes]

    draft = build_draft(target, cfg, seqs, loaded.tokenizer)
    spec = draft.spec
    key = {"model": str(Path(cfg.model).resolve()), "version": cfg.version, "aux_layers": list(spec.aux_layers),
           "seq_len": cfg.seq_len, "dtype": cfg.dtype}
    source = StateSource(target, seqs, tuple(spec.aux_layers) if cfg.version == 3 else (), cfg.cache_hidden_states, key, log,
                         masks=masks)
    embed_w, head_w = target.embed.weight, target.head_weight
    lengths = [len(x) for x in seqs]
    steps_per_epoch = len(batches(train_idx, lengths, cfg.batch_size, 0))
    total_steps = cfg.steps or steps_per_epoch * cfg.epochs
    draft = draft.to(target.embed.weight.device)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    warm = max(1, total_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps))))
    step, epoch, history = 0, 0, []
    if resume_state is not None:
        draft.load_state_dict(resume_state["draft"])
        opt.load_state_dict(resume_state["opt"])
        sched.load_state_dict(resume_state["sched"])
        step, history = resume_state["step"], resume_state["history"]
        torch.set_rng_state(resume_state["torch_rng"])
    core = draft.to(embed_w.device)  # gradients are averaged by hand across processes (see the loop)

    def save_checkpoint():
        if not main:
            return
        state = {"draft": core.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step,
                 "epoch": epoch, "history": history, "seqs": seqs, "masks": masks, "torch_rng": torch.get_rng_state()}

        def write(d: Path):
            torch.save(state, d / "state.pt")
            (d / "train_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))

        _atomic_save_dir(ckpt, write)

    def run_eval() -> dict:
        core.eval()
        r = evaluate(core, embed_w, head_w, source, eval_idx, cfg.ttt_steps, cfg.batch_size) if eval_idx else {}
        core.train()
        return r

    log(f"training EAGLE-{cfg.version}: {len(train_idx)} train / {len(eval_idx)} eval sequences, "
        f"{total_steps} steps, ttt {cfg.ttt_steps}, draft vocab {spec.draft_vocab_size}, aux layers {list(spec.aux_layers)}")
    draft.train()
    t_loop = time.perf_counter()
    last = {}
    while step < total_steps:
        # the epoch and the place in it follow from the step alone, so a resumed run continues exactly
        epoch = step // steps_per_epoch
        epoch_batches = batches(train_idx, lengths, cfg.batch_size, cfg.seed * 1000 + epoch)
        for bidx in epoch_batches[step % steps_per_epoch:]:
            if step >= total_steps:
                break
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # the rows of this step, also on resume
            st = _to(source.batch(bidx, cfg.prompt_rows, gen), core.fc.weight.device)
            with torch.autocast(core.fc.weight.device.type, dtype=torch.bfloat16, enabled=cfg.autocast):
                outs = ttt_forward(core, embed_w, st["ids"], core.feature(st["hidden"], st.get("aux")), cfg.ttt_steps,
                                   st["rows"])
                loss, stats = eagle_losses(core, outs, st, head_w)
            opt.zero_grad(set_to_none=True)
            if acc is not None:
                acc.backward(loss)
            else:
                loss.backward()
            if acc is not None and acc.num_processes > 1:  # data parallel: average the gradients
                for p in core.parameters():
                    if p.grad is not None:
                        p.grad = acc.reduce(p.grad, reduction="mean")
            torch.nn.utils.clip_grad_norm_(core.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            last = {"step": step, "loss": float(loss.detach()),
                    "train_acc": [c / r if r else 0.0 for c, r in zip(stats["correct"], stats["rows"])]}
            if step % 10 == 0 or step == total_steps:
                log(f"step {step}/{total_steps} loss {last['loss']:.3f} acc@0 {last['train_acc'][0]:.2f} "
                    f"({time.perf_counter() - t_loop:.0f}s)")
            if step % cfg.eval_every == 0 or step == total_steps:
                ev = run_eval()
                history.append(dict(last, **ev))
                if ev:
                    log(f"eval @ {step}: per-position acceptance {[round(x, 3) for x in ev['acceptance_per_position']]}, "
                        f"simulated acceptance length {ev['simulated_acceptance_length']:.2f}")
                epoch = step // steps_per_epoch
                save_checkpoint()
    export = export_dir(cfg)
    if main:
        export_eagle(core, export, loaded)
        log(f"exported the draft to {export}")
    final = history[-1] if history else last
    return {"version": cfg.version, "export": str(export), "checkpoint": str(ckpt), "steps": step,
            "train_sequences": len(train_idx), "eval_sequences": len(eval_idx),
            "draft_vocab_size": spec.draft_vocab_size, "aux_layers": list(spec.aux_layers), "ttt_steps": cfg.ttt_steps,
            "final": final, "wall_s": round(time.perf_counter() - t_start, 1)}
