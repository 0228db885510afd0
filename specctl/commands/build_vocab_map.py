"""`specctl build-vocab-map`: map a draft's vocabulary onto a target's, and/or EAGLE-3's reduced vocabulary.

Thin: resolve the two tokenizers, call ``specctl.drafts.vocab_map``, write the file, render the
overlap. Progress on stderr, results on stdout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from specctl.commands._options import JsonOpt

HELP = """Map a draft model's vocabulary onto a target's, so that a draft with another tokenizer stays lossless.

Tokens are matched by the bytes they stand for (byte-level 'Ġ'/'Ċ', sentencepiece '▁' and <0xNN> byte tokens undone). The map stores both tokenizers' fingerprints and is refused for any other pair. The draft_model method drafts through this token-level intersection, or through text when the overlap is too low (the report says which). Hand it over with the speculative config's "vocab_map" key (specctl's; without it the map is built at load).

With --draft-vocab-size N --data FILE it also builds EAGLE-3's reduced draft vocabulary (d2t/t2d): the N target tokens most frequent in FILE (.jsonl, .json, text, or a folder). --draft may then be omitted.

Overlap and file go to stdout (--json for machines), progress to stderr.

Examples:

  specctl build-vocab-map --draft smollm2-135m --target qwen2.5-coder-1.5b --output map.safetensors

  specctl bench --model qwen2.5-coder-1.5b --speculative-config '{"method": "draft_model", "model": "smollm2-135m", "vocab_map": "map.safetensors"}'

  specctl build-vocab-map --target qwen2.5-coder-1.5b --draft-vocab-size 32000 --data prompts.jsonl --output d2t.safetensors --json
"""


def build_vocab_map_cmd(
    target: Annotated[str, typer.Option("--target", "-t", help="Target model: HF folder (a tokenizer-only folder is enough), .gguf file, or catalogue name.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Map file to write: .safetensors, or .json for JSON.")],
    draft: Annotated[Optional[str], typer.Option("--draft", "-d", help="Draft model (same forms as --target).")] = None,
    draft_vocab_size: Annotated[Optional[int], typer.Option("--draft-vocab-size", help="EAGLE-3: size N of the reduced draft vocabulary (needs --data).")] = None,
    data: Annotated[Optional[Path], typer.Option("--data", help="EAGLE-3: text whose token frequencies pick the N tokens.")] = None,
    json_out: JsonOpt = False,
) -> None:
    from specctl.errors import UsageError

    if draft is None and draft_vocab_size is None:
        raise UsageError("nothing to build: give --draft (a token map) and/or --draft-vocab-size with --data",
                         "e.g. specctl build-vocab-map --draft smollm2-135m --target qwen2.5-coder-1.5b --output map.safetensors")
    if (draft_vocab_size is None) != (data is None):
        raise UsageError("--draft-vocab-size and --data go together", "give both, e.g. --draft-vocab-size 32000 --data prompts.jsonl")
    if draft_vocab_size is not None and draft_vocab_size <= 0:
        raise UsageError(f"--draft-vocab-size must be positive, got {draft_vocab_size}", "pass e.g. --draft-vocab-size 32000")
    if output.suffix not in (".safetensors", ".json"):
        raise UsageError(f"--output {output} must end in .safetensors or .json", "e.g. --output map.safetensors")
    from specctl.files import unwritable

    if (bad := unwritable(output, folder=False)) is not None:
        raise UsageError(f"--output: {bad}", "choose a file path you can write to")

    from rich.console import Console

    err = Console(stderr=True, log_path=False)
    from specctl.drafts.draft_vocab import build_draft_vocab
    from specctl.drafts.vocab_map import VocabMap, build_vocab_map, tokenizer_fingerprint

    t_tok, t_name, t_vocab = _tokenizer(target, err)
    if draft is not None:
        d_tok, d_name, _ = _tokenizer(draft, err)
        err.log(f"mapping {len(d_tok)} draft tokens onto {len(t_tok)} target tokens by byte string")
        vmap = build_vocab_map(d_tok, t_tok, d_name, t_name, t_vocab)
    else:
        vmap = VocabMap(tokenizer_fingerprint(t_tok), max(t_vocab, len(t_tok)), target_name=t_name)
    if draft_vocab_size is not None:
        err.log(f"counting target tokens in {data}")
        vmap.draft_vocab = build_draft_vocab(t_tok, data, draft_vocab_size, vmap.target_vocab_size,
                                             on_skip=lambda f, why: err.log(f"skipping {f} ({why})"))
        vmap.info = dict(vmap.info, data=str(data))
    vmap.save(output)
    err.log(f"wrote {output}")

    report = dict(vmap.overlap(), output=str(output))
    if draft is not None:
        from specctl.runtime.proposers.draft_model import MIN_TLI_AGREEMENT, MIN_TLI_COVERAGE
        from specctl.drafts.vocab_map import boundary_agreement

        same = vmap.draft_fingerprint == vmap.target_fingerprint
        report["draft_model_mode"] = "same" if same else ("auto" if vmap.draft_coverage >= MIN_TLI_COVERAGE else "text")
        report["min_tli_agreement"] = MIN_TLI_AGREEMENT
        # how often the two tokenizers cut real text at the same bytes (the ceiling of the intersection)
        probes = {"code": Path(json.decoder.__file__).read_text()[:8000]}
        if data is not None:
            from specctl.drafts.draft_vocab import read_texts

            probes["data"] = "\n".join(t for _, t in zip(range(200), read_texts(data)))[:20000]
        report["boundary_agreement"] = {k: boundary_agreement(d_tok, t_tok, v) for k, v in probes.items() if v}
    if json_out:
        typer.echo(json.dumps(report, indent=2))
        return
    render(report)


def _tokenizer(spec: str, err) -> tuple[object, str, int]:
    """(tokenizer, display name, model vocab size) of a model spec; a tokenizer-only folder is enough."""
    from transformers import AutoTokenizer

    from specctl.errors import ModelError
    from specctl.models import resolve_model

    path = Path(spec).expanduser()
    if not (path.is_dir() and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))):
        try:  # a tokenizer is the same in every dtype: take whichever copy is in the cache
            path = resolve_model(spec, dtype="bfloat16", pull=False)
        except ModelError:
            try:
                path = resolve_model(spec, dtype="float32", pull=False)
            except ModelError:
                path = resolve_model(spec, dtype="bfloat16")
    err.log(f"loading the tokenizer of {spec} ({path})")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is a model-folder problem
        raise ModelError(f"cannot load a tokenizer from {path} ({type(e).__name__})",
                         "the folder needs tokenizer.json or tokenizer_config.json") from None
    vocab = len(tok)
    cfg = path / "config.json"
    if cfg.is_file():
        try:
            vocab = max(vocab, int(json.loads(cfg.read_text()).get("vocab_size") or 0))
        except (ValueError, json.JSONDecodeError):
            pass
    name = spec if not Path(spec).expanduser().exists() else path.name
    return tok, name, vocab


def render(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"vocab map → {r['output']}", title_justify="left", show_header=False)
    t.add_column("", style="bold", no_wrap=True)
    t.add_column("")
    if "draft_vocab_size" in r:
        t.add_row("draft", f"{r['draft']} ({r['draft_vocab_size']} tokens, {r.get('draft_scheme', '?')}, "
                           f"fingerprint {r['draft_fingerprint'][:12]})")
    t.add_row("target", f"{r['target']} ({r['target_vocab_size']} ids, fingerprint {r['target_fingerprint'][:12]})")
    if "draft_vocab_size" in r:
        t.add_row("shared tokens", f"{r['shared_tokens']}")
        t.add_row("overlap", f"{r['draft_coverage']:.1%} of the draft vocabulary, {r['target_coverage']:.1%} of the target's")
        for name, a in r.get("boundary_agreement", {}).items():
            what = "stdlib json/decoder.py" if name == "code" else r.get("data", "--data")
            t.add_row(f"cut alike ({name})", f"{a:.1%} of the target's tokens are draft tokens too, on {what}")
        mode = {"same": "same tokenizer: ids pass straight through",
                "auto": f"token-level intersection while the recent text is cut alike (>= {r['min_tli_agreement']:.0%}), "
                        "else text (the draft's text re-tokenized)",
                "text": "text: the draft's text re-tokenized (the vocabularies share too little)"}[r["draft_model_mode"]]
        t.add_row("draft_model drafts by", mode)
    if "eagle3_draft_vocab" in r:
        e = r["eagle3_draft_vocab"]
        t.add_row("EAGLE-3 d2t/t2d", f"{e['draft_vocab_size']} tokens cover {e['data_coverage']:.1%} of "
                                     f"{e['tokens_counted']} tokens in {r.get('data', 'the data')}")
    Console().print(t)


def register(app: typer.Typer) -> None:
    app.command("build-vocab-map", help=HELP)(build_vocab_map_cmd)
