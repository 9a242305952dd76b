"""The committed dashboard pictures show the dashboards as they are: each PNG carries the title and row titles it was
drawn with (``dashboards/render.py`` writes them into the PNG's metadata, beside drawing them), and they must be the
committed JSON's. A dashboard that gains, loses or renames a row fails here until its picture is redrawn
(``make dashboard-images``). docs/dashboards.md names every row too, and counts read as Grafana shows them.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "dashboards"))  # dashboards/ is a folder of scripts

import markdown_draw  # noqa: E402
import render  # noqa: E402

TUNING = json.loads((ROOT / "dashboards" / "mooncake-lookups-tuning.json").read_text())


@pytest.mark.parametrize("name,image", sorted(render.IMAGES.items()))
def test_each_picture_carries_its_dashboards_rows(name: str, image: str) -> None:
    dashboard = json.loads((ROOT / "dashboards" / name).read_text())
    with Image.open(ROOT / "dashboards" / "images" / image) as png:
        carried = png.text.get(render.ROWS_KEY)
    assert carried is not None, f"{image} says nothing of what it shows: redraw it (make dashboard-images)"
    assert json.loads(carried) == render.picture_rows(dashboard), \
        f"{image} shows other rows than {name}: redraw it (make dashboard-images)"


@pytest.mark.parametrize("name", sorted(render.IMAGES))
def test_the_dashboards_page_names_every_row(name: str) -> None:
    page = (ROOT / "docs" / "dashboards.md").read_text()
    rows = render.picture_rows(json.loads((ROOT / "dashboards" / name).read_text()))["rows"]
    assert [r for r in rows if f"*{r.split(' (')[0]}" not in page] == []


def test_a_count_reads_as_a_count() -> None:
    assert render.fmt(2048.0, "none") == "2,048"
    assert render.fmt(3.5, "none") == "3.5"
    assert not re.search(r"e\+", render.fmt(16384.0, "short"))
    assert render.fmt(0.0025, "s") == "2.5 ms"
    # No exponents on any axis (Grafana writes none): a tiny share, a rate in thousands.
    assert render.fmt(7.45e-8, "percentunit") == "0.00000745%"
    assert render.fmt(1500.0, "ops") == "1.5K/s" and render.fmt(0.025, "reqps") == "0.025/s"


@pytest.mark.parametrize("image", sorted(render.IMAGES.values()))
def test_each_picture_is_readable_at_the_width_the_docs_show_it(image: str) -> None:
    """docs/dashboards.md shows each picture across the page's column (render.DISPLAY_PX wide): its smallest text
    (tick labels, legends, text panels) must be at least render.MIN_TEXT_PX tall there, and the PNG at least that
    wide, so the page shrinks it rather than blowing it up."""
    with Image.open(ROOT / "dashboards" / "images" / image) as png:
        smallest, width = png.text.get(render.SMALLEST_TEXT_KEY), png.size[0]
    assert smallest is not None, f"{image} was drawn before its text sizes were measured: make dashboard-images"
    assert float(smallest) >= render.MIN_TEXT_PX, f"{image}: text {smallest} px tall at {render.DISPLAY_PX} px wide"
    assert width >= render.DISPLAY_PX


def test_smallest_text_is_measured_at_the_display_width() -> None:
    fig = plt.figure(figsize=(12, 3), dpi=100)
    try:
        fig.text(0.1, 0.5, "big", fontsize=20)
        fig.text(0.5, 0.5, "small", fontsize=9)
        fig.text(0.8, 0.5, "   ", fontsize=2)  # blank: nothing a reader sees
        assert render.smallest_text_px(fig) == pytest.approx(9 / 72 * render.DISPLAY_PX / 12)
    finally:
        plt.close(fig)


def _drawn_text_panel(panel: dict) -> list:
    """The text artists of ``panel`` drawn as render.py draws a text panel."""
    fig = plt.figure(figsize=(24 * render.COL_IN, 6), dpi=render.DPI)
    try:
        g = panel["gridPos"]
        cell = render.Cell(fig, 10, 10, g["w"] * render.COL_IN * render.DPI - 20, g["h"] * render.ROW_IN * render.DPI)
        render._draw(cell, panel, [])
        return [(t.get_text(), t.get_fontweight(), t.get_fontfamily()[0]) for t in fig.texts]
    finally:
        plt.close(fig)


def test_text_panels_are_drawn_as_grafana_renders_their_markdown() -> None:
    """Grafana renders a text panel's markdown (bold, inline code, lists, tables): no markdown syntax is left in the
    picture, bold words are bold, code is monospace, the table's cells are laid out in columns."""
    panels = {p["title"]: p for p in TUNING["panels"] if p["type"] == "text"}
    modes = _drawn_text_panel(panels["Lookup modes and what they cost"])
    words = [w for w, _, _ in modes]
    assert not [w for w in words if any(mark in w for mark in ("**", "`", "|", "---"))], words
    assert {w for w, weight, _ in modes if weight == "bold"} >= {"Three", "costs,", "trade.", "mode", "deferred"}
    assert ("lookup_async", "bold", markdown_draw.MONO) in modes or ("lookup_async", "normal", markdown_draw.MONO) in \
        modes
    assert ("microseconds", "normal", markdown_draw.SANS) in modes
    advice = _drawn_text_panel(panels["What to change"])
    assert [w for w, _, _ in advice].count("•") == 4
    assert not [w for w, _, _ in advice if w.startswith("*")]


def test_markdown_blocks_follow_commonmark_with_tables() -> None:
    got = markdown_draw.blocks("# Title\n\nA **bold** and `code` line.\n\n1. one\n2. two\n\n| a | b |\n| - | - |\n"
                               "| 1 | *2* |\n")
    assert [(b.kind, b.marker) for b in got] == [("heading", ""), ("paragraph", ""), ("item", "1."), ("item", "2."),
                                                 ("table", "")]
    assert markdown_draw.Run("bold", bold=True) in got[1].runs and markdown_draw.Run("code", code=True) in got[1].runs
    header, row = got[4].rows
    assert [r.text for c in header for r in c] == ["a", "b"] and row[1] == [markdown_draw.Run("2", italic=True)]
