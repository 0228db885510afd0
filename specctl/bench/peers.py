"""Peers for `specctl bench --peer hf`: transformers' own generation on the same prompts, same run.

  hf:plain                model.generate, greedy
  hf:prompt-lookup        model.generate(prompt_lookup_num_tokens=k)  (transformers' n-gram speculation)
  hf:assisted:<draft>     model.generate(assistant_model=draft), one per draft benched with draft_model;
                          a draft with another tokenizer runs as universal assisted generation
                          (``tokenizer=target's, assistant_tokenizer=draft's``)

Timing: generate() does not report prefill apart, so decode time = time of the full generate minus
the time of a 1-token generate on the same prompt (its prefill + first token), measured just before.

What it does not know: which drafts to run or how they are named (the suite decides), specctl's own runtime.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specctl.errors import UsageError
from specctl.runtime.decoder import GenerationResult
from specctl.runtime.metrics import SpecStats


@dataclass
class HFPeer:
    name: str
    kwargs: dict  # extra generate() arguments
    config: dict = field(default_factory=dict)  # what the row reports as its configuration


class HFPeers:
    """Loads the target (and each draft) with transformers once; runs each peer mode per prompt."""

    def __init__(self, model_path, dtype: torch.dtype, prompt_lookup_k: int = 10,
                 drafts: list[tuple[str, Path]] = ()):
        """``drafts``: (name, dense HF folder) pairs; each adds the peer ``hf:assisted:<name>``."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.peers = [HFPeer("hf:plain", {}),
                      HFPeer("hf:prompt-lookup", {"prompt_lookup_num_tokens": prompt_lookup_k},
                             {"prompt_lookup_num_tokens": prompt_lookup_k})]
        for name, path in drafts:
            draft = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
            dtok = AutoTokenizer.from_pretrained(str(path))
            kw = {"assistant_model": draft}
            # transformers tells a different tokenizer by the vocabulary size alone
            universal = draft.config.get_text_config().vocab_size != self.model.config.get_text_config().vocab_size
            if not universal and dtok.get_vocab() != self.tokenizer.get_vocab():
                raise UsageError(f"transformers cannot run assisted generation with draft {name}: its tokenizer differs "
                                 "from the target's but its vocabulary size is the same",
                                 "bench that draft without --peer hf")
            if universal:
                kw.update(tokenizer=self.tokenizer, assistant_tokenizer=dtok)
            self.peers.append(HFPeer(f"hf:assisted:{name}", kw,
                                     {"assistant_model": str(path), "universal_assisted_generation": universal}))

    @torch.inference_mode()
    def run(self, peer: HFPeer, prompt_ids: list[int], max_new_tokens: int, stop_ids) -> GenerationResult:
        x = torch.tensor([prompt_ids])
        common = dict(do_sample=False, eos_token_id=list(stop_ids) or None, pad_token_id=(list(stop_ids) or [0])[0])
        t0 = time.perf_counter()
        self.model.generate(x, max_new_tokens=1, **common)
        t1 = time.perf_counter()
        out = self.model.generate(x, max_new_tokens=max_new_tokens, **common, **peer.kwargs)
        t2 = time.perf_counter()
        tokens = out[0, len(prompt_ids):].tolist()
        finish = "stop" if tokens and tokens[-1] in set(stop_ids) else "length"
        prefill = t1 - t0
        return GenerationResult(tokens, finish, SpecStats(), prefill, max(t2 - t1 - prefill, 1e-9), 0)
