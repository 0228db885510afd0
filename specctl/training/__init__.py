"""Training drafts for speculative decoding: data (records, self-distillation, tokenisation with loss
masks), heads and trainers (Medusa in ``medusa``; EAGLE and MTP beside it), and the on-disk layouts
the serving engines load (``export``). Modules import torch, transformers, accelerate and peft only
where they need them, so importing this package is cheap.
"""
