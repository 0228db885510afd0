"""Writers for a BenchReport: CSV (the JSON's numbers, one row per method x workload) and PNG plots.

Plots: ``speedup.png`` (speedup per method, grouped by workload) and ``acceptance.png``
(per-position acceptance rate per method, one panel per workload); a method swept over k (``--sweep-k``) is
one series per k. Files are written atomically.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from specctl.files import write_bytes_atomic

CSV_FIELDS = ("workload", "method", "k", "requests", "new_tokens", "tokens_per_s", "tokens_per_s_min",
              "tokens_per_s_max", "runs", "speedup", "speedup_vs_specctl_baseline", "ttft_s", "target_forwards",
              "identical_to_baseline", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
              "acceptance_rate", "mean_acceptance_length", "acceptance_rate_per_pos", "error")


def write_csv(rows: list[dict], path: str | Path) -> Path:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({**r, "acceptance_rate_per_pos": " ".join(f"{x:.4f}" for x in r["acceptance_rate_per_pos"])})
    path = Path(path)
    write_bytes_atomic(path, buf.getvalue().encode())
    return path


def write_plots(rows: list[dict], header: dict, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(series_name(r, rows) for r in rows if r["method"] != "baseline"))
    title = f"{Path(header['model']).name} · {header['dtype']} · {header['machine']}"
    paths = []

    fig, ax = plt.subplots(figsize=(min(20, max(6, 0.8 * len(workloads) * max(len(methods), 1))), 4.5))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        vals = [next((r["speedup"] or 0 for r in rows if r["workload"] == w and series_name(r, rows) == m), 0)
                for w in workloads]
        xs = [j + i * width for j in range(len(workloads))]
        bars = ax.bar(xs, vals, width, label=m)
        ax.bar_label(bars, fmt="%.2fx", fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, not over them
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "speedup.png"))
    plt.close(fig)

    # one panel per workload (a few panels a line), one curve per method
    curves = [r for r in rows if r["acceptance_rate_per_pos"]]
    panels = list(dict.fromkeys(r["workload"] for r in curves)) or ["(no drafts)"]
    ncols = min(len(panels), 4)
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, 3.2 * nrows), squeeze=False, sharey=True)
    for ax, w in zip(axes.flat, panels):
        for r in curves:
            if r["workload"] == w:
                pos = r["acceptance_rate_per_pos"]
                ax.plot(range(1, len(pos) + 1), pos, marker="o", ms=3, label=series_name(r, rows))
        ax.set_title(w, fontsize=9)
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1.02)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel("acceptance rate")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "acceptance.png"))
    plt.close(fig)
    return paths


def series_name(row: dict, rows: list[dict]) -> str:
    """A row's name in the plots: its method, plus ' k=N' when the method ran at several k (--sweep-k)."""
    ks = {r["k"] for r in rows if r["method"] == row["method"]}
    return f"{row['method']} k={row['k']}" if len(ks) > 1 else row["method"]


def _save(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    write_bytes_atomic(path, buf.getvalue())
    return path
