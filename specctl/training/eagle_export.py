"""Write a trained EAGLE draft in the layouts vLLM and SGLang load (``load_eagle_draft`` reads them back).

EAGLE-3 (vLLM ``llama_eagle3.py``, SGLang ``llama_eagle3.py``): config.json with
``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``, ``vocab_size`` (the
target's), ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` (top
level and in ``eagle_config``); tensors ``midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
input_layernorm, hidden_norm, post_attention_layernorm}.weight``, ``fc.weight`` [H, 3H],
``norm.weight``, ``lm_head.weight`` [N, H], ``d2t`` int64 [N] (target id = i + d2t[i]), ``t2d`` bool [V].
The folder name must contain ``eagle3``: that is how vLLM tells an EAGLE-3 draft apart.

EAGLE-1 (vLLM ``llama_eagle.py``, the SafeAILab checkpoints): a Llama config with one layer and
tensors ``fc.weight`` [H, 2H] (input cat(embedding, feature)), ``layers.0.*`` without
``input_layernorm`` (layer 0 has none); the LM head and the embedding are the target's.

Neither layout carries the token embedding: both engines share the target's.
What it does not know: training, the proposer's runtime.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specctl.runtime.proposers.eagle import EagleDraft


def draft_config(draft: EagleDraft, target_config: dict | None = None, dtype: str = "float32") -> dict:
    """The config.json of a draft (target_config: the target's config.json, for ids and rope keys)."""
    s, a = draft.spec, draft.spec.args
    tc = target_config or {}
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"] if s.version == 3 else ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_position_embeddings,
        "vocab_size": s.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    if a.rope_scaling:
        cfg["rope_scaling"] = a.rope_scaling
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if tc.get(key) is not None:
            cfg[key] = tc[key]
    if s.version == 3:
        cfg.update(draft_vocab_size=s.draft_vocab_size, target_hidden_size=s.target_hidden_size,
                   eagle_aux_hidden_state_layer_ids=list(s.aux_layers),
                   eagle_config={"eagle_aux_hidden_state_layer_ids": list(s.aux_layers), "use_aux_hidden_state": True})
    return cfg


def draft_tensors(draft: EagleDraft, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The draft's tensors under the engines' names."""
    out = {}
    for name, t in draft.state_dict().items():
        if name == "inv_freq":
            continue
        if name in ("d2t", "t2d"):
            out[name] = t.detach().cpu().contiguous()
            continue
        if draft.version == 1 and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        out[name] = t.detach().to(dtype).cpu().contiguous()
    return out


def export_eagle(draft: EagleDraft, folder: str | Path, target=None, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json + model.safetensors into ``folder`` (atomically per file). ``target``: a LoadedModel."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tcfg = {}
    if target is not None and (Path(target.path) / "config.json").exists():
        tcfg = json.loads((Path(target.path) / "config.json").read_text())
    cfg = draft_config(draft, tcfg, str(dtype).removeprefix("torch."))
    tmp = folder / "model.safetensors.tmp"
    save_file(draft_tensors(draft, dtype), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / "model.safetensors")
    tmp = folder / "config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp, folder / "config.json")
    return folder
