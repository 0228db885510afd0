"""A peer engine (vLLM, llama.cpp) in a process of its own, driven by ``specctl bench --peer``.

Run as a script by the interpreter that has the engine installed (``python peer_worker.py SPEC``),
so it imports nothing from specctl: vLLM pins its own transformers, and may live in another venv.

SPEC (JSON, argv[1]): {"engine": "vllm" | "llama.cpp", "model": path (an HF folder for vLLM, or a .gguf
that vLLM loads with quantization "gguf"; a .gguf for llama.cpp), "dtype": "bfloat16", "threads": 2,
"max_len": 4096}.

Then, one JSON object a line on stdin, one answer a line on stdout:

  {"mode": {"kind": "plain"}, ...}                                  plain greedy decoding
  {"mode": {"kind": "ngram", "k": 10}, ...}                         prompt lookup / n-gram drafts
  {"mode": {"kind": "draft", "k": 4, "draft": path}, ...}           a draft model (vLLM)
  ... "prompt_ids": [...], "max_new_tokens": 128, "stop_token_ids": [...]
  -> {"tokens": [...], "prefill_s": t, "decode_s": t, "spec": {...}}  or  {"error": "..."}

"spec" (vLLM, speculative modes): what vLLM's own spec-decode counters (``LLM.get_metrics()``:
vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens, _num_accepted_tokens_per_pos)
counted over the full generation, under specctl's SpecStats names.

vLLM builds an engine per mode and keeps it while requests of that mode follow (send them grouped by
mode: two vLLM engines may not fit together). llama.cpp keeps an engine per mode for the whole run
(each maps the same GGUF file, so a second engine costs its context, not the weights): bench sends
its requests in step with specctl's own, prompt by prompt. Timing as for transformers' peer: decode
time = a full generation minus a one-token generation of the same prompt (prefill + first token),
measured just before; prefix caching is off, so the second prefill costs what the first did.

vLLM runs as its CPU users run it (docs/getting_started/installation/cpu.md): ``dtype`` given
explicitly (bfloat16 by default, as vLLM recommends on CPU), its default compilation (on CPU, vLLM
0.32 traces the model once and compiles it with inductor; ``enforce_eager`` is not what its docs
recommend, so it is not set here), its default block size, and the threads bound to the cores bench
gives it (``VLLM_CPU_OMP_THREADS_BIND``). Only ``disable_log_stats=False`` differs from ``LLM()``'s
defaults: it keeps the statistics that the acceptance counters come from.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time


class VLLMEngine:
    def __init__(self, spec: dict, mode: dict):
        from vllm import LLM

        # on the CPU backend gpu_memory_utilization is the share of host memory vLLM reserves (weights,
        # the activation peak of its profiling run, KV): a quarter holds a 1.5B target; with a draft
        # model beside it (its weights and its own profiling peak) that left no KV, so more
        share = spec.get("memory_fraction", 0.45 if mode["kind"] == "draft" else 0.25)
        kw = dict(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), max_model_len=spec.get("max_len", 4096),
                  enable_prefix_caching=False, seed=0, gpu_memory_utilization=share, disable_log_stats=False)
        if str(spec["model"]).lower().endswith(".gguf"):  # specctl runs it quantized: so does vLLM
            kw["quantization"] = "gguf"
        if mode["kind"] == "ngram":
            kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": mode["k"],
                                        "prompt_lookup_max": mode.get("prompt_lookup_max", 5),
                                        "prompt_lookup_min": mode.get("prompt_lookup_min", 2)}
        elif mode["kind"] == "draft":
            kw["speculative_config"] = {"method": "draft_model", "model": mode["draft"],
                                        "num_speculative_tokens": mode["k"]}
        self.llm = LLM(**kw)

    def generate(self, ids: list[int], max_new: int, stop: list[int]) -> list[int]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_new, stop_token_ids=stop or None)
        out = self.llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def spec_counters(self) -> dict:
        """vLLM's spec-decode counters now (summed over label sets), under SpecStats' names."""
        out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}
        for m in self.llm.get_metrics():
            key = m.name.removeprefix("vllm:spec_decode_")
            if key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                out[key] += int(m.value)
            elif key == "num_accepted_tokens_per_pos":
                acc, vals = out[key], [int(v) for v in m.values]
                out[key] = [(acc[i] if i < len(acc) else 0) + (vals[i] if i < len(vals) else 0)
                            for i in range(max(len(acc), len(vals)))]
        return out

    def close(self) -> None:
        del self.llm


def counted_between(before: dict, after: dict) -> dict:
    """What the counters counted from ``before`` to ``after`` (per position too)."""
    b = before["num_accepted_tokens_per_pos"]
    a = after["num_accepted_tokens_per_pos"]
    b = b + [0] * (len(a) - len(b))
    return {"num_drafts": after["num_drafts"] - before["num_drafts"],
            "num_draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
            "num_accepted_tokens": after["num_accepted_tokens"] - before["num_accepted_tokens"],
            "num_accepted_tokens_per_pos": [x - y for x, y in zip(a, b)]}


class LlamaCppEngine:
    keeps_modes = True  # the engines of every mode stay loaded side by side (one mapped file)

    def __init__(self, spec: dict, mode: dict):
        from llama_cpp import Llama

        kw = dict(model_path=spec["model"], n_ctx=spec.get("max_len", 4096), n_threads=spec.get("threads"),
                  n_batch=512, verbose=False, seed=0)
        if mode["kind"] == "ngram":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=mode["k"])
            kw["logits_all"] = True  # llama-cpp-python verifies drafts from every row's logits
        elif mode["kind"] != "plain":
            raise ValueError(f"llama.cpp peer: mode {mode['kind']} is not supported (plain, ngram)")
        self.llm = Llama(**kw)

    def generate(self, ids: list[int], max_new: int, stop: list[int]) -> list[int]:
        self.llm.reset()  # no reuse of the previous prompt's cache
        out = []
        stop = set(stop)
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in stop or len(out) >= max_new:
                break
        return out

    def close(self) -> None:
        self.llm.close() if hasattr(self.llm, "close") else None
        del self.llm


ENGINES = {"vllm": VLLMEngine, "llama.cpp": LlamaCppEngine}


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("threads"):
        n = int(spec["threads"])
        os.environ.setdefault("OMP_NUM_THREADS", str(n))
        # vLLM's CPU backend binds its OpenMP threads and by default keeps one core for itself; bench
        # gives it the same cores specctl decodes on
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}" if n > 1 else "0")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # The protocol owns the real stdout. Engines print, and so do their child processes and C code,
    # which write to file descriptor 1 whatever sys.stdout is: point fd 1 at stderr for all of them.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    cls = ENGINES[spec["engine"]]
    engines: dict[str, object] = {}  # mode (as JSON) -> its engine
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            mode = json.dumps(req["mode"], sort_keys=True)
            if mode not in engines and engines and not getattr(cls, "keeps_modes", False):
                for old in engines.values():
                    old.close()
                engines.clear()
                gc.collect()
            if mode not in engines:
                engines[mode] = cls(spec, req["mode"])
            engine = engines[mode]
            ids, n, stop = req["prompt_ids"], req["max_new_tokens"], req.get("stop_token_ids", [])
            counters = getattr(engine, "spec_counters", None) if req["mode"]["kind"] != "plain" else None
            t0 = time.perf_counter()
            engine.generate(ids, 1, stop)
            t1 = time.perf_counter()
            before = counters() if counters else None
            t2 = time.perf_counter()
            tokens = engine.generate(ids, n, stop)
            t3 = time.perf_counter()
            prefill = t1 - t0
            ans = {"tokens": tokens, "prefill_s": prefill, "decode_s": max(t3 - t2 - prefill, 1e-9)}
            if counters:
                ans["spec"] = counted_between(before, counters())
        except Exception as e:  # noqa: BLE001 - reported to the parent, which names the peer
            ans = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(ans) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
