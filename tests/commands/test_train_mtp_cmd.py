"""`specctl train-mtp`: trains on a tiny model, writes a loadable draft (or a stitched model), prints the
summary on stdout (--json), and answers usage errors in one line."""

from __future__ import annotations

import json

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
