"""MTP training: step weights, the loss falls and eval acceptance rises on the tiny model's own text,
checkpoints resume where they stopped, and stitch -> reload round-trips (the stitched folder loads as
a target, unchanged, and its MTP modules load back equal)."""

from __future__ import annotations

import json

import pytest
import torch

from specctl.modeling import load_transformer
from specctl.training.checkpoints import checkpoint_dirs
from specctl.training.mtp import MtpTrainConfig, init_stack, step_weights, train_mtp
from specctl.drafts.mtp_files import MTP_FILE, export_mtp, load_mtp


def test_step_weights():
    w = step_weights(3, 0.6)
    assert torch.allclose(w, torch.tensor([1, 0.6, 0.36]) / 1.96)
    assert float(w.sum()) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def data_file(tiny_model_dir, tmp_path_factory):
    """The tiny model's own greedy text (character tokenizer: text round-trips to the same ids)."""
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.loading import load_model
    from specctl.runtime.runner import TargetRunner

    lm = load_model(tiny_model_dir, dtype="float32")
    dec = SpecDecoder(TargetRunner(lm.model, 256))
    rows = []
    for i in range(12):
        p = lm.tokenizer.encode(f"def f{i}(x):", add_special_tokens=False)
        out = dec.generate(p, SamplingParams(max_new_tokens=60, ignore_eos=True)).token_ids
        rows.append({"text": lm.tokenizer.decode(p + out)})
    path = tmp_path_factory.mktemp("mtp-data") / "own.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(model, data, out, **kw):
    base = dict(model=str(model), data=str(data), output=str(out), seq_len=32, batch_size=8, lr=1e-2, depth=2,
                eval_split=0.2, save_every=5)
    base.update(kw)
    return MtpTrainConfig(**base)


