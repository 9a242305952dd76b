"""Draw the dashboards as PNG images from a real Prometheus: ``python dashboards/render.py --out dashboards/images``.

No Grafana installs here, so this is a picture of what each dashboard shows, not a Grafana screenshot:
every panel sits at its grid position, time series are lines with their legends, stats are big numbers,
text panels are their text. With no ``--prometheus`` it starts the live stack (real master, lookup
server, vLLM schedulers, Prometheus; see live_stack.py), drives a workload for ``--seconds`` and draws
what Prometheus then holds.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # dashboards/ is a folder of scripts, not an installed package
    sys.path.insert(0, str(HERE))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import generate  # noqa: E402
import lint  # noqa: E402
from live_queries import QueryRun, all_values, run_queries  # noqa: E402

COL_IN = 0.78  # inches per grid column
ROWS_KEY = "mooncake-lookout:rows"  # PNG text chunk: the dashboard's title and row titles, as JSON (tests compare)
ROW_IN = 0.36  # inches per grid row
IMAGES = {generate.OVERVIEW_JSON: "overview.png", generate.TUNING_JSON: "tuning.png"}


def fmt(value: float, unit: str) -> str:
    """A value in the panel's unit, the way Grafana would roughly show it."""
    if not math.isfinite(value):
        return "n/a"
    if unit == "s":
        for scale, suffix in ((1, "s"), (1e-3, "ms"), (1e-6, "µs")):
            if abs(value) >= scale or scale == 1e-6:
                return f"{value / scale:.3g} {suffix}"
    if unit in ("none", "short", "") and abs(value) >= 1000:
        return f"{value:,.0f}"  # a count, as Grafana shows one: 2,048, not 2.05e+03
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    if unit == "bytes":
        for scale, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B")):
            if abs(value) >= scale or scale == 1:
                return f"{value / scale:.3g} {suffix}"
    if unit in ("reqps", "ops"):
        return f"{value:.3g}/s"
    if unit == "Bps":
        return fmt(value, "bytes") + "/s"
    return f"{value:.3g}"


def legend(template: str, metric: dict[str, str]) -> str:
    """Grafana's ``{{label}}`` legend substitution."""
    if template in ("", "__auto"):
        return ",".join(f"{k}={v}" for k, v in metric.items()) or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), template).strip()


def _series(run: QueryRun) -> list[tuple[str, list[float], list[float]]]:
    out = []
    for s in run.response.get("data", {}).get("result", []):
        points = s.get("values") or [s["value"]]
        xs = [float(t) for t, _ in points]
        ys = [float(v) for _, v in points]
        out.append((legend(run.target.get("legendFormat", ""), s["metric"]), xs, ys))
    return out


def _draw(ax: Any, panel: dict[str, Any], runs: list[QueryRun]) -> None:
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "none")
    ax.set_title(panel.get("title", ""), fontsize=8, loc="left")
    kind = panel["type"]
    if kind == "text":
        ax.axis("off")
        text = re.sub(r"[*`]", "", panel["options"]["content"])
        ax.text(0, 1, text, fontsize=5.5, va="top", ha="left", family="monospace", wrap=True,
                transform=ax.transAxes)
        return
    series = [s for r in runs for s in _series(r)]
    if kind in ("stat", "table"):
        ax.axis("off")
        if kind == "stat":
            # As Grafana does: one big value per series, titled by its legend when there are several.
            last = [(name, ys[-1]) for name, _, ys in series if ys and math.isfinite(ys[-1])]
            if len(last) > 1:
                text, size = "   ".join(f"{name} {fmt(value, unit)}" for name, value in last), 10
            else:
                text, size = fmt(last[0][1] if last else float("nan"), unit), 16
            ax.text(0.5, 0.4, text, fontsize=size, ha="center", va="center", transform=ax.transAxes)
        else:
            rows = [name for name, _, _ in series][:6]
            ax.text(0, 0.9, "\n".join(rows) or "no data", fontsize=5.5, va="top", family="monospace",
                    transform=ax.transAxes)
        return
    t0 = min((xs[0] for _, xs, _ in series if xs), default=0.0)
    for name, xs, ys in series[:12]:
        step = "post" if kind == "state-timeline" else None
        xs_rel = [x - t0 for x in xs]
        if step:
            ax.step(xs_rel, ys, where=step, label=name, linewidth=1)
        else:
            ax.plot(xs_rel, ys, label=name, linewidth=1)
    if not series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", fontsize=8, color="grey", transform=ax.transAxes)
    ax.tick_params(labelsize=5.5)
    ax.set_xlabel("seconds", fontsize=5.5)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: fmt(v, unit)))
    if series:
        ax.legend(fontsize=5, loc="upper left", ncol=2, framealpha=0.6)


