"""What train-mtp learns from: token sequences, the frozen target's states over them, and the labels.

Two sources give the same thing, ``MtpData`` (per sequence: tokens [n], h^0 [n, H] final-normed, the
target's greedy labels [n], ``IGNORE`` where a row is not learnt):

- ``from_windows``: text cut into windows of --seq-len tokens joined by EOS (``windows``), the target run
  over them here (``target_states``);
- ``from_examples``: the trainers' own sequences (``specctl.training.data``: chat-templated, the answers'
  tokens marked), their states read through a states cache (``--cache-hidden-states``, e.g. an EAGLE-3
  run's: the target need not run again); rows learnt are the answers' and a seeded ``prompt_rows``
  fraction of the others.

``loss_vocab`` picks the N tokens the loss's softmax runs over (the target's most frequent choices in the
data): on a CPU the full head (~150k rows for Qwen) is ~90 % of a step; the export keeps the target's head.

What it does not know: the MTP modules, the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specctl.errors import DataError

IGNORE = -100  # a label no loss reads (F.cross_entropy's ignore_index)


@torch.no_grad()
def target_states(target, tokens: torch.Tensor, chunk: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> (h^0 [B, T, H] final-normed fp32, greedy labels [B, T]): ``eagle_states.target_states``
    a chunk of sequences at a time, the labels where the tokens are."""
    from specctl.training.eagle_states import target_states as states

    hs, ys = [], []
    for i in range(0, tokens.shape[0], chunk):
        st = states(target, tokens[i:i + chunk])
        hs.append(st["hidden"])
        ys.append(st["argmax"].to(tokens.device))
    return torch.cat(hs), torch.cat(ys)


def windows(tokenizer, texts: list[str], seq_len: int, max_windows: int | None = None,
            id_seqs: list[list[int]] = ()) -> torch.Tensor:
    """[N, seq_len] token windows over the id sequences and the texts, joined by EOS (last partial window dropped)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for seq in [*id_seqs, *(tokenizer.encode(t, add_special_tokens=False) for t in texts)]:
        ids.extend(seq)
        if eos is not None:
            ids.append(eos)
    n = len(ids) // seq_len
    if n == 0:
        raise DataError(f"the training text is shorter than one window ({len(ids)} tokens < --seq-len {seq_len})",
                        "give more data or lower --seq-len")
    w = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
    return w[:max_windows] if max_windows else w


def flat_text(record) -> str:
    """A record as plain text for windows: its text, or its turns' contents joined by newlines."""
    return record.text if record.text is not None else "\n".join(m["content"] for m in record.messages or [])


@dataclass
class MtpData:
    """Sequences with the target's states: tokens[i] [n_i], hidden[i] [n_i, H], labels[i] [n_i] (the target's
    greedy choice after each token; ``IGNORE`` on a row not learnt)."""

    tokens: list[torch.Tensor]
    hidden: list[torch.Tensor]
    labels: list[torch.Tensor]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return sum(int(t.numel()) for t in self.tokens)

    @classmethod
    def from_windows(cls, w: torch.Tensor, h: torch.Tensor, y: torch.Tensor) -> "MtpData":
        """Windows [N, T] with their states [N, T, H] and labels [N, T]: every row learnt."""
        return cls(list(w), list(h), list(y))

    @classmethod
    def from_examples(cls, examples, states: list[dict[str, torch.Tensor]], prompt_rows: float = 1.0,
                      seed: int = 0) -> "MtpData":
        """Examples (``input_ids``, ``loss_mask``) with their cached states (``hidden``, ``argmax``): row t is
        learnt where token t+1 is an answer's, or (a seeded draw per sequence) with probability ``prompt_rows``."""
        toks, hid, lab = [], [], []
        for i, (e, st) in enumerate(zip(examples, states)):
            y = st["argmax"].long().clone()
            if prompt_rows < 1.0:
                nxt = torch.tensor(list(e.loss_mask[1:]) + [0], dtype=torch.bool)
                g = torch.Generator().manual_seed(seed * 1_000_003 + i)
                y[~(nxt | (torch.rand(len(nxt), generator=g) < prompt_rows))] = IGNORE
            toks.append(torch.tensor(e.input_ids, dtype=torch.long))
            hid.append(st["hidden"])
            lab.append(y)
        return cls(toks, hid, lab)

    def batch(self, idx: list[int], device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> tokens [B, T] (right-padded with 0), h^0 [B, T, H] fp32, labels [B, T] (``IGNORE`` in the padding)."""
        T = max(int(self.tokens[i].numel()) for i in idx)
        H = self.hidden[idx[0]].shape[-1]
        tok = torch.zeros(len(idx), T, dtype=torch.long)
        h0 = torch.zeros(len(idx), T, H, dtype=torch.float32)
        y = torch.full((len(idx), T), IGNORE, dtype=torch.long)
        for b, i in enumerate(idx):
            n = int(self.tokens[i].numel())
            tok[b, :n], h0[b, :n], y[b, :n] = self.tokens[i], self.hidden[i].float(), self.labels[i]
        return tok.to(device), h0.to(device), y.to(device)

    def counts(self, idx: list[int], depth: int) -> torch.Tensor:
        """[depth] the labels depth d reads in these sequences (its rows j < n - d whose label at j + d is
        learnt): the denominators of a global batch's per-depth means."""
        out = torch.zeros(depth)
        for i in idx:
            y = self.labels[i]
            for d in range(1, depth + 1):
                out[d - 1] += float((y[d:] != IGNORE).sum())
        return out

    def remapped(self, remap: torch.Tensor) -> "MtpData":
        """The same sequences with every label t as ``remap[t]`` (a loss vocabulary's index, or ``IGNORE``)."""
        return MtpData(self.tokens, self.hidden,
                       [torch.where(y == IGNORE, y, remap[y.clamp(min=0)]) for y in self.labels])


def loss_vocab(data: MtpData, n: int, vocab_size: int, always=()) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The loss's vocabulary: (ids [n'] of the n most frequent learnt labels plus ``always``, remap [V] from a
    token to its index there or ``IGNORE``, the share of learnt labels it covers)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for y in data.labels:
        y = y[y != IGNORE]
        counts.index_add_(0, y, torch.ones_like(y))
    keep = set(int(i) for i in counts.topk(min(n, vocab_size)).indices if counts[i] > 0)
    keep |= {int(i) for i in always if 0 <= int(i) < vocab_size}
    ids = torch.tensor(sorted(keep), dtype=torch.long)
    remap = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    remap[ids] = torch.arange(len(ids))
    covered = float(counts[ids].sum()) / max(1, int(counts.sum()))
    return ids, remap, covered



