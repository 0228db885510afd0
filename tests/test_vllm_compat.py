"""specctl.vllm_compat: every method's config, as sent to vLLM, holds only keys of vLLM's SpeculativeConfig
(the recorded schema), and nothing specctl-only; the vLLM bench peer reads vLLM's acceptance counters. No vLLM
needed (but for the one ``pytest -m vllm`` test, which checks the schema against the installed vLLM)."""

from __future__ import annotations

import json

import pytest

from specctl.config import SpecConfig
from specctl.vllm_compat import (SPECCTL_ONLY_KEYS, SUFFIX_KEYS, VLLM_METHODS, VLLM_SPECULATIVE_CONFIG_FIELDS,
                                 dropped_keys, vllm_speculative_config)

CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "suffix_decoding_max_tree_depth": 12},
    "medusa": {"method": "medusa", "model": "/d/medusa", "num_speculative_tokens": 3},
    "medusa_auto_tree": {"method": "medusa", "model": "/d/medusa", "num_speculative_tokens": 3,
                         "speculative_token_tree": "auto"},
    "eagle": {"method": "eagle", "model": "/d/eagle", "num_speculative_tokens": 4},
    "eagle3": {"method": "eagle3", "model": "/d/eagle3", "num_speculative_tokens": 4},
    "eagle3_tree": {"method": "eagle3", "model": "/d/eagle3", "speculative_eagle_topk": 4,
                    "speculative_num_draft_tokens": 16},
    "draft_model": {"method": "draft_model", "model": "/d/small", "num_speculative_tokens": 5,
                    "disable_by_batch_size": 4},
    "mtp": {"method": "mtp", "model": "/d/mtp", "num_speculative_tokens": 1},
    "deepseek_mtp": {"method": "deepseek_mtp", "num_speculative_tokens": 2},
    "passthrough": {"method": "eagle3", "model": "/d/eagle3", "draft_tensor_parallel_size": 1,
                    "disable_padded_drafter_batch": True},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_emitted_keys_are_vllm_fields(name):
    spec = SpecConfig.from_dict(dict(CONFIGS[name]))
    sent = vllm_speculative_config(spec)
    assert set(sent) <= VLLM_SPECULATIVE_CONFIG_FIELDS, set(sent) - VLLM_SPECULATIVE_CONFIG_FIELDS
    assert not set(sent) & SPECCTL_ONLY_KEYS
    assert sent["method"] in VLLM_METHODS
    assert sent["num_speculative_tokens"] >= 1
    assert all(v is not None for v in sent.values())
    if sent["method"] != "suffix":
        assert not set(sent) & set(SUFFIX_KEYS)
    assert sent.get("speculative_token_tree") != "auto"
    # what vLLM does know is kept as given
    for key in ("model", "prompt_lookup_max", "draft_tensor_parallel_size", "disable_padded_drafter_batch"):
        if key in CONFIGS[name]:
            assert sent[key] == CONFIGS[name][key]


def test_every_vllm_method_of_specctl_is_covered():
    from specctl.config import VLLM_METHODS as SPECCTL_VLLM_METHODS

    covered = {c["method"] for c in CONFIGS.values()}
    assert set(SPECCTL_VLLM_METHODS) <= covered


def test_suffix_keeps_its_keys():
    sent = vllm_speculative_config(SpecConfig.from_dict(dict(CONFIGS["suffix"])))
    assert sent["suffix_decoding_max_tree_depth"] == 12 and set(SUFFIX_KEYS) <= set(sent)


def test_deepseek_mtp_is_sent_as_mtp_and_dicts_are_accepted():
    assert vllm_speculative_config({"method": "deepseek_mtp", "num_speculative_tokens": 1}) == \
        {"method": "mtp", "num_speculative_tokens": 1}


def test_hybrid_has_no_vllm_form():
    spec = SpecConfig.from_dict({"method": "hybrid", "proposers": [{"method": "ngram"}, {"method": "suffix"}]})
    with pytest.raises(ValueError, match="one proposer at a time"):
        vllm_speculative_config(spec)


def test_other_schema_and_dropped_keys():
    spec = SpecConfig.from_dict(dict(CONFIGS["eagle3_tree"]))
    full = spec.to_dict()
    sent = vllm_speculative_config(spec, fields={"method", "model"})
    assert sent == {"method": "eagle3", "model": "/d/eagle3"}
    # user-set keys that were dropped are named; specctl's suffix defaults are not
    gone = dropped_keys(full, vllm_speculative_config(spec))
    assert gone == ["speculative_eagle_topk", "speculative_num_draft_tokens"]


def test_recorded_schema_is_sane():
    assert {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
            "max_model_len"} <= VLLM_SPECULATIVE_CONFIG_FIELDS
    assert not VLLM_SPECULATIVE_CONFIG_FIELDS & SPECCTL_ONLY_KEYS


