"""The cost model: what a draft is predicted to gain, from acceptance α and cost ratio ρ.

A draft of k tokens with acceptance α and cost ratio ρ (one draft step / one target step) gives
    S(α, ρ, k) = (1 − α^(k+1)) / ((1 − α)(1 + kρ))  tokens per target-step time
(the seed's formula). Without probing, ρ is estimated from parameter counts plus a fixed per-layer
overhead (small models are overhead-bound; see ``LAYER_OVERHEAD_PARAMS``), and α is a workload
prior (``WORKLOADS``, labelled as such); ngram's prediction (``ngram_prediction``) takes ρ = 0 and the
workload's ``ngram_alpha``, fitted to bench's ngram runs. ``estimate_alpha`` is α by maximum likelihood over the
(drafted, accepted) steps the probe measures.

sparse_attn is judged apart, by the roofline model of one step (``specctl/roofline.py``) from the
target's shapes, the context and the batch: ``sparse_attn_choice`` (bytes only, or a measured
machine) and ``sparse_roofline`` (the probe's prediction on this machine at the asked context).

What it does not know: how folders are read or drafts checked, the order of the flowchart; it runs
nothing but ``sparse_roofline``'s measurement of the machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from specctl.drafts.formats import text_config
from specctl.errors import UsageError
from specctl.recommend.choices import Choice, Node, make_choice

LAYER_OVERHEAD_PARAMS = 5e6
"""A decode step costs ~ (parameters read + this many per layer): fitted on this CPU from MODELS.md
(bf16 tok/s of SmolLM2-135M, 30 layers, and Qwen2.5-Coder-1.5B, 28 layers). It keeps a thin, deep
model from being judged by its parameters alone."""
MIN_GAIN = 1.1  # a model draft must be predicted to beat this, else the walk falls through to layer 1
K_MAX = 16  # largest k the speedup formula is maximised over
CROSS_TOKENIZER_PENALTY = 0.1  # prior α of a draft with another tokenizer, below a same-tokenizer one
PATTERN_ALPHA_WHEN_MATCHED = 0.7
"""Prior acceptance of an n-gram/suffix draft on the steps where it finds a match, on a workload
whose output copies the prompt or repeats earlier responses (measured on code editing here: 0.8 to
0.85 for ngram on Qwen2.5-Coder; a prior, --probe measures it)."""


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    copies_prompt: bool  # the output repeats spans of the prompt: ngram's case
    repeats: bool  # requests repeat across calls: suffix's case (its cache of earlier responses)
    alpha_prior: float  # assumed acceptance of a same-tokenizer draft model (a prior, not a measurement)
    prompts: str | None  # built-in bench workload --probe uses (None: chat, with a note)
    context: int = 1024  # typical tokens in the KV cache while decoding (prompt + output)
    ngram_alpha: float | None = None
    """Prior acceptance of ngram per draft token over every decode step (unmatched steps included), where
    bench measured ngram on this kind of prompt: fitted so that S(α, 0, 10) is ngram's measured speedup
    (README, Qwen2.5-Coder-1.5B/0.5B bf16): code-edit 2.77-3.40x -> 0.65 (x2.83); humaneval 6.05-6.95x ->
    0.88 (x6.29); math 1.32-1.36x -> 0.25 (x1.33); summarize 0.99-1.19x -> 0.1; chat, mt-bench
    0.97-1.09x -> 0.05. None: not measured (the walk then does not weigh ngram against a draft model)."""


# Every built-in bench workload (specctl.workloads.WORKLOADS) is a recommend workload too, under the
# same name (a test checks it), beside recommend's own kinds of use (code, rag, translation, ...).
WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("chat", "open-ended conversation", False, False, 0.6, "chat", ngram_alpha=0.05),
    Workload("mt-bench", "multi-turn conversation (MT-Bench, both turns)", False, False, 0.6, "mt-bench",
             ngram_alpha=0.05),
    Workload("sharegpt", "real users' chat (ShareGPT first turns)", False, False, 0.6, "sharegpt", ngram_alpha=0.05),
    Workload("code", "code generation and editing", True, False, 0.8, "code-edit", ngram_alpha=0.65),
    Workload("code-edit", "edits that mostly copy the given code", True, False, 0.8, "code-edit", ngram_alpha=0.65),
    Workload("humaneval", "code completion of a given signature and docstring (HumanEval)", True, False, 0.8,
             "humaneval", ngram_alpha=0.88),
    Workload("agentic", "agent loops and tool calls over a fixed template", True, True, 0.75, "agentic@2"),
    Workload("batch", "fixed-template batch jobs", False, True, 0.7, "agentic@2"),
    Workload("rag", "answers grounded in retrieved passages", True, False, 0.7, "summarize", ngram_alpha=0.1),
    Workload("summarization", "summaries of a given text", True, False, 0.7, "summarize", ngram_alpha=0.1),
    Workload("summarize", "summaries of a given text, answers from a given file", True, False, 0.7, "summarize",
             ngram_alpha=0.1),
    Workload("translation", "translation", False, False, 0.75, None),
    Workload("math", "reasoning and math", False, False, 0.65, "math", 2048, ngram_alpha=0.25),
    Workload("long-context", "questions over long documents (4k-32k tokens)", True, False, 0.7, "long-4k", 16384),
    Workload("doc-qa", "questions over a 1k-4k token document, answers quoting it", True, False, 0.7, "doc-qa", 4096),
    Workload("long-4k", "questions over about 4k tokens of documents", True, False, 0.7, "long-4k", 4096),
    Workload("long-16k", "questions over about 16k tokens of documents", True, False, 0.7, "long-16k", 16384),
    Workload("long-32k", "questions over about 32k tokens of documents", True, False, 0.7, "long-32k", 32768),
)}

# sparse_attn's prior acceptance per draft token on long contexts (Qwen2.5-Coder-0.5B, long-4k, Vegas
# at k = 4: 0.7-1.0 per position, measured here; a prior, --probe measures it) and elsewhere
SPARSE_ALPHA = {True: 0.8, False: 0.6}


def get_workload(name: str) -> Workload:
    w = WORKLOADS.get(name.strip().lower())
    if w is None:
        raise UsageError(f"unknown workload '{name}'", f"use one of: {', '.join(WORKLOADS)}")
    return w


def ngram_prediction(w: Workload, k: int) -> float | None:
    """ngram's predicted speedup on workload ``w`` at its draft length ``k``: S(α, 0, k) with the
    workload's ``ngram_alpha`` (ρ = 0: a lookup in the prompt costs no model step); None where unknown."""
    return None if w.ngram_alpha is None else predicted_speedup(w.ngram_alpha, 0.0, k)


