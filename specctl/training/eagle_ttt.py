"""EAGLE's training-time test (TTT): the unrolled forward, its losses, and the held-out evaluation.

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
masked (as SpecForge); with ``feature_w`` > 0 plus feature_w * smoothL1(norm(out), f_{t+1+i}): the
draft's final-normed state against the target's, which carries the whole vocabulary's distribution
where the soft CE sees the draft vocabulary's (EAGLE-1's regression, in the space the LM head reads).
EAGLE-1: sum_i 0.8^i * (smoothL1(out, f_{t+1+i}) + 0.1 * softCE(head(out), p)).
Each step's loss is a mean over its scored rows: over a batch, or (``den``) over a whole global batch.

Evaluation (greedy, teacher-forced): step i at row t is accepted when steps 0..i all predict the
target's argmax; per-position acceptance = P(accepted at i), simulated acceptance length =
1 + sum_i P(accepted at i). Exact for chain drafting when the data is the target's greedy output.

What it does not know: the data, the loop, the network's files (``specctl.drafts.eagle_files``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specctl.drafts.eagle import EagleDraft, rope_cos_sin
from specctl.modeling import rotate_half
from specctl.training.eagle_states import StateSource, all_rows


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """[T, (step+1)*T] bool: step-0 keys causal, keys of steps 1..step on the diagonal (see the docstring)."""
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([torch.ones(T, T, dtype=torch.bool, device=device).tril()] + [eye] * step, dim=1)


def shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, n:] padded at the end back to x's length: row t holds x[:, t+n]."""
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


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