def test_hf_overrides_for_a_mimo_mtp_draft(tmp_path):
    import json

    from specctl.vllm_compat import vllm_hf_overrides

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1}))
    assert vllm_hf_overrides({"method": "mtp", "model": str(tmp_path)}) == {"num_nextn_predict_layers": 1}
    assert vllm_hf_overrides({"method": "mtp"}) == {}
    assert vllm_hf_overrides({"method": "eagle3", "model": str(tmp_path)}) == {}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_nextn_predict_layers": 1}))
    assert vllm_hf_overrides({"method": "mtp", "model": str(tmp_path)}) == {}


def test_loader_extra_config_only_for_a_truncated_vocabulary_medusa(tmp_path):
    import json

    from specctl.vllm_compat import vllm_loader_extra_config

    cfg = {"model_type": "medusa", "num_heads": 3, "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "truncated_vocab_size": 64}))
    assert vllm_loader_extra_config({"method": "medusa", "model": str(tmp_path)}) == {"enable_weights_track": False}
    assert vllm_loader_extra_config({"method": "eagle3", "model": str(tmp_path)}) == {}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "truncated_vocab_size": 128}))  # not truncated
    assert vllm_loader_extra_config({"method": "medusa", "model": str(tmp_path)}) == {}
    assert vllm_loader_extra_config({"method": "medusa", "model": str(tmp_path / "nowhere")}) == {}


def test_a_method_vllm_lacks_has_no_vllm_form():
    with pytest.raises(ValueError, match="not a speculative method of vLLM"):
        vllm_speculative_config({"method": "sparse_attn", "num_speculative_tokens": 4})


# --------------------------------------------------------------------------- every method, every engine key

ENGINE_KEYS_SET = {"draft_tensor_parallel_size": 1, "quantization": "fp8", "revision": "main", "enforce_eager": True,
                   "kv_cache_dtype": "auto", "parallel_drafting": False, "rejection_sample_method": "standard"}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_keys_pass_through_for_every_method(name):
    from specctl.config import VLLM_PASSTHROUGH_KEYS

    assert set(ENGINE_KEYS_SET) <= VLLM_PASSTHROUGH_KEYS
    spec = SpecConfig.from_dict({**CONFIGS[name], **ENGINE_KEYS_SET})
    sent = vllm_speculative_config(spec)
    assert set(sent) <= VLLM_SPECULATIVE_CONFIG_FIELDS
    assert ENGINE_KEYS_SET.items() <= sent.items()


def test_every_recorded_field_a_user_can_give_is_sent():
    from specctl.config import VLLM_PASSTHROUGH_KEYS

    given = {k: f"v-{k}" for k in VLLM_PASSTHROUGH_KEYS}
    sent = vllm_speculative_config(SpecConfig.from_dict({"method": "eagle3", "model": "/d", **given}))
    assert given.items() <= sent.items()


def test_an_older_vllm_token_tree_is_not_sent_and_is_named():
    spec = SpecConfig.from_dict({"method": "medusa", "model": "/d/medusa", "speculative_token_tree": "[(0,), (1,)]"})
    sent = vllm_speculative_config(spec)
    assert "speculative_token_tree" not in sent
    assert dropped_keys(spec.to_dict(), sent, spec.defaulted) == ["speculative_token_tree"]


