"""Medusa heads (Cai et al., arXiv 2401.10774): the network and its files. vLLM's layout (written and
read) and FasterDecoding's original layout (read and written).

Head k: a residual block x + SiLU(W x) (``num_layers`` of them; W zero-initialised, so a fresh head
is the identity) followed by an LM head; head k reads the target's final-normed hidden state h_t and
predicts x[t+k+2] (losses and the trainer: ``specctl.training.medusa``; drafting:
``specctl.runtime.proposers.medusa``).

vLLM layout (``vllm/model_executor/models/medusa.py``, ``vllm/transformers_utils/configs/medusa.py``):

    config.json        {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": K,
                        "num_hidden_layers": L, "hidden_size": H, "vocab_size": V,
                        "truncated_vocab_size": V' (only with token_map), "medusa_fc_bias": bool,
                        "original_lm_head": bool}
    model.safetensors  blocks.{h}.layers.{l}.weight [H, H] (+ blocks.{h}.layers.{l}.bias with medusa_fc_bias)
                       lm_heads.{h}.weight [V', H]    (only lm_heads.0.weight with original_lm_head:
                                                       one LM head shared by every head)
                       token_map [V'] int64           (optional: head row i is vocabulary id token_map[i])

  vLLM loads a token_map only with original_lm_head: its per-head LM heads have V rows and the loaded
  ones are cut to the token map, which its weight loader then refuses. specctl reads both; train-medusa
  writes a truncated vocabulary with the shared head only.

  vLLM's MedusaConfig.from_pretrained renames *every* top-level key containing "num" and "heads"
  (or "layers") to num_heads (num_hidden_layers), so the config carries no other such key; specctl's
  own notes go under "specctl". vLLM strips a "medusa_heads." prefix from tensor names (read here too).

FasterDecoding/Medusa layout (``medusa/model/medusa_model.py``): config ``medusa_num_heads``,
``medusa_num_layers``, ``base_model_name_or_path``; weights in ``medusa_lm_head.pt`` (or
``.safetensors``), the state dict of ``medusa_head`` (``[medusa_head.]{h}.{l}.linear.weight/.bias``
for the residual blocks, which always have a bias there, and ``[medusa_head.]{h}.{L}.weight`` for
the LM head, L = num_layers).

What it does not know: training, the decode loop, checkpoints. Imports only torch and safetensors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specctl.drafts.formats import FormatCheck, TargetFacts, Tensors, truncated_vocab
from specctl.drafts.kinds import check_kind, is_medusa  # noqa: F401 (is_medusa: here as before)
from specctl.errors import ModelError, UsageError
from specctl.files import write_atomic, write_json_atomic

WEIGHTS = "model.safetensors"
_FD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


# --------------------------------------------------------------------------- the heads

class ResidualBlock(nn.Module):
    """x -> x + SiLU(W x [+ b]), ``num_layers`` times; W and b start at zero (the identity)."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        for lin in self.layers:
            nn.init.zeros_(lin.weight)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor, linear=F.linear) -> torch.Tensor:  # x: [..., H]
        for lin in self.layers:
            x = x + F.silu(linear(x, lin.weight, lin.bias))
        return x


def lm_head_count(num_heads: int, shared_lm_head: bool) -> int:
    """How many LM heads (``lm_heads.{i}``) K Medusa heads hold: one shared by every head (vLLM's
    ``original_lm_head``), else one per head. MedusaHeads builds this many, so load_medusa requires this
    many, and ``check_medusa`` (``specctl recommend``) asks the same."""
    return 1 if shared_lm_head else num_heads


def shares_lm_head(cfg: dict) -> bool:
    """Whether a vLLM-layout Medusa ``config.json`` says its heads share one LM head (``original_lm_head``)."""
    return bool(cfg.get("original_lm_head", False))