def test_training_learns_and_resumes(tiny_model_dir, data_file, tmp_path):
    out = tmp_path / "draft"
    first = train_mtp(_cfg(tiny_model_dir, data_file, out, steps=10))
    assert first["steps"] == 10
    st = json.loads((checkpoint_dirs(out)[-1] / "trainer_state.json").read_text())
    assert st["step"] == 10
    resumed = train_mtp(_cfg(tiny_model_dir, data_file, out, steps=40, resume=True))
    assert resumed["steps"] == 40
    st = json.loads((checkpoint_dirs(out)[-1] / "trainer_state.json").read_text())
    assert len(st["losses"]) == 40 and st["losses"][-1] < st["losses"][0]
    assert resumed["eval"]["mean_acceptance_length"] > first["eval"]["mean_acceptance_length"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    assert (out / MTP_FILE).is_file() and (out / "tokenizer.json").is_file()


def test_stitch_round_trip(tiny_model_dir, tmp_path):
    target = load_transformer(tiny_model_dir, torch.float32)
    torch.manual_seed(0)
    stack = init_stack(target, 2)
    with torch.no_grad():
        for p in stack.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = export_mtp(stack, tiny_model_dir, tmp_path / "stitched", stitch=True, head_weight=target.head_weight)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 2 and cfg["num_hidden_layers"] == 2
    # the stitched folder is still the same target
    again = load_transformer(out, torch.float32)
    for (n, a), (_, b) in zip(target.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    # ... and its MTP modules load back equal
    loaded = load_mtp(out, again)
    assert loaded.layout == "deepseek_v3" and loaded.num_layers == 2
    for (n, a), (_, b) in zip(stack.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    # the tensors are in DeepSeek-V3 names after the main layers
    from safetensors import safe_open

    with safe_open(str(out / MTP_FILE), framework="pt") as fh:
        keys = set(fh.keys())
    for i in (2, 3):
        for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "self_attn.q_proj",
                     "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
            assert f"model.layers.{i}.{name}.weight" in keys
    with pytest.raises(ValueError):
        export_mtp(stack, out, out, stitch=True)


def _perturbed_stack(target, n, layout):
    torch.manual_seed(0)
    stack = init_stack(target, n, layout)
    with torch.no_grad():
        for p in stack.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return stack


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mimo_draft_folder_round_trip(arch, tiny_model_factory, tmp_path):
    """The MiMo layout vLLM's MiMoMTPModel loads: names, config, biases, and back through specctl's loader."""
    from safetensors import safe_open

    model_dir = tiny_model_factory(arch=arch)
    target = load_transformer(model_dir, torch.float32)
    stack = _perturbed_stack(target, 1, "mimo")
    out = export_mtp(stack, model_dir, tmp_path / "mimo", layout="mimo", head_weight=target.head_weight,
                     embed_weight=target.embed.weight)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MiMoForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    assert cfg["model_type"] == arch and (out / "tokenizer.json").is_file()
    a = target.args
    H = a.hidden_size
    with safe_open(str(out / MTP_FILE), framework="pt") as fh:
        sd = {k: fh.get_tensor(k) for k in fh.keys()}
    p = "model.mtp_layers.0."
    expected = {p + n + ".weight" for n in ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm",
                                            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                            "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                                            "input_layernorm", "post_attention_layernorm")}
    expected |= {p + f"self_attn.{n}_proj.bias" for n in "qkv"}  # vLLM's block is Qwen2's: always q/k/v biases
    expected |= {"model.embed_tokens.weight", "lm_head.weight"}
    assert set(sd) == expected
    # input_proj reads cat[hidden, embedding]: the hidden half is our eh_proj's second half
    assert torch.equal(sd[p + "input_proj.weight"][:, :H], stack.layers[0].eh_proj.weight[:, H:])
    assert torch.equal(sd[p + "input_proj.weight"][:, H:], stack.layers[0].eh_proj.weight[:, :H])
    if arch == "llama":
        assert not sd[p + "self_attn.q_proj.bias"].any()
    assert torch.equal(sd["lm_head.weight"], target.head_weight)
    loaded = load_mtp(out, target)
    assert loaded.layout == "mimo" and loaded.chain_normed and loaded.zero_pos0 and loaded.num_layers == 1
    for (n, x), (_, y) in zip(stack.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(x, y), n
    with pytest.raises(ValueError, match="draft folder"):
        export_mtp(stack, model_dir, tmp_path / "s", layout="mimo", stitch=True, head_weight=target.head_weight,
                   embed_weight=target.embed.weight)


def test_mimo_training_and_the_proposer_agree(tiny_model_dir, data_file, tmp_path):
    """train -> MiMo draft folder -> MtpProposer drafts with it; the summary says how vLLM takes it."""
    from specctl.config import SpecConfig
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.proposers import build_proposer
    from specctl.runtime.loading import load_model
    from specctl.runtime.runner import TargetRunner

    out = tmp_path / "mimo"
    bars: list[tuple] = []
    s = train_mtp(_cfg(tiny_model_dir, data_file, out, steps=6, layout="mimo"), bar=lambda *a: bars.append(a))
    assert bars[-1] == ("train", 6, 6) and len([b for b in bars if b[0] == "train"]) == 6
    assert s["layout"] == "mimo" and s["vllm"]["speculative_config"]["method"] == "mtp"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MiMoForCausalLM"]
    lm = load_model(tiny_model_dir, dtype="float32")
    spec = SpecConfig.from_dict({"method": "mtp", "model": str(out), "num_speculative_tokens": 2})
    prop = build_proposer(spec, 256, target=lm)
    assert prop.stack.layout == "mimo"
    plain = SpecDecoder(TargetRunner(lm.model, 256))
    ids = lm.tokenizer.encode("def f1(x):", add_special_tokens=False)
    want = plain.generate(ids, SamplingParams(max_new_tokens=24, ignore_eos=True)).token_ids
    dec = SpecDecoder(TargetRunner(lm.model, 256), prop, 2)
    got = dec.generate(ids, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert got.token_ids == want and got.stats.num_draft_tokens > 0


def test_layout_resolution(tiny_model_factory):
    from specctl.errors import UsageError
    from specctl.modeling import ModelArgs
    from specctl.training.mtp import resolve_layout

    base = json.loads((tiny_model_factory(arch="llama") / "config.json").read_text())
    dense = ModelArgs.from_hf_config(base)
    biased = ModelArgs.from_hf_config({**base, "attention_bias": True})
    said: list[str] = []
    assert resolve_layout("auto", dense, warn=said.append) == "mimo" and not said
    assert resolve_layout("auto", biased, warn=said.append) == "deepseek_v3"
    assert "no vLLM MTP architecture" in said[-1] and "o_proj bias" in said[-1]
    assert resolve_layout("auto", dense, stitch=True, warn=said.append) == "deepseek_v3" and "--stitch" in said[-1]
    with pytest.raises(UsageError, match="no vLLM MTP architecture"):
        resolve_layout("mimo", biased)
    with pytest.raises(UsageError, match="not stitched"):
        resolve_layout("mimo", dense, stitch=True)
    resolve_layout("mimo", dense, num_layers=2, warn=said.append)
    assert "module 0" in said[-1]


def test_resume_reads_the_old_checkpoint_layout(tiny_model_dir, data_file, tmp_path):
    """OUTPUT/checkpoint/state.pt, train-mtp's checkpoint before checkpoints/, resumes to the same modules."""
    from safetensors.torch import load_file

    full = train_mtp(_cfg(tiny_model_dir, data_file, tmp_path / "a", steps=10))
    ck = tmp_path / "a" / "checkpoints" / "step-0000005"
    old = tmp_path / "b" / "checkpoint"
    old.mkdir(parents=True)
    torch.save({"stack": {k.removeprefix("stack."): v for k, v in load_file(str(ck / "model.safetensors")).items()},
                "optim": torch.load(ck / "optimizer.bin", weights_only=False),
                "sched": torch.load(ck / "custom_checkpoint_0.pkl", weights_only=False), "step": 5,
                "losses": full["losses"][:5], "layout": full["layout"]}, old / "state.pt")
    resumed = train_mtp(_cfg(tiny_model_dir, data_file, tmp_path / "b", steps=10, resume=True))
    assert resumed["steps"] == 10
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"]), rtol=1e-5, atol=0)
    a, b = load_file(str(tmp_path / "a" / MTP_FILE)), load_file(str(tmp_path / "b" / MTP_FILE))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


def _pack_amx(model) -> None:
    """Every bf16 projection in AMX tiles, as ``pack_for_amx`` leaves a bf16 target on an AMX CPU (done by
    hand, so on any CPU: ``amx_linear.pack`` is plain torch; only running the packed model needs AMX)."""
    from specctl.kernels import amx_linear
    from specctl.modeling import AmxLinear

    for block in model.layers:
        for name in block.PROJECTIONS:
            layer = getattr(block, name)
            if not isinstance(layer, AmxLinear):
                assert amx_linear.packable(layer.weight)
                setattr(block, name, AmxLinear(layer, amx_linear.pack(layer.weight.data), None))


def test_init_stack_reads_a_packed_bf16_target(tiny_model_dir):
    """A bf16 target on an AMX CPU holds its projections as tiles [N/16, K/32, 16, 16, 2]: the modules start
    from the same dense weights as from a plain target (the packed state_dict did not load into a Block)."""
    plain = load_transformer(tiny_model_dir, torch.bfloat16, kernels="torch")
    packed = load_transformer(tiny_model_dir, torch.bfloat16, kernels="torch")
    _pack_amx(packed)
    assert packed.layers[-1].qkv.weight.dim() == 5
    want, got = init_stack(plain, 2, "mimo"), init_stack(packed, 2, "mimo")
    for (n, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items()):
        assert a.dtype == torch.float32 and torch.equal(a, b), n
    from specctl.training.mtp import dense_block_state

    for k, v in dense_block_state(packed.layers[-1]).items():
        assert torch.equal(v, plain.layers[-1].state_dict()[k]), k


def test_bf16_target_trains_and_logs_each_steps_own_loss(tiny_model_dir, data_file, tmp_path):
    """--dtype bfloat16 end to end (the target's projections packed where this CPU runs AMX; the modules read
    its embedding and head in fp32); every step logs its own loss, final_loss is the last step's; a layout
    vLLM cannot load for this target offers no vLLM command, and says why."""
    said: list[str] = []
    s = train_mtp(_cfg(tiny_model_dir, data_file, tmp_path / "bf", steps=3, dtype="bfloat16", layout="deepseek_v3"),
                  progress=said.append)
    assert s["steps"] == 3 and len(s["losses"]) == 3 and s["eval"]["top1_per_depth"]
    logged = [float(line.split(" loss ")[1].split()[0]) for line in said if line.startswith("step ")]
    assert logged == [round(x, 4) for x in s["losses"]]
    assert s["final_loss"] == round(s["losses"][-1], 4) and s["first_loss"] == round(s["losses"][0], 4)
    assert "vllm" not in s and "DeepSeek-V3 targets" in s["vllm_unavailable"]
    assert s["use"]["--model"] == str(tiny_model_dir)  # the target as named, not a cache copy


def test_use_names_the_target_as_given(tiny_model_dir, data_file, tmp_path):
    """The summary's commands name the model as the user did; vLLM's needs a path or Hub id, not a catalogue
    name (only specctl knows those: then the folder it made)."""
    from specctl.training.mtp import vllm_model_name

    s = train_mtp(_cfg(tiny_model_dir, data_file, tmp_path / "m", steps=1, layout="mimo"))
    assert s["model"] == s["use"]["--model"] == s["vllm"]["model"] == str(tiny_model_dir)
    assert "vllm_unavailable" not in s
    assert vllm_model_name("HuggingFaceTB/SmolLM2-135M-Instruct", "/c/x") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert vllm_model_name("smollm2-135m", "/cache/smollm2-135m-float32") == "/cache/smollm2-135m-float32"


def _foreign_run(out, legacy: bool):
    """A copied train-eagle run folder: its checkpoint's tensors are the EAGLE draft's, its settings EAGLE's."""
    from safetensors.torch import save_file

    if legacy:
        (out / "checkpoint").mkdir(parents=True)
        torch.save({"draft": {"d2t": torch.zeros(4)}, "opt": {}, "sched": {}, "step": 5},
                   out / "checkpoint" / "state.pt")
        return out / "checkpoint"
    ck = out / "checkpoints" / "step-0000005"
    ck.mkdir(parents=True)
    save_file({"draft.d2t": torch.zeros(4, dtype=torch.long), "draft.fc.weight": torch.zeros(64, 192)},
              str(ck / "model.safetensors"))
    (ck / "trainer_state.json").write_text(json.dumps({"step": 5, "history": [], "losses": [1.0] * 5,
                                                       "global_batch": 8}))
    (ck / "training_config.json").write_text(json.dumps({"model": "x", "version": 3, "ttt_steps": 3,
                                                         "draft_vocab_size": 32, "seq_len": 32}))
    return ck


def _no_expensive_work(monkeypatch):
    import specctl.modeling
    import specctl.training.mtp as M

    def never(*a, **k):
        raise AssertionError("the check came after loading the target")

    monkeypatch.setattr(specctl.modeling, "load_transformer", never)
    monkeypatch.setattr(M.mtp_data, "target_states", never)


@pytest.mark.parametrize("legacy", [False, True], ids=["checkpoints", "old-state.pt"])
@pytest.mark.parametrize("resume", [True, False], ids=["resume", "no-resume"])
def test_another_trainers_checkpoint_is_one_line_up_front(tiny_model_dir, data_file, tmp_path, monkeypatch,
                                                          legacy, resume):
    from specctl.errors import ModelError

    out = tmp_path / "e3copy"
    ck = _foreign_run(out, legacy)
    _no_expensive_work(monkeypatch)
    with pytest.raises(ModelError) as e:
        train_mtp(_cfg(tiny_model_dir, data_file, out, steps=2, resume=resume))
    msg = str(e.value)
    assert "\n" not in msg and str(out) in msg and ck.name in msg and "did not make" in msg and "new --output" in msg
    assert "draft" in msg and "stack.*" in msg
    if not legacy:
        assert "ttt_steps" in msg


def test_a_checkpoint_that_does_not_fit_is_one_line_up_front(tiny_model_dir, data_file, tmp_path, monkeypatch):
    """train-mtp's own checkpoint, for another target (another hidden size) or another layout, is refused
    before the target loads, naming the folder and the fix."""
    from safetensors.torch import save_file

    from specctl.drafts.mtp import MtpStack
    from specctl.errors import ModelError, UsageError
    from specctl.modeling import ModelArgs
    from specctl.training.mtp import MtpLoss

    def weights(args) -> dict:  # what train-mtp's checkpoint holds (accelerate saves MtpLoss's state)
        return {k: torch.zeros(v.shape) for k, v in MtpLoss(MtpStack(args, 1, "mimo", own_head=False), None, 1,
                                                             None).state_dict().items()}

    out = tmp_path / "run"
    cfg = _cfg(tiny_model_dir, data_file, out, steps=2, resume=True, layout="mimo")
    ck = out / "checkpoints" / "step-0000001"
    ck.mkdir(parents=True)
    (ck / "training_config.json").write_text(json.dumps({**cfg.to_dict(), "model": "/elsewhere/big-model"}))
    base = json.loads((tiny_model_dir / "config.json").read_text())
    other = ModelArgs.from_hf_config({**base, "hidden_size": 128})
    save_file(weights(other), str(ck / "model.safetensors"))
    (ck / "trainer_state.json").write_text(json.dumps({"step": 1, "losses": [1.0], "history": [], "layout": "mimo",
                                                       "global_batch": 8}))
    _no_expensive_work(monkeypatch)
    with pytest.raises(ModelError, match="does not fit this run") as e:
        train_mtp(cfg)
    assert str(ck) in str(e.value) and "/elsewhere/big-model" in str(e.value) and "[128]" in str(e.value)
    mine = ModelArgs.from_hf_config(base)
    save_file(weights(mine), str(ck / "model.safetensors"))
    (ck / "trainer_state.json").write_text(json.dumps({"step": 1, "losses": [1.0], "history": [],
                                                       "layout": "deepseek_v3", "global_batch": 8}))
    with pytest.raises(UsageError, match="deepseek_v3 layout, not mimo"):
        train_mtp(cfg)