def _vllm_python() -> str | None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    for cand in (os.environ.get("SPECCTL_VLLM_PYTHON"), sys.executable):
        if cand and Path(cand).is_file() and subprocess.run(
                [cand, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"]).returncode == 0:
            return cand
    return None


@pytest.mark.vllm
def test_recorded_schema_matches_the_installed_vllm_and_its_speculative_config_accepts_ours():
    """Against a real vLLM (``pytest -m vllm``): the recorded fields are the installed vLLM's, and vLLM's own
    SpeculativeConfig takes an emitted ngram config with every engine key at vLLM's default value."""
    import json
    import subprocess

    python = _vllm_python()
    if python is None:
        pytest.skip("no vLLM: set SPECCTL_VLLM_PYTHON to a python that imports it")
    from specctl.config import VLLM_PASSTHROUGH_KEYS
    from specctl.vllm_compat import VLLM_INTERNAL_FIELDS, VLLM_VERSION_RECORDED

    code = r"""
import dataclasses, json, sys
import vllm
from vllm.config import SpeculativeConfig
fields = SpeculativeConfig.__dataclass_fields__
defaults = {k: f.default for k, f in fields.items()
            if f.default is not dataclasses.MISSING and isinstance(f.default, (bool, int, float, str, type(None)))}
print(json.dumps({"version": vllm.__version__, "fields": sorted(fields), "defaults": defaults}))
"""
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    if info["version"] != VLLM_VERSION_RECORDED:
        pytest.skip(f"vLLM {info['version']} installed, schema recorded from {VLLM_VERSION_RECORDED}")
    assert set(info["fields"]) - VLLM_INTERNAL_FIELDS == VLLM_SPECULATIVE_CONFIG_FIELDS
    engine = {k: v for k, v in info["defaults"].items() if k in VLLM_PASSTHROUGH_KEYS}
    assert len(engine) >= 10  # most engine keys have a plain default
    sent = vllm_speculative_config(SpecConfig.from_dict({**CONFIGS["ngram"], **engine}))
    check = "import json, sys; from vllm.config import SpeculativeConfig; SpeculativeConfig(**json.loads(sys.argv[1]))"
    r = subprocess.run([python, "-c", check, json.dumps(sent)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


# --------------------------------------------------------------------------- the vLLM peer's counters

def test_the_vllm_peer_reads_vllms_spec_decode_counters_as_specstats():
    import io
    from types import SimpleNamespace as NS

    from specctl.bench import peer_worker
    from specctl.bench.peers import ExternalPeer, ExternalPeers

    metrics = [NS(name="vllm:spec_decode_num_drafts", value=3), NS(name="vllm:spec_decode_num_draft_tokens", value=12),
               NS(name="vllm:spec_decode_num_accepted_tokens", value=5),
               NS(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[3, 2, 0, 0]),
               NS(name="vllm:spec_decode_num_drafts", value=1),  # another label set: summed
               NS(name="vllm:num_requests_running", value=1)]
    engine = peer_worker.VLLMEngine.__new__(peer_worker.VLLMEngine)
    engine.llm = NS(get_metrics=lambda: metrics)
    before = engine.spec_counters()
    assert before == {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 5,
                      "num_accepted_tokens_per_pos": [3, 2, 0, 0]}
    metrics[0].value, metrics[2].value, metrics[3].values = 7, 9, [5, 3, 1, 0]
    spec = peer_worker.counted_between(before, engine.spec_counters())
    assert spec == {"num_drafts": 4, "num_draft_tokens": 0, "num_accepted_tokens": 4,
                    "num_accepted_tokens_per_pos": [2, 1, 1, 0]}

    peers = ExternalPeers.__new__(ExternalPeers)  # the worker's answer, as ExternalPeers.run reads it
    answer = {"tokens": [1, 2], "prefill_s": 0.1, "decode_s": 0.2, "spec": spec}
    peers.engine, peers._proc = "vllm", NS(stdin=io.StringIO(), stdout=io.StringIO(json.dumps(answer) + "\n"))
    res = peers.run(ExternalPeer("vllm:ngram", {"kind": "ngram", "k": 4}), [5, 6], 2, [2])
    assert (res.stats.num_drafts, res.stats.num_accepted_tokens, res.stats.num_accepted_tokens_per_pos) == (4, 4, [2, 1, 1, 0])


@pytest.mark.parametrize("method", ["medusa", "mtp"])
def test_k_left_unset_is_left_to_vllm_where_the_draft_sets_it(method):
    """Medusa's heads and MTP's layers say how many tokens they draft, and vLLM reads that when
    num_speculative_tokens is not given (and builds as many Medusa heads as it is told): specctl's
    default 5 went to vLLM and asked 5 heads of a 3-head export."""
    unset = SpecConfig.from_dict({"method": method, "model": "/d/x"})
    assert "num_speculative_tokens" not in vllm_speculative_config(unset)
    assert dropped_keys(unset.to_dict(), vllm_speculative_config(unset), unset.defaulted) == []
    given = SpecConfig.from_dict({"method": method, "model": "/d/x", "num_speculative_tokens": 2})
    assert vllm_speculative_config(given)["num_speculative_tokens"] == 2
    eagle = SpecConfig.from_dict({"method": "eagle3", "model": "/d/x"})  # vLLM needs it for EAGLE
    assert vllm_speculative_config(eagle)["num_speculative_tokens"] == 5


def test_tree_defaults_filled_by_specctl_are_not_named_as_dropped():
    spec = SpecConfig.from_dict({"method": "eagle3", "model": "/d/x", "speculative_eagle_topk": 2})
    assert dropped_keys(spec.to_dict(), vllm_speculative_config(spec), spec.defaulted) == ["speculative_eagle_topk"]


@pytest.mark.parametrize("target_arch", ["Qwen2ForCausalLM", "LlamaForCausalLM", "DeepseekV3ForCausalLM"])
@pytest.mark.parametrize("layout", ["mimo", "deepseek_v3"])
def test_train_mtps_lines_and_serves_refusal_follow_one_rule(tiny_model_factory, tmp_path, layout, target_arch):
    """What train-mtp prints of vLLM (from the layout) and what serve / the model card refuse (from the exported
    folder's config) agree for every layout and target: both ask vllm_compat.vllm_loads_mtp."""
    from specctl.modeling import ModelArgs
    from specctl.training.mtp import vllm_unavailable
    from specctl.vllm_compat import vllm_mtp_refusal

    folder = tiny_model_factory("qwen2")
    args = ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
    draft = tmp_path / "mtp"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["MiMoForCausalLM" if layout == "mimo" else target_arch]}))
    refusal = vllm_mtp_refusal({"method": "mtp", "model": str(draft)}, {"architectures": [target_arch]})
    printed = vllm_unavailable(layout, args, target_arch=target_arch)
    assert (refusal is None) == (printed is None)
    assert (printed is None) == (layout == "mimo" or target_arch == "DeepseekV3ForCausalLM")
