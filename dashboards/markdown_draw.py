"""Draw a Grafana text panel's markdown into a matplotlib picture, the way Grafana renders it.

Grafana renders a text panel in ``markdown`` mode with ``marked``: CommonMark plus GitHub's tables. Here the same
grammar is parsed by markdown-it-py (``commonmark`` preset with ``table`` on) into blocks (paragraphs, headings,
bullet and numbered lists, tables, code blocks, rules) of styled runs (plain, bold, italic, inline code), then laid
out word by word, each word measured by the figure's own renderer, wrapped to the panel's width and cut at its
bottom (Grafana scrolls there). As in Grafana: bold is bold, inline code is monospace on a grey ground, a table has
a bold header row and a rule under each row, list items hang under their bullet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from markdown_it import MarkdownIt
from matplotlib.font_manager import FontProperties
from matplotlib.patches import Rectangle

_MD = MarkdownIt("commonmark").enable("table")
CODE_GROUND = "#ebedf0"  # Grafana's light theme, inline code background
RULE = "#c7d0d9"
SANS, MONO = "DejaVu Sans", "DejaVu Sans Mono"


@dataclass(frozen=True)
class Run:
    """A piece of inline text in one style: ``bold``, ``italic``, ``code`` (monospace on grey)."""

    text: str
    bold: bool = False
    italic: bool = False
    code: bool = False


@dataclass
class Block:
    """One block: ``kind`` is paragraph, heading, item (a list item's paragraph), table, code or rule."""

    kind: str
    runs: list[Run] = field(default_factory=list)
    level: int = 0  # heading level; list depth for items
    marker: str = ""  # an item's bullet or number, on its first paragraph only
    rows: list[list[list[Run]]] = field(default_factory=list)  # table: header row first


def _inline(children: list[Any]) -> list[Run]:
    runs: list[Run] = []
    bold = italic = False
    for tok in children:
        if tok.type in ("strong_open", "strong_close"):
            bold = tok.type == "strong_open"
        elif tok.type in ("em_open", "em_close"):
            italic = tok.type == "em_open"
        elif tok.type == "code_inline":
            runs.append(Run(tok.content, code=True))
        elif tok.type == "softbreak":
            runs.append(Run(" ", bold, italic))
        elif tok.type == "hardbreak":
            runs.append(Run("\n", bold, italic))
        elif tok.type in ("text", "html_inline") and tok.content:
            runs.append(Run(tok.content, bold, italic))
    return runs


def blocks(markdown: str) -> list[Block]:
    """The blocks of ``markdown``, in order."""
    out: list[Block] = []
    lists: list[list[Any]] = []  # [ordered, next number] per open list
    marker = ""
    table: Block | None = None
    row: list[list[Run]] = []
    heading = 0
    for tok in _MD.parse(markdown):
        kind = tok.type
        if kind in ("bullet_list_open", "ordered_list_open"):
            lists.append([kind == "ordered_list_open", int(tok.attrGet("start") or 1)])
        elif kind in ("bullet_list_close", "ordered_list_close"):
            lists.pop()
        elif kind == "list_item_open":
            ordered, number = lists[-1]
            marker = f"{number}." if ordered else "•"
            lists[-1][1] = number + 1
        elif kind == "heading_open":
            heading = int(tok.tag[1:])
        elif kind == "table_open":
            table = Block("table")
        elif kind == "tr_open":
            row = []
        elif kind == "tr_close" and table is not None:
            table.rows.append(row)
        elif kind == "table_close" and table is not None:
            out.append(table)
            table = None
        elif kind == "inline":
            runs = _inline(tok.children or [])
            if table is not None:
                row.append(runs)
            elif heading:
                out.append(Block("heading", runs, level=heading))
                heading = 0
            elif lists:
                out.append(Block("item", runs, level=len(lists), marker=marker))
                marker = ""
            else:
                out.append(Block("paragraph", runs))
        elif kind in ("fence", "code_block"):
            out.append(Block("code", [Run(tok.content.rstrip("\n"), code=True)]))
        elif kind == "hr":
            out.append(Block("rule"))
    return out


class Painter:
    """Lays blocks out in a box of a figure (pixels, origin bottom left) and draws them as text artists."""

    def __init__(self, fig: Any, box: tuple[float, float, float, float], fontsize: float) -> None:
        self.fig, self.size = fig, fontsize
        self.x0, self.y0, self.width, self.height = box
        self.renderer = fig.canvas.get_renderer()
        self.px_per_pt = fig.dpi / 72
        self.line = fontsize * 1.45 * self.px_per_pt
        self.y = self.y0 + self.height  # baseline cursor moves down from the top

    def font(self, run: Run, bold: bool = False) -> FontProperties:
        """The font of a run (``bold`` forces bold, as in a table header)."""
        return FontProperties(family=MONO if run.code else SANS, weight="bold" if run.bold or bold else "normal",
                              style="italic" if run.italic else "normal", size=self.size * (0.92 if run.code else 1))

    def measure(self, text: str, prop: FontProperties) -> float:
        """Width in pixels of ``text`` in ``prop``, as the renderer draws it (trailing spaces counted)."""
        w, _, _ = self.renderer.get_text_width_height_descent(text.replace(" ", "\u00a0"), prop, ismath=False)
        return float(w)

    def wrap(self, runs: list[Run], width: float, bold: bool = False) -> list[list[tuple[float, str, Run]]]:
        """Lines of (x offset, word, run): words wrap at spaces to fit ``width``; a word wider than it stays whole."""
        lines: list[list[tuple[float, str, Run]]] = [[]]
        x = 0.0
        for run in runs:
            if run.text == "\n":
                lines.append([])
                x = 0.0
                continue
            prop = self.font(run, bold)
            space = self.measure(" ", prop)
            parts = run.text.split(" ")
            for i, word in enumerate(parts):
                if i:  # the space before this word
                    x += space
                if not word:
                    continue
                w = self.measure(word, prop)
                if x + w > width and lines[-1]:
                    lines.append([])
                    x = 0.0
                lines[-1].append((x, word, run))
                x += w
        return [line for line in lines if line] or [[]]

    def natural(self, runs: list[Run], bold: bool = False) -> float:
        """Width in pixels of ``runs`` on one line (unwrapped)."""
        line = self.wrap(runs, float("inf"), bold)[0]
        if not line:
            return 0.0
        x, word, run = line[-1]
        return x + self.measure(word, self.font(run, bold))

    def widest_word(self, runs: list[Run], bold: bool = False) -> float:
        """Width in pixels of the widest word of ``runs`` (a column is never narrower)."""
        return max((self.measure(word, self.font(run, bold)) for line in self.wrap(runs, float("inf"), bold)
                    for _, word, run in line), default=0.0)

    def fits(self) -> bool:
        """True while the cursor is inside the box (Grafana scrolls past its bottom: the picture stops there)."""
        return self.y - self.line >= self.y0

    def put(self, x: float, word: str, run: Run, bold: bool = False) -> None:
        """Draw one word with its baseline at the cursor line."""
        W, H = self.fig.bbox.width, self.fig.bbox.height
        prop = self.font(run, bold)
        base = self.y - self.line * 0.75
        if run.code:
            w = self.measure(word, prop)
            self.fig.add_artist(Rectangle(((x - 2) / W, (base - self.line * 0.22) / H), (w + 4) / W,
                                          self.line * 0.9 / H, transform=self.fig.transFigure, color=CODE_GROUND,
                                          zorder=1))
        self.fig.text(x / W, base / H, word, fontproperties=prop, va="baseline", ha="left", zorder=2,
                      parse_math=False)

    def lines(self, lines: list[list[tuple[float, str, Run]]], x: float, bold: bool = False) -> None:
        """Draw wrapped lines from the cursor down, as many as fit."""
        for line in lines:
            if not self.fits():
                return
            for dx, word, run in line:
                self.put(x + dx, word, run, bold)
            self.y -= self.line

    def rule(self, x: float, width: float) -> None:
        """A thin horizontal rule at the cursor."""
        W, H = self.fig.bbox.width, self.fig.bbox.height
        y = (self.y - self.line * 0.1) / H
        self.fig.add_artist(Rectangle((x / W, y), width / W, 1 / H, transform=self.fig.transFigure, color=RULE))

    def table(self, block: Block) -> None:
        """Columns laid out as a browser's automatic table layout does: each at least as wide as its widest word,
        the room left shared in proportion to what each column's cells would take on one line."""
        pad = self.size * self.px_per_pt
        ncols = max(len(r) for r in block.rows)
        cols = [[(row[c], i == 0) for i, row in enumerate(block.rows) if c < len(row)] for c in range(ncols)]
        natural = [max(self.natural(runs, bold) for runs, bold in col) + pad for col in cols]
        least = [max(self.widest_word(runs, bold) for runs, bold in col) + pad for col in cols]
        room = self.width - sum(least)
        if sum(natural) <= self.width:
            widths = natural
        else:
            extra = [n - m for n, m in zip(natural, least)]
            widths = [m + max(room, 0.0) * e / (sum(extra) or 1.0) for m, e in zip(least, extra)]
        for i, row in enumerate(block.rows):
            cells = [self.wrap(cell, widths[c] - pad, bold=i == 0) for c, cell in enumerate(row)]
            height = max(len(c) for c in cells)
            if self.y - self.line * height < self.y0:
                return
            top = self.y
            x = self.x0
            for c, cell in enumerate(cells):
                self.y = top
                self.lines(cell, x, bold=i == 0)
                x += widths[c]
            self.y = top - self.line * height
            self.rule(self.x0, sum(widths))
            self.y -= self.line * 0.2

    def draw(self, markdown: str) -> None:
        """Draw ``markdown`` into the box."""
        gap = self.line * 0.45
        for block in blocks(markdown):
            if not self.fits():
                return
            if block.kind == "table":
                self.table(block)
            elif block.kind == "rule":
                self.rule(self.x0, self.width)
                self.y -= self.line * 0.5
            elif block.kind == "heading":
                runs = [Run(r.text, True, r.italic, r.code) for r in block.runs]
                self.lines(self.wrap(runs, self.width), self.x0)
            elif block.kind == "item":
                indent = self.line * 1.1 * block.level
                if block.marker and self.fits():
                    self.put(self.x0 + indent - self.line * 0.9, block.marker, Run(block.marker))
                self.lines(self.wrap(block.runs, self.width - indent), self.x0 + indent)
                gap_after = self.line * 0.15
                self.y -= gap_after
                continue
            elif block.kind == "code":
                for text in block.runs[0].text.split("\n"):
                    self.lines([[(0.0, text, Run(text, code=True))]], self.x0)
            else:
                self.lines(self.wrap(block.runs, self.width), self.x0)
            self.y -= gap


def draw(fig: Any, box: tuple[float, float, float, float], markdown: str, fontsize: float) -> None:
    """Draw ``markdown`` in ``box`` = (x0, y0, width, height), figure pixels from the bottom left."""
    Painter(fig, box, fontsize).draw(markdown)


__all__ = ["Block", "Painter", "Run", "blocks", "draw"]
