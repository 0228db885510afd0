"""train-medusa, train-eagle and train-mtp have one CLI shape: every shared option is the same ``Annotated``
declaration (commands/_train_options.py) in the three commands, each CLI default is its config's
default (so --help tells the truth), --hold-out has one default, the old --distill-max-new-tokens
spelling still works but is not shown, and a config error is one usage error before anything loads."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from typer.testing import CliRunner

import specctl.training.eagle as eagle
import specctl.training.medusa as medusa
import specctl.training.mtp as mtp
from specctl.cli import app
from specctl.commands import train_eagle, train_medusa, train_mtp
from specctl.errors import SpecctlError, UsageError

runner = CliRunner()
COMMANDS = {"train-medusa": (train_medusa.train_medusa, medusa.MedusaTrainConfig, medusa, "train"),
            "train-eagle": (train_eagle.train_eagle_cmd, eagle.EagleTrainConfig, eagle, "train"),
            "train-mtp": (train_mtp.train_mtp_cmd, mtp.MtpTrainConfig, mtp, "train_mtp")}
SHARED = ("output", "model", "data", "self_distill", "hold_out", "distill_max_prompts", "max_new_tokens",
          "distill_max_new_tokens", "distill_temperature", "distill_samples", "epochs", "steps", "lr", "batch_size",
          "grad_accum", "eval_split", "eval_every", "save_every", "resume", "seed", "device", "push_to_hub", "json_out")


def hints(fn) -> dict:
    return typing.get_type_hints(fn, include_extras=True)


def test_shared_options_are_one_declaration():
    first = hints(train_medusa.train_medusa)
    for name, (fn, _, _, _) in COMMANDS.items():
        h = hints(fn)
        for opt in SHARED:
            assert h[opt] == first[opt], f"{name} --{opt.replace('_', '-')} is declared differently"
        assert typing.get_args(h["epochs"])[0] is float and typing.get_args(h["data"])[0] == typing.Optional[list[str]]


def test_cli_defaults_are_the_configs():
    import inspect

    for name, (fn, cls, _, _) in COMMANDS.items():
        fields = {f.name: f for f in dataclasses.fields(cls)}
        params = inspect.signature(fn).parameters
        for p, param in params.items():
            if p in fields and param.default is not inspect.Parameter.empty and p not in ("model", "aux_layers"):
                f = fields[p]
                want = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                got = param.default
                assert got == want or (want == [] and got is None), f"{name} --{p}: CLI {got!r}, config {want!r}"
        assert params["hold_out"].default == 8


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_shows_the_new_spelling_only(name):
    r = runner.invoke(app, [name, "--help"], terminal_width=200)
    assert r.exit_code == 0
    for opt in ("--max-new-tokens", "--grad-accum", "--save-every", "--device", "--push-to-hub", "--hold-out"):
        assert opt in r.output, (name, opt)
    assert "--distill-max-new-tokens" not in r.output and f"specctl {name} --model" in r.output


class Built(Exception):
    """Raised by the stand-in trainer: the command built this config."""


@pytest.mark.parametrize("name", list(COMMANDS))
def test_old_spelling_still_sets_max_new_tokens(name, tmp_path, monkeypatch):
    _, _, module, fn = COMMANDS[name]

    def capture(cfg, *a, **k):
        raise Built(cfg)

    monkeypatch.setattr(module, fn, capture)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("a prompt\n")
    for flag in ("--max-new-tokens", "--distill-max-new-tokens"):
        r = runner.invoke(app, [name, "--model", "m", "--output", str(tmp_path / "o"), "--self-distill", "sharegpt",
                                "--self-distill", "p.txt", flag, "17", "--epochs", "0.5", "--grad-accum", "2"])
        assert isinstance(r.exception, Built), r.output
        cfg = r.exception.args[0]
        assert cfg.max_new_tokens == 17 and cfg.self_distill == ["sharegpt", "p.txt"] and cfg.epochs == 0.5
        assert cfg.grad_accum == 2 and cfg.hold_out == 8 and cfg.device == "auto"


@pytest.mark.parametrize("name", list(COMMANDS))
@pytest.mark.parametrize("args, message", [(["--grad-accum", "0"], "--grad-accum must be an integer >= 1"),
                                           (["--device", "tpu"], "unknown --device 'tpu'"),
                                           (["--push-to-hub", "not a repo"], "is not a Hub repo id"),
                                           (["--epochs", "0"], "--epochs must be > 0"),
                                           (["--save-every", "-1"], "pass --save-every 0 or more"),
                                           (["--hold-out", "-1"], "pass --hold-out 0 or more")])
def test_config_errors_are_usage_errors(name, args, message, tmp_path):
    r = runner.invoke(app, [name, "--model", "m", "--output", str(tmp_path / "o"), "--data", "x.jsonl", *args])
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2, r.output
    assert message in str(r.exception)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", list(COMMANDS))
@pytest.mark.parametrize("where, message", [("file", "is a file, not a folder"), ("inside-file", "is a file, so")])
def test_an_unwritable_output_is_refused_before_training(name, where, message, tmp_path):
    """Checked with the config, before the model loads (it was found at the save, after the training)."""
    f = tmp_path / "data.jsonl"
    f.write_text('{"prompt": "a", "response": "b"}\n')
    out = f if where == "file" else f / "sub"
    r = runner.invoke(app, [name, "--model", "m", "--output", str(out), "--data", str(f)])
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2, r.output
    assert message in str(r.exception) and "--output" in str(r.exception)
    assert f.read_text().startswith('{"prompt"')


@pytest.mark.parametrize("name", ["train-medusa", "train-eagle"])
@pytest.mark.parametrize("where, message", [("file", "--cache-hidden-states {} is a file. give a folder"),
                                            ("inside-file", "--cache-hidden-states: {} is a file, so")])
def test_a_states_cache_that_cannot_be_a_folder_is_refused_before_training(name, where, message, tmp_path):
    """It was a FileExistsError (exit 1) after the model had loaded."""
    f = tmp_path / "data.jsonl"
    f.write_text('{"prompt": "a", "response": "b"}\n')
    cache = f if where == "file" else f / "states"
    r = runner.invoke(app, [name, "--model", "m", "--output", str(tmp_path / "o"), "--data", str(f),
                            "--cache-hidden-states", str(cache)])
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2, r.output
    assert message.format(f) in str(r.exception)
    assert f.read_text().startswith('{"prompt"') and not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", list(COMMANDS))
@pytest.mark.parametrize("output", ["", " "])
def test_an_empty_output_is_a_usage_error(name, output, tmp_path, monkeypatch):
    """--output '' was the current folder (README.md, config.json ... written there); ' ' a folder named ' '."""
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, [name, "--model", "m", "--output", output, "--data", "x.jsonl"])
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2, r.output
    assert f"--output is {'blank' if output else 'empty'}" in str(r.exception)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_folder_of_other_files_is_refused_before_the_model_loads(name, tiny_model_dir, tmp_path, monkeypatch):
    """A non-empty folder with no run in it (the user's own README.md, config.json) was silently overwritten."""
    loads = []
    monkeypatch.setattr("specctl.runtime.loading.load_model", lambda *a, **k: loads.append(a))
    monkeypatch.setattr("specctl.modeling.load_transformer", lambda *a, **k: loads.append(a))
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("my notes")
    (mine / "config.json").write_text("{}")
    for resume in ([], ["--resume"]):
        r = runner.invoke(app, [name, "--model", str(tiny_model_dir), "--output", str(mine), "--data", str(data),
                                "--dtype", "float32", *resume])
        e = r.exception
        assert isinstance(e, SpecctlError) and not isinstance(e, UsageError) and e.exit_code == 1, r.output
        assert str(mine) in str(e) and "README.md" in str(e) and "choose a new or empty --output" in str(e)
    assert (mine / "README.md").read_text() == "my notes" and sorted(p.name for p in mine.iterdir()) == ["README.md", "config.json"]
    assert loads == []


@pytest.mark.parametrize("command", ["train-eagle", "train-medusa", "train-mtp"])
@pytest.mark.parametrize("spec, words", [("nope.jsonl", "does not exist"), ("chat", "is an evaluation workload"),
                                         ("sharegtp", "did you mean sharegpt?")])
def test_a_bad_self_distill_source_is_said_before_the_model_loads(command, spec, words, tmp_path, monkeypatch):
    """A prompt file that does not exist (or an evaluation workload, or a typo) was found only after the
    target had loaded (6-10 s on a 0.5B): every trainer now says it first, in one line."""
    import specctl.models
    from specctl.errors import SpecctlError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(specctl.models, "resolve_model", lambda *a, **k: pytest.fail("the target was resolved"))
    r = runner.invoke(app, [command, "--model", "m", "--output", str(tmp_path / "o"), "--self-distill", spec])
    assert isinstance(r.exception, SpecctlError), r.output
    assert words in str(r.exception) and "\n" not in str(r.exception)
