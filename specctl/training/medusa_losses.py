"""Medusa heads' training math (Cai et al., arXiv 2401.10774): the targets each head learns, the losses,
the frozen target's features, and the held-out metrics. Pure functions over tensors.

Index convention (the proposer's and vLLM's): for a sequence x[0:T] the target's final-normed hidden
state h_t at position t is what its LM head reads to predict x[t+1]. Medusa head k (0-based) reads
the same h_t and predicts x[t+k+2]: with the decode loop's ``hidden`` (the row that produced the
last emitted token ``last`` = x[t+1]), head 0 drafts the token after ``last``, head 1 the one after
that, and so on. Worked: T = 6, K = 2 heads, response = x[3:6]. Row t = 1 trains head 0 on x[3] and
head 1 on x[4]; row t = 3 trains head 0 on x[5] and head 1 on nothing (x[6] does not exist); row
t = 0 trains head 1 on x[3] only (x[2] is prompt).

Losses: Medusa-1 (frozen target): sum_k 0.8^k CE_k. Medusa-2 (joint, LoRA): CE_base + 0.2 * sum_k
0.8^k CE_k. With soft labels CE_k is taken against the target's own distribution at position t+k+1
(p over x[t+k+2]) instead of the token in the data.

Metrics (teacher-forced, greedy): head k at row t is right when its top-1 equals the target's argmax
at t+k+1; chain acceptance length = 1 + E[number of leading heads that are right], exactly what
greedy chain drafting with k = K accepts when the data is the target's own greedy output.

What it does not know: the loop, the network and its files (``specctl.drafts.medusa``), data formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

HEAD_DECAY = 0.8  # weight of head k's loss: HEAD_DECAY ** k
JOINT_HEADS_WEIGHT = 0.2  # Medusa-2: loss = CE_base + 0.2 * heads' loss


# --------------------------------------------------------------------------- losses and metrics

def head_weights(num_heads: int, decay: float = HEAD_DECAY) -> list[float]:
    return [decay ** k for k in range(num_heads)]


def head_ce_sums(logits: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head summed cross-entropy over valid rows.

    logits [N, K, V'] (head rows); targets [N, K] LM-head rows, -1 = not trained; teacher [N, K, V']
    probabilities (soft labels) or None (the targets are the labels). Returns [K] sums (fp32).
    """
    valid = targets >= 0  # [N, K]
    logp = torch.log_softmax(logits.float(), -1)  # [N, K, V']
    if teacher is None:
        ce = -logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)  # [N, K]
    else:
        ce = -(teacher * logp).sum(-1)  # [N, K]
    return torch.where(valid, ce, torch.zeros_like(ce)).sum(0)


def chain_acceptance(right: torch.Tensor) -> torch.Tensor:
    """right [N, K] bool: head k right at row n -> [N] accepted drafts of a greedy chain (leading run)."""
    return torch.cumprod(right.int(), -1).sum(-1)


ProgressFn = Callable[[str, int, int], None]  # (phase, done, total)


def _noop(*_a, **_k) -> None:
    return None


@dataclass
class Features:
    """Everything Medusa-1 needs from the frozen target, computed once per sequence."""

    hidden: torch.Tensor  # [P, H] final-normed hidden states of every position of every sequence
    rows: torch.Tensor  # [M] long: rows of `hidden` (positions t) that train at least one head
    targets: torch.Tensor  # [M, K] long: vocab id of x[t+k+2], -1 where head k has nothing to learn at t

    @property
    def num_positions(self) -> int:
        return int(self.rows.numel())


def head_targets(ids: torch.Tensor, mask: torch.Tensor, K: int) -> torch.Tensor:
    """ids [T], mask [T] bool (response tokens) -> [T, K]: x[t+k+2] where it exists and is in the response, else -1."""
    T = ids.numel()
    out = torch.full((T, K), -1, dtype=torch.long)
    for k in range(K):
        j = torch.arange(T) + k + 2
        ok = j < T
        jj = j[ok]
        out[ok, k] = torch.where(mask[jj], ids[jj], torch.full_like(ids[jj], -1))
    return out


@torch.inference_mode()
def extract_features(model, examples: list, K: int, seq_len: int, progress: ProgressFn = _noop,
                     states: list[torch.Tensor] | None = None) -> Features:
    """Run the frozen target (the own runtime's Transformer) over each example once; ``states``: each
    example's hidden states already computed (a states cache's), the target not run."""
    from specctl.runtime.runner import TargetRunner

    runner = TargetRunner(model, max_len=seq_len) if states is None else None
    hidden, rows, targets, base = [], [], [], 0
    for i, ex in enumerate(examples):
        ids = torch.tensor(ex.input_ids[:seq_len], dtype=torch.long)
        mask = torch.tensor(ex.loss_mask[:seq_len], dtype=torch.bool)
        if runner is None:
            hidden.append(states[i][:ids.numel()].to(model.embed.weight.dtype))
        else:
            runner.reset()
            hidden.append(runner.run(ids[None].to(runner.device), logits="none").hidden[0].to("cpu"))
        tg = head_targets(ids, mask, K)
        keep = (tg >= 0).any(-1).nonzero().flatten()
        rows.append(keep + base)
        targets.append(tg[keep])
        base += ids.numel()
        progress("features", i + 1, len(examples))
    H = model.args.hidden_size
    return Features(torch.cat(hidden) if hidden else torch.zeros(0, H), torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long),
                    torch.cat(targets) if targets else torch.zeros(0, K, dtype=torch.long))


@torch.no_grad()
def target_argmax(hidden: torch.Tensor, head_weight: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """[P, H] hidden states -> [P] the target's greedy token at each (fp32 scores)."""
    w = head_weight.float()
    return torch.cat([(hidden[i:i + chunk].to(w.device).float() @ w.T).argmax(-1).cpu()
                      for i in range(0, hidden.shape[0], chunk)]) if hidden.shape[0] else torch.zeros(0, dtype=torch.long)


RANKS = 10  # rank accuracies kept per head (Medusa's tree construction reads them)


def metrics(loss: float, ranks: torch.Tensor, valid: torch.Tensor) -> dict:
    """ranks [N, K, R] (head k's rank-r token is the target's choice), valid [N, K]: per-head top-1 and
    rank accuracies over valid rows; chain acceptance over rows where all K are valid (``positions``
    counts those rows: the acceptance length is over them)."""
    right = ranks[..., 0]
    n = valid.sum(0).clamp(min=1).float()  # [K]
    rank_acc = ((ranks & valid[..., None]).sum(0).float() / n[:, None])  # [K, R]
    top1 = [round(float(x), 4) for x in rank_acc[:, 0]]
    full = valid.all(-1)
    acc_len = 1.0 + float(chain_acceptance(right[full]).float().mean()) if bool(full.any()) else 1.0
    return {"loss": round(loss, 5), "top1_per_head": top1, "acceptance_length": round(acc_len, 4),
            "rank_accuracy": [[round(float(x), 4) for x in row] for row in rank_acc],
            "positions": int(full.sum())}
