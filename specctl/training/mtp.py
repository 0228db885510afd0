"""Train MTP modules on a frozen target (DeepSeek-V3 §2.2; speculators' MTP fine-tuning), then export them.

The target runs once over each window of text (no grad) and gives h^0 [B, T, H] (its final-normed
hidden state, what the mtp proposer receives at inference) and its greedy labels y_j = argmax p_j.
Depth d (1..depth; module (d-1) % num_layers, as the proposer recurses) is unrolled over the whole
window exactly as ``specctl.drafts.mtp.mtp_step`` runs it at inference:

    h^d_j = MTP_d(h^{d-1}_j, emb(t_{j+d}))    for j in [0, T-d)
    loss  = sum_d w_d * CE(head(norm(h^d_j)), y_{j+d}),   w_d = beta^(d-1) / sum_d' beta^(d'-1), beta = 0.6

so depth d learns the target's own choice d+1 tokens ahead (the quantity greedy acceptance checks).
Only the MTP modules train (AdamW); the LM head is the target's, frozen and shared. Checkpoints
(modules + optimizer + step) are written atomically every ``checkpoint_every`` steps and resumed
with ``resume``; eval reports per-depth top-1 agreement and the expected acceptance length.

Data: text files/folders/.jsonl read by ``specctl.training.data``; ``self_distill`` (a prompts file or
a workload name, its bench prompts held out) has the target answer each prompt first with the own
runtime (``specctl.training.data.self_distill``, cached and resumable), so training text is what the
target itself writes, in its exact token ids.

What it does not know: the CLI, the decode loop.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specctl.errors import DataError, UsageError
from specctl.runtime.model import KVCache, Transformer
from specctl.drafts.mtp import MtpStack, export_mtp, mimo_unfit_reason, mtp_logits, mtp_step


@dataclass
class MtpTrainConfig:
    model: str
    """Target model (folder or catalogue name); frozen."""
    output: str
    """Output folder (the exported draft, or the stitched copy with --stitch; checkpoint/ inside)."""
    data: str | None = None
    """Training text: a .jsonl/.json/.txt file or a folder of text/code files."""
    self_distill: str | None = None
    """Prompts the target answers first (.jsonl/.txt file or a workload name, via specctl.training.data)."""
    num_layers: int = 1
    """MTP modules to train (num_nextn_predict_layers)."""
    depth: int = 3
    """Draft steps unrolled in training (k); deeper steps reuse module (d-1) % num_layers."""
    beta: float = 0.6
    """Step weights beta^(d-1), normalised."""
    epochs: int = 1
    steps: int | None = None
    """Optimizer steps; overrides epochs when set."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch_size: int = 8
    seq_len: int = 256
    seed: int = 0
    eval_split: float = 0.05
    """Fraction of the windows held out for eval."""
    stitch: bool = False
    """Write a copy of the target with the MTP modules inside, instead of a separate draft folder."""
    resume: bool = False
    checkpoint_every: int = 50
    distill_max_new_tokens: int = 128
    distill_max_prompts: int | None = None
    """Answer at most this many prompts."""
    hold_out: int = 8
    """With a workload name as self_distill: its first N prompts (the ones bench runs) are never trained on."""
    max_windows: int | None = None
    dtype: str = "float32"
    """Dtype of the target during training (the modules train in fp32)."""
    layout: str = "auto"
    """Export layout: "mimo" (vLLM's MiMoMTPModel loads it for a dense target), "deepseek_v3" (specctl's
    runtime; vLLM only for DeepSeek-V3 targets), or "auto" (mimo where it fits, see ``resolve_layout``)."""
    extra: dict = field(default_factory=dict)


def step_weights(depth: int, beta: float = 0.6) -> torch.Tensor:
    """[depth] beta^(d-1), normalised to sum 1."""
    w = torch.tensor([beta ** d for d in range(depth)], dtype=torch.float32)
    return w / w.sum()


LAYOUT_CHOICES = ("auto", "mimo", "deepseek_v3")


