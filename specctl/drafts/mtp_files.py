"""MTP modules on disk: read from a target's own checkpoint or a draft folder (``load_mtp``), written
(``export_mtp``), and found (``mtp_modules`` in a target, ``is_mtp_draft`` / ``check_mtp`` for
``specctl recommend``).

Writing (``export_mtp``; ``read_mtp_tensors`` / ``load_mtp`` read all three back):
Layouts:
  mimo        : MiMo-7B's dense MTP layout, the one vLLM loads for a dense (Qwen2/Llama-shaped) target
                as ``MiMoMTPModel`` (vllm/model_executor/models/mimo_mtp.py): config.json = the target's config
                with ``architectures: ["MiMoForCausalLM"]`` (vLLM turns that into its mimo_mtp draft) and
                ``num_nextn_predict_layers``; tensors ``model.mtp_layers.{i}.{token_layernorm, hidden_layernorm,
                input_proj, final_layernorm}.weight`` and the block under its HF names (q/k/v biases written as
                zeros for a target without them: vLLM's block is Qwen2's, which has them), plus copies of the
                target's ``model.embed_tokens.weight`` and ``lm_head.weight`` (vLLM shares the target's, but its
                loader wants every parameter of the draft in the file). input_proj reads
                cat[hidden_layernorm(h), token_layernorm(emb)] -- the hidden state first, the reverse of
                DeepSeek's eh_proj. vLLM 0.32's MiMo MTP reads num_nextn_predict_layers (and where its
                layers start, num_hidden_layers) from the *target's* config, so the target is run with
                ``hf_overrides={"num_nextn_predict_layers": m}`` (``specctl.vllm_compat.vllm_hf_overrides``;
                ``serve --engine vllm`` adds it). Only a draft folder: vLLM runs a stitched ``MiMoForCausalLM`` target as
                MiMo, which hands the MTP its pre-norm hidden state (specctl trains on the final-normed one) and
                needs Qwen2's biases. vLLM runs module 0 for every draft step (one module is what it uses).
  deepseek_v3 : what follows; vLLM's deepseek_mtp loads it only for DeepSeek-V3-architecture targets, so
                for the dense targets specctl runs it is read by specctl's own runtime alone.
  qwen3_next  : ``mtp.*`` (Qwen3-Next's names), for specctl's runtime and tests.

Forms (deepseek_v3):
  draft folder : config.json = the target's config + ``num_nextn_predict_layers``, one safetensors
                 file holding only ``model.layers.{N+i}.*`` (N = the target's num_hidden_layers), and
                 the target's tokenizer files. Use it as ``{"method": "mtp", "model": DIR}``.
  stitched     : a copy of the target folder with that file added (and the index updated, when the
                 target is sharded) and ``num_nextn_predict_layers`` in config.json: the target now
                 carries its own MTP modules, as DeepSeek-V3 does. Use it as ``--model DIR``.

Tensors of module i (prefix ``model.layers.{N+i}.``): enorm, hnorm, eh_proj, shared_head.norm,
shared_head.head (a copy of the target's LM head, as DeepSeek-V3 ships it) and the decoder block
under its usual HF names (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm,
post_attention_layernorm). The embedding is the target's (vLLM shares it) and is not written.

What it does not know: the modules' computation (``specctl.drafts.mtp``), drafting, training.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specctl.drafts.formats import FormatCheck, TargetFacts, Tensors, text_config
from specctl.drafts.kinds import MTP_TENSOR, check_kind, is_mtp_draft  # noqa: F401 (is_mtp_draft: here as before)
from specctl.drafts.mtp import MtpStack
from specctl.errors import ModelError
from specctl.files import write_atomic, write_json_atomic
from specctl.modeling import ModelArgs, Transformer

MTP_FILE = "model-mtp.safetensors"
# specctl's own, beside vLLM's files (which vLLM does not read): the target ids the draft's head is cut to when
# specctl drafts (train-mtp's loss vocabulary); vLLM drafts over the whole head
DRAFT_VOCAB_FILE = "draft_vocab.json"


def read_draft_vocab(folder: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The ascending target ids of ``folder``'s draft vocabulary, or None where it has none; a file that does not
    fit the target is a one-line ModelError."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["target_ids"]
        ok = isinstance(ids, list) and ids and all(isinstance(i, int) and 0 <= i < vocab_size for i in ids) \
            and all(a < b for a, b in zip(ids, ids[1:]))
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ModelError(f"{path} is not a draft vocabulary of this target (ascending ids below {vocab_size})",
                         f"delete it (the draft then reads the whole head), or export the draft again with train-mtp")
    return torch.tensor(ids, dtype=torch.long)

# --------------------------------------------------------------------------- loading

def _fuse_block(sd: dict, p: str, a: ModelArgs) -> dict[str, torch.Tensor]:
    """HF block names under prefix ``p`` -> Block's fused names (as model.fuse_hf_state_dict does per layer)."""
    def take(n):
        try:
            return sd[p + n]
        except KeyError:
            raise ModelError(f"MTP checkpoint lacks tensor '{p + n}'", "re-export it with specctl train-mtp") from None

    out = {"qkv.weight": torch.cat([take(f"self_attn.{n}_proj.weight") for n in "qkv"], 0),
           "o.weight": take("self_attn.o_proj.weight"),
           "input_norm.weight": take("input_layernorm.weight"),
           "post_norm.weight": take("post_attention_layernorm.weight"),
           "gate_up.weight": torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")], 0),
           "down.weight": take("mlp.down_proj.weight")}
    if a.qkv_bias:
        out["qkv.bias"] = torch.cat([take(f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
    if a.o_bias:
        out["o.bias"] = take("self_attn.o_proj.bias")
    if a.mlp_bias:
        out["gate_up.bias"] = torch.cat([take("mlp.gate_proj.bias"), take("mlp.up_proj.bias")], 0)
        out["down.bias"] = take("mlp.down_proj.bias")
    return out


def read_mtp_tensors(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, the MTP tensors of every *.safetensors in ``folder``) without reading the main model."""
    from specctl.models import open_safetensors

    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{folder} has no config.json", "give the target folder, or a draft folder written by train-mtp")
    cfg = json.loads(cfg_path.read_text())
    n_main = int(cfg.get("num_hidden_layers", 0))
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open_safetensors(f) as fh:
            for key in fh.keys():
                m = re.match(r"model\.layers\.(\d+)\.", key)
                if key.startswith(("mtp.", "model.mtp_layers.")) or (m and int(m.group(1)) >= n_main):
                    sd[key] = fh.get_tensor(key)
    return cfg, sd


def stack_from_state_dict(cfg: dict, sd: dict[str, torch.Tensor], a: ModelArgs, where: str = "checkpoint") -> MtpStack:
    """Build an MtpStack from MTP tensors in any of the layouts (detected from the names)."""
    tc = text_config(cfg)
    for key, ours in (("hidden_size", a.hidden_size), ("vocab_size", a.vocab_size)):
        if tc.get(key) is not None and int(tc[key]) != ours:
            raise ModelError(f"the MTP modules in {where} were made for a {key} of {tc[key]}, the target's is {ours}",
                             "use MTP modules trained for this target (`specctl train-mtp --model TARGET`)")
    if any(k.startswith("model.mtp_layers.") for k in sd):
        return _mimo_stack(cfg, sd, a, where)
    if any(k.startswith("mtp.") for k in sd):
        idx = sorted({int(k.split(".")[2]) for k in sd if k.startswith("mtp.layers.")})
        if not idx:
            raise ModelError(f"{where} has mtp.* tensors but no mtp.layers.*", "check the checkpoint")
        stack = MtpStack(a, len(idx), "qwen3_next")
        first = stack.layers[0]
        first.enorm.weight.data = sd["mtp.pre_fc_norm_embedding.weight"]
        first.hnorm.weight.data = sd["mtp.pre_fc_norm_hidden.weight"]
        first.eh_proj.weight.data = sd["mtp.fc.weight"]
        first.norm.weight.data = sd["mtp.norm.weight"]
        for i, layer in zip(idx, stack.layers):
            layer.block.load_state_dict(_fuse_block(sd, f"mtp.layers.{i}.", a))
        return stack
    idx = sorted(int(m.group(1)) for k in sd if (m := re.match(r"model\.layers\.(\d+)\.eh_proj\.weight$", k)))
    if not idx:
        raise ModelError(f"{where} holds no MTP modules (no model.layers.N.eh_proj nor mtp.* tensors)",
                         "train some with `specctl train-mtp`, or pick another method")
    expected = int(cfg.get("num_nextn_predict_layers") or len(idx))
    if expected != len(idx):
        raise ModelError(f"{where}: num_nextn_predict_layers is {expected} but {len(idx)} MTP module(s) found",
                         "fix num_nextn_predict_layers in config.json")
    own_head = all(f"model.layers.{i}.shared_head.head.weight" in sd for i in idx)
    embed = sd.get(f"model.layers.{idx[0]}.embed_tokens.weight")
    stack = MtpStack(a, len(idx), "deepseek_v3", own_head=own_head, embed=embed)
    for i, layer in zip(idx, stack.layers):
        p = f"model.layers.{i}."
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("norm", "shared_head.norm")):
            try:
                getattr(layer, ours).weight.data = sd[p + theirs + ".weight"]
            except KeyError:
                raise ModelError(f"{where} lacks tensor '{p}{theirs}.weight'", "re-export it with specctl train-mtp") from None
        if own_head:
            layer.head.weight.data = sd[p + "shared_head.head.weight"]
        layer.block.load_state_dict(_fuse_block(sd, p, a))
    return stack


def _mimo_stack(cfg: dict, sd: dict[str, torch.Tensor], a: ModelArgs, where: str) -> MtpStack:
    """MiMo's layout: ``model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}``
    + the block's HF names; input_proj reads cat[hidden_layernorm(h), token_layernorm(emb)] (hidden first)."""
    idx = sorted({int(k.split(".")[2]) for k in sd if k.startswith("model.mtp_layers.")})
    expected = int(cfg.get("num_nextn_predict_layers") or len(idx))
    if expected != len(idx):
        raise ModelError(f"{where}: num_nextn_predict_layers is {expected} but {len(idx)} MTP module(s) found",
                         "fix num_nextn_predict_layers in config.json")
    stack = MtpStack(a, len(idx), "mimo", own_head=False)
    H = a.hidden_size
    for i, layer in zip(idx, stack.layers):
        p = f"model.mtp_layers.{i}."

        def take(n):
            try:
                return sd[p + n]
            except KeyError:
                raise ModelError(f"{where} lacks tensor '{p}{n}'", "re-export it with specctl train-mtp") from None

        layer.enorm.weight.data = take("token_layernorm.weight")
        layer.hnorm.weight.data = take("hidden_layernorm.weight")
        w = take("input_proj.weight")  # [H, 2H]: columns [:H] read h, [H:] read emb
        layer.eh_proj.weight.data = torch.cat([w[:, H:], w[:, :H]], dim=1).contiguous()  # ours: [emb | h]
        layer.norm.weight.data = take("final_layernorm.weight")
        layer.block.load_state_dict(_fuse_block(sd, p, a))
    return stack


def load_mtp(source: str | Path, target: Transformer) -> MtpStack:
    """The MTP modules of ``source`` (the target's folder, or a separate draft folder) for ``target``."""

    check_kind(source, "mtp", ("mtp",))
    cfg, sd = read_mtp_tensors(source)
    stack = stack_from_state_dict(cfg, sd, target.args, where=str(source))
    p = target.embed.weight
    stack = stack.to(device=p.device, dtype=p.dtype)
    for layer in stack.layers:  # a shared_head.head equal to the target's head is the target's head
        if layer.head is not None and layer.head.weight.shape == target.head_weight.shape \
                and torch.equal(layer.head.weight, target.head_weight):
            layer.head = None
    if stack.embed is not None and torch.equal(stack.embed, target.embed.weight):
        stack.embed = None
    ids = read_draft_vocab(source, target.args.vocab_size)
    stack.vocab_ids = None if ids is None else ids.to(p.device)
    return stack.eval().requires_grad_(False)


# --------------------------------------------------------------------------- writing

def unfuse_block(block_sd: dict[str, torch.Tensor], prefix: str, a) -> dict[str, torch.Tensor]:
    """Block's fused names (qkv, gate_up, ...) -> transformers' names under ``prefix``."""
    q_n, kv_n = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    out: dict[str, torch.Tensor] = {}
    for part in ("weight", "bias"):
        if f"qkv.{part}" in block_sd:
            q, k, v = block_sd[f"qkv.{part}"].split([q_n, kv_n, kv_n], 0)
            out.update({prefix + f"self_attn.q_proj.{part}": q, prefix + f"self_attn.k_proj.{part}": k,
                        prefix + f"self_attn.v_proj.{part}": v})
        if f"o.{part}" in block_sd:
            out[prefix + f"self_attn.o_proj.{part}"] = block_sd[f"o.{part}"]
        if f"gate_up.{part}" in block_sd:
            g, u = block_sd[f"gate_up.{part}"].chunk(2, 0)
            out[prefix + f"mlp.gate_proj.{part}"], out[prefix + f"mlp.up_proj.{part}"] = g, u
        if f"down.{part}" in block_sd:
            out[prefix + f"mlp.down_proj.{part}"] = block_sd[f"down.{part}"]
    out[prefix + "input_layernorm.weight"] = block_sd["input_norm.weight"]
    out[prefix + "post_attention_layernorm.weight"] = block_sd["post_norm.weight"]
    return out


def mimo_unfit_reason(a) -> str | None:
    """Why vLLM's MiMo MTP architecture (a Qwen2 decoder block) cannot hold MTP modules for a target with
    ModelArgs ``a``, or None when it can."""
    if a.o_bias:
        return "its attention has an o_proj bias, which the Qwen2 block of vLLM's MiMo MTP lacks"
    if a.mlp_bias:
        return "its MLP has biases, which the Qwen2 block of vLLM's MiMo MTP lacks"
    if a.sliding_window:
        return "it uses sliding-window attention, which vLLM's MiMo MTP block does not"
    if a.num_heads * a.head_dim != a.hidden_size:
        return (f"its head_dim ({a.head_dim}) x heads ({a.num_heads}) != hidden_size ({a.hidden_size}), "
                "and vLLM's Qwen2 block derives head_dim from hidden_size")
    return None


def mtp_state_dict(stack, num_main_layers: int, head_weight: torch.Tensor | None = None,
                   layout: str = "deepseek_v3") -> dict[str, torch.Tensor]:
    """An MtpStack as checkpoint tensors. deepseek_v3: ``model.layers.{N+i}.*`` (``head_weight``, the
    target's LM head, fills shared_head.head of modules without their own); qwen3_next: ``mtp.*``;
    mimo: ``model.mtp_layers.{i}.*`` (no head: vLLM's is the target's)."""
    a = stack.args
    out: dict[str, torch.Tensor] = {}
    H = a.hidden_size
    for i, layer in enumerate(stack.layers):
        if layout == "mimo":
            p = f"model.mtp_layers.{i}."
            out[p + "token_layernorm.weight"] = layer.enorm.weight
            out[p + "hidden_layernorm.weight"] = layer.hnorm.weight
            w = layer.eh_proj.weight  # ours: [H, 2H] over cat[emb, h]; MiMo's input_proj: over cat[h, emb]
            out[p + "input_proj.weight"] = torch.cat([w[:, H:], w[:, :H]], dim=1)
            out[p + "final_layernorm.weight"] = layer.norm.weight
            out.update(unfuse_block(layer.block.state_dict(), p, a))
            if not a.qkv_bias:  # vLLM's MiMo block is Qwen2's: q/k/v biases, here zeros
                for n, size in (("q", a.num_heads * a.head_dim), ("k", a.num_kv_heads * a.head_dim),
                                ("v", a.num_kv_heads * a.head_dim)):
                    out[p + f"self_attn.{n}_proj.bias"] = torch.zeros(size, dtype=layer.eh_proj.weight.dtype)
            continue
        if layout == "qwen3_next":
            out.update(unfuse_block(layer.block.state_dict(), f"mtp.layers.{i}.", a))
            continue
        p = f"model.layers.{num_main_layers + i}."
        out[p + "enorm.weight"] = layer.enorm.weight
        out[p + "hnorm.weight"] = layer.hnorm.weight
        out[p + "eh_proj.weight"] = layer.eh_proj.weight
        out[p + "shared_head.norm.weight"] = layer.norm.weight
        head = layer.head.weight if layer.head is not None else head_weight
        if head is not None:
            out[p + "shared_head.head.weight"] = head
        out.update(unfuse_block(layer.block.state_dict(), p, a))
    if layout == "qwen3_next":
        first = stack.layers[0]
        out.update({"mtp.pre_fc_norm_embedding.weight": first.enorm.weight, "mtp.pre_fc_norm_hidden.weight": first.hnorm.weight,
                    "mtp.fc.weight": first.eh_proj.weight, "mtp.norm.weight": first.norm.weight})
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def export_mtp(stack, target_dir: str | Path, output: str | Path, *, stitch: bool = False,
               head_weight: torch.Tensor | None = None, dtype: torch.dtype | None = None,
               layout: str = "deepseek_v3", extra_config: dict | None = None,
               embed_weight: torch.Tensor | None = None, vocab: dict | None = None) -> Path:
    """Write ``stack`` for the target in ``target_dir`` into ``output`` (a draft folder, or a stitched copy).

    mimo: a draft folder only; ``embed_weight`` and ``head_weight`` (the target's) are written as
    ``model.embed_tokens.weight`` and ``lm_head.weight``. ``vocab`` ({"target_ids": [...], ...}): the draft
    vocabulary specctl's proposer cuts the head to (``DRAFT_VOCAB_FILE``)."""
    from safetensors.torch import save_file

    target_dir, output = Path(target_dir), Path(output)
    if layout == "mimo" and stitch:
        raise ValueError("the mimo layout is written as a draft folder, not stitched into the target")
    cfg = json.loads((target_dir / "config.json").read_text())
    n_main = int(cfg["num_hidden_layers"])
    if dtype is None:
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.get("torch_dtype") or cfg.get("dtype"), torch.float32)
    tensors = {k: v.to(dtype) for k, v in mtp_state_dict(stack, n_main, head_weight, layout).items()}
    if layout == "mimo":
        for name, w in (("model.embed_tokens.weight", embed_weight), ("lm_head.weight", head_weight)):
            if w is None:
                raise ValueError(f"the mimo layout needs the target's {name.split('.')[-2]} (pass it)")
            tensors[name] = w.detach().to(dtype).contiguous().clone()
    output.mkdir(parents=True, exist_ok=True)
    if stitch:
        if output.resolve() == target_dir.resolve():
            raise ValueError("--stitch writes a copy: the output folder must differ from the target's")
        for f in target_dir.iterdir():
            if f.is_file() and f.name not in ("config.json", MTP_FILE):
                shutil.copy2(f, output / f.name)
        index = output / "model.safetensors.index.json"
        if index.is_file():
            idx = json.loads(index.read_text())
            idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != MTP_FILE}
            idx["weight_map"].update({k: MTP_FILE for k in tensors})
            write_json_atomic(index, idx)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                     "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model"):
            if (target_dir / name).is_file():
                shutil.copy2(target_dir / name, output / name)
    write_atomic(output / MTP_FILE, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    cfg["num_nextn_predict_layers"] = stack.num_layers
    if layout == "mimo":
        cfg["architectures"] = ["MiMoForCausalLM"]  # vLLM: a MiMo target's config -> its mimo_mtp draft
    cfg.update(extra_config or {})
    write_json_atomic(output / "config.json", cfg)
    if vocab is not None:
        write_json_atomic(output / DRAFT_VOCAB_FILE, vocab)
    elif (output / DRAFT_VOCAB_FILE).is_file():  # an earlier export's: not this draft's
        (output / DRAFT_VOCAB_FILE).unlink()
    return output


# --------------------------------------------------------------------------- detection and checks: MTP layers in a target, a train-mtp folder (``specctl recommend``)



@dataclass
class MTPInfo:
    present: bool
    layers: int = 0
    evidence: list[str] = field(default_factory=list)
    refused: str | None = None  # why declared MTP layers cannot be used


def mtp_modules(cfg: dict, tensors: Tensors, gguf: dict | None = None) -> MTPInfo:
    """MTP modules from config keys (``num_nextn_predict_layers``, ``mtp_num_hidden_layers``, ...) and tensors:
    DeepSeek-V3's ``model.layers.{N+i}.{eh_proj,enorm,hnorm,shared_head}``, Qwen3-Next's ``mtp.layers.{i}.*``."""
    gguf = gguf or {}
    evidence: list[str] = []
    declared = 0
    for c in (cfg, text_config(cfg)):
        for k, v in c.items():
            if ("nextn" in k or "mtp" in k) and isinstance(v, int) and not isinstance(v, bool) and v > 0:
                declared = max(declared, v)
                evidence.append(f"config.json {k} = {v}")
    for k, v in gguf.items():
        if k.endswith("nextn_predict_layers") and v > 0:
            declared = max(declared, v)
            evidence.append(f"GGUF {k} = {v}")
    names = [n for n in tensors if MTP_TENSOR.search(n)]
    deepseek = {m.group(1) for n in names if (m := re.search(r"layers\.(\d+)\.eh_proj\.", n))}
    qwen = {m.group(1) for n in names if (m := re.search(r"mtp(?:\.layers|_layers)?\.(\d+)\.", n))}
    found = len(deepseek) or len(qwen) or (1 if names else 0) or (declared if gguf.get("nextn_tensors") else 0)
    if names:
        evidence.append(f"{len(names)} MTP tensors (e.g. {names[0]})")
    elif gguf.get("nextn_tensors"):
        evidence.append(f"{gguf['nextn_tensors']} nextn tensors in the GGUF")
    evidence = list(dict.fromkeys(evidence))
    if declared and not found:
        return MTPInfo(False, declared, evidence, f"the config declares {declared} MTP layer(s) but the checkpoint "
                       "holds no MTP tensors (dropped when it was converted or quantized): use a checkpoint that keeps them")
    if declared and deepseek and len(deepseek) != declared:
        return MTPInfo(False, declared, evidence, f"num_nextn_predict_layers is {declared} but {len(deepseek)} MTP "
                       "module(s) are in the weights: fix config.json")
    return MTPInfo(bool(found), declared or found, evidence)


def check_mtp(cfg: dict, tensors: Tensors, target: TargetFacts) -> FormatCheck:
    m = mtp_modules(cfg, tensors)
    tc = text_config(cfg)
    hidden, vocab, n_main = tc.get("hidden_size"), tc.get("vocab_size"), tc.get("num_hidden_layers")
    details = {"layers": m.layers, "hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": n_main,
               "evidence": m.evidence}
    bad = [m.refused] if m.refused else []
    L = target.num_layers
    if any(re.match(r"model\.layers\.\d+\.eh_proj", k) for k in tensors) and L is not None and n_main != L:
        bad.append(f"its modules follow a {n_main}-layer model, the target has {L} layers")
    return FormatCheck(details, bad, hidden, vocab)
