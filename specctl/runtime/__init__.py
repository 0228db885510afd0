"""The shared speculative runtime: every draft method through one lossless loop, on CPU or GPU.

- ``runner``: ``TargetRunner`` over the target network (``specctl.modeling``): prefill, verify a chain
  or a tree, ragged batched forwards, rollback (setting a length); ``quant``: GGUF weights run as they are.
- ``proposers``: one ``<Method>Proposer`` per draft method behind the ``Proposer`` interface.
- ``rejection``: greedy verification and rejection sampling (accepted / recovered / bonus tokens).
- ``decoder``: the propose -> verify -> rollback loop for one request or a batch; ``controller``:
  the draft length from measured acceptance and cost; ``metrics``: SpecStats (vLLM's names).
- ``scheduler`` / ``engine``: continuous batching with chunked prefill over a pool of KV caches;
  ``server`` / ``openai_api``: the OpenAI-compatible HTTP server over the engine.

What it does not know: the networks (``specctl.modeling``, ``specctl.drafts``) and their files,
training, benchmarks, the CLI.
"""
