"""Tiny on-disk folders for the recommend tests, and helpers that read a recommendation's tree.

The folders: config.json + a safetensors file with the right tensor names and (tiny) shapes, + the
conftest's character-level tokenizer (copied from ``tiny_model_dir``) when given one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from specctl.recommend.choices import Node

H, V = 64, 128  # the target's hidden size and vocabulary (the conftest tokenizer's 128 ids)


def write_folder(folder: Path, config: dict, shapes: dict[str, list[int]], tokenizer: Path | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: torch.zeros(s, dtype=torch.float32) for k, s in shapes.items()}, str(folder / "model.safetensors"))
    if tokenizer is not None:
        for f in tokenizer.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, folder / f.name)
    return folder


def llama(folder: Path, layers: int = 4, hidden: int = H, vocab: int = V, tokenizer: Path | None = None,
          extra_config: dict | None = None, extra_shapes: dict | None = None, arch: str = "llama") -> Path:
    inter = 2 * hidden
    shapes = {"model.embed_tokens.weight": [vocab, hidden], "lm_head.weight": [vocab, hidden],
              "model.norm.weight": [hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": [hidden, hidden], p + "self_attn.k_proj.weight": [hidden // 2, hidden],
                   p + "self_attn.v_proj.weight": [hidden // 2, hidden], p + "self_attn.o_proj.weight": [hidden, hidden],
                   p + "mlp.gate_proj.weight": [inter, hidden], p + "mlp.up_proj.weight": [inter, hidden],
                   p + "mlp.down_proj.weight": [hidden, inter], p + "input_layernorm.weight": [hidden],
                   p + "post_attention_layernorm.weight": [hidden]}
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": arch, "hidden_size": hidden, "vocab_size": vocab,
           "num_hidden_layers": layers, "intermediate_size": inter, "num_attention_heads": 4,
           "num_key_value_heads": 2, "hidden_act": "silu"} | (extra_config or {})
    return write_folder(folder, cfg, shapes | (extra_shapes or {}), tokenizer)


def medusa(folder: Path, heads: int = 3, hidden: int = H, vocab: int = V, **cfg) -> Path:
    shapes = {f"blocks.{h}.layers.0.weight": [hidden, hidden] for h in range(heads)}
    shapes |= {f"lm_heads.{h}.weight": [vocab, hidden] for h in range(heads)}
    return write_folder(folder, {"model_type": "medusa", "num_heads": heads, "num_hidden_layers": 1,
                                 "hidden_size": hidden, "vocab_size": vocab} | cfg, shapes)


def eagle3(folder: Path, hidden: int = H, vocab: int = V, draft_vocab: int = 32, **cfg) -> Path:
    shapes = {"fc.weight": [hidden, 3 * hidden], "midlayer.self_attn.q_proj.weight": [hidden, 2 * hidden],
              "norm.weight": [hidden], "lm_head.weight": [draft_vocab, hidden], "d2t": [draft_vocab], "t2d": [vocab]}
    return write_folder(folder, {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                                 "hidden_size": hidden, "target_hidden_size": hidden, "vocab_size": vocab,
                                 "draft_vocab_size": draft_vocab, "num_hidden_layers": 1,
                                 "eagle_aux_hidden_state_layer_ids": [0, 1, 2]} | cfg, shapes)


def eagle1(folder: Path, hidden: int = H, vocab: int = V) -> Path:
    shapes = {"fc.weight": [hidden, 2 * hidden], "layers.0.self_attn.q_proj.weight": [hidden, hidden],
              "embed_tokens.weight": [vocab, hidden]}
    return write_folder(folder, {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
                                 "vocab_size": vocab, "num_hidden_layers": 1}, shapes)


def qwen_like(folder: Path, layers: int = 4) -> Path:
    """A folder whose config has Qwen2.5-0.5B's attention shapes (14 heads, 2 KV heads of 64)."""
    return llama(folder, layers=layers, extra_config={"num_attention_heads": 14, "num_key_value_heads": 2,
                                                     "head_dim": 64})


def answers(node: Node) -> list[tuple[str, str]]:
    """(question, answer) along the tree, depth first."""
    out = [(node.text, node.answer)] if node.kind == "question" else []
    for c in node.children:
        out += answers(c)
    return out


def choices(node: Node) -> list[str]:
    out = [node.text] if node.kind == "choice" else []
    for c in node.children:
        out += choices(c)
    return out


def evidence(node: Node) -> list[Node]:
    out = [node] if node.kind == "evidence" else []
    for c in node.children:
        out += evidence(c)
    return out


def q(rec, start: str) -> str:
    return next(a for t, a in answers(rec.tree) if t.startswith(start))


def gguf_llama(path: Path, layers: int = 2, hidden: int = H, vocab: int = V, untied: bool = True,
               **kv: str) -> Path:
    """A llama GGUF header with zero F32 tensors of the right names and shapes (llama.cpp's layout);
    ``kv``: more string fields (``general.source.huggingface.repository`` as
    ``general_source_huggingface_repository``)."""
    import numpy as np
    from gguf import GGUFWriter

    inter, heads = 2 * hidden, 4
    w = GGUFWriter(str(path), "llama")
    w.add_name("Tiny Llama GGUF")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(2)
    for k, v in kv.items():
        w.add_string(k.replace("_", "."), v)
    kvd = hidden // heads * 2
    w.add_tensor("token_embd.weight", np.zeros((vocab, hidden), dtype=np.float32))
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kvd, hidden)), ("attn_v", (kvd, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (inter, hidden)),
                            ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))):
            w.add_tensor(f"blk.{i}.{name}.weight", np.zeros(shape, dtype=np.float32))
    if untied:
        w.add_tensor("output.weight", np.zeros((vocab, hidden), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def refuse_dense(monkeypatch) -> None:
    """Fail any GGUF -> dense conversion or dense pull: recommend must read the GGUF's header alone."""
    from specctl import gguf_files, models

    def refuse(*a, **k):
        raise AssertionError("recommend converted or pulled dense weights")

    monkeypatch.setattr(gguf_files, "gguf_to_dense", refuse)
    monkeypatch.setattr(models, "_pull", refuse)
