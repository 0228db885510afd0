"""The shared speculative runtime: every draft method through one lossless loop, on CPU or GPU.

- ``model`` / ``runner``: the target network, its KV cache (rollback is setting a length) and
  ``TargetRunner`` (prefill, verify a chain or a tree, ragged batched forwards).
- ``proposers``: one ``<Method>Proposer`` per draft method behind the ``Proposer`` interface.
- ``rejection``: greedy verification and rejection sampling (accepted / recovered / bonus tokens).
- ``decoder``: the propose -> verify -> rollback loop for one request or a batch; ``controller``:
  the draft length from measured acceptance and cost; ``metrics``: SpecStats (vLLM's names).
- ``scheduler`` / ``engine``: continuous batching with chunked prefill over a pool of KV caches;
  ``server`` / ``openai_api``: the OpenAI-compatible HTTP server over the engine.
- ``vocab_map``: token mappings between a draft's and a target's tokenizers.

What it does not know: draft networks' files (``specctl.drafts``), training, benchmarks, the CLI.
"""