def predicted_speedup(alpha: float, rho: float, k: int) -> float:
    """S = (1 − α^(k+1)) / ((1 − α)(1 + kρ)); at α = 1 the limit (k + 1) / (1 + kρ)."""
    tokens = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tokens / (1.0 + k * rho)


def best_k(alpha: float, rho: float, k_max: int = K_MAX) -> tuple[int, float]:
    """(k, S) maximising the predicted speedup over k = 1..k_max."""
    return max(((k, predicted_speedup(alpha, rho, k)) for k in range(1, k_max + 1)), key=lambda t: t[1])


def estimate_rho(draft_cost: float, draft_layers: int | None, target_cost: float, target_layers: int | None) -> float:
    """ρ from parameter counts (+ a per-layer overhead when both layer counts are known)."""
    if draft_layers and target_layers:
        return (draft_cost + LAYER_OVERHEAD_PARAMS * draft_layers) / (target_cost + LAYER_OVERHEAD_PARAMS * target_layers)
    return draft_cost / target_cost


def estimate_alpha(steps: list[tuple[int, int]]) -> float | None:
    """α by maximum likelihood from (drafted, accepted) per step: each draft token is accepted with
    probability α until the first rejection, so α̂ = accepted / (accepted + steps that saw a rejection).
    E.g. [(4, 4), (4, 1)]: 5 accepted, 1 rejection -> 5/6."""
    acc = sum(a for n, a in steps if n > 0)
    rej = sum(1 for n, a in steps if n > 0 and a < n)
    return acc / (acc + rej) if acc + rej else None


