"""Train MTP modules on a frozen target (DeepSeek-V3 §2.2; speculators' MTP fine-tuning), then export them.

The target gives h^0 [B, T, H] (its final-normed hidden state, what the mtp proposer receives) and its greedy
labels y_j = argmax p_j. Depth d (1..depth; module (d-1) % num_layers, as the proposer recurses) is unrolled
over the whole sequence exactly as ``specctl.drafts.mtp.mtp_step`` runs it at inference:

    h^d_j = MTP_d(h^{d-1}_j, emb(t_{j+d}))    for j in [0, T-d)
    loss  = sum_d w_d * CE(head(norm(h^d_j)), y_{j+d}),   w_d = beta^(d-1) / sum_d' beta^(d'-1), beta = 0.6

so depth d learns the target's own choice d+1 tokens ahead (the quantity greedy acceptance checks).
Only the MTP modules train (AdamW, fp32; bf16 autocast where native); the embedding and LM head are the
target's, frozen and shared. Each CE is a mean over the labels of a whole global batch (``loop``: DDP,
--grad-accum). Checkpoints every ``save_every`` steps, resumed with ``resume`` (another trainer's checkpoint
is refused before any work); eval reports per-depth top-1 agreement and the expected acceptance length.
Data (``mtp_data``): windows of text and of the target's own answers (``self_distill``) the target runs over,
or (``cache_hidden_states``) the trainers' chat-templated sequences with states from a cache (an EAGLE-3
run's); ``loss_vocab_size`` cuts the loss's softmax to the data's most frequent target choices.

What it does not know: the CLI, the decode loop, the network's files (``specctl.drafts.mtp``).
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specctl.drafts.mtp import MtpStack, mtp_logits, mtp_step
from specctl.kernels.select import TORCH
from specctl.drafts.mtp_files import export_mtp, mimo_unfit_reason
from specctl.errors import UsageError
from specctl.modeling import Transformer
from specctl.training import checkpoints as C
from specctl.training import loop as L
from specctl.training import mtp_resume as R
from specctl.training import mtp_data
from specctl.training.mtp_data import IGNORE, MtpData, target_states, windows  # noqa: F401 (re-exported)


@dataclass
class MtpTrainConfig(L.TrainConfig):
    """Every setting of a train-mtp run (saved as training_config.json beside every checkpoint); the
    shared ones are ``TrainConfig``'s."""

    TRAINER = "train-mtp"  # a class attribute (no annotation): not a setting

    num_layers: int = 1  # MTP modules to train (num_nextn_predict_layers)
    depth: int = 3  # draft steps unrolled in training (k); deeper steps reuse module (d-1) % num_layers
    beta: float = 0.6  # step weights beta^(d-1), normalised
    stitch: bool = False
    """Write a copy of the target with the MTP modules inside, instead of a separate draft folder."""
    layout: str = "auto"
    """Export layout: "mimo" (vLLM's MiMoMTPModel loads it for a dense target), "deepseek_v3" (specctl's
    runtime; vLLM only for DeepSeek-V3 targets), or "auto" (mimo where it fits, see ``resolve_layout``)."""
    max_windows: int | None = None  # train on at most this many windows
    cache_hidden_states: str | None = None
    """A states cache (train-eagle's, e.g. an EAGLE-3 run's on the same data; made here if absent): train on
    the trainers' own sequences (chat-templated, the answers marked) with the target's states read from it,
    instead of windows of text the target runs over."""
    prompt_rows: float = 1.0  # with a states cache: the rows learnt are the answers' and this fraction of the others
    loss_vocab_size: int | None = None
    """The loss's softmax over the N most frequent target choices in the data (the export keeps the whole head)."""
    autocast: bool | None = None
    """bf16 matmuls (fp32 weights and optimizer); None: where bf16 is native (``loop.autocast_on``)."""
    soft_labels: bool = True
    """Learn the target's distribution at each row (over the loss vocabulary), as EAGLE's trainers do; False:
    its argmax only."""
    # train-mtp's own defaults of shared settings
    max_new_tokens: int = 128
    seq_len: int = 256
    save_every: int = 50

    RESUME_KEYS = L.TrainConfig.RESUME_KEYS + ("num_layers", "depth", "beta", "max_windows", "prompt_rows",
                                               "loss_vocab_size")

    def validated(self) -> "MtpTrainConfig":
        super().validated()
        for name in ("num_layers", "depth"):
            L.at_least(self, name, 1)
        L.need(self.layout in LAYOUT_CHOICES, f"unknown --layout '{self.layout}'", "use auto, mimo or deepseek_v3")
        L.need(not (self.stitch and self.push_to_hub), "--push-to-hub pushes a draft folder; --stitch writes a whole "
               "copy of the target", "drop --stitch to push the draft (vLLM loads the draft folder), or push by hand")
        L.need(self.max_windows is None or self.max_windows >= 1, f"--max-windows must be >= 1, got {self.max_windows}",
               "pass e.g. --max-windows 1000")
        L.need(self.loss_vocab_size is None or self.loss_vocab_size >= 2,
               f"--loss-vocab-size must be >= 2, got {self.loss_vocab_size}", "pass e.g. --loss-vocab-size 8192")
        L.need(0.0 <= self.prompt_rows <= 1.0, f"--prompt-rows must be in [0, 1], got {self.prompt_rows}",
               "pass e.g. --prompt-rows 0.1")
        L.need(self.cache_hidden_states or not self.eval_data, "--eval-data needs --cache-hidden-states (windows of "
               "text are held out by --eval-split)", "add --cache-hidden-states DIR, or drop --eval-data")
        L.folder_option("--cache-hidden-states", self.cache_hidden_states)
        return self


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


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """[out, in] row-major weight of a target projection, whatever form its kernel reads: a bf16 target on an
    AMX CPU holds AMX tiles [out/16, in/32, 16, 16, 2] (``pack_for_amx``), a GGUF ``QuantLinear`` dequantizes."""
    from specctl.modeling import AmxLinear

    if isinstance(layer, AmxLinear):
        return layer.dense_weight()
    return layer.weight


