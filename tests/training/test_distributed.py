"""EAGLE-3 and MTP training on 2 CPU processes (DDP over gloo; accelerate's ``debug_launcher`` forks the
workers, so nothing is imported twice) take the same steps as one process with the doubled batch,
and as one process accumulating two micro-batches (--grad-accum 2): the loss curves agree to 1e-5
relative and the exported weights to 1 % of one step (lr / 100: Adam divides by the root of the second
moment, so where a gradient is near zero the order of float sums, all that differs, moves a weight by up
to a fraction of lr; seen on an AMD EPYC: 2.2e-5 with lr 3e-3, where a missing all-reduce moves
weights by about lr). A 2-process
run stopped after step 2 resumes from its checkpoint (``accelerator.load_state``) to the same curve and
weights, so does one process from that 2-process checkpoint, and a resume with another global batch
is refused.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from specctl.errors import UsageError

STEPS, SAVE = 4, 2
RTOL = 1e-5
EAGLE_LR, MTP_LR = 3e-3, 1e-2


@pytest.fixture(autouse=True)
def fresh_accelerate_state(monkeypatch):
    """Each run here builds its own Accelerator (cpu; a forked worker must not inherit the parent's
    single-process state); OMP at one thread per worker (the two share the cores)."""
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Chat records of uneven lengths (EAGLE: each step's row count differs between the halves of a
    batch) and a text file (MTP: windows)."""
    folder = tmp_path_factory.mktemp("ddp-data")
    chat = folder / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"add {i} " * (1 + i % 4)},
        {"role": "assistant", "content": f"x + {i} == {i} + x. " * (1 + i % 3)}]}) + "\n" for i in range(20)))
    text = folder / "code.txt"
    text.write_text("".join(f"def f{i}(a, b):\n    return a * {i} + b\n" for i in range(40)))
    return chat, text


def eagle_cfg(model, chat, out, **kw):
    from specctl.training.eagle import EagleTrainConfig

    base = dict(model=str(model), output=str(out), data=[str(chat)], steps=STEPS, batch_size=4, seq_len=40,
                eval_split=0.1, eval_every=0, save_every=SAVE, lr=EAGLE_LR, draft_vocab_size=64, ttt_steps=2,
                prompt_rows=0.5, device="cpu")
    base.update(kw)
    return EagleTrainConfig(**base)


def mtp_cfg(model, text, out, **kw):
    from specctl.training.mtp import MtpTrainConfig

    base = dict(model=str(model), output=str(out), data=[str(text)], steps=STEPS, batch_size=4, seq_len=16,
                eval_split=0.1, save_every=SAVE, lr=MTP_LR, depth=2, layout="deepseek_v3", device="cpu")
    base.update(kw)
    return MtpTrainConfig(**base)


def run_both(ecfg, mcfg) -> dict:
    from specctl.training.eagle import train
    from specctl.training.mtp import train_mtp

    e, m = train(ecfg, log=lambda s: None), train_mtp(mcfg)
    return {"eagle": {"losses": e["losses"], "export": e["export"], "processes": e["processes"]},
            "mtp": {"losses": m["losses"], "export": m["output"], "processes": m["processes"]}}