class MedusaHeads(nn.Module):
    """K Medusa heads. Parameter names are vLLM's: blocks.{h}.layers.{l}.weight, lm_heads.{h}.weight.

    ``shared_lm_head``: one LM head for all (vLLM's ``original_lm_head``), kept as a frozen copy of
    the target's. ``token_map`` [V'] (vLLM's truncated vocabulary): LM-head row i scores vocabulary
    id token_map[i]; the other ids are never drafted.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1, bias: bool = False,
                 shared_lm_head: bool = False, token_map: torch.Tensor | None = None):
        super().__init__()
        self.hidden_size, self.vocab_size, self.num_heads, self.num_layers = hidden_size, vocab_size, num_heads, num_layers
        self.bias, self.shared_lm_head = bias, shared_lm_head
        self.layout = "vllm"  # where it was read from (load_medusa sets it)
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, num_layers, bias) for _ in range(num_heads))
        rows = vocab_size if token_map is None else int(token_map.numel())
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, rows, bias=False)
                                      for _ in range(lm_head_count(num_heads, shared_lm_head)))
        self.register_buffer("token_map", None if token_map is None else token_map.long())  # [V'] vocab ids

    def lm_head(self, h: int) -> nn.Linear:
        return self.lm_heads[0 if self.shared_lm_head else h]

    @torch.no_grad()
    def init_lm_heads(self, head_weight: torch.Tensor) -> None:
        """Copy the target's LM head [V, H] (its token_map rows) into every LM head."""
        w = head_weight if self.token_map is None else head_weight[self.token_map.to(head_weight.device)]
        for lm in self.lm_heads:
            lm.weight.copy_(w.to(lm.weight.dtype))
        if self.shared_lm_head:
            self.lm_heads.requires_grad_(False)

    def forward(self, hidden: torch.Tensor, num: int | None = None, linear=F.linear) -> torch.Tensor:
        """hidden [..., H] -> logits [..., n, V'] of the first n = num (default K) heads."""
        n = self.num_heads if num is None else min(num, self.num_heads)
        xs = [self.blocks[h](hidden, linear) for h in range(n)]  # n x [..., H]
        if self.shared_lm_head:
            lm = self.lm_heads[0]
            return linear(torch.stack(xs, -2), lm.weight, None)  # one read of the LM head for all heads
        return torch.stack([linear(x, self.lm_heads[h].weight, None) for h, x in enumerate(xs)], -2)

    def vocab_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """LM-head row indices -> vocabulary ids."""
        return rows if self.token_map is None else self.token_map[rows]

    def rows_of(self, vocab_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids -> LM-head rows, -1 for ids outside the token map (and for -1)."""
        if self.token_map is None:
            return vocab_ids
        lut = torch.full((self.vocab_size + 1,), -1, dtype=torch.long, device=vocab_ids.device)
        lut[self.token_map.to(vocab_ids.device)] = torch.arange(self.token_map.numel(), device=vocab_ids.device)
        return lut[vocab_ids.clamp(min=-1)]  # index -1 is the extra slot, always -1

    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V'] -> [..., V] with -inf at the ids outside the token map."""
        if self.token_map is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.token_map] = logits
        return out


# --------------------------------------------------------------------------- writing

def medusa_config(heads: MedusaHeads, dtype: torch.dtype, notes: dict | None = None) -> dict:
    """vLLM's Medusa config for ``heads`` (see the module docstring for why no other *num* keys)."""
    cfg = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "medusa_fc_bias": heads.bias,
        "original_lm_head": heads.shared_lm_head,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if heads.token_map is not None:
        cfg["truncated_vocab_size"] = int(heads.token_map.numel())
    if notes:
        cfg["specctl"] = notes
    return cfg


