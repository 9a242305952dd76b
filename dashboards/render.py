"""Draw the dashboards as PNG images from a real Prometheus: ``python dashboards/render.py --out dashboards/images``.

No Grafana installs here, so this is a picture of what each dashboard shows, not a Grafana screenshot:
every panel sits at its grid position, time series are lines with their legends below them, stats are big
numbers, text panels are their markdown rendered as Grafana renders it (markdown_draw.py). The scale is chosen for
the size the docs show the pictures at (DISPLAY_PX wide): no text smaller than MIN_TEXT_PX there. With no
``--prometheus`` it starts the live stack (real master, lookup server, vLLM schedulers, Prometheus; see
live_stack.py), drives a workload for ``--seconds`` and draws what Prometheus then holds.
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
import matplotlib.font_manager  # noqa: E402
import matplotlib.lines  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.text  # noqa: E402
import matplotlib.ticker  # noqa: E402

import generate  # noqa: E402
import lint  # noqa: E402
import markdown_draw  # noqa: E402
from live_queries import QueryRun, all_values, run_queries  # noqa: E402

# Scale of the picture: the docs show it at DISPLAY_PX wide (GitHub's column for a markdown page); the grid's 24
# columns then get 40 px each, and every text drawn is at least MIN_TEXT_PX tall there (tests read it back from the
# PNG: SMALLEST_TEXT_KEY).
COL_IN = 0.5  # inches per grid column
ROW_IN = 0.42  # inches per grid row
DPI = 100  # pixels per inch of the PNG (1200 px wide: sharp at DISPLAY_PX)
DISPLAY_PX = 960
MIN_TEXT_PX = 10.0
FONT = 10.0  # points: ticks, legends, axis labels, text panels
TITLE_FONT = 11.5
ROW_FONT = 13.5
ROWS_KEY = "mooncake-lookout:rows"  # PNG text chunk: the dashboard's title and row titles, as JSON (tests compare)
SMALLEST_TEXT_KEY = "mooncake-lookout:smallest-text-px"  # PNG text chunk: smallest text, in px at DISPLAY_PX
IMAGES = {generate.OVERVIEW_JSON: "overview.png", generate.TUNING_JSON: "tuning.png"}


def sig3(value: float) -> str:
    """At most three significant digits, never in exponent form (Grafana writes 0.00000745, not 7.45e-06)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def fmt(value: float, unit: str) -> str:
    """A value in the panel's unit, the way Grafana would roughly show it."""
    if not math.isfinite(value):
        return "n/a"
    if unit == "s":
        for scale, suffix in ((1, "s"), (1e-3, "ms"), (1e-6, "µs")):
            if abs(value) >= scale or scale == 1e-6:
                return f"{sig3(value / scale)} {suffix}"
    if unit in ("none", "short", "") and abs(value) >= 1000:
        return f"{value:,.0f}"  # a count, as Grafana shows one: 2,048, not 2.05e+03
    if unit == "percentunit":
        return f"{sig3(value * 100)}%"
    if unit == "bytes":
        for scale, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B")):
            if abs(value) >= scale or scale == 1:
                return f"{sig3(value / scale)} {suffix}"
    if unit in ("reqps", "ops"):
        return f"{sig3(value / 1000)}K/s" if abs(value) >= 1000 else f"{sig3(value)}/s"
    if unit == "Bps":
        return fmt(value, "bytes") + "/s"
    return sig3(value)


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


class Cell:
    """One panel's place in the figure, in figure pixels (origin bottom left), and the figure's drawing helpers."""

    def __init__(self, fig: Any, left: float, bottom: float, width: float, height: float) -> None:
        self.fig, self.left, self.bottom, self.width, self.height = fig, left, bottom, width, height
        self.pt = fig.dpi / 72  # pixels per point

    def frac(self, x: float, y: float, w: float = 0.0, h: float = 0.0) -> tuple[float, float, float, float]:
        """Pixels to figure fractions."""
        W, H = self.fig.bbox.width, self.fig.bbox.height
        return x / W, y / H, w / W, h / H

    def text(self, x: float, y: float, text: str, **kw: Any) -> None:
        """Text at figure pixels (x, y)."""
        fx, fy, _, _ = self.frac(x, y)
        self.fig.text(fx, fy, text, parse_math=False, **kw)


def _fit(cell: Cell, title: str) -> str:
    """A panel title cut with an ellipsis to the panel's width, as Grafana cuts it."""
    renderer = cell.fig.canvas.get_renderer()
    prop = matplotlib.font_manager.FontProperties(size=TITLE_FONT, weight="bold")
    cut = title
    while cut and renderer.get_text_width_height_descent(cut + ("…" if cut != title else ""), prop,
                                                         ismath=False)[0] > cell.width:
        cut = cut[:-1].rstrip()
    return cut if cut == title else cut + "…"


