"""specctl against llama.cpp's own tools on the same GGUF files and prompts, in one run.

    python benchmarks/llama_cpp_compare.py --target Q15.gguf [--draft Q05.gguf] --llama-bin DIR
        [-w code-edit -w chat] [-n 4] [--max-new-tokens 128] [--repeats 3] [--hide amx_int8]

llama.cpp runs as its users run it: its command-line tools, built from the llama.cpp sources that the
llama-cpp-python sdist carries (README: "llama.cpp peer"), with 2 threads and its own defaults, in the
environment the user gave (nothing specctl's process sets, such as GOMP_SPINCOUNT):

- plain:        ``llama-completion -no-cnv --temp 0`` (its "eval time" line: decode tok/s);
- prompt lookup: ``llama-lookup`` (the n-gram drafting of llama.cpp's examples) at its default draft length
  and at specctl's n-gram draft length (``--spec-draft-n-max``);
- draft model:  ``llama-speculative-simple --spec-type draft-simple -md DRAFT`` at its default draft length (and ``--spec-draft-n-max K``).

specctl runs the same files quantized (``--quantization gguf``: blocks as stored), plain, ngram and
draft_model (the draft GGUF quantized too), greedy, adaptive draft length up to k. Each prompt (a
workload's request rendered with the model's chat template; llama.cpp gets the text and tokenizes it
with the special tokens) runs through every engine in turn, ``--repeats`` times (engines interleaved in each
repeat), so the machine's drift hits all alike; a prompt's figure is the median of its repeats (this
machine is shared: one engine's rate on one prompt moved 1.7x between two runs in a row).
Prints decode tok/s per engine and workload (tokens after the first over the decode time, as
llama.cpp reports them), and the ratios the issue asks for, with the CPU's name.
"""

from __future__ import annotations

import specctl

specctl.process_defaults()  # for specctl's side; llama.cpp gets specctl.user_environ()

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from specctl.kernels.cpu import name as cpu_name

DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
EVAL = re.compile(r"(?<!prompt )eval time =\s+([\d.]+) ms /\s+(\d+) (?:runs|tokens)")
ACCEPT = re.compile(r"accept\s+=\s+([\d.]+)%")