def save_medusa(heads: MedusaHeads, folder: str | Path, dtype: torch.dtype | None = None,
                notes: dict | None = None) -> Path:
    """Write ``heads`` in vLLM's layout into ``folder`` (created; other files there are left alone).

    Each file is replaced atomically; the weights go first, the config last, so a folder whose
    config.json names K heads always holds their weights.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype or next(heads.parameters()).dtype
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in heads.state_dict().items()
               if name != "token_map"}
    if heads.token_map is not None:
        tensors["token_map"] = heads.token_map.detach().to("cpu", torch.int64).contiguous()
    write_atomic(folder / WEIGHTS, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    cfg = medusa_config(heads, dtype, notes)
    write_json_atomic(folder / "config.json", cfg)
    return folder


def save_fasterdecoding(heads: MedusaHeads, folder: str | Path, base_model: str = "") -> Path:
    """Write ``heads`` in FasterDecoding's layout (medusa_lm_head.safetensors + config.json).

    That layout has full-vocabulary, per-head LM heads and biased residual blocks: a shared head is
    copied per head, a missing bias is written as zeros; a truncated vocabulary cannot be expressed.
    """
    from safetensors.torch import save_file

    if heads.token_map is not None:
        raise UsageError("FasterDecoding's layout has no truncated vocabulary", "export with the vLLM layout instead")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    L, out = heads.num_layers, {}
    for h in range(heads.num_heads):
        for l, lin in enumerate(heads.blocks[h].layers):
            out[f"medusa_head.{h}.{l}.linear.weight"] = lin.weight.detach().cpu().contiguous()
            b = lin.bias if lin.bias is not None else torch.zeros(heads.hidden_size, dtype=lin.weight.dtype)
            out[f"medusa_head.{h}.{l}.linear.bias"] = b.detach().cpu().contiguous()
        out[f"medusa_head.{h}.{L}.weight"] = heads.lm_head(h).weight.detach().cpu().clone().contiguous()
    write_atomic(folder / _FD_FILES[0], lambda p: save_file(out, str(p)))
    cfg = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": L, "base_model_name_or_path": base_model,
           "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


# --------------------------------------------------------------------------- reading

def detect_layout(folder: str | Path) -> str:
    """'vllm' or 'fasterdecoding'; ModelError when the folder holds neither."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(f"Medusa heads folder {folder} does not exist",
                         "give the folder `specctl train-medusa --output` wrote (config.json + model.safetensors)")
    cfg = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    if any((folder / f).is_file() for f in _FD_FILES) or "medusa_num_heads" in cfg:
        return "fasterdecoding"
    if cfg.get("model_type") == "medusa" or "num_heads" in cfg:
        return "vllm"
    raise ModelError(f"{folder} holds no Medusa heads (no config.json with model_type 'medusa', no medusa_lm_head.*)",
                     "give a folder written by `specctl train-medusa`, or FasterDecoding's medusa_lm_head.pt + config.json")


def load_medusa(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> MedusaHeads:
    """Read Medusa heads in either layout (auto-detected) into a MedusaHeads in eval mode."""

    folder = Path(folder)
    if folder.is_dir():
        check_kind(folder, "medusa", ("medusa",))
    layout = detect_layout(folder)
    sd = _read_weights(folder, layout)
    heads = _from_vllm(folder, sd) if layout == "vllm" else _from_fasterdecoding(folder, sd)
    heads.layout = layout
    if dtype is not None:
        heads = heads.to(dtype)
    return heads.to(device).eval().requires_grad_(False)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path} ({e})", "re-export the heads with `specctl train-medusa`") from None


def _read_weights(folder: Path, layout: str) -> dict[str, torch.Tensor]:
    from specctl.models import open_safetensors

    def load_file(path: str) -> dict[str, torch.Tensor]:
        with open_safetensors(path) as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}

    if layout == "fasterdecoding":
        for name in _FD_FILES:
            f = folder / name
            if f.is_file():
                sd = load_file(str(f)) if f.suffix == ".safetensors" else torch.load(f, map_location="cpu", weights_only=True)
                return {re.sub(r"^medusa_head\.", "", k): v for k, v in sd.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has no weights (*.safetensors / medusa_lm_head.pt)",
                         "re-export the heads with `specctl train-medusa`")
    sd = {}
    for f in files:
        sd.update(load_file(str(f)))
    return {k.replace("medusa_heads.", "") if layout == "vllm" else re.sub(r"^medusa_head\.", "", k): v
            for k, v in sd.items()}


def _from_vllm(folder: Path, sd: dict[str, torch.Tensor]) -> MedusaHeads:
    cfg = _read_json(folder / "config.json")
    K, L = int(cfg.get("num_heads", 0)), int(cfg.get("num_hidden_layers", 1))
    H, V = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    token_map = sd.get("token_map")
    truncated = truncated_vocab(cfg)  # vLLM ignores a token_map otherwise
    if truncated and token_map is None:
        raise ModelError(f"{folder}: truncated_vocab_size {cfg['truncated_vocab_size']} < vocab_size {V} but no "
                         "token_map tensor", "re-export the heads; the token_map tensor must travel with a truncated vocabulary")
    heads = MedusaHeads(H, V, K, L, bias=bool(cfg.get("medusa_fc_bias", False)),
                        shared_lm_head=shares_lm_head(cfg),
                        token_map=token_map.long() if truncated else None)
    if truncated:  # full-vocabulary LM heads beside a token_map are cut to it, as vLLM does
        sd = {k: v[heads.token_map] if k.startswith("lm_heads.") and v.shape[0] == V else v for k, v in sd.items()}
    want = heads.state_dict()
    extra = sorted(set(sd) - set(want) - {"token_map"})
    missing = sorted(set(want) - set(sd) - {"token_map"})
    if missing or extra:
        what = f"lacks '{missing[0]}'" if missing else f"has an unexpected tensor '{extra[0]}'"
        raise ModelError(f"{folder} {what} for {K} heads x {L} layers", "check config.json against the weights, or re-export")
    sd = {k: v for k, v in sd.items() if k in want}
    if heads.token_map is not None:
        sd["token_map"] = heads.token_map
    _load_checked(heads, sd, folder)
    heads.rank_accuracy = (cfg.get("specctl") or {}).get("rank_accuracy")  # [K][R] held-out, from train-medusa
    return heads