def sparse_attn_choice(target, w: Workload, tree: Node, choice: Choice, context: int | None,
                       batch: int, machine=None) -> tuple[Choice | None, bool]:
    """sparse_attn, judged by the roofline model (specctl/roofline.py) from the target's shapes, the
    context and the batch: it pays when the KV cache read per step is a large share of the weights
    read. ``machine``: the measured one (--probe), else bytes alone (an upper bound: compute is free).
    Returns (the choice, or None where it does not pay; whether it replaces a layer-1 ``choice``)."""
    from specctl.roofline import Machine, Shapes, sparse_attn_estimate

    cfg = text_config(target.config) if target.config else {}
    weights = ""
    try:
        shapes = Shapes.from_config(cfg)
        if target.quantization == "gguf" and target.cost_bytes:  # the GGUF's blocks, not 2 bytes a weight
            shapes = replace(shapes, bytes_per_param=target.cost_bytes / shapes.params_read)
            weights = f" at the GGUF's {8 * shapes.bytes_per_param:.1f} bits a weight"
    except KeyError:
        tree.add(Node("note", "sparse_attn not judged", reason="the target's config.json is not at hand (pull it)"))
        return None, False
    context = context or w.context
    alpha, k = SPARSE_ALPHA[w.copies_prompt and context >= 4096], 4
    tau = (1 - alpha ** (k + 1)) / (1 - alpha)
    m = machine or Machine(1.0, float("inf"), float("inf"), "bytes only")
    est = sparse_attn_estimate(shapes, m, context=context, batch=batch, k=k, tau=tau, algorithm="vegas")
    bound = "" if machine is not None else " (bytes only: an upper bound; --probe measures this machine)"
    reason = (f"at {context} tokens of context and batch {batch}, the KV cache read per step is "
              f"{100 * est.kv_share:.0f}% of the weights read{weights} ({shapes.kv_heads} KV heads of {shapes.head_dim}, "
              f"{shapes.layers} layers); drafting over {est.draft_positions} positions with the target's own layers "
              f"at k={k}, prior α={alpha}: predicted x{est.speedup:.2f}{bound}")
    pays = est.speedup >= MIN_GAIN
    q = tree.add(Node("question", "Is the KV cache a large share of each step's reads (sparse-attention self-speculation)?",
                      "yes" if pays else "no", reason))
    if not pays:
        return None, False
    c = make_choice("sparse_attn", target, "sparse_attn (vegas: the target drafts over the positions it attended to most)",
                    reason, k=k, extra={"sparse_attn_algorithm": "vegas"})
    long = w.prompts if (w.prompts or "").startswith("long-") else "long-4k"  # bench's long-context prompts
    c.commands["specctl_bench"] += f" -w {long} --reuse-prefill"
    c.note = "vLLM RFC #47351's keys: mainline vLLM has no sparse_attn yet (the platformxlab/vegas fork does)"
    replace_choice = choice.layer == 1 and choice.method in ("ngram", "suffix")
    if replace_choice:
        q.add(Node("choice", c.label, reason="no trained draft here, and self-speculation over the long context pays"))
    return c, replace_choice


def sparse_roofline(context: int, batch: int, loaded, c, tau: float) -> dict:
    """sparse_attn's predicted speedup at ``context`` and ``batch`` on this machine: the roofline model
    with the bandwidth and compute measured on the loaded target at that context, and the acceptance
    length ``tau`` the probe measured; ``c`` is the SpecConfig probed."""
    from specctl.roofline import Shapes, sparse_attn_estimate
    from specctl.runtime.machine import measure_machine

    a = loaded.model.args
    shapes = Shapes.of(loaded.model)
    m = measure_machine(loaded.model, context=context, repeats=3)
    skip = c.sparse_attn_skip_layers if isinstance(c.sparse_attn_skip_layers, list) else []
    est = sparse_attn_estimate(shapes, m, context=context, batch=batch, k=c.num_speculative_tokens, tau=tau,
                               ratio=c.sparse_attn_ratio, min_tokens=c.sparse_attn_min_tokens,
                               layer_share=1 - len(skip) / a.num_layers, algorithm=c.sparse_attn_algorithm)
    return {"context": context, "batch": batch, "predicted_speedup": est.speedup, "kv_share": est.kv_share,
            "draft_positions": est.draft_positions, "machine": m.to_dict()}