def load(cfg, loaded, records: list, eval_records: list, log=lambda m: None, bar=lambda *a: None,
         first=None) -> tuple[MtpData, MtpData, dict]:
    """(train, held-out, facts for the summary) of a train-mtp run: ``records`` (``--data``, read already) and
    the target's answers to ``--self-distill``, as windows the target runs over, or (``cache_hidden_states``)
    the trainers' sequences with states from the cache; held out: ``eval_records`` (``--eval-data``, with a
    cache) or a seeded ``eval_split`` of the rest. ``first``: a context in which one process writes caches."""
    import contextlib
    from pathlib import Path

    from specctl.training import data as D

    first = first or contextlib.nullcontext
    target, tok, dev = loaded.model, loaded.tokenizer, loaded.device
    if cfg.cache_hidden_states:
        from specctl.training.eagle_states import cached_states

        with first():
            ex = D.build_examples(cfg, loaded, log=log, progress=bar, records=records)
        held = [e for r in eval_records for e in D.encode(tok, r, cfg.seq_len, loaded.stop_token_ids)]
        train_ex, eval_ex = (ex, held) if eval_records else D.split(ex, cfg.eval_split, cfg.seed)
        key = {"model": str(Path(loaded.path).resolve()), "seq_len": cfg.seq_len, "dtype": cfg.dtype}
        with first():  # one process adds what the cache lacks, the others read
            st = cached_states(target, [e.input_ids for e in train_ex + eval_ex], cfg.cache_hidden_states, key, log)
        train = MtpData.from_examples(train_ex, st[:len(train_ex)], cfg.prompt_rows, cfg.seed)
        held_out = MtpData.from_examples(eval_ex, st[len(train_ex):], 0.0, cfg.seed)  # the answers' rows, as drafted
        log(f"data: {len(train)} sequences, {train.num_tokens} tokens ({len(held_out)} held out)")
        return train, held_out, {"sequences": len(train) + len(held_out), "train_tokens": train.num_tokens}
    with first():  # one process writes the self-distillation cache, the others read it
        recs = D.distill_records(cfg, loaded, seq_len=None, log=log, progress=bar)
    texts = [flat_text(r) for r in records]
    w = windows(tok, texts, cfg.seq_len, cfg.max_windows, [r.prompt_ids + r.response_ids for r in recs])
    w = w[torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(cfg.seed))]
    n_eval = min(int(round(w.shape[0] * cfg.eval_split)) if w.shape[0] > 1 else 0, w.shape[0] - 1)
    log(f"data: {w.shape[0]} windows of {cfg.seq_len} tokens ({w.shape[0] - n_eval} train, {n_eval} eval); "
        "computing the target's states")
    h, y = target_states(target, w.to(dev))
    h, y = h.cpu(), y.cpu()  # batches go to the device as they are used
    train = MtpData.from_windows(w[n_eval:], h[n_eval:], y[n_eval:])
    return train, MtpData.from_windows(w[:n_eval], h[:n_eval], y[:n_eval]), \
        {"windows": int(w.shape[0]), "train_tokens": train.num_tokens}