def dense_block_state(block: nn.Module) -> dict[str, torch.Tensor]:
    """A target Block's state as a fresh ``Block`` loads it: its projections as plain [out, in] weights
    (``dense_weight``), not the packed or quantized forms its state_dict holds where the kernels repacked them."""
    sd = {k: v for k, v in block.state_dict().items() if k.split(".", 1)[0] not in block.PROJECTIONS}
    for name in block.PROJECTIONS:
        layer = getattr(block, name)
        sd[f"{name}.weight"] = dense_weight(layer)
        if layer.bias is not None:
            sd[f"{name}.bias"] = layer.bias
    return sd


def vllm_unavailable(layout: str, args, *, stitch: bool = False, target_arch: str | None = None) -> str | None:
    """Why vLLM cannot run an export in ``layout`` for a target with ModelArgs ``args`` and HF architecture
    ``target_arch``, in a line; None where it can (``vllm_compat.vllm_loads_mtp``, the rule serve and the model
    card apply to the exported folder; the MiMo layout: ``resolve_layout`` writes it only where vLLM's
    MiMoMTPModel loads it)."""
    from specctl.vllm_compat import vllm_loads_mtp

    # a target whose config names no architecture is not a DeepSeek-V3 one (train-mtp trains for none of those)
    if vllm_loads_mtp("MiMoForCausalLM" if layout == "mimo" else None, target_arch or "unnamed"):
        return None
    if stitch:
        return "the stitched copy carries the DeepSeek-V3 MTP layout, which vLLM loads only for DeepSeek-V3 targets"
    reason = mimo_unfit_reason(args)
    if reason:
        return f"no vLLM MTP architecture loads MTP modules for this target ({reason})"
    return ("vLLM loads the DeepSeek-V3 MTP layout only for DeepSeek-V3 targets (--layout mimo writes the one it loads "
            "for this target)")


def vllm_model_name(named: str, folder: str | Path) -> str:
    """The target as vLLM itself takes it: as the user named it (a path, a Hub id), except a catalogue name,
    which only specctl knows: then the folder specctl made of it (``specctl serve --engine vllm`` resolves
    the name itself)."""
    from specctl.models import CATALOGUE

    return str(folder) if str(named).strip().lower() in CATALOGUE else str(named)


