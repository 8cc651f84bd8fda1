"""A small SVG canvas for the docs' pictures (no plotting library): cells, text, arrows, and the look they share."""

from __future__ import annotations

from html import escape

FONT = "font-family='DejaVu Sans Mono, monospace' font-size='11'"
# One colour per request / kind of cell; kept few and distinguishable in grey scale too.
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2")


class Svg:
    """An SVG canvas that grows to fit what is drawn on it; cells carry data attributes (the tests read them)."""

    def __init__(self):
        self.items: list[str] = []
        self.width = self.height = 0

    def _fit(self, x, y):
        self.width, self.height = max(self.width, round(x) + 4), max(self.height, round(y) + 4)

    def cell(self, x, y, w, h, fill, label="", text_fill="#000", **data):
        attrs = "".join(f" data-{k.replace('_', '-')}='{escape(str(v))}'" for k, v in data.items())
        self.items.append(f"<rect x='{x}' y='{y}' width='{w}' height='{h}' fill='{fill}' stroke='#555' "
                          f"stroke-width='0.5'{attrs}/>")
        if str(label):                           # 0 is a label too
            self.text(x + w / 2, y + h / 2 + 4, label, anchor="middle", fill=text_fill)
        self._fit(x + w, y + h)

    rect = cell

    def text(self, x, y, text, anchor="start", fill="#000", bold=False):
        weight = " font-weight='bold'" if bold else ""
        self.items.append(f"<text x='{x}' y='{y}' text-anchor='{anchor}' fill='{fill}' {FONT}{weight}>"
                          f"{escape(str(text))}</text>")
        self._fit(x + (0 if anchor != "start" else 7 * len(str(text))), y)

    def line(self, x1, y1, x2, y2, colour="#555"):
        self.items.append(f"<line x1='{x1}' y1='{y1}' x2='{x2}' y2='{y2}' stroke='{colour}' stroke-width='1.2' "
                          "marker-end='url(#arrow)'/>")
        self._fit(max(x1, x2), max(y1, y2))

    def plain_line(self, x1, y1, x2, y2, colour="#888", width=1.0):
        self.items.append(f"<line x1='{x1}' y1='{y1}' x2='{x2}' y2='{y2}' stroke='{colour}' "
                          f"stroke-width='{width}'/>")
        self._fit(max(x1, x2), max(y1, y2))

    def render(self) -> str:
        arrow = ("<defs><marker id='arrow' markerWidth='8' markerHeight='8' refX='7' refY='4' orient='auto'>"
                 "<path d='M0,0 L8,4 L0,8 z' fill='#555'/></marker></defs>")
        return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{self.width}' height='{self.height}' "
                f"viewBox='0 0 {self.width} {self.height}'>{arrow}" + "".join(self.items) + "</svg>\n")
