"""specctl.recommend.probe: a Layer-2 draft (specctl's own EAGLE-3 export) detected, accepted and probed."""

from __future__ import annotations

import json
import shutil

import torch

from specctl.drafts.eagle import EagleDraft, spec_from_target
from specctl.drafts.eagle_files import export_eagle
from specctl.recommend.flowchart import recommend
from specctl.recommend.probe import apply_probe, probe
from specctl.runtime.loading import load_model


def test_probe_uses_an_exported_eagle3_draft(tiny_model_factory, tmp_path):
    """specctl's own EAGLE-3 export is detected, accepted, and probed through the hidden-state hooks."""
    # a private copy: the session's shared model folders sit beside other tests' drafts
    tgt = tmp_path / "target" / "tiny"
    shutil.copytree(tiny_model_factory(num_hidden_layers=4), tgt)
    loaded = load_model(tgt, dtype="float32")
    torch.manual_seed(0)
    d = EagleDraft(spec_from_target(loaded.model.args, 3, 100)).eval()
    out = export_eagle(d, tmp_path / "drafts" / "tiny-eagle3", loaded)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc abc abc abc abc abc"}) + "\n")
    rec = recommend(str(tgt), drafts=[str(out)], candidates=[])
    assert [(x.kind, x.accepted) for x in rec.drafts] == [("eagle3", True)], rec.drafts[0].reasons
    assert rec.choice.method == "eagle3" and rec.choice.runnable
    res = probe(rec, prompts=str(prompts), num_prompts=1, max_new_tokens=10, dtype="float32")
    apply_probe(rec, res)
    rows = {x["method"]: x for x in res["methods"]}
    assert {"eagle3", "ngram", "suffix"} <= set(rows) and not res["skipped"]
    e = rows["eagle3"]
    assert e["identical_to_baseline"] == 1 and e["rho"] > 0 and e["config"]["model"] == str(out)
    assert rec.tree.children[-1].text.startswith("Measured")


def test_a_measured_best_draft_with_another_vocabulary_gets_no_vllm_command(tmp_path, tiny_model_dir, word_tok_dir):
    """When --probe finds the other-tokenizer draft fastest, the new pick still says vLLM cannot run it."""
    from tests.recommend.builders import llama

    target = llama(tmp_path / "models" / "target", layers=4, tokenizer=tiny_model_dir)
    other = llama(tmp_path / "cands" / "other", layers=1, tokenizer=word_tok_dir)
    rec = recommend(str(target), candidates=[str(other)], workload="chat")
    assert rec.choice.method == "ngram"
    cfg = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    row = {"rank": 1, "label": "draft_model:other", "method": "draft_model", "config": cfg, "k": 2, "alpha": 0.5,
           "rho": 0.1, "predicted_k": 2, "predicted_speedup": 1.5, "measured_speedup": 1.4, "draft_rate": 1.0,
           "verify_cost": 1.0}
    apply_probe(rec, {"num_prompts": 1, "prompts": "chat", "max_new_tokens": 8, "baseline_tokens_per_s": 1.0,
                      "methods": [row], "skipped": []})
    assert rec.choice.config == cfg and rec.choice.commands["vllm"] is None and rec.choice.vllm_config is None
    assert "needs the target's vocabulary" in rec.choice.vllm_unsupported
    assert rec.alternatives[0].method == "ngram"
