"""Writers for a BenchReport: CSV (the JSON's numbers, one row per method x workload) and PNG plots.

Plots: ``speedup.png`` (speedup per method, grouped by workload) and ``acceptance.png``
(per-position acceptance rate per method and workload). Files are written atomically.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

CSV_FIELDS = ("workload", "method", "k", "requests", "new_tokens", "tokens_per_s", "tokens_per_s_min",
              "tokens_per_s_max", "runs", "speedup", "speedup_vs_specctl_baseline", "ttft_s", "target_forwards",
              "identical_to_baseline", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
              "acceptance_rate", "mean_acceptance_length", "acceptance_rate_per_pos")


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_csv(rows: list[dict], path: str | Path) -> Path:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({**r, "acceptance_rate_per_pos": " ".join(f"{x:.4f}" for x in r["acceptance_rate_per_pos"])})
    path = Path(path)
    _atomic_write(path, buf.getvalue().encode())
    return path


def write_plots(rows: list[dict], header: dict, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "baseline"))
    title = f"{Path(header['model']).name} · {header['dtype']} · {header['machine']}"
    paths = []

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(workloads) * max(len(methods), 1) / 2), 4))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        vals = [next((r["speedup"] or 0 for r in rows if r["workload"] == w and r["method"] == m), 0) for w in workloads]
        xs = [j + i * width for j in range(len(workloads))]
        bars = ax.bar(xs, vals, width, label=m)
        ax.bar_label(bars, fmt="%.2fx", fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "speedup.png"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        pos = r["acceptance_rate_per_pos"]
        if pos:
            ax.plot(range(1, len(pos) + 1), pos, marker="o", ms=3, label=f"{r['method']} · {r['workload']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "acceptance.png"))
    plt.close(fig)
    return paths


def _save(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    _atomic_write(path, buf.getvalue())
    return path