def resolve_layout(layout: str, args, *, stitch: bool = False, num_layers: int = 1,
                   warn: Callable[[str], None] = lambda s: None) -> str:
    """The export layout for a target with ModelArgs ``args``: "mimo" where vLLM's MiMo MTP architecture can
    hold the modules (a draft folder, dense target), else "deepseek_v3" with a warning that only specctl's
    runtime will read it. An explicit "mimo" that cannot be written is a UsageError (before any training)."""

    if layout not in LAYOUT_CHOICES:
        raise UsageError(f"unknown MTP layout '{layout}'", f"use one of: {', '.join(LAYOUT_CHOICES)}")
    reason = mimo_unfit_reason(args)
    if layout == "mimo":
        if stitch:
            raise UsageError("--layout mimo is written as a draft folder, not stitched (vLLM would run the stitched "
                             "target as MiMo, which feeds the MTP its pre-norm hidden state)",
                             "drop --stitch, or use --layout deepseek_v3 for specctl's own runtime")
        if reason:
            raise UsageError(f"no vLLM MTP architecture loads MTP modules for this target: {reason}",
                             "use --layout deepseek_v3 (read by specctl's own runtime only)")
    if layout == "auto":
        if stitch:
            warn("warning: --stitch writes the DeepSeek-V3 layout, which vLLM loads only for DeepSeek-V3 targets; "
                 "for vLLM write a draft folder (no --stitch: the MiMo layout)")
            layout = "deepseek_v3"
        elif reason:
            warn(f"warning: no vLLM MTP architecture loads MTP modules for this target ({reason}): writing the "
                 "DeepSeek-V3 layout, which specctl's own runtime reads")
            layout = "deepseek_v3"
        else:
            layout = "mimo"
    if layout == "deepseek_v3" and not stitch and not reason:
        warn("note: vLLM loads the DeepSeek-V3 MTP layout only for DeepSeek-V3 targets; --layout mimo is the one "
             "vLLM loads for this target")
    if layout == "mimo" and num_layers > 1:
        warn(f"warning: vLLM's MiMo MTP runs module 0 at every draft step; modules 1..{num_layers - 1} are used "
             "by specctl's runtime only")
    return layout


def init_stack(target: Transformer, num_layers: int, layout: str = "deepseek_v3") -> MtpStack:
    """Fresh fp32 modules: the block from the target's last layer (residual branches zeroed), the target's head."""
    a = target.args
    stack = MtpStack(a, num_layers, layout, own_head=False)
    H = a.hidden_size
    with torch.no_grad():
        for layer in stack.layers:
            layer.block.load_state_dict({k: v.float() for k, v in target.layers[-1].state_dict().items()})
            layer.enorm.weight.fill_(1.0)
            layer.hnorm.weight.fill_(1.0)
            # Start as "the target's next-token guess": eh_proj passes hnorm(h) through, and the block's
            # residual branches start at zero (o, down), so depth 1 begins at the target's own p(t_{j+1}).
            layer.eh_proj.weight.copy_(torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1))
            layer.block.o.weight.zero_()
            layer.block.down.weight.zero_()
            layer.norm.weight.copy_(target.norm.weight.float())
    return stack.float()


@torch.no_grad()
def target_states(target: Transformer, tokens: torch.Tensor, chunk: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> (h^0 [B, T, H] final-normed fp32, greedy labels [B, T])."""
    hs, ys = [], []
    for i in range(0, tokens.shape[0], chunk):
        t = tokens[i:i + chunk]
        B, T = t.shape
        cache = KVCache(target.args, B, T, target.embed.weight.dtype, t.device)
        mask = torch.ones(T, T, dtype=torch.bool, device=t.device).tril()
        _, h = target(t, 0, cache, mask, logits="none")
        hs.append(h.float())
        ys.append(F.linear(h, target.head_weight).argmax(-1))
    return torch.cat(hs), torch.cat(ys)


def unroll(stack: MtpStack, target: Transformer, tokens: torch.Tensor, h0: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Logits of every depth: list of [B, T-d, V] (d = 1..depth) from tokens [B, T] and h^0 [B, T, H]."""
    a = target.args
    B, T = tokens.shape
    h, out = h0, []
    for d in range(1, depth + 1):
        L = T - d
        if L <= 0:
            break
        kc = torch.zeros(B, a.num_kv_heads, L, a.head_dim, dtype=h0.dtype, device=h0.device)
        vc = torch.zeros_like(kc)
        h, normed = mtp_step(stack, target, d, h[:, :L], tokens[:, d:d + L], 0, kc, vc)
        out.append(mtp_logits(stack, target, d, normed))
    return out


def mtp_loss(logits: list[torch.Tensor], labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_d w_d CE(logits_d, labels[:, d:]), labels [B, T] the target's greedy tokens."""
    loss = logits[0].new_zeros(())
    for d, lg in enumerate(logits, start=1):
        y = labels[:, d:d + lg.shape[1]]
        loss = loss + weights[d - 1] * F.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), y.reshape(-1))
    return loss


