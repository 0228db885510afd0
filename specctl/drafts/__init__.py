"""Draft networks and their files: one module per kind, each with the network and the on-disk layouts
it reads and writes (vLLM's and SGLang's, and the originals).

- ``medusa``: Medusa heads (vLLM's layout; FasterDecoding's).
- ``eagle``: the EAGLE-1 / EAGLE-3 draft layer, its fused bf16 CPU form, vLLM's/SGLang's layouts.
- ``mtp``: multi-token-prediction modules (DeepSeek-V3's, MiMo's and Qwen3-Next's layouts).

Both the runtime's proposers (``specctl.runtime.proposers``) and the trainers (``specctl.training``)
import from here; nothing here imports them. What it does not know: drafting, verification,
training, the CLI.
"""