def _worker(ecfg, mcfg, result):
    """Runs in each forked process: a fresh accelerate state, then both trainings; rank 0 reports."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.set_num_threads(1)
    out = run_both(ecfg, mcfg)
    if dist.get_rank() == 0:
        result.write_text(json.dumps(out))


def on_two_processes(ecfg, mcfg, result) -> dict:
    from accelerate import debug_launcher

    debug_launcher(_worker, args=(ecfg, mcfg, result), num_processes=2)
    return json.loads(result.read_text())


def weights(folder, name):
    return load_file(f"{folder}/{name}")


def assert_same_run(a: dict, b: dict) -> None:
    torch.testing.assert_close(torch.tensor(a["eagle"]["losses"]), torch.tensor(b["eagle"]["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(a["mtp"]["losses"]), torch.tensor(b["mtp"]["losses"]), rtol=RTOL, atol=0)
    for kind, name, lr in (("eagle", "model.safetensors", EAGLE_LR), ("mtp", "model-mtp.safetensors", MTP_LR)):
        wa, wb = weights(a[kind]["export"], name), weights(b[kind]["export"], name)
        assert sorted(wa) == sorted(wb)
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=RTOL, atol=lr / 100)


def test_two_processes_equal_one_with_the_doubled_batch_and_resume(tiny_model_dir, data, tmp_path):
    chat, text = data
    one = run_both(eagle_cfg(tiny_model_dir, chat, tmp_path / "e1"), mtp_cfg(tiny_model_dir, text, tmp_path / "m1"))
    accum = run_both(eagle_cfg(tiny_model_dir, chat, tmp_path / "ea", batch_size=2, grad_accum=2),
                     mtp_cfg(tiny_model_dir, text, tmp_path / "ma", batch_size=2, grad_accum=2))
    two = on_two_processes(eagle_cfg(tiny_model_dir, chat, tmp_path / "e2", batch_size=2),
                           mtp_cfg(tiny_model_dir, text, tmp_path / "m2", batch_size=2), tmp_path / "two.json")
    assert one["eagle"]["processes"] == 1 and two["eagle"]["processes"] == two["mtp"]["processes"] == 2
    assert len(one["eagle"]["losses"]) == len(one["mtp"]["losses"]) == STEPS
    assert one["eagle"]["losses"][-1] < one["eagle"]["losses"][0] and one["mtp"]["losses"][-1] < one["mtp"]["losses"][0]
    assert_same_run(two, one)
    assert_same_run(accum, one)

    # a 2-process run stopped at step 2: only that checkpoint is left; --resume continues it on 2 processes
    for run in ("e2", "m2", "e2x", "m2x"):
        ck = tmp_path / run.rstrip("x") / "checkpoints" / f"step-{SAVE:07d}"
        shutil.copytree(ck, tmp_path / f"{run}r" / "checkpoints" / ck.name)
    resumed = on_two_processes(eagle_cfg(tiny_model_dir, chat, tmp_path / "e2r", batch_size=2, resume=True),
                               mtp_cfg(tiny_model_dir, text, tmp_path / "m2r", batch_size=2, resume=True),
                               tmp_path / "resumed.json")
    assert_same_run(resumed, two)
    # ... and on one process with the doubled batch (the checkpoint holds the draft's own tensor names)
    across = run_both(eagle_cfg(tiny_model_dir, chat, tmp_path / "e2xr", resume=True),
                      mtp_cfg(tiny_model_dir, text, tmp_path / "m2xr", resume=True))
    assert_same_run(across, two)
    # another global batch than the checkpoint's is refused
    with pytest.raises(UsageError, match="had 4 sequences each"):
        run_both(eagle_cfg(tiny_model_dir, chat, tmp_path / "e2r", batch_size=2, steps=6, resume=True),
                 mtp_cfg(tiny_model_dir, text, tmp_path / "m2r"))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_cli_under_accelerate_launch(tiny_model_dir, data, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` (torchrun; gloo with --device cpu) runs train-eagle and
    train-mtp on 2 processes: one summary on stdout, the 1-process curve with the doubled batch. (accelerate's
    `--cpu --num_processes 2` starts one process: it runs several CPU processes only through mpirun.)"""
    import os
    import subprocess
    import sys

    chat, text = data
    one = run_both(eagle_cfg(tiny_model_dir, chat, tmp_path / "e1"), mtp_cfg(tiny_model_dir, text, tmp_path / "m1"))
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
              "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), "-m", "specctl.cli"]
    common = ["--model", str(tiny_model_dir), "--steps", str(STEPS), "--batch-size", "2", "--eval-split", "0.1",
              "--save-every", str(SAVE), "--device", "cpu", "--json"]
    runs = {"eagle": ["train-eagle", "--data", str(chat), "--output", str(tmp_path / "e2"), "--seq-len", "40",
                      "--eval-every", "0", "--lr", "3e-3", "--draft-vocab-size", "64", "--ttt-steps", "2", "--prompt-rows", "0.5"],
            "mtp": ["train-mtp", "--data", str(text), "--output", str(tmp_path / "m2"), "--seq-len", "16", "--lr", "1e-2",
                    "--depth", "2", "--layout", "deepseek_v3"]}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for kind, args in runs.items():
        r = subprocess.run(launch + args + common, capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        s = json.loads(r.stdout)  # one summary: the other process is silent
        assert s["processes"] == 2 and s["global_batch"] == 4
        torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(one[kind]["losses"]), rtol=RTOL, atol=0)