def llama(tool: Path, model: Path, args: list[str], prompt: str, n: int) -> tuple[float, int, str]:
    """One llama.cpp tool run on ``prompt``: (decode tok/s, tokens decoded, acceptance or '')."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    try:
        cmd = [str(tool), "-m", str(model), "-f", f.name, "-n", str(n), "--temp", "0", "-t", "2", "-c", "4096", "--seed", "0", *args]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=specctl.user_environ(), timeout=1800)
    finally:
        os.unlink(f.name)
    out = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"{tool.name} failed ({r.returncode}): {out[-800:]}")
    acc = ACCEPT.search(out)
    m = DECODED.search(out)
    if m:
        toks, secs = int(m.group(1)), float(m.group(2))
        return toks / secs, toks, acc.group(1) + "%" if acc else ""
    m = EVAL.search(out)  # llama-completion's perf line: the decode steps after the prompt
    if not m:
        raise RuntimeError(f"{tool.name}: no timing line in its output: {out[-800:]}")
    ms, runs = float(m.group(1)), int(m.group(2))
    return runs / (ms / 1e3), runs + 1, ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, required=True, help="the target GGUF (e.g. Q4_K_M)")
    ap.add_argument("--draft", type=Path, help="a same-tokenizer draft GGUF (draft_model and llama-speculative-simple)")
    ap.add_argument("--llama-bin", type=Path, default=Path(os.environ.get("SPECCTL_LLAMA_CPP_BIN", "~/llama/build/bin")).expanduser())
    ap.add_argument("-w", "--workload", action="append", default=None)
    ap.add_argument("-n", "--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=4, help="the draft model's most draft tokens (llama.cpp also runs --spec-draft-n-max k)")
    ap.add_argument("--ngram-k", type=int, default=8, help="n-gram's most draft tokens (llama-lookup also runs with it)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of every engine on every prompt (median reported)")
    ap.add_argument("--hide", default="", help="also run specctl as a CPU without these features runs it (e.g. "
                    "amx_int8: the quantized kernels' int8 path instead of the AMX-INT8 panels), in the same loop")
    a = ap.parse_args()
    workloads = a.workload or ["code-edit", "chat"]

    from specctl import chat
    from specctl.config import SpecConfig
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.proposers import build_proposer
    from specctl.runtime.loading import load_model
    from specctl.runtime.runner import TargetRunner
    from specctl.workloads import load_workload

    tools = {t: a.llama_bin / t for t in ("llama-completion", "llama-lookup", "llama-speculative-simple")}
    missing = [str(p) for p in tools.values() if not p.exists()]
    if missing:
        raise SystemExit(f"error: llama.cpp tools not found: {', '.join(missing)}; build them (README: llama.cpp peer) "
                         "and pass --llama-bin DIR")
    max_len = 4096

    def specctl_decoders(hide: str = ""):
        """specctl's engines on the target (and draft) loaded here; with ``hide``, named "<engine> (<kernels>)"."""
        target = load_model(a.target, "bfloat16")
        sfx = f" ({target.model.cpu_kernels}, no {hide})" if hide else ""
        decoders = {"plain" + sfx: SpecDecoder(TargetRunner(target.model, max_len))}
        ngram = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": a.ngram_k})
        decoders["ngram" + sfx] = SpecDecoder(TargetRunner(target.model, max_len), build_proposer(ngram, max_len, target),
                                              a.ngram_k, adaptive=True)
        if a.draft:
            dm = SpecConfig.from_dict({"method": "draft_model", "model": str(a.draft), "quantization": "gguf",
                                       "num_speculative_tokens": a.k})
            decoders["draft_model" + sfx] = SpecDecoder(TargetRunner(target.model, max_len),
                                                        build_proposer(dm, max_len, target), a.k, adaptive=True)
        return target, decoders

    target, decoders = specctl_decoders()
    if a.hide:
        from specctl.kernels import select

        with select.hidden(*a.hide.split(",")):  # the models loaded here keep the kernels such a CPU takes
            decoders.update(specctl_decoders(a.hide)[1])
    peers = {"plain": (tools["llama-completion"], ["-no-cnv"]),
             "ngram": (tools["llama-lookup"], []),
             f"ngram --spec-draft-n-max {a.ngram_k}": (tools["llama-lookup"], ["--spec-draft-n-max", str(a.ngram_k)])}
    if a.draft:
        peers["draft_model"] = (tools["llama-speculative-simple"], ["--spec-type", "draft-simple", "-md", str(a.draft), "-td", "2"])
        peers[f"draft_model --spec-draft-n-max {a.k}"] = (tools["llama-speculative-simple"],
                                                   ["--spec-type", "draft-simple", "-md", str(a.draft), "-td", "2", "--spec-draft-n-max", str(a.k)])
    kernels = getattr(target.model, "cpu_kernels", None)
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; specctl kernels {kernels}")
    print(f"# target {a.target.name}" + (f", draft {a.draft.name}" if a.draft else "") +
          f"; {a.num_prompts} prompts per workload, {a.max_new_tokens} new tokens, greedy, median of {a.repeats} runs a "
          f"prompt; llama.cpp tools in {a.llama_bin}")
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    for dec in decoders.values():  # first calls out of the timing
        dec.generate(chat.render(target.tokenizer, [{"role": "user", "content": "hi"}]),
                     SamplingParams(max_new_tokens=8))
    for w in workloads:
        reqs = load_workload(w, a.num_prompts, 0)
        rates: dict[str, list[float]] = {}
        notes: dict[str, list[str]] = {}
        for r in reqs:
            ids = chat.render(target.tokenizer, r.messages)
            text = target.tokenizer.decode(ids, skip_special_tokens=False)
            runs: dict[str, list[float]] = {}
            for _ in range(a.repeats):
                for name, dec in decoders.items():
                    res = dec.generate(ids, params)
                    runs.setdefault(f"specctl {name}", []).append(res.decode_tokens_per_s)
                    if res.stats.num_draft_tokens and len(runs[f"specctl {name}"]) == 1:
                        notes.setdefault(f"specctl {name}", []).append(
                            f"{100 * res.stats.num_accepted_tokens / res.stats.num_draft_tokens:.0f}%")
                for name, (tool, extra) in peers.items():
                    tps, _, acc = llama(tool, a.target, extra, text, a.max_new_tokens)
                    runs.setdefault(f"llama.cpp {name}", []).append(tps)
                    if acc and len(runs[f"llama.cpp {name}"]) == 1:
                        notes.setdefault(f"llama.cpp {name}", []).append(acc)
            for k, v in runs.items():
                rates.setdefault(k, []).append(sorted(v)[len(v) // 2])
        print(f"\n## {w}")
        mean = {k: sum(v) / len(v) for k, v in rates.items()}
        for k, v in mean.items():
            extra = f"  accept {' '.join(notes[k])}" if k in notes else ""
            print(f"  {k:38s} {v:7.2f} tok/s  (per prompt: {' '.join(f'{x:.1f}' for x in rates[k])}){extra}")
        lp = mean["llama.cpp plain"]
        print(f"  specctl plain / llama.cpp plain: {mean['specctl plain'] / lp:.2f}x")
        best_lookup = max(v for k, v in mean.items() if k.startswith("llama.cpp ngram"))
        print(f"  specctl ngram / llama.cpp prompt lookup (its better setting): {mean['specctl ngram'] / best_lookup:.2f}x")
        if a.draft:
            best_spec = max(v for k, v in mean.items() if k.startswith("llama.cpp draft_model"))
            print(f"  specctl draft_model / llama.cpp speculative (its better setting): "
                  f"{mean['specctl draft_model'] / best_spec:.2f}x")
        for k in [k for k in mean if k.startswith("specctl ") and k.endswith(f", no {a.hide})")]:
            base = k.split(" (")[0]
            print(f"  {base} / {k.removeprefix('specctl ')}: {mean[base] / mean[k]:.2f}x")


if __name__ == "__main__":
    main()
