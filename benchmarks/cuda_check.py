"""Does specctl's runtime work on a GPU, and is it lossless there? One prepared run, every check fail-soft.

    python benchmarks/cuda_check.py --json $OUT/cuda.json          # on the GPU machine (~2-4 minutes)
    python benchmarks/cuda_check.py --device cpu --quick --json /tmp/cuda_check_cpu.json   # develop here

Everything is built in-process, seeded, offline (no model files, no downloads): the test suite's tiny
seeded Llama models (tests/conftest.py), drafts trained for them briefly with specctl's own trainers,
and randomly initialised models of real shapes for the speed check. On ``--device`` D:

  runtime   the own Transformer's logits equal transformers' (fp32); plain greedy decoding equals
            ``model.generate(do_sample=False)``; batched decoding (``generate_batch``, the
            self-distillation path) equals one-at-a-time decoding (informative).
  setup     plain greedy references (SpecDecoder without a draft; the fp32 ones pick the tie-free
            prompts); the drafts' training data (generate_batch, so the trainers run even where the
            decoder fails); Medusa heads (specctl.training.medusa.train, on accelerate's device),
            EAGLE-3 and EAGLE-1 drafts (specctl.training.eagle.train), an MTP module
            (specctl.training.mtp building blocks + export_mtp), trained on D; a draft model (a
            perturbed copy of the target).
  fp32      for ngram, suffix, medusa (chain, tree), eagle, eagle3 (chain, tree), draft_model, mtp:
            greedy speculative output == plain greedy output, token for token, on prompts whose
            plain greedy path has no near-tie (top-2 logit gap >= 1e-4); acceptance and time.
  bf16      the same with the target in bfloat16; every divergence is reported with its position
            and the plain run's top-1 minus top-2 score there (a near-tie explains it: gap < --bf16-tie).
  sampling  stochastic speculative decoding keeps the target distribution: the 2nd and 3rd emitted
            tokens' histograms over N seeded runs against the exact marginals (prefixes enumerated),
            TV distance below the 99.9% quantile of a correct sampler's TV (plain, ngram,
            draft_model, eagle3).
  speed     bf16, random weights of SmolLM2-135M's shape (and, unless --quick, an 8-layer
            Qwen2.5-1.5B-shaped model): specctl's plain greedy decode (the path `specctl bench`
            uses for its baseline) against transformers' generate(do_sample=False), same weights,
            same run, warm-up first; tokens/s and the ratio. Informative, never fails the run.

Output: progress lines on stderr, a report on stdout, all results as JSON with ``--json PATH``.
Exit code 0 when every lossless check (runtime, setup, fp32, bf16, sampling) passed, else 1. A check
that raises is reported with the stage it was in, the exception and the innermost frames, and the
run goes on. The library is used as a user would use it: nothing in it is patched here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import sys
import tempfile
import time
import traceback
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a plain checkout too (no `pip install -e .` on the GPU machine)
    sys.path.insert(0, str(REPO))

T0 = time.perf_counter()
NEAR_TIE = 1e-4  # fp32: prompts whose plain greedy path has a smaller top-2 gap are not used
WORDS = ["def", "return", "print", "hello", "world", "x", "y", "=", "(", ")", "for", "in", "if", "else"]

# Model shapes for the speed check (values from the models' config.json; embedded: the GPU machine has no cache).
SMOLLM2_135M = dict(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_act="silu", rms_norm_eps=1e-5,
    rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
    mlp_bias=False, initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)
QWEN25_15B_8L = dict(  # Qwen2.5-Coder-1.5B with 8 of its 28 layers
    model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=8,
    num_attention_heads=12, num_key_value_heads=2, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0,
    max_position_embeddings=32768, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
    initializer_range=0.02, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# =========================================================================== settings


@dataclass
class Sizes:
    prompts: int  # prompts per greedy check
    new: int  # new tokens per prompt
    candidates: int  # prompts decoded to choose tie-free ones (and to train the drafts on)
    medusa_steps: int
    eagle3_steps: int
    eagle1_steps: int
    mtp_steps: int
    samples: int  # sampling check: seeded runs per method
    sampling_methods: tuple[str, ...]
    speed_new: int
    speed_runs: int
    speed_layers: int | None  # None: the real layer count
    qwen: bool


FULL = Sizes(prompts=4, new=48, candidates=24, medusa_steps=200, eagle3_steps=200, eagle1_steps=120, mtp_steps=60,
             samples=1000, sampling_methods=("plain", "ngram", "draft_model", "eagle3"), speed_new=128, speed_runs=3,
             speed_layers=None, qwen=True)
QUICK = Sizes(prompts=2, new=24, candidates=12, medusa_steps=120, eagle3_steps=80, eagle1_steps=50, mtp_steps=40,
              samples=300, sampling_methods=("plain", "ngram", "draft_model"), speed_new=32, speed_runs=1,
              speed_layers=4, qwen=False)
MAX_LEN = 256


# =========================================================================== results


@dataclass
class Check:
    section: str
    name: str
    gating: bool = True  # counts toward the exit code
    status: str = "pass"  # pass | fail | error | skip | info
    summary: str = ""
    stage: str = ""  # what the check was doing (where an error happened)
    seconds: float = 0.0
    details: dict = field(default_factory=dict)
    error: str | None = None
    where: list[str] = field(default_factory=list)  # innermost frames of the exception
    traceback: str | None = None

    def at(self, stage: str) -> None:
        self.stage = stage

    def fail(self, summary: str) -> None:
        self.status, self.summary = "fail", summary


class Suite:
    def __init__(self, device, budget_s: float, json_path: str | None = None, header: dict | None = None):
        self.checks: list[Check] = []
        self.device = device
        self.budget_s = budget_s
        self.json_path, self.header = json_path, header or {}
        self.fixtures: dict[str, object] = {}
        self.failed_fixtures: dict[str, str] = {}

    def save(self, exit_code: int | None = None) -> None:
        """All results so far as JSON (after every check: a run killed at its time limit still leaves them)."""
        if not self.json_path:
            return
        out = {**self.header, "complete": exit_code is not None, "exit_code": exit_code,
               "seconds": round(time.perf_counter() - T0, 1), "checks": [asdict(c) for c in self.checks]}
        path = Path(self.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=2, default=str) + "\n")
        os.replace(tmp, path)

    def late(self) -> bool:
        return time.perf_counter() - T0 > self.budget_s

    def need(self, *keys: str):
        """The fixtures a check needs; a missing one raises _Skip (its setup check already failed)."""
        for k in keys:
            if k not in self.fixtures:
                raise _Skip(f"needs '{k}', which {self.failed_fixtures.get(k, 'was not built')}")
        return [self.fixtures[k] for k in keys] if len(keys) > 1 else self.fixtures[keys[0]]

    def run(self, section: str, name: str, fn, gating: bool = True, provides: str | None = None) -> Check:
        import torch

        ck = Check(section, name, gating)
        log(f"{section} · {name} ...")
        t = time.perf_counter()
        try:
            out = fn(ck)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # an asynchronous CUDA error surfaces here, in this check
            if provides is not None:
                self.fixtures[provides] = out
        except _Skip as e:
            ck.status, ck.summary = "skip", str(e)
        except Exception as e:  # noqa: BLE001 - fail soft: report, go on with the next check
            ck.status = "error"
            ck.error = f"{type(e).__name__}: {e}"[:2000]
            ck.summary = f"{ck.stage + ': ' if ck.stage else ''}{ck.error.splitlines()[0][:160]}"
            ck.traceback = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-6000:]
            ck.where = [f"{_rel(f.filename)}:{f.lineno} in {f.name}" for f in traceback.extract_tb(e.__traceback__)[-4:]]
        ck.seconds = round(time.perf_counter() - t, 2)
        if ck.status != "error":
            ck.stage = ""
        if provides is not None and provides not in self.fixtures:
            self.failed_fixtures[provides] = f"{section} · {name} did not build ({ck.status})"
        if not ck.gating and ck.status == "pass":
            ck.status = "info"
        log(f"{section} · {name}: {ck.status.upper()} {ck.summary} ({ck.seconds:.1f}s)")
        if ck.where:
            for w in ck.where:
                log(f"    at {w}")
        self.checks.append(ck)
        self.save()
        return ck


class _Skip(Exception):
    pass


def _rel(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return path


# =========================================================================== tiny models (tests/conftest.py)


def import_conftest():
    """tests/conftest.py by file path: build_tiny_hf_model, build_tiny_tokenizer and the constants.

    It imports pytest (for its fixtures only; a stand-in is used where pytest is missing) and sets
    torch to one thread (restored here)."""
    import torch

    threads = torch.get_num_threads()
    if importlib.util.find_spec("pytest") is None:
        def fixture(*a, **k):
            return a[0] if a and callable(a[0]) else (lambda f: f)

        sys.modules["pytest"] = types.SimpleNamespace(fixture=fixture)
    spec = importlib.util.spec_from_file_location("specctl_tests_conftest", REPO / "tests" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.set_num_threads(threads)
    return mod


def save_tiny(conftest, folder: Path, **kw) -> Path:
    model = conftest.build_tiny_hf_model(**kw)
    model.save_pretrained(folder)
    conftest.build_tiny_tokenizer().save_pretrained(folder)
    return folder


def chat_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """As tests/runtime/proposers/test_eagle.py: a few words as a user turn, through the chat template."""
    from specctl.chat import template_ids

    r = random.Random(seed)
    texts = [" ".join(r.choice(WORDS) for _ in range(r.randint(3, 8))) for _ in range(n)]
    return [template_ids(tokenizer, [{"role": "user", "content": t}], True) for t in texts]


@dataclass
class Case:
    prompt: list[int]
    out: list[int]  # plain greedy output
    margins: list[float]  # plain run's top-1 minus top-2 score at each output token


def plain_greedy(model, prompts: list[list[int]], new: int) -> tuple[list[Case], float]:
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.runner import TargetRunner

    dec = SpecDecoder(TargetRunner(model, MAX_LEN))
    t = time.perf_counter()
    cases = []
    for p in prompts:
        res = dec.generate(p, SamplingParams(max_new_tokens=new, ignore_eos=True, record_margins=True))
        cases.append(Case(p, res.token_ids, res.margins))
    return cases, time.perf_counter() - t


def write_records(cases: list[Case], path: Path) -> Path:
    """Training data with exact ids (specctl.training.data reads prompt_ids/response_ids as they are)."""
    with path.open("w") as f:
        for c in cases:
            f.write(json.dumps({"messages": [{"role": "user", "content": "(ids)"}, {"role": "assistant", "content": "(ids)"}],
                                "prompt_ids": c.prompt, "response_ids": c.out}) + "\n")
    return path


# =========================================================================== runtime section


def check_forward_matches_hf(ck: Check, s: Suite, d: dict):
    import torch
    from transformers import AutoModelForCausalLM

    from specctl.modeling import load_transformer
    from specctl.runtime.runner import TargetRunner

    ck.at("load")
    hf = AutoModelForCausalLM.from_pretrained(d["base_dir"], dtype=torch.float32).to(s.device).eval()
    own = load_transformer(d["base_dir"], torch.float32, s.device)
    ids = torch.randint(6, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    ck.at("forward")
    with torch.inference_mode():
        want = hf(ids.to(s.device)).logits.float()
        got = TargetRunner(own, 64, batch=2).forward(ids)
        # decode steps through the cache, one token at a time, against the full forward
        r = TargetRunner(own, 64, batch=2)
        r.forward(ids[:, :30])
        steps = torch.cat([r.forward(ids[:, i:i + 1]) for i in range(30, 40)], 1)
    diff = float((got - want).abs().max())
    step_diff = float((steps - want[:, 30:]).abs().max())
    ck.details.update(max_abs_diff_prefill=diff, max_abs_diff_steps=step_diff, logits_device=str(got.device))
    ck.summary = f"max |Δlogit| prefill {diff:.2e}, steps {step_diff:.2e}"
    if not (diff < 1e-3 and step_diff < 1e-3):
        ck.fail(ck.summary + " (>= 1e-3)")


def check_plain_equals_hf_generate(ck: Check, s: Suite, d: dict):
    import torch
    from transformers import AutoModelForCausalLM

    cases = s.need("cases:loopy:float32")[: max(2, d["sizes"].prompts // 2)]
    ck.at("load")
    hf = AutoModelForCausalLM.from_pretrained(d["loopy_dir"], dtype=torch.float32).to(s.device).eval()
    same = 0
    for c in cases:
        ck.at("generate")
        ids = torch.tensor([c.prompt], device=s.device)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=len(c.out),
                              min_new_tokens=len(c.out), pad_token_id=0)
        hf_ids = out[0, len(c.prompt):].tolist()
        same += hf_ids == c.out
        if hf_ids != c.out:
            ck.details.setdefault("divergences", []).append(_divergence(c, hf_ids))
    ck.details["equal"] = f"{same}/{len(cases)}"
    ck.summary = f"{same}/{len(cases)} equal to transformers generate"
    if same != len(cases):
        ck.fail(ck.summary)


def check_generate_batch(ck: Check, s: Suite, d: dict):
    """The training data (generate_batch, all candidates as one batch) against plain decoding, on the tie-free prompts."""
    same = total = 0
    for target in ("loopy", "base"):
        batched = {tuple(c.prompt): c.out for c in s.need(f"train_cases:{target}")}
        for c in s.need(f"cases:{target}:float32"):
            total += 1
            same += batched.get(tuple(c.prompt)) == c.out
    ck.details["equal"] = f"{same}/{total}"
    ck.summary = f"{same}/{total} batched rows equal one-at-a-time plain decoding"


def _divergence(c: Case, got: list[int]) -> dict:
    pos = next((i for i, (a, b) in enumerate(zip(c.out, got)) if a != b), min(len(c.out), len(got)))
    gap = c.margins[pos] if pos < len(c.margins) else None
    return {"prompt_len": len(c.prompt), "position": pos, "plain_token": c.out[pos] if pos < len(c.out) else None,
            "spec_token": got[pos] if pos < len(got) else None, "plain_top2_gap": gap}


# =========================================================================== setup: models, references, drafts


def setup_references(ck: Check, s: Suite, d: dict, target: str, dtype: str):
    """Plain greedy outputs (with margins) of the target's candidate prompts; fp32 picks the tie-free ones."""
    from specctl.runtime.loading import load_model

    ck.at("load")
    loaded = load_model(d[f"{target}_dir"], dtype=dtype, device=str(s.device))
    n = d["sizes"].prompts
    if dtype == "float32":
        prompts = d[f"{target}_prompts"]
    else:
        prompts = [c.prompt for c in s.need(f"cases:{target}:float32")]
    ck.at("plain greedy decode")
    cases, secs = plain_greedy(loaded.model, prompts, d["sizes"].new)
    tokens = sum(len(c.out) for c in cases)
    ck.details.update(prompts=len(prompts), tokens=tokens, seconds=round(secs, 2), tokens_per_s=round(tokens / secs, 1))
    if dtype == "float32":
        tie_free = [c for c in cases if min(c.margins) >= NEAR_TIE]
        ck.details["tie_free"] = len(tie_free)
        cases = tie_free[:n]
        if len(cases) < n:
            ck.fail(f"only {len(cases)} of {len(prompts)} prompts are tie-free (top-2 gap >= {NEAR_TIE})")
            return cases
    ck.summary = f"{len(prompts)} prompts × {d['sizes'].new} tokens, {tokens / secs:.0f} tok/s"
    return cases


