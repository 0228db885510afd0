"""The Medusa trainer's loop: optimizer, schedule, steps, evaluation and checkpoints (``_Run``), fed by
Medusa-1's frozen-target features (``_FrozenRun``) or Medusa-2's LoRA-wrapped target (``_JointRun``).

Runs the same in one process or under ``accelerate launch`` (the Accelerator of
``specctl.training.loop``: device, DDP, bf16 autocast, gradient accumulation); each process trains on
its shard of the sequences, all take the same steps. A checkpoint is the heads in vLLM's layout (fp32),
``optimizer.pt`` (optimizer, schedule, RNG) and, for Medusa-2, the LoRA adapter.

What it does not know: the CLI, data formats, the heads' file layouts (``specctl.drafts.medusa``).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specctl.drafts import medusa as M
from specctl.drafts.medusa import MedusaHeads
from specctl.files import write_atomic
from specctl.training import checkpoints as C
from specctl.training import loop as L
from specctl.training.medusa_losses import (JOINT_HEADS_WEIGHT, RANKS, Features, extract_features, head_ce_sums,
                                            head_targets, head_weights, metrics, target_argmax)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Run:
    """Shared loop: optimizer, schedule, steps, eval and checkpoints. Subclasses feed batches."""

    def __init__(self, cfg, acc, loaded, path, heads, train_ex, eval_ex, log, progress):
        self.cfg, self.acc, self.loaded, self.path, self.log, self.progress = cfg, acc, loaded, path, log, progress
        self.heads, self.train_ex, self.eval_ex = heads, train_ex, eval_ex
        self.weights = head_weights(cfg.num_heads)

    # subclasses: setup() -> (module to optimize, param groups, steps per epoch); step(step) -> loss; evaluate() -> dict
    def fit(self, state: dict, resume_from: Path | None) -> dict:
        cfg, acc = self.cfg, self.acc
        module, groups, spe = self.setup()
        spe = int(acc.gather(torch.tensor([spe], device=acc.device)).min())  # every process takes the same steps
        total = cfg.steps or max(1, math.ceil(cfg.epochs * spe))
        self.steps_per_epoch = spe
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        sched = L.warmup_cosine(opt, total, cfg.warmup)
        step, history, losses = 0, [], []
        if resume_from is not None:
            self.load_extra(resume_from)
            st = torch.load(resume_from / "optimizer.pt", map_location="cpu", weights_only=False)
            opt.load_state_dict(st["optimizer"])
            sched.load_state_dict(st["scheduler"])
            torch.set_rng_state(st["torch_rng"])
            step, history, losses = state["step"], state["history"], state.get("losses", [])
        self.module, self.opt = acc.prepare(module, opt)
        self.first_loss = state.get("first_loss")
        if step >= total:  # a finished run resumed: its heads are exported again, with its own losses and eval
            self.log(f"the run in {cfg.output} had already reached step {step} of {total}: nothing to train, exporting "
                     "its heads again (pass a larger --steps or --epochs to train on)")
        else:
            self.log(f"training {cfg.num_heads} Medusa heads ({'Medusa-2, LoRA' if cfg.joint else 'Medusa-1, frozen target'}): "
                     f"{total} steps, {spe} per epoch, lr {cfg.lr}")
        last, t_loop = {}, time.perf_counter()
        while step < total:
            loss = self.step(step)
            params = [p for g in groups for p in g["params"]]
            if cfg.max_grad_norm > 0:
                acc.clip_grad_norm_(params, cfg.max_grad_norm)
            self.opt.step()
            sched.step()
            self.opt.zero_grad(set_to_none=True)
            step += 1
            losses.append(loss)
            self.first_loss = loss if self.first_loss is None else self.first_loss
            last = {"step": step, "loss": round(loss, 5), "lr": sched.get_last_lr()[0]}
            self.progress("train", step, total)
            if step % max(1, total // 20) == 0 or step == total:
                self.log(f"step {step}/{total} loss {loss:.4f} ({time.perf_counter() - t_loop:.0f}s)")
            ckpt, evaluating = L.due(cfg, step, total)
            if evaluating:
                ev = self.evaluate() if self.eval_ex else {}
                history.append({**last, **{f"eval_{k}": v for k, v in ev.items()}})
                if ev:
                    self.log(f"eval @ {step}: loss {ev['loss']:.4f}, top-1 per head {ev['top1_per_head']}, "
                             f"acceptance length {ev['acceptance_length']:.3f}")
            if ckpt:
                self._checkpoint(step, history, losses, opt, sched)
        self.heads = acc.unwrap_model(self.module) if not self.cfg.joint else self.joint_heads()
        ev = history[-1] if history else {}
        return {"output": str(self.cfg.output), "steps": step, "epochs": round(step / spe, 3),
                "train_sequences": len(self.train_ex), "eval_sequences": len(self.eval_ex),
                "first_loss": self.first_loss, "final_loss": last.get("loss", round(losses[-1], 5) if losses else None),
                "eval": {k.removeprefix("eval_"): v for k, v in ev.items() if k.startswith("eval_")},
                "history": history, "losses": losses, "mode": "medusa-2" if cfg.joint else "medusa-1"}

    def _checkpoint(self, step, history, losses, opt, sched) -> None:
        acc = self.acc
        acc.wait_for_everyone()
        if acc.is_main_process:
            heads = acc.unwrap_model(self.module) if not self.cfg.joint else self.joint_heads()

            def write(d: Path):
                M.save_medusa(heads, d, torch.float32)  # fp32 master weights: resume is exact
                torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                            "torch_rng": torch.get_rng_state()}, d / "optimizer.pt")
                self.save_extra(d)
                C.write_training_config(d, self.cfg.to_dict())
                C.write_trainer_state(d, {"step": step, "history": history, "losses": losses, "first_loss": self.first_loss})

            path = C.save_checkpoint(self.cfg.output, step, write, self.cfg.keep_checkpoints)
            self.log(f"checkpoint {path}")
        acc.wait_for_everyone()

    def load_extra(self, folder: Path) -> None:
        pass

    def save_extra(self, folder: Path) -> None:
        pass

    def _perm(self, n: int, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch * 7919 + self.acc.process_index)
        return torch.randperm(n, generator=g)


class _FrozenRun(_Run):
    """Medusa-1: the target's hidden states are computed once; a step trains on random positions."""

    CHUNK_ELEMENTS = 1 << 25  # logits elements per micro-batch (memory bound; the step's loss is exact)

    def setup(self):
        cfg, K = self.cfg, self.cfg.num_heads
        model = self.loaded.model
        train_s = eval_s = None
        if cfg.cache_hidden_states:  # e.g. an EAGLE-3 run's on the same data: the target need not run again
            from specctl.training.eagle_states import cached_hidden

            key = {"model": str(Path(self.path).resolve()), "seq_len": cfg.seq_len, "dtype": cfg.dtype}
            with self.acc.main_process_first():  # one process adds what the cache lacks, the others read
                every = cached_hidden(model, [e.input_ids[:cfg.seq_len] for e in self.train_ex + self.eval_ex],
                                      cfg.cache_hidden_states, key, self.log)
            train_s, eval_s = every[:len(self.train_ex)], every[len(self.train_ex):]
        else:
            self.log("computing the target's hidden states")
        self.train_f = extract_features(model, self.train_ex, K, cfg.seq_len, self.progress, train_s)
        self.eval_f = extract_features(model, self.eval_ex, K, cfg.seq_len, self.progress, eval_s) if self.eval_ex else None
        h = self.heads
        self.teacher_w = self.loaded.model.head_weight if h.token_map is None else \
            self.loaded.model.head_weight[h.token_map.to(self.loaded.model.head_weight.device)]  # [V', H]
        self.train_rows_t = h.rows_of(self.train_f.targets)  # [M, K] LM-head rows
        per_seq = max(1, round(self.train_f.num_positions / max(1, len(self.train_ex))))
        self.batch_positions = cfg.batch_size * per_seq * cfg.grad_accum  # the chunks below are the micro-batches
        self.chunk = max(16, self.CHUNK_ELEMENTS // (K * self.teacher_w.shape[0]))
        spe = max(1, math.ceil(self.train_f.num_positions / self.batch_positions))
        self.log(f"{self.train_f.num_positions} training positions, {self.batch_positions} per step")
        trainable = [p for p in h.parameters() if p.requires_grad]
        return h.to(self.acc.device), [{"params": trainable}], spe

    def _teacher(self, f: Features, rows: torch.Tensor) -> torch.Tensor:
        """[n] rows -> [n, K, V'] the target's distribution over x[t+k+2] (at position t+k+1)."""
        K, P = self.cfg.num_heads, f.hidden.shape[0]
        idx = (rows[:, None] + torch.arange(1, K + 1)[None]).clamp(max=P - 1)  # [n, K]
        w = self.teacher_w
        hid = f.hidden[idx].to(w.device, w.dtype)  # [n, K, H]
        return torch.softmax((hid @ w.T).float(), -1)

    def _loss(self, f: Features, sel: torch.Tensor, tgt_rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.acc.device
        x = f.hidden[f.rows[sel]].to(dev).float()  # [n, H]
        logits = self.module(x)  # [n, K, V']
        teacher = self._teacher(f, f.rows[sel]).to(dev) if self.cfg.soft_labels else None
        sums = head_ce_sums(logits, tgt_rows.to(dev), teacher)  # [K]
        w = torch.tensor(self.weights, device=dev)
        return (w * sums / counts.clamp(min=1)).sum(), logits

    def step(self, step: int) -> float:
        e, i = divmod(step, self.steps_per_epoch)
        perm = self._perm(self.train_f.num_positions, e)
        sel = perm[i * self.batch_positions:(i + 1) * self.batch_positions]
        tgt = self.train_rows_t[sel]
        counts = (tgt >= 0).sum(0).float().to(self.acc.device)  # [K] rows per head in the whole step
        chunks = sel.split(self.chunk)
        total = 0.0
        G = self.acc.gradient_accumulation_steps  # acc.backward divides by it: each chunk is already its share
        for j, c in enumerate(chunks):
            ctx = self.acc.no_sync(self.module) if j + 1 < len(chunks) else contextlib.nullcontext()
            with ctx:
                loss, _ = self._loss(self.train_f, c, self.train_rows_t[c], counts)
                self.acc.backward(loss * G)
            total += float(loss.detach())
        return total

    @torch.no_grad()
    def evaluate(self) -> dict:
        f, K, h = self.eval_f, self.cfg.num_heads, self.acc.unwrap_model(self.module)
        if f is None or f.num_positions == 0:
            return {}
        h.eval()
        greedy = target_argmax(f.hidden, self.loaded.model.head_weight)  # [P] the target's choice at each position
        tgt_rows = h.rows_of(f.targets)
        counts = (tgt_rows >= 0).sum(0).float().to(self.acc.device)
        loss, ranks, valid = 0.0, [], []
        for c in torch.arange(f.num_positions).split(self.chunk):
            l, logits = self._loss(f, c, tgt_rows[c], counts)
            loss += float(l)
            R = min(RANKS, logits.shape[-1])
            top = h.vocab_ids(logits.topk(R, -1).indices).cpu()  # [n, K, R] each head's R best tokens
            idx = (f.rows[c][:, None] + torch.arange(1, K + 1)[None]).clamp(max=f.hidden.shape[0] - 1)
            ranks.append(top == greedy[idx][..., None])  # [n, K, R]: rank r is the target's choice
            valid.append(f.targets[c] >= 0)
        h.train()
        return metrics(loss, torch.cat(ranks), torch.cat(valid))


class _Joint(nn.Module):
    """Medusa-2: the LoRA-wrapped target (transformers) and the heads, trained together."""

    def __init__(self, peft_model, heads: MedusaHeads):
        super().__init__()
        self.peft_model, self.heads = peft_model, heads

    def forward(self, ids: torch.Tensor, attn: torch.Tensor):  # ids, attn: [B, T]
        inner = self.peft_model.get_base_model()
        h = inner.model(input_ids=ids, attention_mask=attn).last_hidden_state  # [B, T, H] final-normed
        return inner.lm_head(h), self.heads(h)  # [B, T, V], [B, T, K, V']


class _JointRun(_Run):
    """Medusa-2: sequences in padded batches through the LoRA-wrapped target and the heads."""

    def setup(self):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        cfg = self.cfg
        with _no_transformers_bars():
            hf = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=torch.float32)
        names = {n.rsplit(".", 1)[-1] for n, _ in hf.named_modules()}
        targets = [t for t in LORA_TARGETS if t in names]
        lcfg = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=targets, bias="none")
        with warnings.catch_warnings():  # peft asks transformers for a name it deprecated: not the user's concern
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            pm = get_peft_model(hf, lcfg)
        self.joint = _Joint(pm, self.heads)
        lora = [p for n, p in pm.named_parameters() if p.requires_grad]
        groups = [{"params": [p for p in self.heads.parameters() if p.requires_grad]},
                  {"params": lora, "lr": cfg.base_lr or cfg.lr / 4}]
        return self.joint, groups, max(1, math.ceil(len(self.train_ex) / (cfg.batch_size * cfg.grad_accum)))

    def load_extra(self, folder: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(self.joint.peft_model, load_file(str(folder / "adapter.safetensors")))

    def save_extra(self, folder: Path) -> None:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        pm = self.acc.unwrap_model(self.module).peft_model
        sd = {k: v.contiguous() for k, v in get_peft_model_state_dict(pm).items()}
        write_atomic(folder / "adapter.safetensors", lambda p: save_file(sd, str(p)))

    def joint_heads(self) -> MedusaHeads:
        return self.acc.unwrap_model(self.module).heads

    def _batch(self, exs: list):
        T = min(self.cfg.seq_len, max(len(e.input_ids) for e in exs))
        ids = torch.zeros(len(exs), T, dtype=torch.long)
        attn = torch.zeros(len(exs), T, dtype=torch.long)
        mask = torch.zeros(len(exs), T, dtype=torch.bool)
        for b, e in enumerate(exs):
            n = min(T, len(e.input_ids))
            ids[b, :n] = torch.tensor(e.input_ids[:n])
            attn[b, :n] = 1
            mask[b, :n] = torch.tensor(e.loss_mask[:n], dtype=torch.bool)
        return ids, attn, mask

    def _loss(self, exs: list):
        dev, K = self.acc.device, self.cfg.num_heads
        ids, attn, mask = (t.to(dev) for t in self._batch(exs))
        base_logits, head_logits = self.module(ids, attn)  # [B, T, V], [B, T, K, V']
        B, T = ids.shape
        nxt = torch.where(mask[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], -100))
        base_ce = F.cross_entropy(base_logits[:, :-1].float().reshape(-1, base_logits.shape[-1]), nxt.reshape(-1),
                                  ignore_index=-100)
        tg = torch.stack([head_targets(ids[b].cpu(), mask[b].cpu(), K) for b in range(B)]).to(dev)  # [B, T, K]
        rows = self.joint_heads_rows(tg)
        sums = head_ce_sums(head_logits.reshape(B * T, K, -1), rows.reshape(B * T, K))
        counts = (rows >= 0).reshape(-1, K).sum(0).clamp(min=1)
        heads_loss = (torch.tensor(self.weights, device=dev) * sums / counts).sum()
        return base_ce + JOINT_HEADS_WEIGHT * heads_loss, base_logits, head_logits, tg

    def joint_heads_rows(self, tg: torch.Tensor) -> torch.Tensor:
        return self.joint.heads.rows_of(tg)

    def step(self, step: int) -> float:
        e, i = divmod(step, self.steps_per_epoch)
        perm = self._perm(len(self.train_ex), e)
        bs, G = self.cfg.batch_size, self.cfg.grad_accum
        total = 0.0
        for j in range(G):  # micro-batches: accelerate syncs (DDP) and lets the optimizer step on the last
            sel = perm[(i * G + j) * bs:(i * G + j + 1) * bs]
            exs = [self.train_ex[int(k)] for k in (sel if len(sel) else perm[:bs])]
            with self.acc.accumulate(self.module):
                loss = self._loss(exs)[0] * (1.0 if len(sel) else 0.0)
                self.acc.backward(loss)
            total += float(loss.detach()) / G
        return total

    @torch.no_grad()
    def evaluate(self) -> dict:
        K, bs = self.cfg.num_heads, self.cfg.batch_size
        self.module.eval()
        loss, right, valid, n = 0.0, [], [], 0
        for s in range(0, len(self.eval_ex), bs):
            exs = self.eval_ex[s:s + bs]
            l, base_logits, head_logits, tg = self._loss(exs)
            loss += float(l) * len(exs)
            n += len(exs)
            greedy = base_logits.argmax(-1)  # [B, T] the (fine-tuned) target's choice
            B, T = greedy.shape
            idx = (torch.arange(T, device=greedy.device)[:, None] + torch.arange(1, K + 1, device=greedy.device)).clamp(max=T - 1)
            want = greedy[:, idx]  # [B, T, K] argmax at t+k+1
            R = min(RANKS, head_logits.shape[-1])
            top = self.joint.heads.vocab_ids(head_logits.topk(R, -1).indices)  # [B, T, K, R]
            right.append((top == want[..., None]).reshape(-1, K, R).cpu())
            valid.append((tg >= 0).reshape(-1, K).cpu())
        self.module.train()
        return metrics(loss / max(1, n), torch.cat(right), torch.cat(valid))

    def export_base(self, folder: Path) -> None:
        """The fine-tuned target (LoRA merged) as a plain HF folder, with the tokenizer."""
        import copy

        from specctl.fetch import atomic_dir
        from specctl.files import give_umask_mode

        pm = self.acc.unwrap_model(self.module).peft_model
        merged = copy.deepcopy(pm).merge_and_unload()
        with atomic_dir(folder) as tmp, _no_transformers_bars():
            merged.save_pretrained(str(tmp))
            self.loaded.tokenizer.save_pretrained(str(tmp))
            gen = Path(self.path) / "generation_config.json"
            if gen.is_file():
                (tmp / "generation_config.json").write_text(gen.read_text())
            for f in tmp.iterdir():
                give_umask_mode(f)  # safetensors writes 0600: a server running as another user could not read it


@contextlib.contextmanager
def _no_transformers_bars():
    """transformers' own tqdm bars (loading weights, writing shards) off: the log says what is loaded and saved."""
    from transformers.utils import logging as tlog

    bars = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            tlog.enable_progress_bar()
