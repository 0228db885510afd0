"""Write trained MTP modules in the DeepSeek-V3 layout, which vLLM's deepseek_mtp and SGLang's NextN load.

Two forms:
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


def mtp_state_dict(stack, num_main_layers: int, head_weight: torch.Tensor | None = None,
                   layout: str = "deepseek_v3") -> dict[str, torch.Tensor]:
    """An MtpStack as checkpoint tensors. deepseek_v3: ``model.layers.{N+i}.*`` (``head_weight``, the
    target's LM head, fills shared_head.head of modules without their own); qwen3_next: ``mtp.*``."""
    a = stack.args
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(stack.layers):
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
               layout: str = "deepseek_v3", extra_config: dict | None = None) -> Path:
    """Write ``stack`` for the target in ``target_dir`` into ``output`` (a draft folder, or a stitched copy)."""
    target_dir, output = Path(target_dir), Path(output)
    cfg = json.loads((target_dir / "config.json").read_text())
    n_main = int(cfg["num_hidden_layers"])
    if dtype is None:
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.get("torch_dtype") or cfg.get("dtype"), torch.float32)
    tensors = {k: v.to(dtype) for k, v in mtp_state_dict(stack, n_main, head_weight, layout).items()}
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
    cfg.update(extra_config or {})
    tmp = output / "config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, output / "config.json")
    return output