def init_stack(target: Transformer, num_layers: int, layout: str = "deepseek_v3") -> MtpStack:
    """Fresh fp32 modules: the block from the target's last layer (residual branches zeroed), the target's head."""
    a = target.args
    stack = MtpStack(a, num_layers, layout, own_head=False)
    H = a.hidden_size
    last = dense_block_state(target.layers[-1])
    with torch.no_grad():
        for layer in stack.layers:
            layer.block.load_state_dict({k: v.float() for k, v in last.items()})
            layer.enorm.weight.fill_(1.0)
            layer.hnorm.weight.fill_(1.0)
            # Start as "the target's next-token guess": eh_proj passes hnorm(h) through, and the block's
            # residual branches start at zero (o, down), so depth 1 begins at the target's own p(t_{j+1}).
            layer.eh_proj.weight.copy_(torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1))
            layer.block.o.weight.zero_()
            layer.block.down.weight.zero_()
            layer.norm.weight.copy_(target.norm.weight.float())
    return stack.float()


class FrozenTarget:
    """What the MTP modules read of the frozen target (``mtp_step``/``mtp_logits``: args, its embedding, LM
    head and rotary embedding) with the embedding and head in fp32, the dtype the modules train in: a bf16
    target's own would make every depth run in bf16 against fp32 weights. An fp32 target's tensors are
    used as they are (no copy); a tied head stays one tensor."""

    def __init__(self, target: Transformer):
        self.args, self.rope = target.args, target.rope
        emb = target.embed.weight.float()  # [V, H]
        self.embed = SimpleNamespace(weight=emb)
        self.head_weight = emb if target.head_weight is target.embed.weight else target.head_weight.float()  # [V, H]
        self.kernels = TORCH  # fp32 training: torch's linears (autograd)


def unroll_normed(stack: MtpStack, target: Transformer | FrozenTarget, tokens: torch.Tensor, h0: torch.Tensor,
                  depth: int) -> list[torch.Tensor]:
    """Every depth's normed output (what the head reads): list of [B, T-d, H] (d = 1..depth) from tokens
    [B, T] and h^0 [B, T, H]."""
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
        out.append(normed)
    return out


def unroll(stack: MtpStack, target: Transformer | FrozenTarget, tokens: torch.Tensor, h0: torch.Tensor,
           depth: int) -> list[torch.Tensor]:
    """Logits of every depth: list of [B, T-d, V] (d = 1..depth) from tokens [B, T] and h^0 [B, T, H]."""
    return [mtp_logits(stack, target, d, n) for d, n in enumerate(unroll_normed(stack, target, tokens, h0, depth), 1)]


def mtp_loss(logits: list[torch.Tensor], labels: torch.Tensor, weights: torch.Tensor,
             counts: torch.Tensor | None = None) -> torch.Tensor:
    """sum_d w_d CE(logits_d, labels[:, d:]), labels [B, T] the target's greedy tokens (``IGNORE``: not read).
    Each depth's CE is a mean over its labels read here, or (``counts`` [depth]) a sum over them divided by
    counts[d-1]: the mean over a global batch with that many labels, of which these are a part."""
    loss = logits[0].new_zeros((), dtype=torch.float32)
    for d, lg in enumerate(logits, start=1):
        y = labels[:, d:d + lg.shape[1]]
        ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), y.reshape(-1), ignore_index=IGNORE, reduction="sum")
        n = (y != IGNORE).sum().clamp(min=1) if counts is None else counts[d - 1].clamp(min=1)
        loss = loss + weights[d - 1] * ce / n
    return loss