def setup_train_data(ck: Check, s: Suite, d: dict, target: str) -> list[Case]:
    """The target's greedy answers to every candidate prompt, decoded as the rows of one batch
    (offline.generate_batch, the self-distillation path): the drafts' training data. Independent of
    SpecDecoder, so the trainers are exercised on D even where speculative decoding fails."""
    from specctl.runtime.loading import load_model
    from specctl.runtime.offline import generate_batch

    ck.at("load")
    loaded = load_model(d[f"{target}_dir"], dtype="float32", device=str(s.device))
    prompts = d[f"{target}_prompts"]
    ck.at("generate_batch")
    t = time.perf_counter()
    outs = generate_batch(loaded.model, prompts, [d["sizes"].new] * len(prompts))
    secs = time.perf_counter() - t
    ck.summary = f"{len(prompts)} rows × {d['sizes'].new} tokens in {secs:.2f}s"
    return [Case(p, o, []) for p, (o, _) in zip(prompts, outs)]


def setup_draft_model(ck: Check, s: Suite, d: dict) -> Path:
    """The base target's weights perturbed (2% of each tensor's std): same tokenizer, drafts often accepted."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = d["tmp"] / "draft-same"
    hf = AutoModelForCausalLM.from_pretrained(d["base_dir"], dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.02 * p.std() * torch.randn(p.shape, generator=g))
    hf.save_pretrained(folder)
    AutoTokenizer.from_pretrained(d["base_dir"]).save_pretrained(folder)
    return folder


def setup_medusa(ck: Check, s: Suite, d: dict) -> Path:
    from specctl.training.medusa import MedusaTrainConfig, train

    cases = s.need("train_cases:loopy")
    data = write_records(cases, d["tmp"] / "medusa-data.jsonl")
    out = d["tmp"] / "medusa-heads"
    ck.at("train")
    summary = train(MedusaTrainConfig(model=str(d["loopy_dir"]), output=str(out), data=[str(data)], num_heads=3,
                                      steps=d["sizes"].medusa_steps, lr=1e-2, batch_size=8, seq_len=128,
                                      dtype="float32", eval_split=0.0))
    ck.details.update(first_loss=summary.get("first_loss"), final_loss=summary.get("final_loss"), steps=summary.get("steps"))
    ck.summary = f"{summary.get('steps')} steps, loss {summary.get('first_loss'):.3f} -> {summary.get('final_loss'):.3f}"
    return out


def setup_eagle(ck: Check, s: Suite, d: dict, version: int) -> str:
    from specctl.runtime.loading import load_model
    from specctl.training.eagle import EagleTrainConfig, train

    cases = s.need("train_cases:base")
    data = d["tmp"] / "eagle-data.jsonl"
    if not data.exists():
        write_records(cases, data)
    ck.at("load target")
    loaded = load_model(d["base_dir"], dtype="float32", device=str(s.device))
    steps = d["sizes"].eagle3_steps if version == 3 else d["sizes"].eagle1_steps
    cfg = EagleTrainConfig(model=str(d["base_dir"]), output=str(d["tmp"] / f"eagle-run{version}"), data=[str(data)],
                           version=version, steps=steps, batch_size=8, seq_len=128, eval_split=0.1, lr=1e-2,
                           eval_every=1000, save_every=0, draft_vocab_size=96 if version == 3 else None)
    ck.at("train")
    summary = train(cfg, loaded=loaded, log=lambda m: None)
    acc = (summary.get("final") or {}).get("train_acc") or []
    ck.details.update(steps=summary.get("steps"), train_acc=acc, export=summary.get("export"))
    ck.summary = f"{summary.get('steps')} steps, train acc per position {[round(a, 2) for a in acc]}"
    return summary["export"]


def setup_mtp(ck: Check, s: Suite, d: dict) -> Path:
    """One MTP module overfit (depth 3) on the base target's own greedy outputs, as tests/runtime/proposers/test_mtp.py,
    on D; exported as a DeepSeek-V3 draft folder (from the trainer's building blocks, on the suite's own loaded target)."""
    import torch

    from specctl.runtime.loading import load_model
    from specctl.training.mtp import init_stack, mtp_loss, step_weights, target_states, unroll
    from specctl.drafts.mtp_files import export_mtp

    cases = s.need("train_cases:base")
    ck.at("load target")
    loaded = load_model(d["base_dir"], dtype="float32", device=str(s.device))
    L = min(len(c.prompt) + len(c.out) for c in cases)
    seqs = torch.tensor([(c.prompt + c.out)[:L] for c in cases], device=s.device)
    ck.at("target states")
    h0, y = target_states(loaded.model, seqs)
    ck.at("train")
    torch.manual_seed(0)
    stack = init_stack(loaded.model, 1)
    ck.details["init_stack_device"] = str(next(stack.parameters()).device)
    stack = stack.to(s.device)  # init_stack builds on the CPU whatever the target's device
    opt = torch.optim.AdamW(stack.parameters(), lr=1e-2)
    w = step_weights(3)
    losses = []
    for _ in range(d["sizes"].mtp_steps):
        loss = mtp_loss(unroll(stack, loaded.model, seqs, h0, 3), y, w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    stack.eval().requires_grad_(False)
    ck.at("export")
    out = export_mtp(stack, d["base_dir"], d["tmp"] / "mtp-draft", head_weight=loaded.model.head_weight)
    ck.details.update(steps=len(losses), first_loss=losses[0], final_loss=losses[-1], seq_len=L)
    ck.summary = f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    return out


# =========================================================================== greedy losslessness (fp32, bf16)


def method_table(d: dict) -> dict[str, tuple[str, callable, tuple[str, ...]]]:
    """name -> (target, fixtures -> vLLM-style speculative config, fixtures needed)."""
    return {
        "ngram": ("loopy", lambda f: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                      "prompt_lookup_max": 3}, ()),
        "suffix": ("loopy", lambda f: {"method": "suffix", "num_speculative_tokens": 8}, ()),
        "medusa": ("loopy", lambda f: {"method": "medusa", "model": str(f["medusa"]), "num_speculative_tokens": 3},
                   ("medusa",)),
        "medusa-tree": ("loopy", lambda f: {"method": "medusa", "model": str(f["medusa"]), "num_speculative_tokens": 3,
                                            "speculative_token_tree": "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"},
                        ("medusa",)),
        "eagle": ("base", lambda f: {"method": "eagle", "model": f["eagle1"], "num_speculative_tokens": 4}, ("eagle1",)),
        "eagle3": ("base", lambda f: {"method": "eagle3", "model": f["eagle3"], "num_speculative_tokens": 4}, ("eagle3",)),
        "eagle3-tree": ("base", lambda f: {"method": "eagle3", "model": f["eagle3"], "num_speculative_tokens": 4,
                                           "speculative_eagle_topk": 3, "speculative_num_draft_tokens": 12}, ("eagle3",)),
        "draft_model": ("base", lambda f: {"method": "draft_model", "model": str(f["draft_model"]),
                                           "num_speculative_tokens": 4}, ("draft_model",)),
        "mtp": ("base", lambda f: {"method": "mtp", "model": str(f["mtp"]), "num_speculative_tokens": 3}, ("mtp",)),
    }


def check_greedy(ck: Check, s: Suite, d: dict, name: str, dtype: str):
    import torch

    from specctl.config import SpecConfig
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.metrics import SpecStats
    from specctl.runtime.proposers import build_proposer
    from specctl.runtime.loading import load_model
    from specctl.runtime.runner import TargetRunner

    target, make_cfg, needs = method_table(d)[name]
    cases = s.need(f"cases:{target}:{dtype}")
    for k in needs:
        s.need(k)
    ck.at("load target")
    loaded = load_model(d[f"{target}_dir"], dtype=dtype, device=str(s.device))  # fresh: eagle3 sets aux_layers on it
    ck.at("build proposer")
    torch.manual_seed(0)
    cfg = SpecConfig.from_dict(make_cfg(s.fixtures))
    ck.details["config"] = cfg.to_dict()
    prop = build_proposer(cfg, MAX_LEN, target=loaded)
    dec = SpecDecoder(TargetRunner(loaded.model, MAX_LEN), prop, cfg.num_speculative_tokens)
    stats, same, steps, divs = SpecStats(), 0, 0, []
    ck.at("speculative decode")
    t = time.perf_counter()
    with torch.inference_mode():
        for c in cases:
            res = dec.generate(c.prompt, SamplingParams(max_new_tokens=len(c.out), ignore_eos=True))
            stats = stats.merge(res.stats)
            steps += res.num_steps
            if res.token_ids == c.out:
                same += 1
            else:
                divs.append(_divergence(c, res.token_ids))
    secs = time.perf_counter() - t
    n = len(cases)
    ck.details.update(equal=f"{same}/{n}", seconds=round(secs, 3), target_steps=steps, stats=stats.to_dict(),
                      divergences=divs)
    ck.summary = (f"{same}/{n} equal · mean acc len {stats.mean_acceptance_length:.2f} · "
                  f"acc rate {stats.acceptance_rate:.2f} · {steps} steps for {sum(len(c.out) for c in cases)} tokens · "
                  f"decode {secs:.2f}s")
    if dtype == "float32":
        if same != n:
            ck.fail(ck.summary + f" · first divergence {divs[0]}")
        elif stats.num_draft_tokens == 0:
            ck.fail(ck.summary + " · no draft token was proposed: losslessness not exercised")
    else:
        tie = d["bf16_tie"]
        unexplained = [x for x in divs if x["plain_top2_gap"] is None or x["plain_top2_gap"] >= tie]
        ck.details["unexplained"] = len(unexplained)
        if divs:
            gaps = ", ".join(f"pos {x['position']} gap {x['plain_top2_gap']:.3g}" for x in divs if x["plain_top2_gap"] is not None)
            ck.summary += f" · divergences at {gaps}"
        if unexplained:
            ck.fail(ck.summary + f" · {len(unexplained)} not at a near-tie (gap >= {tie})")
        elif stats.num_draft_tokens == 0:
            ck.fail(ck.summary + " · no draft token was proposed")


# =========================================================================== sampling


def exact_marginals(model, prompt: list[int], temperature: float, depth: int, prune: float, chunk: int = 256):
    """Exact distributions of emitted tokens 1..depth under plain sampling, prefixes enumerated with
    batched forwards (as tests/runtime/test_decoder.py). Returns ([V] float64 CPU marginals, mass pruned)."""
    import torch

    from specctl.runtime.rejection import logits_to_probs
    from specctl.runtime.runner import TargetRunner

    V = model.args.vocab_size
    prefixes, marginals, dropped = [((), 1.0)], [], 0.0
    for _ in range(depth):
        marginal = torch.zeros(V, dtype=torch.float64)
        nxt = []
        for i in range(0, len(prefixes), chunk):
            part = prefixes[i:i + chunk]
            rows = torch.tensor([prompt + list(p) for p, _ in part])
            logits = TargetRunner(model, rows.shape[1], batch=len(part)).forward(rows, logits="last")[:, 0]
            joint = torch.tensor([m for _, m in part], dtype=torch.float64)[:, None] * \
                logits_to_probs(logits, temperature).double().cpu()
            marginal += joint.sum(0)
            keep = joint >= prune
            for r, (p, _) in enumerate(part):
                nxt += [(p + (t,), float(joint[r, t])) for t in keep[r].nonzero().flatten().tolist()]
            dropped += float(joint[~keep].sum())
        marginals.append(marginal)
        prefixes = nxt
    return marginals, dropped


def null_tv_quantile(exact, n: int, q: float = 0.999, trials: int = 2000) -> float:
    """The q-quantile of TV(empirical of n exact samples, exact): how far a correct sampler may land."""
    import torch

    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(exact.float().expand(trials, -1), n, replacement=True, generator=g)
    hist = torch.zeros(trials, exact.numel()).scatter_add_(1, draws, torch.ones(draws.shape)) / n
    return float(torch.quantile(0.5 * (hist - exact.float()).abs().sum(1), q))


def check_sampling(ck: Check, s: Suite, d: dict, name: str):
    import numpy as np
    import torch

    from specctl.config import SpecConfig
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.proposers import build_proposer
    from specctl.runtime.loading import load_model
    from specctl.runtime.runner import TargetRunner

    N = d["sizes"].samples
    dev = s.device

    def gen(seed: int):
        return torch.Generator(device=dev).manual_seed(seed)

    if name in ("plain", "ngram"):  # the loopy target, a cold temperature: ngram drafts get accepted often
        target, temperature, k, prune = "loopy", 0.1, 3, 1e-6
        cfg = None if name == "plain" else {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                                            "prompt_lookup_max": 3}
    else:
        target, temperature, k, prune = "base", 0.3, 2, 1e-5
        key = {"draft_model": "draft_model", "eagle3": "eagle3"}[name]
        path = s.need(key)
        cfg = {"method": name, "model": str(path), "num_speculative_tokens": k}
    ck.at("load target")
    loaded = load_model(d[f"{target}_dir"], dtype="float32", device=str(dev))
    torch.manual_seed(0)
    if cfg is None:
        dec = SpecDecoder(TargetRunner(loaded.model, MAX_LEN))
    else:
        ck.at("build proposer")
        c = SpecConfig.from_dict(cfg)
        dec = SpecDecoder(TargetRunner(loaded.model, MAX_LEN), build_proposer(c, MAX_LEN, target=loaded), k)
    params = SamplingParams(max_new_tokens=4, temperature=temperature, ignore_eos=True)

    ck.at("choose a prompt")
    with torch.inference_mode():
        if target == "loopy":  # a prompt that loops (its own greedy continuation), the one ngram accepts most on
            if "sampling_prompt:loopy" not in s.fixtures:
                plain = SpecDecoder(TargetRunner(loaded.model, MAX_LEN))
                c = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                          "prompt_lookup_max": 3})
                ngram = SpecDecoder(TargetRunner(loaded.model, MAX_LEN), build_proposer(c, MAX_LEN), 3)
                cands = []
                for seed in range(5):
                    x = np.random.default_rng(seed).integers(6, 128, 6).tolist()
                    cands.append(x + plain.generate(x, SamplingParams(max_new_tokens=40, ignore_eos=True)).token_ids)

                def rate(p):
                    st = [ngram.generate(p, params, gen(10_000 + i)).stats for i in range(20)]
                    return sum(x.num_accepted_tokens for x in st) / max(1, sum(x.num_draft_tokens for x in st))

                s.fixtures["sampling_prompt:loopy"] = max(cands, key=rate)
            prompt = s.fixtures["sampling_prompt:loopy"]
        else:
            prompt = s.need("cases:base:float32")[0].prompt
        ck.at("exact marginals")
        (_, m2, m3), dropped = exact_marginals(loaded.model, prompt, temperature, depth=3, prune=prune)
        V = loaded.model.args.vocab_size
        sec, third = torch.zeros(V, dtype=torch.float64), torch.zeros(V, dtype=torch.float64)
        drafted = accepted = 0
        ck.at("sampled decode")
        t = time.perf_counter()
        for i in range(N):
            res = dec.generate(prompt, params, gen(i))
            sec[res.token_ids[1]] += 1
            third[res.token_ids[2]] += 1
            drafted += res.stats.num_draft_tokens
            accepted += res.stats.num_accepted_tokens
        secs = time.perf_counter() - t
    ck.at("compare")
    rows = []
    ok = True
    for label, emp, exact in (("token 2", sec / N, m2), ("token 3", third / N, m3)):
        tv = 0.5 * float((emp - exact).abs().sum())
        bound = null_tv_quantile(exact, N) + dropped
        rows.append({"token": label, "tv": round(tv, 4), "bound": round(bound, 4)})
        ok &= tv < bound
    rate = accepted / drafted if drafted else None
    ck.details.update(samples=N, temperature=temperature, k=k if cfg else 0, prompt_len=len(prompt), pruned_mass=dropped,
                      tv=rows, draft_tokens=drafted, accepted=accepted, acceptance_rate=rate, seconds=round(secs, 2))
    ck.summary = (" · ".join(f"{r['token']} TV {r['tv']:.3f} < {r['bound']:.3f}" if r["tv"] < r["bound"] else
                             f"{r['token']} TV {r['tv']:.3f} >= {r['bound']:.3f}" for r in rows)
                  + (f" · acc rate {rate:.2f}" if rate is not None else "") + f" · N={N}")
    if not ok:
        ck.fail(ck.summary)
    elif cfg is not None and drafted == 0:
        ck.fail(ck.summary + " · no drafts: the verifier was not exercised")
    elif rate is not None and not 0.05 < rate < 0.98:
        ck.details["note"] = "acceptance rate near 0 or 1: accepted/recovered tokens not both exercised"


# =========================================================================== speed


def check_speed(ck: Check, s: Suite, d: dict, shape: dict, label: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.modeling import load_transformer
    from specctl.runtime.runner import TargetRunner

    sz = d["sizes"]
    cfg_dict = dict(shape)
    if sz.speed_layers is not None:
        cfg_dict["num_hidden_layers"] = min(cfg_dict["num_hidden_layers"], sz.speed_layers)
    ck.details["config"] = cfg_dict
    dev = s.device
    ck.at("init random weights")
    config = AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(0)
    with torch.device(dev):
        try:
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            hf = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    hf = hf.to(dev).eval()
    folder = d["tmp"] / f"speed-{label}"
    ck.at("save + load into the own runtime")
    hf.save_pretrained(folder)
    own = load_transformer(folder, torch.bfloat16, dev)
    prompt = torch.randint(100, cfg_dict["vocab_size"] - 100, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    new, runs = sz.speed_new, sz.speed_runs
    ck.at("same weights: prefill logits")
    with torch.inference_mode():  # random weights: the logits are close together, bf16 outputs diverge early
        a = TargetRunner(own, len(prompt)).forward(torch.tensor([prompt])).float()
        b = hf(torch.tensor([prompt], device=dev)).logits.float()
    ck.details.update(prefill_max_abs_diff=float((a - b).abs().max()),
                      prefill_argmax_agree=float((a.argmax(-1) == b.argmax(-1)).float().mean()),
                      prefill_logit_std=float(b.std()))
    del a, b

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    ck.at("transformers generate")  # first: its numbers are kept even if specctl's decode fails
    x = torch.tensor([prompt], device=dev)
    pad = cfg_dict.get("pad_token_id") or 0

    def generate(n: int):
        return hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=pad)

    with torch.inference_mode():
        generate(8)  # warm-up
        t_full = t_one = float("inf")
        for _ in range(runs):
            sync()
            t = time.perf_counter()
            out = generate(new)
            sync()
            t_full = min(t_full, time.perf_counter() - t)
            t = time.perf_counter()
            generate(1)
            sync()
            t_one = min(t_one, time.perf_counter() - t)
    hf_tokens = out[0, len(prompt):].tolist()
    hf_res = {"e2e_tok_s": new / t_full, "decode_tok_s": (new - 1) / max(t_full - t_one, 1e-9), "prefill_s": t_one,
              "wall_s": t_full}
    ck.details.update(new_tokens=new, prompt_len=len(prompt), runs=runs, transformers=hf_res,
                      params_m=round(sum(p.numel() for p in hf.parameters()) / 1e6, 1))

    ck.at("specctl plain decode")
    dec = SpecDecoder(TargetRunner(own, max_len=len(prompt) + new + 8))
    with torch.inference_mode():
        dec.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
        best = None
        for _ in range(runs):
            sync()
            t = time.perf_counter()
            res = dec.generate(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
            sync()
            wall = time.perf_counter() - t
            if best is None or wall < best[0]:
                best = (wall, res)
    wall, res = best
    own_tokens = res.token_ids
    specctl = {"e2e_tok_s": new / wall, "decode_tok_s": res.decode_tokens_per_s, "prefill_s": res.prefill_s, "wall_s": wall}
    agree = next((i for i, (a, b) in enumerate(zip(own_tokens, hf_tokens)) if a != b), min(len(own_tokens), len(hf_tokens)))
    if agree < new:  # how close a tie the first differing token was (specctl's top-1 minus top-2, fp32-rescored)
        with torch.inference_mode():
            m = dec.generate(prompt, SamplingParams(max_new_tokens=agree + 1, ignore_eos=True, record_margins=True)).margins
        ck.details["top2_gap_at_divergence"] = m[agree] if agree < len(m) else None
    ratio = specctl["e2e_tok_s"] / hf_res["e2e_tok_s"]
    ratio_dec = specctl["decode_tok_s"] / hf_res["decode_tok_s"]
    ck.details.update(specctl=specctl, ratio_e2e=ratio, ratio_decode=ratio_dec, same_tokens_prefix=agree)
    ck.summary = (f"specctl {specctl['e2e_tok_s']:.1f} tok/s (decode {specctl['decode_tok_s']:.1f}) vs transformers "
                  f"{hf_res['e2e_tok_s']:.1f} tok/s (decode ~{hf_res['decode_tok_s']:.1f}): ×{ratio:.2f} "
                  f"(decode ×{ratio_dec:.2f}) · outputs agree on the first {agree}/{new} tokens"
                  + (f" (top-2 gap there {ck.details['top2_gap_at_divergence']:.3g})" if agree < new else "")
                  + f", prefill argmax on {ck.details['prefill_argmax_agree']:.0%} of positions")


# =========================================================================== report


def environment(device) -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": str(device), "threads": torch.get_num_threads(),
           "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "kernels": __import__("specctl.modeling.load", fromlist=["_kernels"])._kernels,
           "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        try:
            p = torch.cuda.get_device_properties(device)
            env.update(gpu=torch.cuda.get_device_name(device), capability=f"{p.major}.{p.minor}",
                       gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda,
                       allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
        except Exception as e:  # noqa: BLE001 - the header is informative only
            env["gpu"] = f"? ({type(e).__name__}: {e})"
    return env


def print_report(s: Suite, env: dict, exit_code: int) -> None:
    print(f"specctl CUDA check · {env.get('gpu', env.get('cpu'))} · torch {env['torch']} · "
          f"transformers {env['transformers']} · device {env['device']}")
    w = max(len(c.name) for c in s.checks) if s.checks else 10
    section = None
    for c in s.checks:
        if c.section != section:
            section = c.section
            print(f"\n{section}")
        print(f"  {c.name:<{w}}  {c.status.upper():<5}  {c.seconds:6.1f}s  {c.summary}")
    problems = [c for c in s.checks if c.status in ("fail", "error")]
    if problems:
        print("\nproblems")
        for c in problems:
            print(f"  {c.section} · {c.name} [{c.status}{', at ' + c.stage if c.stage else ''}]: {c.error or c.summary}"[:600])
            for where in c.where:
                print(f"      at {where}")
    gating = [c for c in s.checks if c.gating]
    passed = sum(c.status == "pass" for c in gating)
    skipped = sum(c.status == "skip" for c in gating)
    print(f"\n{passed}/{len(gating)} lossless checks passed ({skipped} skipped) in {time.perf_counter() - T0:.0f}s "
          f"-> exit {exit_code}")


# =========================================================================== main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available, else cpu)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a CPU run")
    ap.add_argument("--json", default=None, help="write all results as JSON here")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on cpu, torch's default otherwise)")
    ap.add_argument("--sections", default="runtime,setup,fp32,bf16,sampling,speed",
                    help="comma-separated subset of: runtime,setup,fp32,bf16,sampling,speed")
    ap.add_argument("--bf16-tie", type=float, default=0.1,
                    help="a bf16 divergence at a plain top-2 gap below this counts as a near-tie (default 0.1)")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="after this many seconds the optional checks (eagle3 sampling, the Qwen speed check) are skipped")
    ap.add_argument("--torch-path", action="store_true",
                    help="on a CPU, run the torch ops a GPU runs instead of specctl's C++ bf16 kernels "
                         "(--kernels torch: the EAGLE draft follows its target)")
    args = ap.parse_args()

    import specctl

    specctl.process_defaults()  # OpenMP settings (GOMP_SPINCOUNT) before torch loads
    import torch

    if args.torch_path:
        from specctl.modeling import set_kernels

        set_kernels("torch")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    sizes = QUICK if args.quick else FULL
    sections = set(args.sections.split(","))

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    threads = args.threads or (1 if device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    env = environment(device)
    log(f"device {device} · {env.get('gpu', env.get('cpu'))} · torch {env['torch']} · "
        f"{'quick' if args.quick else 'full'} sizes")
    s = Suite(device, args.budget_s, args.json, {"environment": env, "argv": sys.argv[1:], "sizes": asdict(sizes)})

    with tempfile.TemporaryDirectory(prefix="specctl-cuda-check-") as tmp_name:
        tmp = Path(tmp_name)
        d: dict = {"tmp": tmp, "sizes": sizes, "bf16_tie": args.bf16_tie}

        def build_models(ck: Check):
            """The test suite's tiny llamas: 'loopy' (seed 1, init 0.05: its greedy output loops) and 'base' (seed 0)."""
            ck.at("import tests/conftest.py")
            conftest = import_conftest()
            ck.at("build and save")
            d["loopy_dir"] = save_tiny(conftest, tmp / "tiny-loopy", seed=1, initializer_range=0.05)
            d["base_dir"] = save_tiny(conftest, tmp / "tiny-base")
            d["loopy_prompts"] = conftest.make_repetitive_prompts(sizes.candidates, seed=0)
            d["base_prompts"] = chat_prompts(conftest.build_tiny_tokenizer(), sizes.candidates, seed=0)
            ck.summary = f"2 tiny llamas (vocab {conftest.TINY_VOCAB_SIZE}, 2 layers), {sizes.candidates} prompts each"
            return True

        s.run("setup", "tiny models", build_models, provides="tiny")
        if "tiny" in s.fixtures:
            for target in ("loopy", "base"):
                s.run("setup", f"plain reference fp32 ({target})",
                      lambda ck, t=target: setup_references(ck, s, d, t, "float32"), provides=f"cases:{target}:float32")
            for target in ("loopy", "base"):
                s.run("setup", f"training data ({target})", lambda ck, t=target: setup_train_data(ck, s, d, t),
                      provides=f"train_cases:{target}")

        if "runtime" in sections and "tiny" in s.fixtures:
            s.run("runtime", "forward == transformers (fp32)", lambda ck: check_forward_matches_hf(ck, s, d))
            s.run("runtime", "plain greedy == transformers generate", lambda ck: check_plain_equals_hf_generate(ck, s, d))
            s.run("runtime", "generate_batch == plain", lambda ck: check_generate_batch(ck, s, d), gating=False)

        wants_drafts = sections & {"fp32", "bf16", "sampling"}
        if "tiny" in s.fixtures and wants_drafts:
            s.run("setup", "draft model (perturbed copy)", lambda ck: setup_draft_model(ck, s, d), provides="draft_model")
            s.run("setup", "train medusa heads", lambda ck: setup_medusa(ck, s, d), provides="medusa")
            s.run("setup", "train eagle3 draft", lambda ck: setup_eagle(ck, s, d, 3), provides="eagle3")
            s.run("setup", "train eagle (EAGLE-1) draft", lambda ck: setup_eagle(ck, s, d, 1), provides="eagle1")
            s.run("setup", "train mtp module", lambda ck: setup_mtp(ck, s, d), provides="mtp")

        names = list(method_table(d))
        if "fp32" in sections and "tiny" in s.fixtures:
            for name in names:
                s.run("fp32", name, lambda ck, n=name: check_greedy(ck, s, d, n, "float32"))
        if "bf16" in sections and "tiny" in s.fixtures:
            for target in ("loopy", "base"):
                s.run("bf16", f"plain reference ({target})",
                      lambda ck, t=target: setup_references(ck, s, d, t, "bfloat16"), provides=f"cases:{target}:bfloat16")
            for name in names:
                s.run("bf16", name, lambda ck, n=name: check_greedy(ck, s, d, n, "bfloat16"))
        if "sampling" in sections and "tiny" in s.fixtures:
            for name in sizes.sampling_methods:
                if name == "eagle3" and s.late():
                    s.checks.append(Check("sampling", name, gating=False, status="skip",
                                         summary=f"over the {args.budget_s:.0f}s budget"))
                    continue
                s.run("sampling", name, lambda ck, n=name: check_sampling(ck, s, d, n))
        if "speed" in sections:
            s.run("speed", "smollm2-135m shape, bf16", lambda ck: check_speed(ck, s, d, SMOLLM2_135M, "smollm2"),
                  gating=False)
            if sizes.qwen:
                if s.late():
                    s.checks.append(Check("speed", "qwen2.5-1.5b shape (8 layers), bf16", gating=False, status="skip",
                                          summary=f"over the {args.budget_s:.0f}s budget"))
                else:
                    s.run("speed", "qwen2.5-1.5b shape (8 layers), bf16",
                          lambda ck: check_speed(ck, s, d, QWEN25_15B_8L, "qwen"), gating=False)

    bad = [c for c in s.checks if c.gating and c.status in ("fail", "error", "skip")]
    exit_code = 1 if bad else 0
    print_report(s, env, exit_code)
    s.save(exit_code)
    if args.json:
        log(f"wrote {args.json}")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
