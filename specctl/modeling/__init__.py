"""The target network: the own transformer, its KV cache, and loading checkpoints into it.

- ``args``: ``ModelArgs`` (a model's shape from config.json), rotary frequencies, the row limits.
- ``transformer``: ``Transformer`` / ``Block`` (forward, ragged forward, the C++ kernels' fast paths).
- ``kv_cache``: ``KVCache`` (rollback is setting a length) and the attention weights Vegas ranks by.
- ``load``: ``load_transformer`` from an HF folder, ``--kernels`` (``set_kernels``).

Drafts (``specctl.drafts``) build on its blocks; the runtime (``specctl.runtime``) decodes with it.
What it does not know: sampling, speculation, tokenizers, requests. The names below are the
package's interface.
"""

from specctl.modeling.args import SDPA_ROWS, SUPPORTED_ARCHS, VERIFY_ROWS, ModelArgs, rope_inv_freq
from specctl.modeling.kv_cache import KVCache, scored_upto
from specctl.modeling.load import (KERNEL_MODES, enable_exact_bf16, fuse_blocks, fuse_hf_state_dict, load_transformer,
                                   read_config, set_kernels)
from specctl.modeling.transformer import (AmxLinear, Block, DenseLinear, RMSNorm, Segment, Transformer, adopt_kernels,
                                          attention_scores, pack_for_amx, rotate_half)

__all__ = ["SDPA_ROWS", "SUPPORTED_ARCHS", "VERIFY_ROWS", "ModelArgs", "rope_inv_freq", "KVCache", "attention_scores",
           "scored_upto", "KERNEL_MODES", "enable_exact_bf16", "fuse_blocks", "fuse_hf_state_dict", "load_transformer",
           "read_config", "set_kernels", "Block", "RMSNorm", "Segment", "Transformer", "AmxLinear", "DenseLinear",
           "adopt_kernels", "pack_for_amx", "rotate_half"]
