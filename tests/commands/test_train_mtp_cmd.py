"""`specctl train-mtp`: trains on a tiny model, writes a loadable draft (or a stitched model), prints the
summary on stdout (--json), and answers usage errors in one line."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from specctl.cli import app

runner = CliRunner()


def test_help_lists_example():
    r = runner.invoke(app, ["train-mtp", "--help"])
    assert r.exit_code == 0
    assert "specctl train-mtp --model" in r.output and "--stitch" in r.output


def test_needs_data(tmp_path, tiny_model_dir):
    r = runner.invoke(app, ["train-mtp", "--model", str(tiny_model_dir), "--output", str(tmp_path / "o")])
    assert r.exit_code != 0


def test_train_stitch_and_bench(tmp_path, tiny_model_dir):
    data = tmp_path / "d.txt"
    data.write_text("def add(a, b):\n    return a + b\n" * 40)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Write f{i}"}) + "\n" for i in range(3)))
    out = tmp_path / "stitched"
    r = runner.invoke(app, ["train-mtp", "--model", str(tiny_model_dir), "--data", str(data), "--self-distill", str(prompts),
                            "--distill-max-new-tokens", "16", "--output", str(out), "--stitch", "--steps", "4",
                            "--seq-len", "32", "--batch-size", "4", "--depth", "2", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["form"] == "stitched" and s["steps"] == 4 and s["eval"]["top1_per_depth"]
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert (out / "data" / "self_distill.jsonl").is_file()
    r = runner.invoke(app, ["bench", "--model", str(out), "--dtype", "float32", "--speculative-config",
                            '{"method": "deepseek_mtp", "num_speculative_tokens": 2}', "-w", "chat", "-n", "1",
                            "--max-new-tokens", "8", "--json"])
    assert r.exit_code == 0, r.output


def test_layout_mimo_is_refused_up_front_where_vllm_cannot_load_it(tmp_path, tiny_model_factory):
    """A target whose attention has an o_proj bias: no vLLM MTP architecture fits; one line, before training."""
    model = tiny_model_factory(arch="llama", attention_bias=True)
    data = tmp_path / "d.txt"
    data.write_text("abc " * 200)
    out = tmp_path / "o"
    r = runner.invoke(app, ["train-mtp", "--model", str(model), "--data", str(data), "--output", str(out),
                            "--layout", "mimo", "--steps", "1", "--seq-len", "16"])
    assert getattr(r.exception, "exit_code", None) == 2, r.output  # UsageError: the CLI prints one line, exits 2
    assert "no vLLM MTP architecture" in str(r.exception) and "o_proj bias" in str(r.exception)
    assert not (out / "checkpoints").exists()  # refused before anything was written


def test_unknown_layout(tmp_path, tiny_model_dir):
    r = runner.invoke(app, ["train-mtp", "--model", str(tiny_model_dir), "--data", "x.txt", "--output", str(tmp_path / "o"),
                            "--layout", "eagle"])
    assert getattr(r.exception, "exit_code", None) == 2 and "unknown --layout" in str(r.exception)


def _summary(**kw) -> dict:
    s = {"output": "mtp-draft", "form": "draft", "model": "smollm2-135m",
         "target": "/root/.cache/specctl/models/smollm2-135m-float32", "num_layers": 1, "depth": 3, "layout": "mimo",
         "steps": 6, "train_tokens": 1056, "first_loss": 14.6119, "final_loss": 13.9243, "seconds": 45.4,
         "eval": {"top1_per_depth": [0.27, 0.22, 0.19], "mean_acceptance_length": 1.3},
         "use": {"--model": "smollm2-135m", "--speculative-config": {"method": "mtp", "model": "mtp-draft",
                                                                     "num_speculative_tokens": 3}},
         "vllm": {"model": "/root/.cache/specctl/models/smollm2-135m-float32",
                  "hf_overrides": {"num_nextn_predict_layers": 1},
                  "speculative_config": {"method": "mtp", "model": "/home/someone/runs/2024/mtp-draft",
                                         "num_speculative_tokens": 1}}}
    s.update(kw)
    return s


def test_use_lines_print_whole_and_name_the_model_as_given(capsys, monkeypatch):
    """In an 80-column terminal each command is one whole line to copy (no "…", not folded in a cell), with
    the model as the user named it (the catalogue name, not specctl's cache copy)."""
    from specctl.commands.train_mtp import render

    monkeypatch.setenv("COLUMNS", "80")
    render(_summary())
    out = capsys.readouterr().out
    assert "…" not in out
    lines = out.splitlines()
    assert ("use: specctl bench --model smollm2-135m --speculative-config '{\"method\": \"mtp\", \"model\": "
            "\"mtp-draft\", \"num_speculative_tokens\": 3}'") in lines
    serve = next(ln for ln in lines if ln.startswith("vLLM: "))
    assert serve.startswith("vLLM: specctl serve --engine vllm --model smollm2-135m --speculative-config '{\"method\": "
                            "\"mtp\", \"model\": \"/home/someone/runs/2024/mtp-draft\", \"num_speculative_tokens\": 1}'")
    assert not any("/root/.cache" in ln for ln in lines if ln.startswith(("vLLM", "use")))
    assert "LLM(model=" not in out  # vLLM's own API does not know a catalogue name
    assert "first → last step" in out and "13.9243" in out


def test_a_path_target_gets_vllms_python_line_too(capsys, monkeypatch):
    from specctl.commands.train_mtp import render

    monkeypatch.setenv("COLUMNS", "80")
    s = _summary(model="./models/my-very-long-model-name-that-would-not-fit", target="/abs/models/my-very-long")
    s["use"]["--model"] = s["vllm"]["model"] = s["model"]
    render(s)
    out = capsys.readouterr().out
    assert ("vLLM (Python): LLM(model='./models/my-very-long-model-name-that-would-not-fit', hf_overrides="
            "{\"num_nextn_predict_layers\": 1}, speculative_config={\"method\": \"mtp\", \"model\": "
            "\"/home/someone/runs/2024/mtp-draft\", \"num_speculative_tokens\": 1})") in out.splitlines()


def test_a_layout_vllm_cannot_load_offers_no_vllm_command(capsys, monkeypatch):
    """--layout deepseek_v3 for a target that is not DeepSeek-V3: specctl's command, and one line saying why
    there is no vLLM one."""
    from specctl.commands.train_mtp import render

    monkeypatch.setenv("COLUMNS", "80")
    s = _summary(layout="deepseek_v3", vllm_unavailable="vLLM loads the DeepSeek-V3 MTP layout only for "
                 "DeepSeek-V3 targets (--layout mimo writes the one it loads for this target)")
    del s["vllm"]
    render(s)
    out = capsys.readouterr().out
    assert "specctl serve --engine vllm" not in out and "LLM(" not in out
    vllm = [ln for ln in out.splitlines() if ln.startswith("vLLM")]
    assert vllm == [f"vLLM: not offered: {s['vllm_unavailable']}"]
    assert any(ln.startswith("use: specctl bench --model smollm2-135m ") for ln in out.splitlines())


def test_a_copied_train_eagle_run_is_refused_in_one_line(tmp_path, tiny_model_dir):
    """--resume into a folder holding train-eagle's checkpoint: exit 1, one line naming the folder and the fix,
    before the model loads."""
    from safetensors.torch import save_file

    ck = tmp_path / "e3copy" / "checkpoints" / "step-0000002"
    ck.mkdir(parents=True)
    save_file({"draft.d2t": torch.zeros(4, dtype=torch.long)}, str(ck / "model.safetensors"))
    (ck / "trainer_state.json").write_text(json.dumps({"step": 2, "history": [], "losses": [1.0, 1.0]}))
    (ck / "training_config.json").write_text(json.dumps({"version": 3, "ttt_steps": 3}))
    data = tmp_path / "d.txt"
    data.write_text("abc " * 200)
    r = runner.invoke(app, ["train-mtp", "--model", str(tiny_model_dir), "--data", str(data), "--output",
                            str(tmp_path / "e3copy"), "--resume", "--steps", "2", "--seq-len", "16"])
    assert getattr(r.exception, "exit_code", None) == 1, r.output
    msg = str(r.exception)
    assert "\n" not in msg and "e3copy" in msg and "train-mtp did not make" in msg and "new --output" in msg
