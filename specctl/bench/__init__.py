"""Measuring speculative decoding on real workloads: ``specctl bench``.

- the prompts come from ``specctl.workloads`` (built-in workloads from real data on the machine or
  in wheels, or a user's .jsonl), one layer below, which the trainers read too.
- ``suite``: the measuring loop, each method against a no-speculation baseline in the same run
  (speedup, acceptance, per-position rates, identical-to-baseline checks); ``concurrency``: the same
  under N concurrent requests through the batching engine; ``memory``: what each method holds.
- ``peers`` / ``peer_worker``: other engines (transformers, vLLM, llama.cpp) on the same prompts,
  each in its own process and environment; ``report``: tables, JSON and CSV.

What it does not know: how a method drafts or verifies (``specctl.runtime``), the CLI. Importing
it stays cheap (no torch).
"""
