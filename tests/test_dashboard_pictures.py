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

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "dashboards"))  # dashboards/ is a folder of scripts

import render  # noqa: E402


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
