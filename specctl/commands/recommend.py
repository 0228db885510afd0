"""`specctl recommend MODEL`: the layered selection flowchart, walked with evidence, and ready configs.

Thin: parse, call ``specctl.recommend`` (inspection, the walk, the probe), render. The tree and the
configs go to stdout (``--json`` for machines); progress of ``--probe`` goes to stderr.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from specctl.commands._options import DeviceOpt, DtypeOpt, JsonOpt, KernelsOpt, SeedOpt, use_kernels, use_quantization

HELP = """Recommend a speculative decoding method for MODEL, walking the seed's layered flowchart.

The layers, by adoption cost: 1 ngram/suffix (no model), 2 Medusa/EAGLE (a small add-on trained for the target), 3 draft_model (a whole smaller model), 4 MTP (trained in). The walk: own training -> MTP; built-in MTP layers -> mtp; a Medusa/EAGLE draft made for this target (--drafts, or folders beside the model; checked for hidden size, vocabulary and recorded base model) -> use it; a smaller model with the same tokenizer (--candidates, or the offline catalogue) whose cost ratio ρ leaves a gain -> draft_model; otherwise suffix where requests repeat, else ngram. Beside the walk, sparse_attn (the target drafts for itself over part of its KV cache, vLLM RFC #47351) is judged by a roofline model of one step from the model's shapes, --context-len and --batch: it pays when the KV cache read per step is a large share of the weights read, and replaces ngram/suffix when it does.

Prints the path as a tree with the reason at each step, then ready configs: specctl flags and vLLM's --speculative-config JSON. Says when a recommended method is not runnable in this installation yet.

--probe runs every applicable, implemented method briefly (a --prompts .jsonl file, or the workload's built-in prompts) against plain decoding, measures acceptance α and cost ratio ρ, predicts the speedup (1-α^(k+1)) / ((1-α)(1+kρ)) at the best k, measures the real speedup, and ranks the methods by it. With --quantization gguf it runs the target's GGUF quantized as stored (a .gguf MODEL, or a catalogue model's kept GGUF; nothing is converted), and the printed commands carry --quantization gguf.

Examples:

  specctl recommend qwen2.5-coder-1.5b --workload code

  specctl recommend ./my-model --drafts ./my-model-eagle3 --json

  specctl recommend smollm2-135m --probe -n 2 --max-new-tokens 32

  specctl recommend qwen2.5-coder-0.5b --workload long-context --context-len 32768 --batch 8
"""


def recommend_cmd(
    model: Annotated[str, typer.Argument(help="Target: a local HF folder, a .gguf file, or a catalogue name.")],
    drafts: Annotated[Optional[list[str]], typer.Option("--drafts", "-d", help="A Medusa/EAGLE draft folder, or a folder of them (repeatable). Folders beside MODEL are searched too.")] = None,
    candidates: Annotated[Optional[list[str]], typer.Option("--candidates", "-c", help="A smaller model to consider for draft_model (repeatable). Default: the offline catalogue.")] = None,
    own_training: Annotated[bool, typer.Option("--own-training", help="You train this model yourself (MTP can be trained in).")] = False,
    workload: Annotated[str, typer.Option("--workload", "-w", help="chat, mt-bench, sharegpt, code, code-edit, humaneval, agentic, batch, rag, summarization, summarize, doc-qa, translation, math, long-context, long-4k, long-16k, long-32k (every built-in workload of bench, and kinds of use).")] = "chat",
    context_len: Annotated[Optional[int], typer.Option("--context-len", help="Tokens in the KV cache while decoding (default: the workload's typical: 1024, 2048 for math, 16384 for long-context, 4096/16384/32768 for long-4k/16k/32k); judges sparse_attn.")] = None,
    batch: Annotated[int, typer.Option("--batch", help="Requests decoding together (judges sparse_attn: the KV read grows with it).")] = 1,
    probe: Annotated[bool, typer.Option("--probe", help="Run each applicable, implemented method briefly and rank them by measured speedup.")] = False,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="--probe: a .jsonl file of prompts ({\"prompt\": ...} or {\"messages\": [...]}) instead of the built-in workload.")] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", "-n", help="--probe: prompts to run.")] = 2,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="--probe: tokens generated per prompt.")] = 32,
    num_speculative_tokens: Annotated[Optional[int], typer.Option("--num-speculative-tokens", "-k", help="--probe: k for every method (default: each method's own).")] = None,
    fixed_k: Annotated[bool, typer.Option("--fixed-k", help="--probe: always draft k tokens (default: adaptive, as bench).")] = False,
    seed: SeedOpt = 0,
    dtype: DtypeOpt = "bfloat16",
    device: DeviceOpt = "cpu",
    kernels: KernelsOpt = "auto",
    quantization: Annotated[str, typer.Option(
        "--quantization", metavar="[none|gguf]",
        help="--probe only (the recommendation itself reads the model's shape, not its weights): the weights the "
        "probe runs, as vLLM's flag: none (dense; a .gguf MODEL is converted once to dense), or gguf (a .gguf MODEL, "
        "or a catalogue name's kept GGUF, run quantized as stored, on the CPU, with nothing converted); the printed "
        "commands then carry --quantization gguf.")] = "none",
    json_out: JsonOpt = False,
) -> None:
    from specctl.errors import UsageError
    from specctl.recommend import get_workload

    get_workload(workload)  # fail fast, before reading any model
    quant = use_quantization(quantization)
    if probe:
        use_kernels(kernels)
        if num_prompts <= 0:
            raise UsageError(f"--num-prompts must be positive, got {num_prompts}", "pass e.g. -n 2")
        if max_new_tokens <= 0:
            raise UsageError(f"--max-new-tokens must be positive, got {max_new_tokens}", "pass e.g. --max-new-tokens 32")
        if num_speculative_tokens is not None and num_speculative_tokens <= 0:
            raise UsageError(f"-k must be positive, got {num_speculative_tokens}", "pass e.g. -k 4")
    elif prompts is not None:
        raise UsageError("--prompts only applies with --probe", "add --probe")
    elif quant is not None:
        raise UsageError("--quantization only applies with --probe (the recommendation reads the model's shape)",
                         "add --probe")

    from rich.console import Console

    err = Console(stderr=True, log_path=False)
    from specctl import recommend as r

    if context_len is not None and context_len < 1:
        raise UsageError(f"--context-len must be positive, got {context_len}", "pass e.g. --context-len 16384")
    if batch < 1:
        raise UsageError(f"--batch must be positive, got {batch}", "pass e.g. --batch 8")
    rec = r.recommend(model, drafts=drafts, candidates=candidates, own_training=own_training, workload=workload,
                      pull=probe, dtype=dtype, context=context_len, batch=batch, quantization=quant)
    if probe:
        if prompts is not None:
            from specctl.workloads import load_workload

            load_workload(str(prompts), 1, seed)  # a bad prompts file fails before the model loads
        say = (lambda m: err.log(m)) if not json_out or err.is_terminal else (lambda m: err.print(m, highlight=False))
        result = r.probe(rec, prompts=str(prompts) if prompts else None, num_prompts=num_prompts,
                         max_new_tokens=max_new_tokens, k=num_speculative_tokens, adaptive=not fixed_k, dtype=dtype,
                         device=device, seed=seed, progress=say, quantization=quant)
        r.apply_probe(rec, result)
    if json_out:
        typer.echo(json.dumps(rec.to_dict(), indent=2))
        return
    render(rec)


LAYER_NAMES = {1: "no model", 2: "light add-on", 3: "independent model", 4: "trained in"}
_MARK = {True: "[green]✓[/]", False: "[red]✗[/]", None: "[yellow]~[/]"}


def _tree_label(node) -> str:
    from rich.markup import escape

    if node.kind == "question":
        ans = node.answer or ""
        color = "green" if ans == "yes" else "yellow" if ans == "no" else "cyan"
        text = f"[bold]{escape(node.text)}[/] → [{color}]{escape(ans)}[/]"
    elif node.kind == "choice":
        text = f"[bold magenta]► {escape(node.text)}[/]"
    elif node.kind == "evidence":
        text = f"{_MARK[node.ok]} {escape(node.text)}"
    else:
        text = f"[dim]{escape(node.text)}[/]" if node.text else ""
    if node.reason:
        text += f"  [dim]{escape(node.reason)}[/]"
    return text


def _add(tree, node) -> None:
    for child in node.children:
        if not child.text and child.kind == "note":
            continue
        _add(tree.add(_tree_label(child)), child)


def render(rec) -> None:
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.tree import Tree

    out = Console()
    tree = Tree(f"[bold]{escape(rec.tree.text)}[/]  [dim]{escape(rec.tree.reason)}[/]")
    _add(tree, rec.tree)
    out.print(tree)
    for n in rec.notes:
        out.print(f"[dim]note: {escape(n)}[/]")
    out.print()
    for i, c in enumerate([rec.choice] + rec.alternatives):
        head = "Recommended" if i == 0 else "Alternative"
        out.print(f"[bold]{head}:[/] {escape(c.label)} [dim](layer {c.layer}: {LAYER_NAMES[c.layer]})[/]")
        if c.reason and i:
            out.print(f"  [dim]{escape(c.reason)}[/]")
        if not c.runnable or c.note:
            out.print(f"  [yellow]{escape(c.note or 'not runnable in this installation')}[/]")
        out.print(f"  specctl: {escape(c.commands['specctl_serve'])}", soft_wrap=True)
        if c.commands.get("vllm"):
            out.print(f"  vLLM:    {escape(c.commands['vllm'])}", soft_wrap=True)
        else:
            out.print(f"  vLLM:    none: {escape(c.vllm_unsupported or 'vLLM cannot run this choice')}", soft_wrap=True)
    if rec.probe:
        p = rec.probe
        out.print()
        out.print(f"[bold]--probe[/]: {p['num_prompts']} prompt(s) of {escape(p['prompts'])}, {p['max_new_tokens']} new tokens, "
                  f"{escape(_weights(p))} on {p['device']} ({p['threads']} threads), draft length {p['draft_length']}; "
                  f"baseline {p['baseline_tokens_per_s']:.2f} tok/s. predicted = (1-α^(k+1))/((1-α)(1+kρ)) at its best k; "
                  "verify = one verify forward / one decode step (the formula takes 1).")
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("#", "method", "k", "α", "ρ", "predicted", "best k", "measured", "tok/s", "acc. len", "verify", "= base"):
            t.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)

        def f(x, d=2):
            return "—" if x is None else f"{x:.{d}f}"

        for r in p["methods"]:
            t.add_row(str(r["rank"]), escape(r["label"]), str(r["k"]), f(r["alpha"]), f(r["rho"], 3),
                      "—" if r["predicted_speedup"] is None else f"x{r['predicted_speedup']:.2f}",
                      str(r["predicted_k"] or "—"),
                      "—" if r["measured_speedup"] is None else f"x{r['measured_speedup']:.2f}",
                      f(r["tokens_per_s"]), f(r["mean_acceptance_length"]), f(r["verify_cost"]),
                      f"{r['identical_to_baseline']}/{r['requests']}")
        wide = out if out.is_terminal else Console(width=max(out.width, 120))  # piped: keep every column whole
        wide.print(t)
        for s in p["skipped"]:
            out.print(f"[dim]not probed: {escape(s['label'])}: {escape(s['reason'])}[/]")
        if p.get("note"):
            out.print(f"[dim]note: {escape(p['note'])}[/]")


def _weights(p: dict) -> str:
    """What ran, as bench's header names it: 'GGUF quantized (FILE), kernels gguf-amx_int8, bfloat16
    activations' or 'bfloat16, kernels amx'."""
    kernels = p.get("kernels") or "torch"
    if p.get("quantization", "none") != "none":
        where = f" ({Path(p['model_path']).name})" if p.get("model_path") else ""
        return f"GGUF quantized{where}, kernels {kernels}, {p['dtype']} activations"
    return f"{p['dtype']}, kernels {kernels}"


def register(app: typer.Typer) -> None:
    app.command("recommend", help=HELP)(recommend_cmd)
