"""Own no-speculation decoding vs transformers' `model.generate`, same model, prompt and dtype.

    python benchmarks/baseline_vs_hf.py [--model qwen2.5-coder-1.5b] [--dtype bfloat16] [--max-new-tokens 64]

Both run greedy on the same prompt (the first code-edit and chat prompts), alternating, best of
--runs; timing covers the whole generation (prefill + decode) for both, since generate() does not
report them apart. Prints tokens/s of each, the ratio (own / transformers), and whether the
outputs are identical.
"""

from __future__ import annotations

import specctl

specctl.process_defaults()  # OpenMP settings (GOMP_SPINCOUNT) before torch loads

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from specctl.workloads import load_workload, render_prompt
    from specctl.models import resolve_model
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.loading import load_model, parse_dtype
    from specctl.runtime.runner import TargetRunner

    path = resolve_model(a.model, dtype=a.dtype)
    own = load_model(path, dtype=a.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=parse_dtype(a.dtype)).eval()
    n = a.max_new_tokens
    print(f"{path.name} · {a.dtype} · {torch.get_num_threads()} threads · {n} new tokens (ignore EOS) · best of {a.runs}")
    ratios = []
    for wl in ("code-edit", "chat"):
        ids = render_prompt(own.tokenizer, load_workload(wl, 1)[0])
        dec = SpecDecoder(TargetRunner(own.model, max_len=len(ids) + n + 8))
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        x = torch.tensor([ids])
        dec.generate(ids, SamplingParams(max_new_tokens=4))  # warm-up
        hf.generate(x, max_new_tokens=4, do_sample=False)
        t_own, t_hf = float("inf"), float("inf")
        for _ in range(a.runs):
            t = time.perf_counter()
            res = dec.generate(ids, params)
            t_own = min(t_own, time.perf_counter() - t)
            t = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            t_hf = min(t_hf, time.perf_counter() - t)
        hf_tokens = out[0, len(ids):].tolist()
        same = hf_tokens == res.token_ids
        r = t_hf / t_own
        ratios.append(r)
        print(f"  {wl:10s} prompt {len(ids):4d} tok | specctl {n / t_own:6.2f} tok/s | transformers {n / t_hf:6.2f} tok/s"
              f" | ratio {r:.2f}x | identical {same}")
    print(f"specctl / transformers: min ratio {min(ratios):.2f}x ({'PASS' if min(ratios) >= 1.0 else 'FAIL'}: own baseline >= generate)")


if __name__ == "__main__":
    main()