def _legend_columns(fig: Any, labels: list[str], width: float) -> int:
    """As many legend columns as fit ``width`` pixels side by side (at least one)."""
    renderer = fig.canvas.get_renderer()
    prop = matplotlib.font_manager.FontProperties(size=FONT)
    widest = max(renderer.get_text_width_height_descent(label, prop, ismath=False)[0] for label in labels)
    entry = widest + 3.2 * FONT * fig.dpi / 72  # handle, its gap and the column spacing
    return max(1, min(len(labels), int(width // entry)))


def _draw_timeseries(cell: Cell, panel: dict[str, Any], series: list[Any], unit: str, top: float) -> None:
    """A graph with its legend below it, as Grafana's default (list, bottom) legend."""
    fig, pt = cell.fig, cell.pt
    shown = series[:12]
    line = FONT * 1.35 * pt
    ncol = _legend_columns(fig, [name for name, _, _ in shown], cell.width) if shown else 1
    # Grafana scrolls a legend taller than its share of the panel: the picture lists what fits and counts the rest.
    max_rows = max(1, int(0.4 * cell.height // line))
    listed = len(shown) if len(shown) <= max_rows * ncol else max_rows * ncol - 1
    rows = -(-min(len(shown), max_rows * ncol) // ncol)
    legend_h = rows * line + 0.3 * line if shown else 0.0
    axis_h = FONT * 3.3 * pt  # tick labels and the x label under the plot
    y_ticks_w = FONT * 5.2 * pt  # room for the y tick labels left of the plot
    plot_bottom = cell.bottom + legend_h + axis_h
    ax = fig.add_axes(cell.frac(cell.left + y_ticks_w, plot_bottom, cell.width - y_ticks_w,
                                max(top - plot_bottom, line)))
    t0 = min((xs[0] for _, xs, _ in series if xs), default=0.0)
    handles = []
    for name, xs, ys in shown:
        xs_rel = [x - t0 for x in xs]
        if panel["type"] == "state-timeline":
            (h,) = ax.step(xs_rel, ys, where="post", label=name, linewidth=1.2)
        else:
            (h,) = ax.plot(xs_rel, ys, label=name, linewidth=1.2)
        handles.append(h)
    if not series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", fontsize=FONT, color="grey", transform=ax.transAxes)
    ax.tick_params(labelsize=FONT)
    ax.set_xlabel("seconds", fontsize=FONT, labelpad=1)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: fmt(v, unit)))
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
    low = panel.get("fieldConfig", {}).get("defaults", {}).get("min")
    if low is not None and series:
        ax.set_ylim(bottom=low)  # as Grafana honours the panel's min: a flat zero sits on the axis
    # Long tick labels (0.000006%) push left of the cell: move the plot right by what sticks out.
    over = cell.left - ax.get_tightbbox(fig.canvas.get_renderer()).x0
    if over > 0:
        left, bottom, width, height = ax.get_position().bounds
        ax.set_position((left + over / fig.bbox.width, bottom, width - over / fig.bbox.width, height))
    if len(handles) > listed:
        more = matplotlib.lines.Line2D([], [], alpha=0, label=f"+{len(handles) - listed} more")
        handles = [*handles[:listed], more]
    if handles:
        _, y, _, _ = cell.frac(0, cell.bottom + legend_h)
        x, _, _, _ = cell.frac(cell.left, 0)
        fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(x, y), bbox_transform=fig.transFigure,
                   ncol=ncol, fontsize=FONT, frameon=False, handlelength=1.4, handletextpad=0.4, columnspacing=1.2,
                   borderpad=0, borderaxespad=0, labelspacing=0.35)


def _draw_table(cell: Cell, runs: list[QueryRun], top: float) -> None:
    """A table of series labels, one column per label (Grafana's labelsToFields, columns mode), in the order the
    query's ``by (...)`` names them."""
    metrics = [s["metric"] for r in runs for s in r.response.get("data", {}).get("result", [])]
    if not metrics:
        cell.text(cell.left, top - FONT * 1.5 * cell.pt, "no data", fontsize=FONT, color="grey")
        return
    order = [w.strip() for r in runs for m in re.finditer(r"\bby \(([^)]*)\)", r.expr) for w in m.group(1).split(",")]
    present = {k for m in metrics for k in m if k != "__name__"}
    columns = [c for c in dict.fromkeys(order) if c in present] + sorted(present - set(order))
    run = markdown_draw.Run
    rows = [[[run(c)] for c in columns]] + [[[run(m.get(c, ""))] for c in columns] for m in metrics]
    painter = markdown_draw.Painter(cell.fig, (cell.left, cell.bottom, cell.width, top - cell.bottom), FONT)
    painter.table(markdown_draw.Block("table", rows=rows))


def _draw(cell: Cell, panel: dict[str, Any], runs: list[QueryRun]) -> None:
    """Draw one panel in its cell: the title, then its body as Grafana shows that panel type."""
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "none")
    pt = cell.pt
    title_h = TITLE_FONT * 1.7 * pt
    top = cell.bottom + cell.height - title_h
    cell.text(cell.left, top + TITLE_FONT * 0.45 * pt, _fit(cell, panel.get("title", "")), fontsize=TITLE_FONT,
              va="baseline", weight="bold", color="#24292e")
    kind = panel["type"]
    if kind == "text":
        markdown_draw.draw(cell.fig, (cell.left, cell.bottom, cell.width, top - cell.bottom),
                           panel["options"]["content"], FONT)
        return
    series = [s for r in runs for s in _series(r)]
    if kind == "stat":
        # As Grafana does: one big value per series, titled by its legend when there are several.
        last = [(name, ys[-1]) for name, _, ys in series if ys and math.isfinite(ys[-1])]
        if len(last) > 1:
            text, size = "   ".join(f"{name} {fmt(value, unit)}" for name, value in last), 13.0
        else:
            text, size = fmt(last[0][1] if last else float("nan"), unit), 22.0
        cell.text(cell.left + cell.width / 2, cell.bottom + (top - cell.bottom) / 2, text, fontsize=size,
                  ha="center", va="center")
        return
    if kind == "table":
        _draw_table(cell, runs, top)
        return
    _draw_timeseries(cell, panel, series, unit, top)


def smallest_text_px(fig: Any) -> float:
    """Height in pixels of the smallest text drawn in ``fig`` (titles, ticks, legends, text panels) when the picture
    is shown DISPLAY_PX wide."""
    sizes = [t.get_fontsize() for t in fig.findobj(matplotlib.text.Text)
             if t.get_visible() and t.get_text().strip() and _inside(t)]
    return min(sizes) / 72 * DISPLAY_PX / fig.get_figwidth()


def _inside(t: Any) -> bool:
    """False for text artists matplotlib keeps but does not draw (an axis' empty offset text, ticks off-axes)."""
    fig = t.figure
    bbox = t.get_window_extent(fig.canvas.get_renderer())
    return bool(bbox.x1 > 0 and bbox.y1 > 0 and bbox.x0 < fig.bbox.width and bbox.y0 < fig.bbox.height)


def render(name: str, dashboard: dict[str, Any], runs: list[QueryRun], out: Path) -> Path:
    """Draw one dashboard to ``out`` (PNG); returns the path."""
    panels = list(lint.iter_panels(dashboard))
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    top_in = 0.7  # room for the dashboard title above the first row
    height_in = bottom * ROW_IN + top_in + 0.1
    fig = plt.figure(figsize=(24 * COL_IN, height_in), dpi=DPI)
    fig.text(0.01, 1 - 0.25 / height_in, dashboard["title"], fontsize=15, va="top", weight="bold")
    by_panel: dict[int, list[QueryRun]] = {}
    for r in runs:
        by_panel.setdefault(r.panel["id"], []).append(r)
    for p in panels:
        g = p["gridPos"]
        pad_x, pad_y = 0.12, 0.1  # inches between panels
        if p["type"] == "row":
            y = 1 - (top_in + g["y"] * ROW_IN + 0.3) / height_in
            fig.text(0.005, y, p["title"], fontsize=ROW_FONT, weight="bold")
            continue
        left_px = (g["x"] * COL_IN + pad_x) * DPI
        width_px = (g["w"] * COL_IN - 2 * pad_x) * DPI
        bottom_px = (height_in - top_in - (g["y"] + g["h"]) * ROW_IN + pad_y) * DPI
        height_px = (g["h"] * ROW_IN - 2 * pad_y) * DPI
        _draw(Cell(fig, left_px, bottom_px, width_px, height_px), p, by_panel.get(p["id"], []))
    out.parent.mkdir(parents=True, exist_ok=True)
    smallest = smallest_text_px(fig)
    fig.savefig(out, dpi=DPI, metadata={ROWS_KEY: json.dumps(picture_rows(dashboard)),
                                         SMALLEST_TEXT_KEY: f"{smallest:.2f}"})
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


__all__ = ["DISPLAY_PX", "MIN_TEXT_PX", "ROWS_KEY", "SMALLEST_TEXT_KEY", "Cell", "fmt", "legend", "main",
           "picture_rows", "render", "render_all", "sig3", "smallest_text_px"]

if __name__ == "__main__":
    sys.exit(main())
