"""Draft networks and their files, one kind at a time: the network, the on-disk layouts it reads and
writes (vLLM's and SGLang's, and the originals), and how a folder of that kind is recognised and
checked against a target (``specctl recommend`` runs these).

- ``medusa``: Medusa heads and their files (vLLM's layout; FasterDecoding's).
- ``eagle`` / ``eagle_files``: the EAGLE-1 / EAGLE-3 draft layer and its fused bf16 CPU form / its
  files (vLLM's and SGLang's layouts).
- ``mtp`` / ``mtp_files``: multi-token-prediction modules and their ragged batched step / their files
  (MiMo's, DeepSeek-V3's and Qwen3-Next's layouts; MTP layers found in a target).
- ``vocab_map`` / ``draft_vocab``: a draft's tokenizer mapped onto the target's (the map file) /
  EAGLE-3's reduced draft vocabulary (d2t, t2d).
- ``formats``: what the detectors and checks share.

Both the runtime's proposers (``specctl.runtime.proposers``) and the trainers (``specctl.training``)
import from here; it builds on ``specctl.modeling`` and imports nothing above it. What it does not
know: drafting, verification, training, the CLI.
"""
