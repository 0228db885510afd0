"""SpecConfig: vLLM's --speculative-config JSON works unchanged, and every bad input is one clear error."""

from __future__ import annotations

import json

import pytest

from specctl.config import SpecConfig
from specctl.errors import ConfigError, UsageError


def test_vllm_ngram_json_accepted_unchanged():
    text = '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}'
    cfg = SpecConfig.from_json(text)
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 2, 4)
    assert json.loads(text).items() <= cfg.to_dict().items()  # every key given comes back unchanged
    assert SpecConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()  # round trip


def test_passthrough_keys_are_kept():
    cfg = SpecConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}')
    assert cfg.vllm_only == {"draft_tensor_parallel_size": 1}
    assert cfg.to_dict()["draft_tensor_parallel_size"] == 1


def test_unknown_key_did_you_mean():
    with pytest.raises(ConfigError) as e:
        SpecConfig.from_json('{"method": "ngram", "num_speculative_token": 3}')
    assert "num_speculative_token'" in str(e.value)
    assert "did you mean 'num_speculative_tokens'" in str(e.value)


def test_malformed_json():
    with pytest.raises(ConfigError, match="not valid JSON"):
        SpecConfig.from_json('{"method": "ngram",')
    with pytest.raises(ConfigError, match="JSON object"):
        SpecConfig.from_json('["ngram"]')


@pytest.mark.parametrize("k", [0, -1])
def test_k_must_be_positive(k):
    with pytest.raises(ConfigError, match="num_speculative_tokens must be >= 1"):
        SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": k})


@pytest.mark.parametrize("k", ["4", 2.5, True])
def test_k_must_be_an_integer(k):
    with pytest.raises(ConfigError, match="num_speculative_tokens must be an integer"):
        SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": k})


def test_min_greater_than_max():
    with pytest.raises(ConfigError, match=r"prompt_lookup_min \(5\) > prompt_lookup_max \(3\)"):
        SpecConfig.from_dict({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3})