@torch.no_grad()
def evaluate(stack: MtpStack, target: Transformer, tokens: torch.Tensor, h0: torch.Tensor, labels: torch.Tensor,
             depth: int, batch_size: int = 8) -> dict:
    """Per-depth top-1 agreement with the target and the expected greedy acceptance length (1 + leading run)."""
    if tokens.shape[0] == 0:
        return {}
    correct = [0.0] * depth
    total = [0] * depth
    runs, n_runs = 0.0, 0
    for i in range(0, tokens.shape[0], batch_size):
        t, h, y = tokens[i:i + batch_size], h0[i:i + batch_size], labels[i:i + batch_size]
        lg = unroll(stack, target, t, h, depth)
        hits = [(x.argmax(-1) == y[:, d:d + x.shape[1]]) for d, x in enumerate(lg, start=1)]
        for d, hit in enumerate(hits):
            correct[d] += float(hit.sum())
            total[d] += hit.numel()
        L = hits[-1].shape[1]
        lead = torch.cumprod(torch.stack([hit[:, :L] for hit in hits], -1).int(), -1).sum(-1)  # [B, L]
        runs += float(lead.sum())
        n_runs += lead.numel()
    acc = [c / max(t, 1) for c, t in zip(correct, total)]
    return {"top1_per_depth": [round(x, 4) for x in acc], "mean_acceptance_length": round(1 + runs / max(n_runs, 1), 4)}


# --------------------------------------------------------------------------- data

def read_texts(path: str | Path) -> list[str]:
    """Texts from a .jsonl/.json/.txt file or a folder (through specctl.training.data when present)."""
    try:
        from specctl.training import data as shared  # the shared reader, when it exists
        if hasattr(shared, "read_texts"):
            return list(shared.read_texts(path))
    except ImportError:
        pass
    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".py", ".txt", ".md", ".jsonl", ".json"))
        return [t for f in files for t in read_texts(f)]
    if not path.is_file():
        raise DataError(f"training data {path} does not exist", "give a .jsonl/.txt file or a folder of text")
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".jsonl":
        return [_record_text(json.loads(line)) for line in text.splitlines() if line.strip()]
    if path.suffix == ".json":
        data = json.loads(text)
        return [_record_text(r) for r in (data if isinstance(data, list) else [data])]
    return [text]


def _record_text(r) -> str:
    if isinstance(r, str):
        return r
    for key in ("text", "content", "completion"):
        if isinstance(r.get(key), str):
            return r[key]
    if "messages" in r:
        return "\n".join(m.get("content", "") for m in r["messages"])
    if "turns" in r:
        return "\n".join(r["turns"])
    return " ".join(str(v) for v in r.values() if isinstance(v, str))


