"""Write trained MTP modules in a layout vLLM loads: MiMo's (dense targets), or DeepSeek-V3's.

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

What it does not know: training, the runtime.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

MTP_FILE = "model-mtp.safetensors"


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


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata or {"format": "pt"})
    os.replace(tmp, path)


def export_mtp(stack, target_dir: str | Path, output: str | Path, *, stitch: bool = False,
               head_weight: torch.Tensor | None = None, dtype: torch.dtype | None = None,
               layout: str = "deepseek_v3", extra_config: dict | None = None,
               embed_weight: torch.Tensor | None = None) -> Path:
    """Write ``stack`` for the target in ``target_dir`` into ``output`` (a draft folder, or a stitched copy).

    mimo: a draft folder only; ``embed_weight`` and ``head_weight`` (the target's) are written as
    ``model.embed_tokens.weight`` and ``lm_head.weight``."""
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
            tmp = index.with_name(index.name + ".tmp")
            tmp.write_text(json.dumps(idx, indent=2))
            os.replace(tmp, index)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                     "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model"):
            if (target_dir / name).is_file():
                shutil.copy2(target_dir / name, output / name)
    _atomic_save(tensors, output / MTP_FILE)
    cfg["num_nextn_predict_layers"] = stack.num_layers
    if layout == "mimo":
        cfg["architectures"] = ["MiMoForCausalLM"]  # vLLM: a MiMo target's config -> its mimo_mtp draft
    cfg.update(extra_config or {})
    tmp = output / "config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, output / "config.json")
    return output