def test_ngram_lookup_defaults():
    assert (SpecConfig.from_dict({"method": "ngram"}).prompt_lookup_min,
            SpecConfig.from_dict({"method": "ngram"}).prompt_lookup_max) == (2, 5)
    only_max = SpecConfig.from_dict({"method": "ngram", "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpecConfig.from_dict({"method": "ngram", "prompt_lookup_min": 3})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (3, 3)
    assert SpecConfig.from_dict({"method": "ngram"}).num_speculative_tokens >= 1


def test_unknown_method():
    with pytest.raises(ConfigError, match="unknown speculative method 'ngrma'") as e:
        SpecConfig.from_dict({"method": "ngrma"})
    assert "did you mean 'ngram'" in str(e.value)


def test_vllm_method_not_implemented_yet(monkeypatch):
    import specctl.config as C

    monkeypatch.delitem(C.PROPOSER_MODULES, "eagle")  # a vLLM method no proposer serves
    with pytest.raises(ConfigError, match="not available in this version") as e:
        SpecConfig.from_dict({"method": "eagle", "model": "x", "num_speculative_tokens": 2})
    assert "ngram" in str(e.value)


@pytest.mark.parametrize("model", ["[ngram]", "ngram"])
def test_model_ngram_selects_ngram(model):
    cfg = SpecConfig.from_dict({"model": model, "num_speculative_tokens": 3})
    assert cfg.method == "ngram"


def test_method_alias_ngram_in_brackets():
    assert SpecConfig.from_dict({"method": "[ngram]"}).method == "ngram"


def test_no_method():
    with pytest.raises(ConfigError, match="no speculative method"):
        SpecConfig.from_dict({"num_speculative_tokens": 3})


def test_config_error_is_a_usage_error_with_exit_code_2():
    assert issubclass(ConfigError, UsageError)
    with pytest.raises(ConfigError) as e:
        SpecConfig.from_json("{")
    assert e.value.exit_code == 2
    assert "\n" not in str(e.value)  # one line: the problem, then the fix
    assert e.value.fix


# --------------------------------------------------------------------------- keys vLLM accepts

def test_passthrough_keys_are_all_keys_vllm_accepts():
    import dataclasses

    from specctl.config import OLDER_VLLM_KEYS, VLLM_PASSTHROUGH_KEYS
    from specctl.vllm_compat import VLLM_INTERNAL_FIELDS, VLLM_SPECULATIVE_CONFIG_FIELDS

    own = {f.name for f in dataclasses.fields(SpecConfig)}
    assert VLLM_PASSTHROUGH_KEYS <= VLLM_SPECULATIVE_CONFIG_FIELDS  # nothing vLLM refuses
    assert not VLLM_PASSTHROUGH_KEYS & VLLM_INTERNAL_FIELDS  # nor its computed config objects
    assert VLLM_PASSTHROUGH_KEYS | own >= VLLM_SPECULATIVE_CONFIG_FIELDS  # and every key it has is taken
    assert not OLDER_VLLM_KEYS & VLLM_SPECULATIVE_CONFIG_FIELDS


def test_a_vllm_config_with_every_engine_key_is_taken_unchanged():
    from specctl.config import VLLM_PASSTHROUGH_KEYS

    extra = {k: f"value-of-{k}" for k in VLLM_PASSTHROUGH_KEYS}
    cfg = SpecConfig.from_dict({"method": "eagle3", "model": "/d", "num_speculative_tokens": 3, **extra})
    assert cfg.vllm_only == extra and extra.items() <= cfg.to_dict().items()


@pytest.mark.parametrize("key", ["disable_log_stats", "draft_model_config", "target_model_config"])
def test_keys_vllm_refuses_in_a_speculative_config_are_refused_here(key):
    with pytest.raises(ConfigError) as e:
        SpecConfig.from_dict({"method": "ngram", key: True})
    assert f"'{key}'" in str(e.value) and "\n" not in str(e.value)
    if key == "disable_log_stats":
        assert "engine flag" in str(e.value) and "--disable-log-stats after --" in str(e.value)


def test_older_vllm_token_tree_key_is_kept_for_the_own_runtime():
    cfg = SpecConfig.from_dict({"method": "medusa", "model": "/d", "speculative_token_tree": "[(0,), (1,)]"})
    assert cfg.vllm_only == {"speculative_token_tree": "[(0,), (1,)]"}


@pytest.mark.parametrize("method,extra", [("ngram", {}), ("medusa", {"model": "/d"}), ("eagle3", {"model": "/d"}),
                                          ("draft_model", {"model": "/d"}), ("mtp", {})])
def test_to_dict_leaves_out_suffix_defaults_of_other_methods(method, extra):
    d = SpecConfig.from_dict({"method": method, **extra}).to_dict()
    assert not [k for k in d if k.startswith("suffix_decoding_")]
    assert SpecConfig.from_dict(d).to_dict() == d  # and round-trips
    set_by_user = SpecConfig.from_dict({"method": method, **extra, "suffix_decoding_max_tree_depth": 8}).to_dict()
    assert set_by_user["suffix_decoding_max_tree_depth"] == 8  # what a user set is kept (vllm_compat drops it)


def test_suffix_to_dict_has_its_four_keys():
    d = SpecConfig.from_dict({"method": "suffix"}).to_dict()
    assert {k for k in d if k.startswith("suffix_decoding_")} == {
        "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"}


def test_quantization_is_vllms_key_and_the_own_runtime_runs_gguf_drafts():
    """"quantization" keeps every value vLLM takes (sent with --engine vllm); the own runtime's draft_model runs
    None and "gguf", and refuses the rest when the draft loads; "gguf" on a method without a draft model is refused."""
    from specctl.vllm_compat import vllm_speculative_config

    cfg = SpecConfig.from_dict({"method": "draft_model", "model": "d.gguf", "quantization": "gguf"})
    assert cfg.quantization == "gguf" and cfg.own_quantization() == "gguf"
    assert cfg.to_dict()["quantization"] == "gguf" and vllm_speculative_config(cfg)["quantization"] == "gguf"
    assert SpecConfig.from_dict({"method": "draft_model", "model": "d"}).own_quantization() is None
    fp8 = SpecConfig.from_dict({"method": "draft_model", "model": "d", "quantization": "fp8"})
    assert vllm_speculative_config(fp8)["quantization"] == "fp8"
    with pytest.raises(ConfigError, match="'fp8' is vLLM's"):
        fp8.own_quantization()
    with pytest.raises(ConfigError, match="'ngram' drafts with none"):
        SpecConfig.from_dict({"method": "ngram", "quantization": "gguf"})
    with pytest.raises(ConfigError, match="quantization must be a string"):
        SpecConfig.from_dict({"method": "draft_model", "model": "d", "quantization": 4})
