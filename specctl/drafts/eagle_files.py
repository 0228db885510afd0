"""EAGLE drafts on disk: the layouts vLLM and SGLang load, read (``load_eagle_draft``), written
(``export_eagle``) and recognised (``is_eagle3`` / ``is_eagle``, ``check_eagle3`` / ``check_eagle``,
which ``specctl recommend`` runs over the folders it finds).

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

What it does not know: the network's computation (``specctl.drafts.eagle``), drafting, training.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specctl.drafts.eagle import EagleDraft, EagleSpec, default_aux_layers
from specctl.drafts.formats import FormatCheck, TargetFacts, Tensors
from specctl.drafts.kinds import check_kind, is_eagle, is_eagle3  # noqa: F401 (the detectors: here as before)
from specctl.errors import ModelError
from specctl.files import write_atomic, write_json_atomic
from specctl.modeling import ModelArgs

# --------------------------------------------------------------------------- loading (vLLM / SGLang layouts)

def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from specctl.models import open_safetensors

    sd: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        with open_safetensors(f) as fh:
            for key in fh.keys():
                sd[key] = fh.get_tensor(key)
    if not files:
        bins = sorted(folder.glob("pytorch_model*.bin"))
        for f in bins:
            sd.update(torch.load(f, map_location="cpu", weights_only=True))
    if not sd:
        raise ModelError(f"{folder} has no EAGLE weights (*.safetensors or pytorch_model.bin)",
                         "pass the folder `specctl train-eagle` wrote, or an EAGLE checkpoint folder")
    return sd


def load_eagle_draft(folder: str | Path, target_args: ModelArgs, version: int | None = None) -> tuple[EagleDraft, torch.Tensor | None]:
    """An EAGLE-1/-3 draft in vLLM's layout -> (EagleDraft fp32 eval, its own embedding [V, H] or None).

    Accepts ``midlayer.*`` or ``layers.0.*`` names, with or without a ``model.`` prefix; EAGLE-3
    without d2t means a full draft vocabulary.
    """

    folder = Path(folder)
    check_kind(folder, {1: "eagle", 3: "eagle3"}.get(version, "eagle"), {1: ("eagle",), 3: ("eagle3",)}.get(version, ("eagle", "eagle3")))
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise ModelError(f"{folder} has no readable config.json ({type(e).__name__})",
                         "pass the EAGLE draft folder (config.json + weights)") from None
    sd = {k.removeprefix("model."): v for k, v in _read_tensors(folder).items()}
    archs = " ".join(cfg.get("architectures") or [])
    layers = {k.split(".")[1] for k in sd if k.startswith("layers.") and k.count(".") > 1}
    if len(layers) > 1 and "fc.weight" not in sd:  # a whole model, not a one-layer draft
        raise ModelError(f"{folder} is a whole model ({len(layers)} layers, {archs or 'no architecture'}), not an "
                         "EAGLE draft", "pass a draft in vLLM's EAGLE layout (one layer + fc: `specctl train-eagle`), "
                         "or use it as a draft model: \"method\": \"draft_model\"")
    is3 = "Eagle3" in archs or "d2t" in sd or any(k.startswith("midlayer.") for k in sd) or "hidden_norm" in " ".join(sd)
    v = version or (3 if is3 else 1)
    sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): t for k, t in sd.items()}
    c = dict(cfg, model_type="llama", num_hidden_layers=1)
    c.setdefault("vocab_size", target_args.vocab_size)
    c.setdefault("hidden_size", target_args.hidden_size)
    args = ModelArgs.from_hf_config(c)
    if args.hidden_size != target_args.hidden_size and v == 1:
        raise ModelError(f"EAGLE-1 draft width {args.hidden_size} != the target's {target_args.hidden_size}",
                         "use a draft trained for this target")
    if args.vocab_size != target_args.vocab_size:
        raise ModelError(f"the draft was made for a vocabulary of {args.vocab_size}, the target has {target_args.vocab_size}",
                         "use a draft trained for this target")
    eagle_cfg = cfg.get("eagle_config") or {}
    aux = tuple(sorted(set(cfg.get("eagle_aux_hidden_state_layer_ids") or eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
                           or (default_aux_layers(target_args.num_layers) if v == 3 else ()))))
    n = int(cfg.get("draft_vocab_size") or args.vocab_size) if v == 3 else args.vocab_size
    spec = EagleSpec(v, args, args.vocab_size, n, int(cfg.get("target_hidden_size") or target_args.hidden_size), aux,
                     extra={"fc_bias": "fc.bias" in sd})
    fc_in = sd["fc.weight"].shape[1] if "fc.weight" in sd else None
    if v == 3 and fc_in is not None and fc_in != len(aux) * spec.target_hidden_size:
        raise ModelError(f"fc.weight reads {sd['fc.weight'].shape[1]} features, not {len(aux)} aux layers x {spec.target_hidden_size}",
                         "set eagle_aux_hidden_state_layer_ids in the draft's config.json")
    draft = EagleDraft(spec)
    embed = sd.pop("embed_tokens.weight", None)
    if v == 3:
        if "d2t" not in sd:
            sd["d2t"] = torch.zeros(n, dtype=torch.int64)
        if "t2d" not in sd:
            t2d = torch.zeros(args.vocab_size, dtype=torch.bool)
            t2d[sd["d2t"].long() + torch.arange(n)] = True
            sd["t2d"] = t2d
        sd["d2t"], sd["t2d"] = sd["d2t"].long(), sd["t2d"].bool()
    if v == 1:  # layer 0 of EAGLE-1 has no input norm (vLLM replaces it by the identity)
        sd.pop("midlayer.input_layernorm.weight", None)
    sd = {k: t for k, t in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    missing, unexpected = draft.load_state_dict({k: t.float() if t.is_floating_point() else t for k, t in sd.items()},
                                                strict=False)
    if missing or unexpected:
        raise ModelError(f"EAGLE-{v} checkpoint in {folder} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}",
                         "pass a draft in vLLM's EAGLE layout (see `specctl train-eagle --help`)")
    if embed is not None and embed.shape[0] != target_args.vocab_size:
        embed = None
    return draft.float().eval().requires_grad_(False), None if embed is None else embed.float()


# --------------------------------------------------------------------------- writing (vLLM / SGLang layouts)

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
    tensors = draft_tensors(draft, dtype)
    write_atomic(folder / "model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    write_json_atomic(folder / "config.json", cfg)
    if draft.version == 1:
        sglang_copy(folder, cfg)
    return folder


SGLANG_DIR = "sglang"  # an EAGLE-1 export's copy under SGLang's architecture name


def sglang_copy(folder: Path, cfg: dict) -> Path:
    """EAGLE-1 under SGLang's name: vLLM turns a draft's ``LlamaForCausalLM`` into its EAGLE class
    (``EagleLlamaForCausalLM``) and has no class for SGLang's ``LlamaForCausalLMEagle``, which SGLang
    needs (its own EAGLE-1 copies, lmsys/sglang-EAGLE-*, are renamed so). So the export keeps vLLM's
    name and ``folder/sglang`` holds the same weights (a hard link where the filesystem allows) under
    SGLang's: ``--speculative-draft-model-path folder/sglang``."""
    import os
    import shutil

    out = folder / SGLANG_DIR
    out.mkdir(exist_ok=True)

    def link(p: Path) -> None:
        try:
            os.link(folder / "model.safetensors", p)
        except OSError:  # another filesystem, or no hard links: a copy
            shutil.copyfile(folder / "model.safetensors", p)

    write_atomic(out / "model.safetensors", link)
    write_json_atomic(out / "config.json", dict(cfg, architectures=["LlamaForCausalLMEagle"]))
    return out


