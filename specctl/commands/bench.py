"""`specctl bench`: methods x workloads against the no-speculation baseline, in one run."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from specctl.workloads import WORKLOADS  # names and one-line descriptions; no torch
from specctl.commands._options import (DeviceOpt, DtypeOpt, JsonOpt, KernelsOpt, ModelOpt, QuantizationOpt, SeedOpt,
                                       use_kernels, use_quantization)

PEERS = ("hf", "vllm", "llama.cpp")

HELP = """Measure speculative methods on real workloads against the plain-decoding baseline.

Every prompt runs without speculation and with each method in the same run; the table shows decode
tokens/s, speedup over that baseline, acceptance rate, mean acceptance length (bonus token
included), per-position acceptance, and whether each output equals the baseline's.

Examples:

  specctl bench --method ngram

  specctl bench --model qwen2.5-coder-1.5b --method ngram -k 10 --workload code-edit --json

  specctl bench --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'

  specctl bench --model qwen2.5-coder-1.5b --method ngram --peer hf --runs 3 --csv out.csv --plot plots/

Two drafts in one run (each --speculative-config adds a row, here draft_model:<draft>; --peer hf adds
transformers' assisted generation per draft, hf:assisted:<draft>, universal for another tokenizer):

  specctl bench --model qwen2.5-coder-1.5b --peer hf --speculative-config '{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 5}' --speculative-config '{"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 5}'

The strongest peers in the same table (optional installs; vLLM usually in a venv of its own, named by
SPECCTL_VLLM_PYTHON; llama.cpp reads a GGUF of the same weights):

  SPECCTL_VLLM_PYTHON=~/vllm/bin/python specctl bench --model qwen2.5-coder-1.5b --method ngram --peer vllm --peer llama.cpp --peer-gguf qwen2.5-coder-1.5b-bf16.gguf

A GGUF run quantized, as stored (its blocks read by specctl's CPU kernels; --peer llama.cpp then runs the
same file):

  specctl bench --model qwen2.5-coder-1.5b --quantization gguf --method ngram --peer llama.cpp

The best k per method and workload, from one run over several k (add --fixed-k to draft exactly k):

  specctl bench --model qwen2.5-coder-1.5b --method ngram --method suffix --sweep-k 2,4,8,16 -w code-edit -w chat --json

Every workload, multi-turn chat included (one row per turn), in one run:

  specctl bench --model qwen2.5-coder-1.5b -w code-edit -w humaneval -w chat -w mt-bench -w summarize -w math -w agentic

N-gram first, the draft model where it finds nothing (specctl's "hybrid"; each part gets a row of
its own under the hybrid's):

  specctl bench --model qwen2.5-coder-1.5b -w code-edit --speculative-config '{"method": "hybrid", "proposers": [{"method": "ngram"}, {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4}]}'

Aggregate throughput under load: the prompts through the continuous-batching engine with N requests
decoding together (one target forward per step), plain and each method, at each N:

  specctl bench --model qwen2.5-coder-0.5b --method ngram -w chat -n 16 --max-new-tokens 64 --concurrency 1 --concurrency 4 --concurrency 8

Workloads (-w NAME, or a .jsonl file of your own prompts; NAME@R repeats it for R rounds):

""" + "\n\n".join(f"  {name}: {desc}" for name, desc in WORKLOADS.items()) + "\n"


def bench(
    model: ModelOpt = None,
    method: Annotated[Optional[list[str]], typer.Option("--method", help="Draft method (repeatable). Default: ngram.")] = None,
    num_speculative_tokens: Annotated[Optional[int], typer.Option("--num-speculative-tokens", "-k", help="Draft tokens per step (k) for --method; method default when unset.")] = None,
    speculative_config: Annotated[Optional[list[str]], typer.Option("--speculative-config", help="vLLM's --speculative-config JSON (keys unchanged); repeatable, each adds one configuration, labelled by its method and, where several share one, by what tells them apart: the draft (draft_model:smollm2-135m), else the keys that differ (ngram:k=4, ngram:k=8,prompt_lookup_max=3), else a number (ngram#2: the same configuration twice, or nested settings that differ).")] = None,
    workload: Annotated[Optional[list[str]], typer.Option("--workload", "-w", help=f"{', '.join(WORKLOADS)}, or a .jsonl file of prompts (repeatable); NAME@R repeats it for R rounds (one row per round). Default: code-edit and chat.")] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", "-n", help="Prompts per workload (>= 1).")] = 4,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Tokens generated per prompt (>= 2: decode speed is measured over the tokens after the first).")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy (outputs comparable token for token).")] = 0.0,
    peer: Annotated[Optional[list[str]], typer.Option("--peer", help="Also run peers on the same prompts (repeatable): hf (transformers generate: plain, prompt lookup, assisted), vllm (plain, ngram, draft_model), llama.cpp (plain, prompt lookup).")] = None,
    peer_gguf: Annotated[Optional[str], typer.Option("--peer-gguf", help="The GGUF file --peer llama.cpp loads (the same weights as --model; default: --model when it is a .gguf, and with --quantization gguf the very file specctl runs).")] = None,
    runs: Annotated[int, typer.Option("--runs", help="Repeat every prompt N times; tok/s is the median over repetitions (min/max in --json), speedup the median of each repetition's ratio to its plain. With --concurrency: N rounds, each configuration once a round (plain first), the same way.")] = 1,
    csv_out: Annotated[Optional[str], typer.Option("--csv", help="Also write the results as CSV to this file.")] = None,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Also write speedup.png and acceptance.png into this folder.")] = None,
    fixed_k: Annotated[bool, typer.Option("--fixed-k", help="Always draft k tokens (default: adapt the draft length per request to what pays).")] = False,
    compile: Annotated[bool, typer.Option("--compile", help="Run one-token decode steps through torch.compile (float32, or a GPU with CUDA graphs; bf16 on CPU already runs a fused C++ step).")] = False,
    reuse_prefill: Annotated[bool, typer.Option("--reuse-prefill", help="Prefill each prompt once, for the baseline, and let every method take its keys/values over (a 16k-token prompt takes minutes on a CPU); the methods' TTFT then counts no prefill. Methods that read the target's prompt states (Medusa, EAGLE, MTP) prefill as usual.")] = False,
    interleave: Annotated[str, typer.Option("--interleave", help="steps (default): every method decodes each prompt in lockstep, one step each in turn, each with a KV cache of its own, so a noisy machine's drifts hit all alike; prompts: one method after the other per prompt (one KV cache; always so with --reuse-prefill). With --concurrency: every configuration's engine steps in turn, N KV slots each, or one configuration after the other.")] = "steps",
    sweep_k: Annotated[Optional[str], typer.Option("--sweep-k", help="Comma-separated k values (e.g. 2,4,8): run every configuration at each k (overriding its own) and report the best k per method and workload (table; 'best_k' in --json).")] = None,
    concurrency: Annotated[Optional[list[int]], typer.Option("--concurrency", "-c", help="Measure aggregate throughput with N requests decoding together (repeatable, e.g. -c 1 -c 8): all prompts queued at once through the continuous-batching engine with N KV slots; reports total tok/s, speedup over plain at the same N, scaling over plain at N=1, TTFT and inter-token latency.")] = None,
    max_num_batched_tokens: Annotated[int, typer.Option("--max-num-batched-tokens", help="With --concurrency: prompt tokens one engine step may carry (chunked prefill, as serve).")] = 2048,
    seed: SeedOpt = 0,
    dtype: DtypeOpt = "bfloat16",
    device: DeviceOpt = "cpu",
    kernels: KernelsOpt = "auto",
    quantization: QuantizationOpt = "none",
    json_out: JsonOpt = False,
) -> None:
    from specctl.config import SpecConfig
    from specctl.drafts.kinds import draft_method
    from specctl.errors import UsageError

    quant = use_quantization(quantization)

    configs: list[SpecConfig] = []
    for m in method or ([] if speculative_config else ["ngram"]):
        configs.append(SpecConfig(method=m, num_speculative_tokens=num_speculative_tokens).validated())
    for text in speculative_config or []:
        configs.append(SpecConfig.from_json(text, method_of=draft_method))  # a draft folder and no method: its method
    if max_new_tokens < 2:  # the first token comes from the prefill: no decoding, no draft, no decode speed
        raise UsageError(f"--max-new-tokens must be >= 2 (decode speed is measured over the tokens after the "
                         f"first, and nothing is drafted before it), got {max_new_tokens}", "pass e.g. --max-new-tokens 128")
    if num_prompts < 1:
        raise UsageError(f"--num-prompts must be >= 1, got {num_prompts}",
                         "pass e.g. -n 4 (the default); a workload with fewer prompts runs all it has")
    if temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {temperature}", "use 0 for greedy")
    from specctl.bench.suite import check_interleave

    check_interleave(interleave)  # before the model loads
    workloads = workload or ["code-edit", "chat"]
    peers = tuple(peer or ())
    for p in peers:
        if p not in PEERS:
            raise UsageError(f"unknown peer '{p}'", f"use one of: {', '.join(PEERS)}")
    if runs < 1:
        raise UsageError(f"--runs must be >= 1, got {runs}", "pass e.g. --runs 3")
    if peer_gguf is not None and "llama.cpp" not in peers:
        raise UsageError(f"--peer-gguf {peer_gguf} is the file --peer llama.cpp loads, and this run has no --peer llama.cpp",
                         "add --peer llama.cpp, or drop --peer-gguf")
    check_output(csv_out, plot)  # before hours of measuring, not at the save after them
    path = None
    if quant is not None:  # the file specctl runs (refused at once when it is not a GGUF), and llama.cpp too
        from specctl.models import resolve_model

        path = resolve_model(model, dtype=dtype, quantization=quant)
        if "llama.cpp" in peers and peer_gguf is None:
            peer_gguf = str(path)
    if "llama.cpp" in peers:
        if peer_gguf is None and model and model.endswith(".gguf"):
            peer_gguf = model
        if peer_gguf is None:
            raise UsageError("--peer llama.cpp needs the model as a GGUF file",
                             "pass --peer-gguf model.gguf (e.g. from llama.cpp's convert_hf_to_gguf.py --outtype bf16)")
        from pathlib import Path

        if not Path(peer_gguf).expanduser().is_file():
            raise UsageError(f"--peer-gguf {peer_gguf} does not exist", "pass the path of a .gguf file")
        peer_gguf = str(Path(peer_gguf).expanduser())
    for p in peers:
        if p != "hf":
            from specctl.bench.peers import engine_python

            engine_python(p)  # fail fast, before loading the model, when the engine is not installed
    ks = parse_k_list(sweep_k) if sweep_k is not None else None
    use_kernels(kernels)
    levels = sorted(set(concurrency or []))
    if levels:
        if max_num_batched_tokens < 1:
            raise UsageError(f"--max-num-batched-tokens must be >= 1, got {max_num_batched_tokens}",
                             "pass e.g. --max-num-batched-tokens 256")
        if any(n < 1 for n in levels):
            raise UsageError(f"--concurrency must be >= 1, got {min(levels)}", "pass e.g. --concurrency 1 --concurrency 8")
        clash = [o for o, v in (("--peer", peers), ("--sweep-k", ks), ("--compile", compile), ("--plot", plot),
                                ("--csv", csv_out), ("--reuse-prefill", reuse_prefill)) if v]
        if clash:
            raise UsageError(f"{', '.join(clash)} cannot be combined with --concurrency yet",
                             "measure them in a run without --concurrency")

    from rich.console import Console

    err = Console(stderr=True)
    from specctl.workloads import load_workload

    # fail fast on a bad workload, before loading the model
    for w in workloads:
        load_workload(w, num_prompts, seed)

    from specctl.models import resolve_model
    from specctl.runtime.loading import load_model, parse_device

    parse_device(device)  # a bad --device fails before the model is fetched or read
    if path is None:
        path = resolve_model(model, dtype=dtype)
    err.log(f"loading {path} ({dtype}, {device}{', GGUF quantized' if quant else ''})")
    loaded = load_model(path, dtype=dtype, device=device)

    import torch

    from specctl.bench.suite import run_bench
    from specctl.runtime.decoder import SamplingParams

    torch.manual_seed(seed)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=loaded.stop_token_ids)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if levels:
        _bench_concurrency(loaded, configs, workloads, num_prompts, params, levels, seed, not fixed_k, json_out, err,
                           max_num_batched_tokens, kernels, runs, interleave)
        return
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=True, disable=not err.is_terminal) as prog:
        task = prog.add_task("loading", total=None)  # run_bench gives the total first
        done = [0]

        def progress(adv, desc, total=None):
            prog.update(task, advance=adv, description=desc, total=total)
            if total is not None:
                done.append(total)
            if adv and not err.is_terminal:  # a log, not a terminal: one line per prompt run
                done[0] += adv
                err.log(f"[{done[0]}/{done[-1] if len(done) > 1 else '?'}] {desc}")

        report = run_bench(loaded, configs, workloads, num_prompts, params, seed,
                           progress=progress,
                           adaptive=not fixed_k, peers=peers, runs=runs, sweep_k=ks,
                           compile=compile, peer_gguf=peer_gguf, reuse_prefill=reuse_prefill, interleave=interleave,
                           warn=lambda m: err.log(f"[yellow]peer failed, its rows are left empty:[/] {m}"),
                           notice=lambda m: err.log(f"[yellow]{m}[/]"))
    report.header["draft_length"] = "fixed k" if fixed_k else "adaptive (up to k)"
    report.header["kernels"] = kernels
    report.header["reuse_prefill"] = reuse_prefill

    rows = report.rows()
    if csv_out:
        from specctl.bench.report import write_csv

        err.log(f"wrote {write_csv(rows, csv_out)}")
    if plot:
        from specctl.bench.report import write_plots

        for p in write_plots(rows, report.header, plot):
            err.log(f"wrote {p}")
    if json_out:
        out = {"header": report.header, "results": rows}
        if ks:
            out["best_k"] = report.best_k()
        typer.echo(json.dumps(out, indent=2))
        return
    render(report)
    if ks:
        render_best_k(report)


def check_output(csv_out: str | None, plot: str | None) -> None:
    """A one-line usage error, before any model loads, when --csv's file or --plot's folder cannot be
    written (``specctl.files.unwritable``)."""
    from pathlib import Path

    from specctl.errors import UsageError
    from specctl.files import unwritable

    for flag, value, folder in (("--csv", csv_out, False), ("--plot", plot, True)):
        if not value:
            continue
        bad = unwritable(Path(value).expanduser(), folder=folder)
        if bad is not None:
            what = "a folder path you can write to (it is created if missing)" if folder else "a file path you can write to"
            raise UsageError(f"{flag} {value}: {bad}", f"choose {what}")


def _bench_concurrency(loaded, configs, workloads, num_prompts, params, levels, seed, adaptive, json_out, err,
                       max_num_batched_tokens, kernels, runs: int = 1, interleave: str = "steps") -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specctl.bench.concurrency import run_concurrency

    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=True, disable=not err.is_terminal) as prog:
        task = prog.add_task("loading", total=None)

        def progress(adv, desc, total=None):
            prog.update(task, advance=adv, description=desc, total=total)
            if not err.is_terminal and adv == 0 and total is None:  # a log: one line per measurement
                err.log(desc)

        header, rows = run_concurrency(loaded, configs, workloads, num_prompts, params, levels, seed,
                                       adaptive=adaptive, progress=progress,
                                       max_num_batched_tokens=max_num_batched_tokens, runs=runs,
                                       interleave=interleave)
    header["kernels"] = kernels
    if json_out:
        typer.echo(json.dumps({"header": header, "results": rows}, indent=2))
        return
    render_concurrency(header, rows)


def render_concurrency(h: dict, rows: list[dict]) -> None:
    from rich.table import Table

    def ms(x):
        return "—" if x is None else f"{x * 1e3:.0f}"

    t = Table(title=_title(h), title_justify="left",
              caption="tok/s: all requests' tokens over the wall time; speedup: over plain at the same N; "
                      "x plain@1: over plain with one request at a time; roof: N one-row forwards over one N-row "
                      "forward, measured in this run (the most x plain@1 can reach); TTFT from queueing; ITL between a "
                      "request's token-bearing steps; = base: outputs equal to plain's; +mem: the method's tensors "
                      "beyond the target's (draft weights, draft KV caches).", caption_justify="left")
    for col in ("workload", "N", "method", "k", "tok/s", "speedup", "x plain@1", "roof", "mean batch", "TTFT p50 ms",
                "ITL p50 ms", "ITL p99 ms", "accept", "= base", "+mem MiB"):
        t.add_column(col, justify="left" if col in ("workload", "method") else "right", no_wrap=True)
    for r in rows:
        t.add_row(r["workload"], str(r["concurrency"]), r["method"], "—" if r["k"] is None else str(r["k"]),
                  f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x" if r["speedup"] else "—",
                  f"{r['scaling_vs_plain_1']:.2f}x" if r["scaling_vs_plain_1"] else "—",
                  f"{r['roof_vs_plain_1']:.2f}x" if r["method"] == "baseline" else "", f"{r['mean_batch']:.1f}",
                  ms(r["ttft_p50_s"]), ms(r["itl_p50_s"]), ms(r["itl_p99_s"]),
                  "—" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}",
                  "—" if r["identical_to_baseline"] is None else f"{r['identical_to_baseline']}/{r['requests']}",
                  _mib(r.get("extra_memory_mib")))
    _stdout().print(t)


def parse_k_list(text: str) -> list[int]:
    """'2,4,8' -> [2, 4, 8] (duplicates dropped, order kept); anything else is a usage error."""
    from specctl.errors import UsageError

    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ks = []
    if not ks or any(k < 1 for k in ks):
        raise UsageError(f"--sweep-k must be comma-separated integers >= 1, got '{text}'", "pass e.g. --sweep-k 2,4,8")
    return list(dict.fromkeys(ks))


def render_best_k(report) -> None:
    from rich.table import Table

    t = Table(title=f"best k (of {', '.join(map(str, report.header['sweep_k']))}) by decode tok/s",
              title_justify="left")
    for col in ("workload", "method", "best k", "tok/s", "speedup", "acc. len", "tok/s by k"):
        t.add_column(col, justify="left" if col in ("workload", "method", "tok/s by k") else "right", no_wrap=True)
    for method, cells in report.best_k().items():
        for w, c in cells.items():
            t.add_row(w, method, str(c["k"]), f"{c['tokens_per_s']:.2f}",
                      f"{c['speedup']:.2f}x" if c["speedup"] is not None else "—", f"{c['mean_acceptance_length']:.2f}",
                      " · ".join(f"{k}: {v:.1f}" for k, v in c["by_k"].items()))
    _stdout().print(t)


def render(report) -> None:
    from rich.table import Table

    from specctl.bench.labels import peer_engine

    out = _stdout()
    t = Table(title=_title(report.header), title_justify="left",
              caption="speedup: specctl methods over specctl's plain decoding; a peer's (hf:*, vllm:*, llama.cpp:*) "
                      "over its own plain. "
                      "with TTFT: the speedup over each request's whole time, prefill included (where a draft "
                      "model reads the prompt). "
                      "= base: outputs equal to specctl's plain output.", caption_justify="left")
    for col in ("workload", "method", "k", "tok/s", "speedup", "with TTFT", "accept", "acc. len", "per-position",
                "= base", "+mem MiB"):
        t.add_column(col, justify="left" if col in ("workload", "method", "per-position") else "right", no_wrap=True)
    for r in report.rows():
        if r.get("error"):
            t.add_row(r["workload"], r["method"], "—", "failed", "—", "—", "—", "—", r["error"][:60], "—", "—")
            continue
        base = r["method"] == "baseline"
        no_stats = base or peer_engine(r["method"]) is not None
        per_pos = " ".join(f"{x:.2f}" for x in r["acceptance_rate_per_pos"][:4])
        if len(r["acceptance_rate_per_pos"]) > 4:
            per_pos += " …"
        same = "—" if base else ("n/a (sampling)" if r["identical_to_baseline"] is None
                                 else f"{r['identical_to_baseline']}/{r['requests']}")
        if r["divergence_margins"]:
            same += f" (tie Δ≤{max(r['divergence_margins']):.2g})"
        tps = f"{r['tokens_per_s']:.2f}" if r["runs"] else "n/a"  # no token after the first: no decode time
        if r["runs"] > 1:
            tps += f" [{r['tokens_per_s_min']:.1f}–{r['tokens_per_s_max']:.1f}]"
        t.add_row(
            r["workload"], r["method"], "—" if no_stats and not r["k"] else str(r["k"]), tps,
            "n/a" if not r["runs"] else f"{r['speedup']:.2f}x" if r["speedup"] is not None else "—",
            f"{r['request_speedup']:.2f}x" if r.get("request_speedup") is not None else "—",
            "—" if no_stats else f"{r['acceptance_rate']:.2f}", "—" if no_stats else f"{r['mean_acceptance_length']:.2f}",
            "—" if no_stats else per_pos, same, _mib(r.get("extra_memory_mib")),
        )
        for name, s in (r.get("by_proposer") or {}).items():  # a hybrid's parts: who drafted, how well
            share = s["num_drafts"] / r["num_drafts"] if r.get("num_drafts") else 0.0
            pp = " ".join(f"{x:.2f}" for x in s["acceptance_rate_per_pos"][:4])
            t.add_row("", f"  ↳ {name}", "", f"{share:.0%} of drafts", "", "", f"{s['acceptance_rate']:.2f}",
                      f"{s['mean_acceptance_length']:.2f}", pp, "", "")
    out.print(t)


def _title(h: dict) -> str:
    """The table's title: model, dtype, device, machine and its CPU kernel path, run settings."""
    quant = " · GGUF quantized" if h.get("quantization", "none") != "none" else ""
    return (f"{h['model']} · {h['dtype']}{quant} · {h['device']} ({h['machine']}, {h['threads']} threads, kernels "
            f"{h.get('cpu_kernels') or 'torch'}) · torch {h['torch']} · {h['max_new_tokens']} new tokens · "
            f"temperature {h['temperature']} · draft length {h.get('draft_length', 'fixed k')}")


def _mib(x) -> str:
    """A method's extra memory in MiB ("—" where none is measured: the baseline, peers)."""
    if not x:
        return "—"
    return f"{x:.2f}" if x < 10 else f"{x:.0f}"


def _stdout():
    """The results console: piped into a file (no terminal, no COLUMNS), wide enough that no column is cut."""
    import os

    from rich.console import Console

    out = Console()
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(width=240)
    return out


def register(app: typer.Typer) -> None:
    app.command("bench", help=HELP)(bench)
