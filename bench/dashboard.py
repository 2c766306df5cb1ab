"""Draw the Grafana dashboard's panels (cluster.monitoring.PANELS) from a Prometheus's answers.

    python bench/dashboard.py --prometheus http://127.0.0.1:9090 --minutes 10 --out docs/dashboard.png

No Grafana is packaged for this machine, so the picture in docs/deploy.md is drawn here with
matplotlib from `query_range` over the same PromQL the dashboard JSON holds: one subplot per panel,
one line per series. tests/cluster/test_prometheus.py calls `draw` when SPECFLASH_DASHBOARD_PNG is set.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]


def _legend(template: str, labels: dict) -> str:
    for key, value in labels.items():
        template = template.replace("{{" + key + "}}", str(value))
    return template


def draw(prometheus: str, out: str | Path, minutes: float = 10.0, step_s: float = 2.0) -> Path:
    import httpx
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cluster.monitoring import PANELS

    end = time.time()
    start = end - 60 * minutes
    rows = (len(PANELS) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(14, 3 * rows), squeeze=False)
    for ax, (title, (unit, queries)) in zip(axes.flat, PANELS.items()):
        for legend, expr in queries:
            params = {"query": expr, "start": start, "end": end, "step": step_s}
            body = httpx.get(f"{prometheus}/api/v1/query_range", params=params, timeout=30).json()
            for series in body.get("data", {}).get("result", []):
                t = [float(v[0]) - end for v in series["values"]]
                y = [float(v[1]) for v in series["values"]]
                ax.plot(t, y, marker=".", markersize=2, linewidth=1, label=_legend(legend, series["metric"]))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds before the end of the run", fontsize=8)
        ax.set_ylabel(unit, fontsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(PANELS):]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prometheus", required=True, help="base URL of the Prometheus that scraped the run")
    p.add_argument("--minutes", type=float, default=10.0, help="how far back to draw")
    p.add_argument("--out", default="docs/dashboard.png")
    args = p.parse_args(argv)
    print(f"wrote {draw(args.prometheus, args.out, args.minutes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