def _from_fasterdecoding(folder: Path, sd: dict[str, torch.Tensor]) -> MedusaHeads:
    cfg = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    keys = [tuple(int(x) for x in m.groups()) for k in sd if (m := re.fullmatch(r"(\d+)\.(\d+)\.weight", k))]
    if not keys:
        raise ModelError(f"{folder}: no '{{h}}.{{l}}.weight' LM-head tensors in the Medusa weights",
                         "expected FasterDecoding's medusa_head state dict")
    K = int(cfg.get("medusa_num_heads", max(h for h, _ in keys) + 1))
    L = int(cfg.get("medusa_num_layers", max(l for _, l in keys)))
    V, H = sd[f"0.{L}.weight"].shape
    heads = MedusaHeads(H, V, K, L, bias=True)
    new = {}
    for h in range(K):
        for l in range(L):
            new[f"blocks.{h}.layers.{l}.weight"] = sd[f"{h}.{l}.linear.weight"]
            new[f"blocks.{h}.layers.{l}.bias"] = sd[f"{h}.{l}.linear.bias"]
        new[f"lm_heads.{h}.weight"] = sd[f"{h}.{L}.weight"]
    _load_checked(heads, new, folder)
    return heads


def _load_checked(heads: MedusaHeads, sd: dict[str, torch.Tensor], folder: Path) -> None:
    want = heads.state_dict()
    for k, v in sd.items():
        if k in want and tuple(want[k].shape) != tuple(v.shape):
            raise ModelError(f"{folder}: tensor '{k}' has shape {tuple(v.shape)}, expected {tuple(want[k].shape)}",
                             "check hidden_size / vocab_size in config.json, or re-export")
    heads.to(next((v.dtype for v in sd.values() if v.is_floating_point()), torch.float32))
    heads.load_state_dict(sd, strict=True)


# --------------------------------------------------------------------------- detection and checks (``specctl recommend`` runs them over the folders it finds)

def check_medusa(cfg: dict, tensors: Tensors, target: TargetFacts) -> FormatCheck:
    heads = cfg.get("num_heads", cfg.get("medusa_num_heads"))
    details = {"num_heads": heads, "num_layers": cfg.get("num_hidden_layers", cfg.get("medusa_num_layers")),
               "hidden_size": cfg.get("hidden_size"), "vocab_size": cfg.get("vocab_size")}
    bad = []
    lm = sorted(k for k in tensors if re.match(r"lm_heads\.\d+\.weight$", k))
    if not heads:
        bad.append("config.json has no num_heads")
    elif lm and len(lm) != lm_head_count(heads, shares_lm_head(cfg)):
        shared = " sharing one LM head (original_lm_head)" if shares_lm_head(cfg) else ""
        bad.append(f"config says {heads} heads{shared} but the weights hold {len(lm)} lm_heads")
    if "token_map" in tensors and truncated_vocab(cfg) and not shares_lm_head(cfg) and len(lm) > 1:
        bad.append("note: a token_map beside one LM head per head: vLLM refuses it (it loads a truncated vocabulary "
                   "only with original_lm_head); retrain with --shared-lm-head, or without --truncated-vocab-size")
    if any(k.startswith("medusa_head") for k in tensors):
        bad.append("note: original Medusa layout (medusa_head.*): vLLM loads blocks.*/lm_heads.*; convert it")
    hs = [tensors[k][1][0] for k in lm if tensors[k][1]]
    vocab = cfg.get("vocab_size") or (hs[0] if hs else None)
    hidden = cfg.get("hidden_size") or next((s[1][-1] for k, s in tensors.items() if k.startswith("blocks.")), None)
    return FormatCheck(details, bad, hidden, vocab)