# --------------------------------------------------------------------------- detection and checks (``specctl recommend`` runs them over the folders it finds)

def _eagle_details(cfg: dict) -> dict:
    aux = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return {"hidden_size": cfg.get("hidden_size"), "target_hidden_size": cfg.get("target_hidden_size"),
            "vocab_size": cfg.get("vocab_size"), "draft_vocab_size": cfg.get("draft_vocab_size"), "aux_layers": aux}


def check_eagle3(cfg: dict, tensors: Tensors, target: TargetFacts) -> FormatCheck:
    details = _eagle_details(cfg)
    H, L, aux, bad = target.hidden_size, target.num_layers, details["aux_layers"], []
    dv = cfg.get("draft_vocab_size")
    if "d2t" in tensors and dv and tensors["d2t"][1] and tensors["d2t"][1][0] != dv:
        bad.append(f"d2t has {tensors['d2t'][1][0]} entries but draft_vocab_size is {dv}")
    if aux and L is not None and max(aux) >= L:
        bad.append(f"it reads target layers {aux} but the target has {L} layers")
    fc = tensors.get("fc.weight")
    if fc and H and len(fc[1]) == 2 and fc[1][1] % H:
        bad.append(f"fc.weight takes {fc[1][1]} inputs, not a multiple of the target's hidden size {H}")
    return FormatCheck(details, bad, cfg.get("target_hidden_size") or cfg.get("hidden_size"), cfg.get("vocab_size"))


def check_eagle(cfg: dict, tensors: Tensors, target: TargetFacts) -> FormatCheck:
    H, bad = target.hidden_size, []
    if "fc.weight" in tensors and H and tensors["fc.weight"][1][-1] != 2 * H:
        bad.append(f"fc.weight takes {tensors['fc.weight'][1][-1]} inputs, EAGLE-1 needs 2 x {H}")
    return FormatCheck(_eagle_details(cfg), bad, cfg.get("hidden_size"), cfg.get("vocab_size"))