def windows(tokenizer, texts: list[str], seq_len: int, max_windows: int | None = None,
            id_seqs: list[list[int]] = ()) -> torch.Tensor:
    """[N, seq_len] token windows over the id sequences and the texts, joined by EOS (last partial window dropped)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for seq in [*id_seqs, *(tokenizer.encode(t, add_special_tokens=False) for t in texts)]:
        ids.extend(seq)
        if eos is not None:
            ids.append(eos)
    n = len(ids) // seq_len
    if n == 0:
        raise DataError(f"the training text is shorter than one window ({len(ids)} tokens < --seq-len {seq_len})",
                        "give more data or lower --seq-len")
    w = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
    return w[:max_windows] if max_windows else w


# --------------------------------------------------------------------------- training

def _atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train_mtp(cfg: MtpTrainConfig, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Run the whole recipe (data, states, training, eval, export); returns a summary dict."""
    from specctl.models import resolve_model
    from specctl.runtime.model import load_transformer
    from specctl.runtime.runner import parse_dtype

    if cfg.data is None and cfg.self_distill is None:
        raise UsageError("no training data", "give --data FILE_OR_DIR and/or --self-distill PROMPTS")
    if cfg.num_layers < 1 or cfg.depth < 1:
        raise UsageError("--num-layers and --depth must be >= 1", "e.g. --num-layers 1 --depth 3")
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model_dir = resolve_model(cfg.model, dtype="float32" if cfg.dtype in ("float32", "fp32") else "bfloat16")
    from specctl.runtime.model import ModelArgs

    layout = resolve_layout(cfg.layout, ModelArgs.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text())),
                            stitch=cfg.stitch, num_layers=cfg.num_layers, warn=progress)
    out = Path(cfg.output).expanduser()
    ckpt_dir = out / "checkpoint"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    target = load_transformer(model_dir, parse_dtype(cfg.dtype))

    texts: list[str] = []
    id_seqs: list[list[int]] = []
    if cfg.self_distill:
        from specctl.runtime.runner import LoadedModel, stop_token_ids
        from specctl.training import data as shared

        loaded = LoadedModel(model_dir, target, tok, stop_token_ids(model_dir, tok), target.embed.weight.dtype,
                             target.embed.weight.device)
        reqs = shared.load_prompts(cfg.self_distill, hold_out=cfg.hold_out)[: cfg.distill_max_prompts]
        recs = shared.self_distill(loaded, reqs, max_new_tokens=cfg.distill_max_new_tokens, seed=cfg.seed,
                                   cache=ckpt_dir / "self_distill.jsonl", log=progress)
        id_seqs = [r.prompt_ids + r.response_ids for r in recs]
    if cfg.data:
        texts += read_texts(cfg.data)
    w = windows(tok, texts, cfg.seq_len, cfg.max_windows, id_seqs)
    g = torch.Generator().manual_seed(cfg.seed)
    w = w[torch.randperm(w.shape[0], generator=g)]
    n_eval = int(round(w.shape[0] * cfg.eval_split)) if w.shape[0] > 1 else 0
    n_eval = min(n_eval, w.shape[0] - 1)
    train_w, eval_w = w[n_eval:], w[:n_eval]
    progress(f"data: {w.shape[0]} windows of {cfg.seq_len} tokens ({train_w.shape[0]} train, {n_eval} eval); "
             "computing the target's states")
    h_all, y_all = target_states(target, w)

    stack = init_stack(target, cfg.num_layers, layout)
    params = [p for p in stack.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(train_w.shape[0] / cfg.batch_size)
    total = cfg.steps if cfg.steps is not None else cfg.epochs * per_epoch
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, total))))))
    step, losses = 0, []
    state_path = ckpt_dir / "state.pt"
    if cfg.resume and state_path.is_file():
        st = torch.load(state_path, weights_only=False)
        if st.get("layout", "deepseek_v3") != layout:
            raise UsageError(f"the checkpoint in {ckpt_dir} was trained for the {st.get('layout', 'deepseek_v3')} layout, "
                             f"not {layout}", f"pass --layout {st.get('layout', 'deepseek_v3')}, or drop --resume")
        stack.load_state_dict(st["stack"])
        opt.load_state_dict(st["optim"])
        sched.load_state_dict(st["sched"])
        step, losses = st["step"], st.get("losses", [])
        progress(f"resumed from step {step}")
    weights = step_weights(cfg.depth, cfg.beta)
    hw, yw = h_all[n_eval:], y_all[n_eval:]
    stack.train()
    while step < total:
        epoch, pos = divmod(step, per_epoch)
        order = torch.randperm(train_w.shape[0], generator=torch.Generator().manual_seed(cfg.seed + 1 + epoch))
        idx = order[pos * cfg.batch_size:(pos + 1) * cfg.batch_size]
        logits = unroll(stack, target, train_w[idx], hw[idx], cfg.depth)
        loss = mtp_loss(logits, yw[idx], weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        losses.append(float(loss.detach()))
        if step % max(1, min(10, total // 10)) == 0 or step == total:
            progress(f"step {step}/{total} loss {sum(losses[-10:]) / len(losses[-10:]):.4f} lr {sched.get_last_lr()[0]:.2e}")
        if step % cfg.checkpoint_every == 0 or step == total:
            _atomic_torch_save({"stack": stack.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                                "step": step, "losses": losses, "config": asdict(cfg), "layout": layout}, state_path)
    stack.eval()
    ev = evaluate(stack, target, eval_w, h_all[:n_eval], y_all[:n_eval], cfg.depth, cfg.batch_size)
    if ev:
        progress(f"eval: top-1 per depth {ev['top1_per_depth']}, mean acceptance length {ev['mean_acceptance_length']}")
    export_mtp(stack, model_dir, out, stitch=cfg.stitch, head_weight=target.head_weight.float(), layout=layout,
               embed_weight=target.embed.weight.float())
    summary = {"output": str(out), "form": "stitched" if cfg.stitch else "draft", "target": str(model_dir),
               "num_layers": cfg.num_layers, "depth": cfg.depth, "layout": layout, "steps": step, "windows": int(w.shape[0]),
               "train_tokens": int(train_w.numel()), "final_loss": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4),
               "eval": ev, "seconds": round(time.perf_counter() - t0, 1),
               "use": ({"--model": str(out), "--speculative-config": {"method": "mtp", "num_speculative_tokens": cfg.depth}}
                       if cfg.stitch else
                       {"--model": str(model_dir), "--speculative-config": {"method": "mtp", "model": str(out),
                                                                             "num_speculative_tokens": cfg.depth}})}
    if layout == "mimo":  # vLLM: the target as is, this folder as its MTP draft (one token per step is what it runs)
        summary["vllm"] = {"model": str(model_dir), "hf_overrides": {"num_nextn_predict_layers": cfg.num_layers},
                           "speculative_config": {"method": "mtp", "model": str(out.resolve()), "num_speculative_tokens": 1}}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
