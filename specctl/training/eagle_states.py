"""EAGLE training data as the trainer reads it: sequences, length-grouped batches, and the target's
states for a batch (computed online, or once into safetensors shards and read back).

For a batch of sequence indices ``StateSource.batch`` gives ids [B, T] (right-padded), lengths [B],
the target's final-normed hidden [B, T, H], its argmax [B, T], EAGLE-3's aux states [B, T, A*H], and
the rows to unroll (``rows`` [B, R], ``row_mask`` [B, R]): the answer rows, plus a seeded fraction
``prompt_rows`` of the others.

What it does not know: the draft, its losses, the loop.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specctl.files import write_atomic, write_json_atomic


def all_rows(B: int, T: int, device=None) -> torch.Tensor:
    """[B, T] the row positions 0..T-1 of every sequence (``ttt_forward``'s default)."""
    return torch.arange(T, device=device).expand(B, T)


def batches(idx: list[int], lengths: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """One epoch's batches: a seeded shuffle, then sequences of similar length grouped (sorted within
    windows of 32 batches, so little padding), the batches in a seeded random order."""
    rng = random.Random(seed)
    perm = list(idx)
    rng.shuffle(perm)
    win = 32 * batch_size
    out = []
    for w in range(0, len(perm), win):
        chunk = sorted(perm[w:w + win], key=lambda i: lengths[i])
        out += [chunk[s:s + batch_size] for s in range(0, len(chunk), batch_size)]
    rng.shuffle(out)
    return out


def pad_batch(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [B, T] (right-padded with 0), lengths [B]."""
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s, dtype=torch.long)
    return ids, torch.tensor([len(s) for s in seqs])


@torch.no_grad()
def target_states(model, ids: torch.Tensor, aux_layers: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """The target over ids [B, T]: hidden [B, T, H] (final-normed), argmax [B, T], and with
    ``aux_layers`` aux [B, T, A*H] (the inputs of those layers, EAGLE-3)."""
    from specctl.modeling import KVCache

    B, T = ids.shape
    dev = model.embed.weight.device
    cache = KVCache(model.args, B, T, model.embed.weight.dtype, dev)
    mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    _, h, aux = model(ids.to(dev), 0, cache, mask if T > 1 else None, logits="none", aux_layers=tuple(aux_layers))
    # the argmax through the LM head's own path (what the target serves with: exact, and fast where torch's bf16
    # matmul is not, e.g. ~5x slower than fp32 on AVX2), a sequence at a time: [T, V] logits, not [B, T, V]
    out = {"hidden": h.float(), "argmax": torch.cat([model.head(h[b:b + 1]).argmax(-1) for b in range(B)]).cpu()}
    if aux_layers:
        out["aux"] = aux.float()
    return out


class StateSource:
    """Target states for a batch of sequence indices: computed online, or read from a disk cache.

    ``masks`` (one 0/1 list per sequence, 1 on learnt tokens): row t is an answer row when the token
    it reads, x[t+1], is learnt; ``batch`` unrolls those rows and a random ``prompt_rows`` fraction
    of the others (1.0: every row, None masks: every row is an answer row).
    """

    def __init__(self, model, seqs: list[list[int]], aux_layers: tuple[int, ...], cache_dir: str | None, key: dict, log,
                 masks: list[list[int]] | None = None):
        self.model, self.seqs, self.aux_layers = model, seqs, tuple(aux_layers)
        self.masks = masks
        self.need_aux = bool(aux_layers)
        self.cache: dict[int, dict[str, torch.Tensor]] | None = None
        if cache_dir:
            self.cache = _cached_states(model, seqs, self.aux_layers, Path(cache_dir), key, log)

    def batch(self, idx: list[int], prompt_rows: float = 1.0, seed: int | None = None) -> dict[str, torch.Tensor]:
        ids, lengths = pad_batch([self.seqs[i] for i in idx])
        if self.cache is None:
            st = target_states(self.model, ids, self.aux_layers)
        else:
            T = ids.shape[1]
            st = {}
            for name in ("hidden", "argmax") + (("aux",) if self.need_aux else ()):
                rows = [self.cache[i][name] for i in idx]
                buf = torch.zeros((len(idx), T) + rows[0].shape[1:], dtype=torch.float32 if name != "argmax" else torch.long)
                for b, r in enumerate(rows):
                    buf[b, :r.shape[0]] = r.to(buf.dtype)
                st[name] = buf
        st.update(ids=ids, lengths=lengths)
        st.update(self._rows(idx, ids.shape[1], prompt_rows, seed))
        return st

    def _rows(self, idx: list[int], T: int, prompt_rows: float, seed: int | None) -> dict[str, torch.Tensor]:
        """Each sequence's prompt rows are drawn from a generator of (seed, its index): a sequence gets
        the same rows whichever batch, process or micro-batch it is in (None: torch's global RNG)."""
        B = len(idx)
        if self.masks is None or prompt_rows >= 1.0:
            return {"rows": all_rows(B, T).contiguous(), "row_mask": torch.ones(B, T, dtype=torch.bool)}
        chosen = []
        for i in idx:
            m = torch.tensor(self.masks[i][1:] + [0], dtype=torch.bool)  # row t: x[t+1] is learnt
            if prompt_rows > 0:
                g = None if seed is None else torch.Generator().manual_seed(seed * 1_000_003 + i)
                m = m | (torch.rand(m.shape, generator=g) < prompt_rows)
            chosen.append(m.nonzero()[:, 0])
        R = max(1, max(len(c) for c in chosen))
        rows = torch.zeros(B, R, dtype=torch.long)
        row_mask = torch.zeros(B, R, dtype=torch.bool)
        for b, c in enumerate(chosen):
            rows[b, :len(c)] = c
            row_mask[b, :len(c)] = True
        return {"rows": rows, "row_mask": row_mask}


def _seq_id(seq: list[int]) -> str:
    """A sequence's name in the cache: the hash of its token ids."""
    import hashlib

    return hashlib.sha1(np.asarray(seq, dtype=np.int64).tobytes()).hexdigest()[:20]


def _cached_states(model, seqs, aux_layers: tuple[int, ...], folder: Path, key: dict, log) -> dict[int, dict[str, torch.Tensor]]:
    """The target's states of every sequence: those in ``folder``'s shards (made under the same ``key``:
    model, layers, dtype) read back, the others computed and written, a shard at a time, the index
    updated after each (atomically): an interrupted run, or a run on more or other data, computes only
    the sequences not in the cache yet. Sequences are found by the hash of their token ids."""
    from safetensors.torch import load_file, save_file

    index = folder / "index.json"
    need_aux = bool(aux_layers)
    key = dict(key, aux=list(aux_layers), layout=2)
    names = [_seq_id(s) for s in seqs]
    shards: dict[str, list[str]] = {}
    have: dict[str, dict[str, torch.Tensor]] = {}
    if index.exists():
        meta = json.loads(index.read_text())
        if meta.get("key") == key:
            wanted = set(names)
            for shard, inside in meta["shards"].items():
                shards[shard] = inside
                if wanted.intersection(inside):
                    for name, t in load_file(str(folder / shard)).items():
                        sid, field_ = name.split(".", 1)
                        if sid in wanted:
                            have.setdefault(sid, {})[field_] = t
        else:
            log(f"cached states in {folder} were made for another model or settings: recomputing")
    todo = [i for i, n in enumerate(names) if n not in have]
    if have:
        log(f"reusing cached target states from {folder} ({len(seqs) - len(todo)} of {len(seqs)} sequences)")
    folder.mkdir(parents=True, exist_ok=True)
    cur: dict[str, torch.Tensor] = {}
    per_shard = 64
    for s in range(0, len(todo), 8):
        idx = todo[s:s + 8]
        ids, lengths = pad_batch([seqs[i] for i in idx])
        st = target_states(model, ids, aux_layers)
        for b, i in enumerate(idx):
            n = int(lengths[b])
            row = {"hidden": st["hidden"][b, :n].to(torch.bfloat16), "argmax": st["argmax"][b, :n].cpu()}
            if need_aux:
                row["aux"] = st["aux"][b, :n].to(torch.bfloat16)
            have[names[i]] = row
            cur.update({f"{names[i]}.{k}": v.contiguous().cpu() for k, v in row.items()})
        if len(cur) >= per_shard * len(row) or s + 8 >= len(todo):
            name = f"shard-{len(shards):05d}.safetensors"
            while name in shards or (folder / name).exists():
                name = f"shard-{int(name[6:11]) + 1:05d}.safetensors"
            write_atomic(folder / name, lambda p, t=cur: save_file(t, str(p)))
            shards[name] = sorted({k.split(".", 1)[0] for k in cur})
            write_json_atomic(index, {"key": key, "shards": shards}, indent=1)
            cur = {}
        log(f"cached target states: {len(seqs) - len(todo) + min(s + 8, len(todo))}/{len(seqs)} sequences")
    return {i: have[n] for i, n in enumerate(names)}


def cached_hidden(model, seqs: list[list[int]], folder: str | Path, key: dict, log) -> list[torch.Tensor]:
    """Each sequence's final-normed hidden states [n, H] (bf16) through a states cache (``cached_states``)."""
    return [st["hidden"] for st in cached_states(model, seqs, folder, key, log)]


def cached_states(model, seqs: list[list[int]], folder: str | Path, key: dict, log) -> list[dict[str, torch.Tensor]]:
    """Each sequence's final-normed hidden states [n, H] (bf16) and the target's argmax [n] through a states
    cache (``train-eagle --cache-hidden-states``'s folder): a cache made for the same ``key`` (model, sequence
    length, dtype) serves whatever EAGLE settings it was made with, the sequences it lacks computed and added
    under those settings (it stays whole for train-eagle); with none there, a cache of these alone is made."""
    folder = Path(folder)
    aux, full = (), dict(key, version=None, aux_layers=[])
    index = folder / "index.json"
    if index.exists():
        made = json.loads(index.read_text()).get("key") or {}
        if all(made.get(k) == v for k, v in key.items()):
            full = {k: v for k, v in made.items() if k not in ("aux", "layout")}
            aux = tuple(made.get("aux") or ())
    states = _cached_states(model, seqs, aux, folder, full, log)
    return [{"hidden": states[i]["hidden"], "argmax": states[i]["argmax"]} for i in range(len(seqs))]

