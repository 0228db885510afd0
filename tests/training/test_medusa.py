"""Medusa training on tiny models: fresh heads are the identity, the index convention holds, the loss
falls and a small batch is overfit, export -> load reproduces the heads' logits in both layouts (and
in what vLLM's loader expects), checkpoints resume exactly where they stopped, and Medusa-2 (LoRA)
trains and exports a loadable target."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from specctl.drafts.medusa import MedusaHeads, detect_layout, load_medusa, save_fasterdecoding, save_medusa
from specctl.errors import UsageError
from specctl.training import data as D
from specctl.training.checkpoints import checkpoint_dirs
from specctl.training.loop import warmup_cosine
from specctl.training.medusa import MedusaTrainConfig, train
from specctl.training.medusa_losses import chain_acceptance, extract_features, head_targets, metrics


def test_fresh_heads_are_the_targets_lm_head(tiny_model):
    h = MedusaHeads(64, 128, num_heads=3)
    h.init_lm_heads(tiny_model.head_weight)
    x = torch.randn(5, 64)
    logits = h(x)  # [5, 3, 128]
    for k in range(3):  # zero-initialised residual blocks: every head starts as the target's LM head
        torch.testing.assert_close(logits[:, k], x @ tiny_model.head_weight.T)


def test_head_targets_worked_example():
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    mask = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool)
    t = head_targets(ids, mask, K=2)  # the module docstring's example
    assert t[1].tolist() == [13, 14] and t[3].tolist() == [15, -1] and t[0].tolist() == [-1, 13]
    assert t[4].tolist() == [-1, -1] and t[5].tolist() == [-1, -1]


def test_chain_acceptance_and_schedule():
    right = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    assert chain_acceptance(right).tolist() == [2, 0, 3]
    f = warmup_cosine(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 100, 0.1).lr_lambdas[0]
    assert f(0) == 0.0 and f(5) == pytest.approx(0.5) and f(10) == pytest.approx(1.0)  # transformers' warm-up
    assert f(99) == pytest.approx(0.1, abs=0.01)  # cosine down to 10%


def test_acceptance_positions_are_the_rows_it_is_measured_on():
    """The acceptance length is over rows where every head has a target; its position count was of rows
    where any head had one (near a response's end the later heads have none)."""
    ranks = torch.tensor([[1, 1], [1, 0], [0, 0], [1, 1]], dtype=torch.bool)[..., None]  # [N=4, K=2, R=1]
    valid = torch.tensor([[1, 1], [1, 1], [1, 0], [0, 0]], dtype=torch.bool)  # [N, K]
    m = metrics(0.0, ranks, valid)
    assert m["positions"] == 2 and m["acceptance_length"] == pytest.approx(1 + (2 + 1) / 2)
    assert m["top1_per_head"] == [pytest.approx(2 / 3, abs=1e-4), 0.5]  # each head over its own valid rows


@pytest.fixture(scope="module")
def loopy(tiny_model_factory):
    """A tiny llama whose greedy output falls into loops (learnable), and 16 of its own answers."""
    from specctl.runtime.loading import load_model
    from tests.conftest import loopy_answers

    path = tiny_model_factory(seed=1, initializer_range=0.05)
    lm = load_model(path, dtype="float32")
    return path, lm, [D.Record(prompt_ids=p, response_ids=out) for p, out in loopy_answers(lm, 16, 10, 32)]


def patch_examples(monkeypatch, recs):
    """Train on these in-memory records (exact ids) instead of reading cfg.data."""
    monkeypatch.setattr(D, "read_records", lambda path: [])
    monkeypatch.setattr(D, "build_examples", lambda cfg, loaded, **kw: [e for r in recs for e in D.encode(None, r, cfg.seq_len)])


def cfg_for(path, out, **kw) -> MedusaTrainConfig:
    base = dict(model=str(path), output=str(out), data=["(patched)"], num_heads=3, lr=1e-2, batch_size=4, seq_len=64,
                dtype="float32", eval_split=0.0, steps=40)
    base.update(kw)
    return MedusaTrainConfig(**base)


def test_loss_falls_and_a_small_batch_is_overfit(loopy, tmp_path, monkeypatch):
    path, lm, recs = loopy
    patch_examples(monkeypatch, recs[:4])
    s = train(cfg_for(path, tmp_path / "run", steps=150))
    assert s["final_loss"] < 0.1 * s["first_loss"]
    heads = load_medusa(tmp_path / "run")
    exs = [e for r in recs[:4] for e in D.encode(None, r, 64)]
    f = extract_features(lm.model, exs, 3, 64)
    pred = heads.vocab_ids(heads(f.hidden[f.rows]).argmax(-1))  # [M, 3]
    valid = f.targets >= 0
    assert float((pred == f.targets)[valid].float().mean()) > 0.95  # memorised


def test_eval_split_reports_per_head_accuracy_and_acceptance(loopy, tmp_path, monkeypatch):
    path, _, recs = loopy
    patch_examples(monkeypatch, recs)
    s = train(cfg_for(path, tmp_path / "run", eval_split=0.25, steps=30, soft_labels=True, truncated_vocab_size=64,
                      shared_lm_head=True))
    ev = s["eval"]
    assert len(ev["top1_per_head"]) == 3 and all(0 <= x <= 1 for x in ev["top1_per_head"])
    assert 1.0 <= ev["acceptance_length"] <= 4.0 and ev["positions"] > 0
    assert s["eval_sequences"] == 4 and s["train_sequences"] == 12
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["truncated_vocab_size"] == 64
    assert json.loads((tmp_path / "run" / "training_config.json").read_text())["soft_labels"] is True


def test_a_states_cache_from_train_eagle_serves_medusa_without_running_the_target(loopy, tmp_path, monkeypatch):
    """train-medusa --cache-hidden-states reads train-eagle's cache of the same data as it is (the target does
    not run again, the cache stays EAGLE's); with none there it makes one of hidden states that a second run
    reuses. The hidden states are the target's (to bf16)."""
    from specctl.runtime import runner as R
    from specctl.training import eagle as E
    from specctl.training import eagle_states as S

    path, lm, recs = loopy
    patch_examples(monkeypatch, recs)
    cache = tmp_path / "states"
    E.train(E.EagleTrainConfig(model=str(path), output=str(tmp_path / "eagle"), data=["(patched)"], steps=1, batch_size=4,
                               seq_len=64, dtype="float32", eval_split=0.0, cache_hidden_states=str(cache)),
            log=lambda m: None)
    index = json.loads((cache / "index.json").read_text())
    assert index["key"]["aux"]  # EAGLE-3's aux states are in it
    exs = [e for r in recs for e in D.encode(None, r, 64)]
    ran = extract_features(lm.model, exs, 3, 64).hidden
    with monkeypatch.context() as m:
        m.setattr(S, "target_states", lambda *a, **k: pytest.fail("the target ran again"))
        m.setattr(R.TargetRunner, "run", lambda *a, **k: pytest.fail("the target ran again"))
        logs: list[str] = []
        train(cfg_for(path, tmp_path / "run", steps=3, cache_hidden_states=str(cache)), log=logs.append)
        assert any("reusing cached target states" in x and f"{len(exs)} of {len(exs)}" in x for x in logs)
        cached = extract_features(lm.model, exs, 3, 64, states=S.cached_hidden(
            lm.model, [e.input_ids for e in exs], cache, {"model": str(Path(path).resolve()), "seq_len": 64,
                                                            "dtype": "float32"}, lambda x: None)).hidden
    assert json.loads((cache / "index.json").read_text()) == index  # still train-eagle's, whole
    torch.testing.assert_close(cached, ran.to(torch.bfloat16).float())
    own = tmp_path / "own"
    train(cfg_for(path, tmp_path / "run2", steps=3, cache_hidden_states=str(own)))
    assert json.loads((own / "index.json").read_text())["key"]["aux"] == []  # hidden states alone
    logs = []
    with monkeypatch.context() as m:
        m.setattr(S, "target_states", lambda *a, **k: pytest.fail("the target ran again"))
        train(cfg_for(path, tmp_path / "run3", steps=3, cache_hidden_states=str(own)), log=logs.append)
    assert any("reusing cached target states" in x for x in logs)


def _vllm_names_ok(folder, K: int, L: int, bias: bool, shared: bool, truncated: bool) -> None:
    """What vLLM's Medusa.load_weights and MedusaConfig.from_pretrained expect of the folder."""
    from safetensors import safe_open

    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert cfg["num_heads"] == K and cfg["num_hidden_layers"] == L and cfg["medusa_fc_bias"] == bias
    # MedusaConfig.from_pretrained renames every key with "num" and "heads"/"layers": only ours may exist
    assert [k for k in cfg if "num" in k] == ["num_heads", "num_hidden_layers"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
    want = {f"blocks.{h}.layers.{l}.weight" for h in range(K) for l in range(L)}
    want |= {f"blocks.{h}.layers.{l}.bias" for h in range(K) for l in range(L)} if bias else set()
    want |= {"lm_heads.0.weight"} if shared else {f"lm_heads.{h}.weight" for h in range(K)}
    want |= {"token_map"} if truncated else set()
    assert names == want
    assert shared or not truncated  # vLLM cuts per-head LM heads (V rows) to a token map, then refuses them
    assert all(re.fullmatch(r"(blocks\.\d+\.layers\.\d+\.(weight|bias)|lm_heads\.\d+\.weight|token_map)", n) for n in names)


@pytest.mark.parametrize("shared", [False, True])
def test_the_format_check_says_when_vllm_refuses_a_truncated_vocabulary(tmp_path, shared):
    """A token_map beside one LM head per head (what train-medusa wrote before): the check that recommend runs
    names vLLM's refusal and the fix; beside the one shared head (vLLM's original_lm_head) nothing is said."""
    from safetensors import safe_open

    from specctl.drafts.formats import TargetFacts
    from specctl.drafts.medusa import check_medusa

    save_medusa(MedusaHeads(64, 128, 3, shared_lm_head=shared, token_map=torch.arange(8)), tmp_path, torch.float32)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as fh:
        tensors = {k: (None, list(fh.get_slice(k).get_shape())) for k in fh.keys()}
    check = check_medusa(json.loads((tmp_path / "config.json").read_text()), tensors, TargetFacts("t", 64, 128, 4))
    said = [r for r in check.reasons if "vLLM refuses it" in r]
    assert (said and "--shared-lm-head" in said[0] and said[0].startswith("note:")) if not shared else not said


@pytest.mark.parametrize("bias, shared, truncated, L", [(False, False, False, 1), (True, True, True, 2),
                                                        (False, True, False, 1)])
def test_export_load_reproduces_the_logits(tiny_model, tmp_path, bias, shared, truncated, L):
    torch.manual_seed(0)
    tm = torch.tensor([3, 5, 8, 13, 21, 34, 55, 89]) if truncated else None
    h = MedusaHeads(64, 128, 3, L, bias=bias, shared_lm_head=shared, token_map=tm)
    h.init_lm_heads(tiny_model.head_weight)
    with torch.no_grad():
        for p in h.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_medusa(h, tmp_path / "v", torch.float32)
    _vllm_names_ok(tmp_path / "v", 3, L, bias, shared, truncated)
    back = load_medusa(tmp_path / "v")
    assert detect_layout(tmp_path / "v") == "vllm" and back.shared_lm_head == shared
    x = torch.randn(7, 64)
    torch.testing.assert_close(back(x), h(x), rtol=0, atol=0)
    torch.testing.assert_close(back.full_vocab(back(x)), h.full_vocab(h(x)), rtol=0, atol=0)
    if not truncated:  # FasterDecoding's layout (biased blocks, per-head LM heads): same logits
        save_fasterdecoding(h, tmp_path / "fd", base_model="tiny")
        fd = load_medusa(tmp_path / "fd")
        assert detect_layout(tmp_path / "fd") == "fasterdecoding" and fd.bias
        torch.testing.assert_close(fd(x), h(x), rtol=0, atol=0)


def test_fasterdecoding_pt_file_and_vllm_prefix(tmp_path):
    """medusa_lm_head.pt with bare keys ({h}.{l}.linear.weight, {h}.{L}.weight), as FasterDecoding saves it."""
    torch.manual_seed(1)
    h = MedusaHeads(64, 128, 2, 1, bias=True)
    with torch.no_grad():
        for p in h.parameters():
            p.normal_()
    sd = {}
    for k in range(2):
        sd[f"{k}.0.linear.weight"] = h.blocks[k].layers[0].weight.detach().clone()
        sd[f"{k}.0.linear.bias"] = h.blocks[k].layers[0].bias.detach().clone()
        sd[f"{k}.1.weight"] = h.lm_heads[k].weight.detach().clone()
    (tmp_path / "fd").mkdir()
    torch.save(sd, tmp_path / "fd" / "medusa_lm_head.pt")
    (tmp_path / "fd" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    x = torch.randn(3, 64)
    torch.testing.assert_close(load_medusa(tmp_path / "fd")(x), h(x), rtol=0, atol=0)
    # vLLM strips a "medusa_heads." prefix; so does the loader
    from safetensors.torch import save_file

    save_medusa(h, tmp_path / "v", torch.float32)
    from safetensors.torch import load_file

    sdv = load_file(str(tmp_path / "v" / "model.safetensors"))
    save_file({f"medusa_heads.{k}": v for k, v in sdv.items()}, str(tmp_path / "v" / "model.safetensors"))
    torch.testing.assert_close(load_medusa(tmp_path / "v")(x), h(x), rtol=0, atol=0)


def test_a_finished_run_without_checkpoints_is_not_overwritten(loopy, tmp_path, monkeypatch):
    path, _, recs = loopy
    patch_examples(monkeypatch, recs[:4])
    train(cfg_for(path, tmp_path / "a", steps=4))
    assert checkpoint_dirs(tmp_path / "a") == []
    weights = (tmp_path / "a" / "model.safetensors").read_bytes()
    for resume in (False, True):  # nothing to continue from either way; the export stays
        with pytest.raises(UsageError, match="earlier run's export"):
            train(cfg_for(path, tmp_path / "a", steps=4, seed=1, resume=resume))
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == weights


def test_resume_continues_from_the_checkpoint(loopy, tmp_path, monkeypatch):
    path, _, recs = loopy
    patch_examples(monkeypatch, recs[:6])
    full = train(cfg_for(path, tmp_path / "a", steps=20, save_every=10))
    assert [p.name for p in checkpoint_dirs(tmp_path / "a")] == ["step-0000010", "step-0000020"]
    ck = tmp_path / "a" / "checkpoints" / "step-0000010"
    assert json.loads((ck / "training_config.json").read_text())["num_heads"] == 3
    # an interrupted run: only the step-10 checkpoint exists; --resume continues to step 20
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(ck, tmp_path / "b" / "checkpoints" / ck.name)
    with pytest.raises(UsageError, match="already holds checkpoints"):
        train(cfg_for(path, tmp_path / "b", steps=20, save_every=10))
    with pytest.raises(UsageError, match="num_heads"):
        train(cfg_for(path, tmp_path / "b", steps=20, save_every=10, num_heads=2, resume=True))
    resumed = train(cfg_for(path, tmp_path / "b", steps=20, save_every=10, resume=True))
    assert resumed["steps"] == 20 and resumed["history"][-1]["step"] == 20
    x = torch.randn(4, 64)
    torch.testing.assert_close(load_medusa(tmp_path / "b")(x), load_medusa(tmp_path / "a")(x))
    assert resumed["final_loss"] == pytest.approx(full["final_loss"], rel=1e-4)
    assert resumed["first_loss"] == pytest.approx(full["first_loss"])
    # a finished run extends: --resume with more steps continues from its last checkpoint
    longer = train(cfg_for(path, tmp_path / "a", steps=24, save_every=10, resume=True))
    assert longer["steps"] == 24 and [h["step"] for h in longer["history"]][-2:] == [20, 24]
    # a finished run resumed as it was, its export gone (Ctrl-C while exporting): exported again with its
    # own losses (the final loss was None, which the summary could not print)
    for f in ("model.safetensors", "training_config.json", "train_summary.json"):
        (tmp_path / "a" / f).unlink()
    again = train(cfg_for(path, tmp_path / "a", steps=24, save_every=10, resume=True))
    assert again["steps"] == 24 and again["final_loss"] == longer["final_loss"] and again["first_loss"] == full["first_loss"]
    assert json.loads((tmp_path / "a" / "train_summary.json").read_text())["final_loss"] == longer["final_loss"]
    torch.testing.assert_close(load_medusa(tmp_path / "a")(x), load_medusa(tmp_path / "a" / "checkpoints" / "step-0000024")(x))


def test_joint_medusa2_trains_lora_and_exports_the_merged_target(loopy, tmp_path, monkeypatch, capfd):
    import stat

    from specctl import files
    from specctl.runtime.loading import load_model

    path, _, recs = loopy
    patch_examples(monkeypatch, recs[:4])
    s = train(cfg_for(path, tmp_path / "j", steps=25, joint=True, lr=5e-3, save_every=20))
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "it/s]" not in err  # transformers' bars, in a clean log
    for f in (tmp_path / "j" / "base").iterdir():  # as a plain file, not safetensors' 0600
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~files._UMASK, f.name
    assert s["mode"] == "medusa-2" and s["final_loss"] < s["first_loss"]
    assert (tmp_path / "j" / "checkpoints" / "step-0000020" / "adapter.safetensors").is_file()
    base = load_model(tmp_path / "j" / "base", dtype="float32")  # the merged target loads in the own runtime
    heads = load_medusa(tmp_path / "j")
    assert json.loads((tmp_path / "j" / "config.json").read_text())["specctl"]["base_dir"] == "base"
    assert heads(torch.randn(2, 64)).shape == (2, 3, 128) and base.model.args.hidden_size == 64
    # the card and the summary serve the heads with the fine-tuned target they belong to, not the original
    target = str((tmp_path / "j" / "base").resolve())
    assert s["target"] == target and f"vllm serve {target}" in (tmp_path / "j" / "README.md").read_text()


def test_config_validation():
    with pytest.raises(UsageError, match="no training data"):
        MedusaTrainConfig(model="m", output="o").validated()
    with pytest.raises(UsageError, match="num-heads"):
        MedusaTrainConfig(model="m", output="o", data=["d"], num_heads=0).validated()
    with pytest.raises(UsageError, match="--joint and --shared-lm-head"):
        MedusaTrainConfig(model="m", output="o", data=["d"], joint=True, shared_lm_head=True).validated()


def test_evaluations_fall_on_eval_every_not_on_every_checkpoint(loopy, tmp_path, monkeypatch):
    """--eval-every N evaluates every N steps and at the end, whatever --save-every is (a held-out split can cost
    more than the steps between checkpoints); --eval-every 0 evaluates at each checkpoint and at the end."""
    path, _, recs = loopy
    patch_examples(monkeypatch, recs[:6])
    evaluated = lambda s: [h["step"] for h in s["history"] if "eval_loss" in h]  # noqa: E731
    assert evaluated(train(cfg_for(path, tmp_path / "a", steps=10, save_every=2, eval_every=4, eval_split=0.34))) == [4, 8, 10]
    assert evaluated(train(cfg_for(path, tmp_path / "b", steps=10, save_every=4, eval_every=0, eval_split=0.34))) == [4, 8, 10]
    assert [p.name for p in checkpoint_dirs(tmp_path / "a")][-1] == "step-0000010"
