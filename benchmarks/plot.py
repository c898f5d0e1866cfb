"""Peak memory and step time against T, one line per mode, from the CSV of run.py.

    .venv/bin/python benchmarks/plot.py bench_out/results.csv     # writes bench_out/results.png
    .venv/bin/python benchmarks/plot.py a.csv b.csv --out ab.png  # the rows of several runs
    .venv/bin/python benchmarks/run.py ... --plot                 # the same, after the run

One row of three panels per workload of the CSV, against T, on log axes: peak extra
memory of one step (MiB), step time as a ratio to stock Inductor's (``vs stock``), and
the median step time (ms).  The times of one T come from one process that interleaves
the modes (benchmarks/README.md): the ratio is measured side by side, the absolute times
of two T values are not (on a shared machine they follow its load).

matplotlib is an optional benchmark dependency (``pip install -e '.[bench]'``): without
it this prints one line saying so and writes nothing; the CSV is there either way.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
from collections import defaultdict

__all__ = ["LABELS", "load", "series", "write_plot"]

LABELS = {  # mode -> legend
    "eager": "eager",
    "inductor": "stock Inductor",
    "autochunk": "Inductor + AutoChunker",
    "chunked_logits": "chunked_logits (ours)",
    "chunked_logits_dyn": "chunked_logits, dynamic=True",
    "torch_lce": "F.linear_cross_entropy, eager",
    "torch_lce_compiled": "F.linear_cross_entropy, compiled",
}
MISSING = ("plot: matplotlib is not installed, no PNG written "
           "(pip install matplotlib, or pip install -e '.[bench]'); the CSV is {csv}")


def load(csv_path) -> list[dict]:
    with open(csv_path, newline="") as f:
        return list(csv.DictReader(f))


def _number(text: str | None) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return None if value != value else value  # NaN: not measured


def series(rows: list[dict], column: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """workload -> mode -> sorted [(T, value of ``column``)], rows without a value left out."""
    out: dict = defaultdict(lambda: defaultdict(list))
    for r in rows:
        value = _number(r.get(column))
        if value is not None:
            out[r["workload"]][r["mode"]].append((int(r["T"]), value))
    return {w: {m: sorted(pts) for m, pts in modes.items()} for w, modes in out.items()}


def _import_pyplot():
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


PANELS = (("peak_mib", "peak extra memory of one step (MiB)"),
          ("t_ratio_vs_stock", "step time / stock Inductor's"),
          ("t_median_ms", "median step time (ms)"))


def write_plot(csv_path, png_path=None) -> pathlib.Path | None:
    """Plot the CSV at ``csv_path`` (or the rows of a list of CSVs) into ``png_path``
    (default: the (first) CSV's name with .png); the PNG's path, or None (and one line on
    stdout) when matplotlib is missing."""
    paths = [pathlib.Path(p) for p in (csv_path if isinstance(csv_path, (list, tuple)) else [csv_path])]
    png_path = pathlib.Path(png_path) if png_path else paths[0].with_suffix(".png")
    plt = _import_pyplot()
    if plt is None:
        print(MISSING.format(csv=", ".join(map(str, paths))), flush=True)
        return None
    rows = [r for path in paths for r in load(path)]
    data = {column: series(rows, column) for column, _ in PANELS}
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    vocab = {r["workload"]: r["V"] for r in rows}
    plain = plt.FuncFormatter(lambda v, _: f"{v:g}")
    fig, axes = plt.subplots(len(workloads), len(PANELS), squeeze=False,
                             figsize=(5.5 * len(PANELS), 4 * len(workloads)))
    for i, name in enumerate(workloads):
        for j, (column, title) in enumerate(PANELS):
            ax = axes[i][j]
            ts_all = sorted({int(r["T"]) for r in rows if r["workload"] == name})
            for mode, points in data[column].get(name, {}).items():
                ts, values = zip(*points)
                ax.plot(ts, values, marker="o", label=LABELS.get(mode, mode))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(ts_all)
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(plt.NullFormatter())
            ax.yaxis.set_major_locator(plt.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plt.NullFormatter())
            ax.set_xlabel("T (rows)")
            ax.set_title(f"{name}, V {vocab[name]}: {title}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=8)
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    print(f"plot: {png_path}", flush=True)
    return png_path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="*", default=["bench_out/results.csv"], help="run.py's CSV(s)")
    p.add_argument("--out", default=None, help="the PNG (default: next to the first CSV, .png)")
    args = p.parse_args(argv)
    write_plot(args.csv, args.out)


if __name__ == "__main__":
    main()