class MtpLoss(nn.Module):
    """The modules' training forward as one module call, what DDP wraps: the unrolled depths and their loss,
    the head run on the rows learnt only (a loss vocabulary's head where ``target``'s is one).

    The frozen target is held outside the module's parameters (DDP neither copies nor syncs it)."""

    def __init__(self, stack: MtpStack, target: Transformer | FrozenTarget | None, depth: int,
                 weights: torch.Tensor | None, soft: bool = False):
        super().__init__()
        self.stack, self.depth, self.soft = stack, depth, soft
        self.frozen = (target, weights)

    def forward(self, tokens: torch.Tensor, h0: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        target, weights = self.frozen  # tokens, labels [B, T]; h0 [B, T, H]; counts [depth]
        loss = h0.new_zeros((), dtype=torch.float32)
        for d, normed in enumerate(unroll_normed(self.stack, target, tokens, h0, self.depth), start=1):
            y = labels[:, d:d + normed.shape[1]]
            keep = y != IGNORE
            lg = mtp_logits(self.stack, target, d, normed[keep]).float()  # [n, V]: the rows learnt alone
            if self.soft:  # the target's distribution where its argmax is the label (its states at those rows)
                with torch.no_grad():
                    h = h0[:, d:d + normed.shape[1]][keep].to(target.head_weight.dtype)
                    p = torch.softmax(F.linear(h, target.head_weight).float(), -1)
                ce = -(p * torch.log_softmax(lg, -1)).sum()
            else:
                ce = F.cross_entropy(lg, y[keep], reduction="sum")
            loss = loss + weights[d - 1] * ce / counts[d - 1].clamp(min=1)
        return loss


@torch.no_grad()
def evaluate(stack: MtpStack, target: Transformer | FrozenTarget, data: MtpData, depth: int, batch_size: int = 8,
             device=None) -> dict:
    """Per-depth top-1 agreement with the target on its learnt rows (the target's whole head) and the
    expected greedy acceptance length (1 + leading run) over the rows every depth reads."""
    if len(data) == 0:
        return {}
    correct, total = [0.0] * depth, [0] * depth
    runs, n_runs = 0.0, 0
    for i in range(0, len(data), batch_size):
        t, h, y = data.batch(list(range(i, min(i + batch_size, len(data)))), device)
        hits, valid = [], []
        for d, normed in enumerate(unroll_normed(stack, target, t, h, depth), start=1):
            yd = y[:, d:d + normed.shape[1]]
            top = torch.cat([mtp_logits(stack, target, d, c).argmax(-1) for c in normed.reshape(-1, normed.shape[-1]).split(1024)])
            hit, ok = top.view_as(yd) == yd, yd != IGNORE
            correct[d - 1] += float((hit & ok).sum())
            total[d - 1] += int(ok.sum())
            hits.append(hit)
            valid.append(ok)
        if len(hits) < depth:
            continue
        L = hits[-1].shape[1]
        ok = torch.stack([v[:, :L] for v in valid], -1).all(-1)  # [B, L] rows every depth reads
        lead = torch.cumprod(torch.stack([hit[:, :L] for hit in hits], -1).int(), -1).sum(-1)  # [B, L]
        runs += float(lead[ok].sum())
        n_runs += int(ok.sum())
    acc = [c / max(t, 1) for c, t in zip(correct, total)]
    return {"top1_per_depth": [round(x, 4) for x in acc], "mean_acceptance_length": round(1 + runs / max(n_runs, 1), 4)}


# --------------------------------------------------------------------------- training

def train_mtp(cfg: MtpTrainConfig, progress: Callable[[str], None] = lambda s: None, command: str | None = None,
              bar: Callable[[str, int, int], None] = lambda *a: None) -> dict:
    """Run the whole recipe (data, states, training, eval, export, model card); returns a summary dict.
    ``progress``: log lines; ``command``: the command line for the model card; ``bar``: (phase, done,
    total) for a progress bar (self-distillation, training steps)."""
    from transformers import AutoTokenizer

    from specctl.files import write_json_atomic
    from specctl.models import resolve_model
    from specctl.modeling import ModelArgs, load_transformer
    from specctl.runtime.loading import LoadedModel, parse_dtype, stop_token_ids
    from specctl.training import data as D

    cfg.validated()
    t0 = time.perf_counter()
    acc = L.accelerator(cfg, find_unused=cfg.depth < cfg.num_layers)  # a module no depth reaches gets no gradient
    main, dev = acc.is_main_process, acc.device
    log = progress if main else (lambda s: None)
    bar = bar if main else (lambda *a: None)
    L.check_push(cfg, acc)
    model_dir = resolve_model(cfg.model, dtype="float32" if cfg.dtype in ("float32", "fp32") else "bfloat16")
    target_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    args = ModelArgs.from_hf_config(target_cfg)
    target_arch = (target_cfg.get("architectures") or [None])[0]
    layout = resolve_layout(cfg.layout, args, stitch=cfg.stitch, num_layers=cfg.num_layers, warn=log)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output).expanduser()
    with torch.device("meta"):  # what a checkpoint of these sizes holds (MtpLoss's state, as accelerate saves it)
        want = {k: tuple(v.shape) for k, v in MtpLoss(MtpStack(args, cfg.num_layers, layout, own_head=False), None, 1,
                                                       None).state_dict().items()}
    gbs, newest = L.global_batch_size(cfg, acc), R.newest_checkpoint(out)  # the newest checked before anything costly
    found, state = R.read_checkpoint(newest) if newest is not None else ({}, {})
    if newest is not None:
        R.refuse_foreign_checkpoint(cfg, out, newest, found, want)
    resume_from = L.resume_point(cfg, log, legacy=out / R.LEGACY_CHECKPOINT)
    if resume_from is not None:
        if resume_from != newest:
            found, state = R.read_checkpoint(resume_from)
        R.check_resumable(resume_from, found, state, want, layout, gbs)
    records = [r for p in cfg.data for r in D.read_records(p)]
    eval_records = [r for p in cfg.eval_data for r in D.read_records(p, flag="--eval-data")] \
        if cfg.cache_hidden_states else []
    D.check_not_evaluation(records)  # bad data fails before the model loads (held-out records may be bench's)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    target = load_transformer(model_dir, parse_dtype(cfg.dtype), device=dev)
    loaded = LoadedModel(model_dir, target, tok, stop_token_ids(model_dir, tok), target.embed.weight.dtype, dev)
    train, evals, facts = mtp_data.load(cfg, loaded, records, eval_records, log, bar, acc.main_process_first)

    stack = init_stack(target, cfg.num_layers, layout).to(dev)
    frozen = FrozenTarget(target)  # what the modules read of the target, in their fp32
    learner, vocab = frozen, None  # the target as the loss reads it: its head cut to the loss vocabulary, if one
    if cfg.loss_vocab_size:
        ids, remap, covered = mtp_data.loss_vocab(train, cfg.loss_vocab_size, args.vocab_size, tok.all_special_ids or ())
        log(f"loss vocabulary: {len(ids)} tokens cover {covered:.1%} of the learnt labels (the rest are not learnt)")
        train, learner = train.remapped(remap), copy.copy(frozen)
        vocab = {"target_ids": ids.tolist(), "learnt_label_coverage": round(covered, 4),
                 "built_from": f"train-mtp --loss-vocab-size {cfg.loss_vocab_size}: the data's most frequent target choices"}
        learner.head_weight = frozen.head_weight[ids.to(frozen.head_weight.device)]
    per_epoch = math.ceil(len(train) / gbs)
    total = cfg.steps or max(1, math.ceil(cfg.epochs * per_epoch))
    opt = torch.optim.AdamW([p for p in stack.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = L.warmup_cosine(opt, total, cfg.warmup)
    weights = step_weights(cfg.depth, cfg.beta).to(dev)
    model, opt = acc.prepare(MtpLoss(stack, learner, cfg.depth, weights, cfg.soft_labels), opt)
    acc.register_for_checkpointing(sched)
    step, losses, history = 0, [], []
    if resume_from is not None and resume_from.is_file():  # the old single file: ``state`` is the whole file
        stack.load_state_dict(state["stack"])
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        step, losses = state["step"], state.get("losses", [])
    elif resume_from is not None:
        state = C.load_checkpoint(resume_from, acc)
        step, losses, history = state["step"], state["losses"], state["history"]
    if step:
        log(f"resumed from step {step}")

    def run_eval() -> dict:
        stack.eval()
        ev = evaluate(stack, frozen, evals, cfg.depth, cfg.batch_size, dev)
        stack.train()
        return ev

    def save(step: int) -> None:
        def write(d: Path) -> None:
            C.write_training_config(d, cfg.to_dict())
            C.write_trainer_state(d, {"step": step, "losses": losses, "history": history, "layout": layout,
                                      "global_batch": gbs})

        log(f"checkpoint {C.save_checkpoint(out, step, write, cfg.keep_checkpoints, acc=acc)}")

    bf16 = L.autocast_on(cfg, dev)
    scale = acc.num_processes * acc.gradient_accumulation_steps  # undoes DDP's mean and accelerate's 1/grad_accum
    model.train()
    ev: dict = {}
    while step < total:
        epoch, pos = divmod(step, per_epoch)  # the place in the data follows from the step: resume is exact
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed + 1 + epoch))
        batch = order[pos * gbs:(pos + 1) * gbs].tolist()
        step_loss = torch.zeros((), device=dev)
        counts = train.counts(batch, cfg.depth).to(dev)  # each depth's labels in the global batch
        for idx, wt in L.shares(batch, acc):
            with acc.accumulate(model):
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = model(*train.batch(idx, dev), counts)
                L.backward_step(acc, model, opt, loss, wt * scale, cfg.max_grad_norm)
                step_loss += wt * loss.detach()
        sched.step()
        step += 1
        bar("train", step, total)
        losses.append(float(L.reduce_sum(acc, step_loss)))
        if step % max(1, min(10, total // 10)) == 0 or step == total:
            # this step's own loss, as the other trainers log it
            log(f"step {step}/{total} loss {losses[-1]:.4f} lr {sched.get_last_lr()[0]:.2e}")
        ckpt, evaluating = L.due(cfg, step, total)
        if evaluating:
            ev = run_eval()
            history.append({"step": step, "loss": losses[-1], **ev})
            if ev:
                log(f"eval @ {step}: top-1 per depth {ev['top1_per_depth']}, mean acceptance length "
                    f"{ev['mean_acceptance_length']}")
        if ckpt:
            save(step)
    unit = "sequences" if cfg.cache_hidden_states else "windows"
    if not ev:  # a resumed run that had already reached its steps
        ev = run_eval()
    # the target as the user named it (a catalogue name, a path, a Hub id): specctl resolves it again
    summary = {"output": str(out), "form": "stitched" if cfg.stitch else "draft", "model": cfg.model,
               "target": str(model_dir), "num_layers": cfg.num_layers, "depth": cfg.depth, "layout": layout,
               "steps": step, **facts,
               "first_loss": round(losses[0], 4) if losses else None,
               "final_loss": round(losses[-1], 4) if losses else None,  # the last step's, as the other trainers report
               "eval": ev, "losses": losses, "global_batch": gbs, "processes": acc.num_processes,
               "use": ({"--model": str(out), "--speculative-config": {"method": "mtp", "num_speculative_tokens": cfg.depth}}
                       if cfg.stitch else
                       {"--model": cfg.model, "--speculative-config": {"method": "mtp", "model": str(out),
                                                                        "num_speculative_tokens": cfg.depth}})}
    no_vllm = vllm_unavailable(layout, args, stitch=cfg.stitch, target_arch=target_arch)
    if no_vllm is None:  # vLLM: the target as is, this folder as its MTP draft (one token per step is what it runs)
        summary["vllm"] = {"model": vllm_model_name(cfg.model, model_dir),
                           "hf_overrides": {"num_nextn_predict_layers": cfg.num_layers},
                           "speculative_config": {"method": "mtp", "model": str(out.resolve()), "num_speculative_tokens": 1}}
    else:
        summary["vllm_unavailable"] = no_vllm
    if main:
        export_mtp(stack, model_dir, out, stitch=cfg.stitch, head_weight=frozen.head_weight, layout=layout,
                   embed_weight=frozen.embed.weight, vocab=vocab)
        C.write_training_config(out, cfg.to_dict())
        if cfg.stitch:
            log("no model card for a stitched target (it is a copy of the target, not a draft vLLM loads beside it)")
        else:
            held_out = None
            if ev:
                held_out = {"mean_acceptance_length": ev["mean_acceptance_length"],
                            "acceptance_rate": (ev["mean_acceptance_length"] - 1) / cfg.depth,
                            "top-1 per depth": ev["top1_per_depth"],
                            "measured": f"teacher-forced greedy chains of {cfg.depth} over {len(evals)} held-out {unit} "
                                        f"of {'at most ' * (unit == 'sequences')}{cfg.seq_len} tokens, not an end-to-end decode"}
            summary["hub"] = L.publish(out, cfg, method="mtp", base_model=cfg.model, held_out=held_out,
                                       data=L.card_data(cfg, **{f"training_{unit}": len(train), f"{unit[:-1]}_tokens": cfg.seq_len}),
                                       command=command or L.command_line("train-mtp", cfg), log=log)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    if main:
        write_json_atomic(out / "train_summary.json", summary)
    acc.wait_for_everyone()
    return summary