def render(name: str, dashboard: dict[str, Any], runs: list[QueryRun], out: Path) -> Path:
    """Draw one dashboard to ``out`` (PNG); returns the path."""
    panels = list(lint.iter_panels(dashboard))
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    top_in = 0.9  # room for the dashboard title above the first row
    height_in = bottom * ROW_IN + top_in + 0.1
    fig = plt.figure(figsize=(24 * COL_IN, height_in))
    fig.text(0.01, 1 - 0.3 / height_in, dashboard["title"], fontsize=12, va="top")
    by_panel: dict[int, list[QueryRun]] = {}
    for r in runs:
        by_panel.setdefault(r.panel["id"], []).append(r)
    for p in panels:
        g = p["gridPos"]
        pad_x, pad_y = 0.35, 0.3
        left = (g["x"] * COL_IN + pad_x) / (24 * COL_IN)
        width = (g["w"] * COL_IN - 2 * pad_x) / (24 * COL_IN)
        if p["type"] == "row":
            y = 1 - (top_in + g["y"] * ROW_IN + 0.25) / height_in
            fig.text(0.005, y, p["title"], fontsize=9, weight="bold")
            continue
        bottom_frac = 1 - (top_in + (g["y"] + g["h"]) * ROW_IN - pad_y) / height_in
        h_frac = (g["h"] * ROW_IN - 2 * pad_y) / height_in
        ax = fig.add_axes((left, bottom_frac, width, h_frac))
        _draw(ax, p, by_panel.get(p["id"], []))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72, metadata={ROWS_KEY: json.dumps(picture_rows(dashboard))})
    plt.close(fig)
    return out


def picture_rows(dashboard: dict[str, Any]) -> dict[str, Any]:
    """What a picture says it shows: the dashboard's title and its row titles, in order."""
    rows = [p["title"] for p in lint.iter_panels(dashboard) if p["type"] == "row"]
    return {"title": dashboard["title"], "rows": rows}


def render_all(prom: Any, out_dir: Path, *, rate_interval: str, seconds: float) -> list[Path]:
    """Run every panel query on ``prom`` with every variable at All, and draw each dashboard."""
    paths = []
    for name, image in IMAGES.items():
        dashboard = json.loads((HERE / name).read_text())
        runs = run_queries(prom, name, dashboard, all_values(dashboard), rate_interval=rate_interval,
                           seconds=seconds)
        paths.append(render(name, dashboard, runs, out_dir / image))
    return paths


def main(argv: list[str] | None = None) -> int:
    """Render from a given Prometheus, or from a live stack started for the purpose."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "images", help="folder for the PNGs")
    ap.add_argument("--prometheus", help="base URL of a Prometheus to read (default: start the live stack)")
    ap.add_argument("--rate-interval", default=None, help="value for $__rate_interval (default 10s live, 1m)")
    ap.add_argument("--seconds", type=float, default=60.0, help="time range drawn (and driven, live)")
    args = ap.parse_args(argv)
    if args.prometheus:
        from live_stack import PromAPI

        paths = render_all(PromAPI(args.prometheus), args.out, rate_interval=args.rate_interval or "1m",
                           seconds=args.seconds)
    else:
        from live_stack import RATE_INTERVAL, LiveStack

        with LiveStack() as stack:
            stop = threading.Event()
            worker = stack.drive_in_background(stop)
            try:
                stop.wait(args.seconds)  # the workload runs for the drawn time range
            finally:
                stop.set()
                worker.join(60)
            paths = render_all(stack.prometheus, args.out, rate_interval=args.rate_interval or RATE_INTERVAL,
                               seconds=args.seconds)
    for p in paths:
        print(f"wrote {p}")
    return 0


__all__ = ["ROWS_KEY", "fmt", "legend", "main", "picture_rows", "render", "render_all"]

if __name__ == "__main__":
    sys.exit(main())
