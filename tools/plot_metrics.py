"""Plot a run's metrics JSONL (`--metrics-path`) to a PNG: reward and eval curves against rollout id.

    python tools/plot_metrics.py outputs/run/metrics.jsonl outputs/run/curve.png
    python tools/plot_metrics.py metrics.jsonl curve.png --keys rollout/raw_reward train/pg_loss --x rollout_id
    python tools/plot_metrics.py opd/metrics.jsonl cmp.png --label OPD --also GRPO=grpo/metrics.jsonl \
        --hline eval/addition "teacher=0.9"

Each line is one JSON object, e.g. {"rollout_id": 3, "rollout/raw_reward": 0.41, "eval/addition": 0.5}. By default
it plots `rollout/raw_reward` and every numeric `eval/<name>` score (not truncation ratios or step counters), one
panel per key; a line without a key is a gap in that curve only. `--also LABEL=PATH` draws other runs' curves in the
same panels (a comparison), `--hline KEY LABEL=VALUE` a labelled horizontal line in KEY's panel.
"""

import argparse
import math
import os
import sys

from slime.utils.data import iter_jsonl

X_KEY = "rollout_id"


def read_metrics(path: str) -> list[dict]:
    rows = list(iter_jsonl(path))
    if not rows:
        raise ValueError(f"{path} has no metrics lines; was the run started with --metrics-path {path}?")
    return rows


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def default_keys(rows: list[dict]) -> list[str]:
    seen = []
    for row in rows:
        for k, v in row.items():
            if k not in seen and _is_number(v):
                seen.append(k)
    evals = [k for k in seen if k.startswith("eval/") and not any(s in k for s in ("truncated", "step", "length"))]
    return [k for k in ["rollout/raw_reward"] if k in seen] + evals


def series(rows: list[dict], key: str, x_key: str = X_KEY):
    xs, ys = [], []
    for i, row in enumerate(rows):
        if _is_number(row.get(key)):
            xs.append(row.get(x_key, i))
            ys.append(row[key])
    return xs, ys


def plot(
    rows: list[dict], out_png: str, keys=None, x_key: str = X_KEY, title=None, label=None, also=(), hlines=()
) -> list[str]:
    """Write the PNG; returns the keys that were plotted. `also`: (label, rows) of other runs drawn in the same
    panels; `hlines`: (key, label, value) horizontal lines."""
    import matplotlib  # heavy: only to draw the PNG

    matplotlib.use("Agg")  # headless: no display on training nodes or CI
    import matplotlib.pyplot as plt  # after use("Agg")

    keys = list(keys) if keys else default_keys(rows)
    plotted = [k for k in keys if series(rows, k, x_key)[0]]
    missing = [k for k in keys if k not in plotted]
    if not plotted:
        available = sorted({k for r in rows for k, v in r.items() if _is_number(v)})
        raise ValueError(f"none of {keys} has numeric values in the metrics; available keys: {available}")
    if missing:
        print(f"plot_metrics: no values for {missing}, skipped", file=sys.stderr)
    fig, axes = plt.subplots(len(plotted), 1, figsize=(8, 2.6 * len(plotted)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], plotted):
        for run_label, run_rows in [(label, rows), *also]:
            xs, ys = series(run_rows, key, x_key)
            ax.plot(xs, ys, marker="o" if len(xs) < 40 else None, markersize=3, linewidth=1.2, label=run_label)
        for line_key, line_label, value in hlines:
            if line_key == key:
                ax.axhline(value, color="gray", linestyle="--", linewidth=1, label=f"{line_label} ({value:g})")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if label or also or any(k == key for k, _, _ in hlines):
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel(x_key)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return plotted


def _split(item: str, flag: str) -> tuple[str, str]:
    label, sep, value = item.partition("=")
    if not sep or not label or not value:
        raise ValueError(f"{flag} {item!r}: expected LABEL=VALUE")
    return label, value


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics_jsonl")
    p.add_argument("out_png")
    p.add_argument("--keys", nargs="+", default=None, help="metrics to plot (default: raw reward + eval scores)")
    p.add_argument("--x", default=X_KEY, help=f"x-axis key (default {X_KEY}; a line without it uses its line number)")
    p.add_argument("--title", default=None)
    p.add_argument("--label", default=None, help="legend label of metrics_jsonl's curves")
    p.add_argument("--also", nargs="+", default=[], metavar="LABEL=PATH", help="other runs' metrics, same panels")
    p.add_argument("--hline", nargs=2, action="append", default=[], metavar=("KEY", "LABEL=VALUE"))
    a = p.parse_args(argv)
    try:
        also = [(lab, read_metrics(path)) for lab, path in (_split(x, "--also") for x in a.also)]
        hlines = [(key, lab, float(v)) for key, (lab, v) in ((k, _split(x, "--hline")) for k, x in a.hline)]
        title = a.title or a.metrics_jsonl
        plotted = plot(read_metrics(a.metrics_jsonl), a.out_png, a.keys, a.x, title, a.label, also, hlines)
    except (OSError, ValueError) as e:
        sys.exit(f"plot_metrics: {e}")
    print(f"wrote {a.out_png} ({', '.join(plotted)})")


if __name__ == "__main__":
    main()
