"""Load on a running OpenAI-compatible server: N concurrent streaming clients, as its users send it.

    specctl serve --model qwen2.5-coder-0.5b --method ngram --port 8000 &
    python benchmarks/serve_load.py --url http://127.0.0.1:8000/v1 --model qwen2.5-coder-0.5b -c 1 -c 8 -c 16

Each level sends ``--requests`` chat requests (default 2 per client: MT-Bench first turns from the
bench's chat workload; ``--workload code-edit`` sends its ~300-700-token prompts whose answers copy them,
the prompt-heavy load) through the ``openai`` client, ``--clients`` of them in flight at once,
streaming ``--max-tokens`` tokens each (greedy, ignore_eos where the server takes it). Each level
sends prompts no earlier level sent (while the workload has that many), so that no server answers
them from a prefix cache. Prints, per
level: total completion tokens over the wall time (aggregate tok/s), time to first token and
inter-token latency (p50, p99), and failures. Works against any OpenAI-compatible server
(``vllm serve`` too), so the same prompts measure both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np


def workload_messages(workload: str, n: int) -> list[list[dict]]:
    """The first ``n`` requests of one of bench's workloads, as the chat messages a client sends."""
    from specctl.workloads import load_workload

    return [[dict(m) for m in r.messages] for r in load_workload(workload, n, 0)]


async def one(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    stamps, n = [], 0
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return {"ttft": stamps[0] - t0 if stamps else None, "gaps": list(np.diff(stamps)), "tokens": n}


async def level(url: str, api_key: str, model: str, prompts: list[list[dict]], clients: int, requests: int,
                max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=3600)
    queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(prompts[i % len(prompts)])
    results, failures = [], []

    async def worker():
        while not queue.empty():
            p = queue.get_nowait()
            try:
                results.append(await one(client, model, p, max_tokens))
            except Exception as e:  # noqa: BLE001 - counted and reported
                failures.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in results)
    pct = (lambda xs, q: float(np.percentile(xs, q)) if xs else None)
    return {"clients": clients, "requests": len(results), "failures": len(failures), "tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99), "first_failure": failures[0] if failures else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("-c", "--clients", type=int, action="append", help="concurrent clients (repeatable)")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default: 2 per client)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workload", default="chat", help="bench's workload whose prompts are sent (chat, code-edit, ...)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    levels = a.clients or [1, 8]
    counts = [a.requests or 2 * c for c in levels]
    # every level its own prompts, none sent before: a server's prefix cache (vLLM's is on by default)
    # would otherwise answer an earlier level's prompts from its cache
    prompts = workload_messages(a.workload, sum(counts))
    rows, sent = [], 0
    for c, n in zip(levels, counts):
        mine = prompts[sent:sent + n] or prompts  # a workload with fewer prompts than asked for repeats them
        sent += n
        r = asyncio.run(level(a.url, a.api_key, a.model, mine, c, n, a.max_tokens))
        rows.append(r)
        if not a.json:
            ms = (lambda x: "—" if x is None else f"{x * 1e3:.0f}")
            print(f"{c:3d} clients: {r['tokens_per_s']:7.1f} tok/s in total, TTFT p50 {ms(r['ttft_p50_s'])} ms "
                  f"p99 {ms(r['ttft_p99_s'])} ms, ITL p50 {ms(r['itl_p50_s'])} ms p99 {ms(r['itl_p99_s'])} ms, "
                  f"{r['requests']} requests, {r['failures']} failed", flush=True)
    if a.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