def step_masks(draft: EagleDraft, st: dict, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TTT step i over the unrolled rows [B, R]: (valid: the row has a position t+1+i in its sequence and
    is not padding; scored: valid and, EAGLE-3, the target's argmax there is in the draft vocabulary;
    the target's argmax at t+1+i)."""
    B, T = st["argmax"].shape
    rows = st.get("rows")
    if rows is None:
        rows = all_rows(B, T, st["argmax"].device)
    valid = step_valid(st["lengths"], T, i, rows)
    if st.get("row_mask") is not None:
        valid = valid & st["row_mask"]
    am_next = _gather_rows(st["argmax"], rows + 1 + i)
    scored = valid & draft.t2d[am_next] if draft.version == 3 else valid
    return valid, scored, am_next


def step_counts(draft: EagleDraft, st: dict, steps: int) -> torch.Tensor:
    """[steps] the scored rows of each TTT step (the loss's denominators), before any forward."""
    return torch.stack([step_masks(draft, st, i)[1].sum() for i in range(steps)]).float()


def eagle_losses(draft: EagleDraft, outs: list[torch.Tensor], st: dict, head_weight: torch.Tensor,
                 decay: float = 0.8, den: torch.Tensor | None = None, feature_w: float = 0.0) -> tuple[torch.Tensor, dict]:
    """The weighted TTT loss and per-step accuracy counts (see the module docstring).

    ``st`` may carry ``rows`` [B, R] (the rows ``ttt_forward`` unrolled) and ``row_mask`` [B, R]
    (False on padding rows); default every row. Step i's loss is a sum over its scored rows divided by
    ``den[i]`` ([steps], e.g. the count over a whole global batch), default this batch's count.
    """
    hidden = st["hidden"]
    rows = st.get("rows")
    if rows is None:
        rows = all_rows(*st["argmax"].shape, st["argmax"].device)
    tids = draft.target_ids.to(hidden.device)
    w_draft = head_weight[tids].float() if draft.version == 3 else None
    total = hidden.new_zeros(())
    stats = {"loss": [], "correct": [], "rows": []}
    ok_chain = torch.ones(rows.shape, dtype=torch.bool, device=rows.device)
    for i, o in enumerate(outs):
        valid, m, am_next = step_masks(draft, st, i)  # [B, R] each
        h_next = _gather_rows(hidden, rows + 1 + i)  # [B, R, H] the target's state at t+1+i
        logits = draft.logits(o, head_weight)  # [B, R, N]
        if draft.version == 3:
            with torch.no_grad():
                p = torch.softmax(F.linear(h_next.float(), w_draft), -1)  # [B, R, N] over the draft vocabulary
            lf = logits.float()
            per_row = torch.logsumexp(lf, -1) - (p * lf).sum(-1)  # soft CE (sum p = 1)
            if feature_w:
                per_row = per_row + feature_w * F.smooth_l1_loss(draft.norm(o).float(), h_next.float(),
                                                                 reduction="none").mean(-1)
        else:
            p = torch.softmax(F.linear(h_next.to(head_weight.dtype), head_weight).float(), -1)  # [B, R, V]
            ce = -(p * torch.log_softmax(logits.float(), -1)).sum(-1)
            reg = F.smooth_l1_loss(o.float(), h_next.float(), reduction="none").mean(-1)
            per_row = reg + 0.1 * ce
        mf = m.to(per_row.dtype)
        loss_i = (per_row * mf).sum() / (mf.sum() if den is None else den[i]).clamp(min=1.0)
        total = total + decay ** i * loss_i
        with torch.no_grad():
            ok_chain = ok_chain & (tids[logits.argmax(-1)] == am_next)
            stats["loss"].append(float(loss_i))
            stats["correct"].append(int((ok_chain & valid).sum()))
            stats["rows"].append(int(valid.sum()))
    return total, stats


class TttLoss(nn.Module):
    """The draft's training forward as one module call, what DDP wraps: the TTT unroll and its loss.

    The target's embedding and LM head are held as plain tensors (not this module's parameters, so
    DDP neither copies nor syncs them)."""

    def __init__(self, draft: EagleDraft, embed_weight: torch.Tensor, head_weight: torch.Tensor, steps: int,
                 feature_w: float = 0.0):
        super().__init__()
        self.draft, self.steps, self.feature_w = draft, steps, feature_w
        self.frozen = (embed_weight, head_weight)

    def forward(self, st: dict, den: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        embed_weight, head_weight = self.frozen
        outs = ttt_forward(self.draft, embed_weight, st["ids"], self.draft.feature(st["hidden"], st.get("aux")),
                           self.steps, st["rows"])
        return eagle_losses(self.draft, outs, st, head_weight, den=den, feature_w=self.feature_w)


def to_device(st: dict, device) -> dict:
    return {k: v.to(device) for k, v in st.items()}


@torch.no_grad()
def evaluate(draft, embed_weight, head_weight, source: "StateSource", idx: list[int], steps: int, batch: int) -> dict:
    """Per-position acceptance and simulated acceptance length on rows with all ``steps`` positions
    inside, among the rows that are learnt (the answers of chat records; all of a text)."""
    correct = [0] * steps
    rows_n = 0
    losses = []
    walk_drafts = walk_accepted = 0
    for s in range(0, len(idx), batch):
        st = to_device(source.batch(idx[s:s + batch], prompt_rows=0.0), draft.fc.weight.device)
        outs = ttt_forward(draft, embed_weight, st["ids"], draft.feature(st["hidden"], st.get("aux")), steps, st["rows"])
        loss, _ = eagle_losses(draft, outs, st, head_weight)
        losses.append(float(loss))
        T = st["ids"].shape[1]
        full = step_valid(st["lengths"], T, steps - 1, st["rows"]) & st["row_mask"]  # rows where every step is scored
        tids = draft.target_ids
        ok = torch.ones_like(full)
        run = torch.zeros(full.shape, dtype=torch.long, device=full.device)  # [B, R] leading steps right from each row
        for i, o in enumerate(outs):
            ok = ok & (tids[draft.logits(o, head_weight).argmax(-1)] == _gather_rows(st["argmax"], st["rows"] + 1 + i))
            correct[i] += int((ok & full).sum())
            run += ok.long()
        rows_n += int(full.sum())
        d, a = _walk(st["rows"].tolist(), full.tolist(), run.tolist())
        walk_drafts, walk_accepted = walk_drafts + d, walk_accepted + a
    acc = [c / rows_n if rows_n else 0.0 for c in correct]
    return {"eval_loss": sum(losses) / max(len(losses), 1), "acceptance_per_position": acc,
            "simulated_acceptance_length": 1.0 + sum(acc), "eval_rows": rows_n,
            "decoding_acceptance_length": 1.0 + walk_accepted / walk_drafts if walk_drafts else 1.0}


def _walk(rows: list[list[int]], full: list[list[bool]], run: list[list[int]]) -> tuple[int, int]:
    """(drafts, accepted drafts) of greedy chain decoding over each sequence's answer rows: a draft
    starts at the first row, keeps its leading right steps, and the next starts one token past them.
    Decoding spends more steps where the draft is wrong (it advances less there), which the average
    over every row (``simulated_acceptance_length``) weighs as little as anywhere else."""
    drafts = accepted = 0
    for pos, ok, n in zip(rows, full, run):
        at = {p: j for j, p in enumerate(pos) if ok[j]}
        p = min(at, default=None)
        while p is not None and p in at:
            a = n[at[p]]
            drafts, accepted = drafts + 1, accepted + a
            p += a + 1
    return drafts, accepted
