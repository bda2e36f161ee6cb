"""Hand-written SVG charts: line charts (linear or log axes) and grouped bar charts.

Written by hand rather than with matplotlib so the harness needs nothing beyond
Python's standard library to draw its pictures, and the SVGs are small and diffable.
"""

from __future__ import annotations

import math
from html import escape

W, H = 760, 440
ML, MR, MT, MB = 80, 170, 48, 70  # margins: left, right (legend), top, bottom
PALETTE = {
    "flatmesh": "#d62728",
    "envoy": "#1f77b4",
    "haproxy": "#2ca02c",
    "nginx": "#9467bd",
    "direct": "#7f7f7f",
}
EXTRA = ["#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


def color(name: str, i: int) -> str:
    return PALETTE.get(name, EXTRA[i % len(EXTRA)])


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    start = math.floor(lo / step) * step
    ticks = []
    t = start
    while t <= hi + step * 1e-9:
        if t >= lo - step * 1e-9:
            ticks.append(round(t, 10))
        t += step
    return ticks


def log_ticks(lo: float, hi: float) -> list[float]:
    ticks = []
    e = math.floor(math.log10(lo))
    while 10**e <= hi * 1.0001:
        for m in (1, 2, 5):
            v = m * 10**e
            if lo * 0.9999 <= v <= hi * 1.0001:
                ticks.append(v)
        e += 1
    return ticks


def fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e6:
        return f"{v / 1e6:g}M"
    if abs(v) >= 1e3:
        return f"{v / 1e3:g}k"
    if abs(v) >= 1:
        return f"{v:g}"
    return f"{v:.3g}"


class Axis:
    def __init__(self, lo: float, hi: float, a: float, b: float, log: bool):
        self.log = log
        if log:
            lo = max(lo, 1e-9)
            hi = max(hi, lo * 1.0001)
            self.lo, self.hi = 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi))
            self.ticks = log_ticks(self.lo, self.hi)
        else:
            self.ticks = nice_ticks(lo, hi)
            self.lo, self.hi = min(self.ticks[0], lo), max(self.ticks[-1], hi)
        self.a, self.b = a, b

    def __call__(self, v: float) -> float:
        if self.log:
            f = (math.log10(max(v, 1e-12)) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            f = (v - self.lo) / ((self.hi - self.lo) or 1)
        return self.a + f * (self.b - self.a)


def _frame(title: str, xlabel: str, ylabel: str) -> list[str]:
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        'font-family="Helvetica, Arial, sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{ML + (W - ML - MR) / 2}" y="24" text-anchor="middle" font-size="15" font-weight="bold">{escape(title)}</text>',
        f'<text x="{ML + (W - ML - MR) / 2}" y="{H - 14}" text-anchor="middle" font-size="13">{escape(xlabel)}</text>',
        f'<text transform="translate(18,{MT + (H - MT - MB) / 2}) rotate(-90)" text-anchor="middle" font-size="13">{escape(ylabel)}</text>',
    ]


def _axes(xa: Axis, ya: Axis, xticks: list[float] | None = None) -> list[str]:
    out = []
    x0, x1, y0, y1 = ML, W - MR, H - MB, MT
    for t in ya.ticks:
        y = ya(t)
        out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
    for t in xticks if xticks is not None else xa.ticks:
        x = xa(t)
        out.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + 5}" stroke="black"/>')
        out.append(f'<text x="{x:.1f}" y="{y0 + 19}" text-anchor="middle">{fmt(t)}</text>')
    out.append(f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="black"/>')
    out.append(f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="black"/>')
    return out


def _legend(entries: list[tuple[str, str, str]]) -> list[str]:
    out = []
    x = W - MR + 16
    for i, (label, col, dash) in enumerate(entries):
        y = MT + 8 + i * 20
        d = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<line x1="{x}" y1="{y}" x2="{x + 24}" y2="{y}" stroke="{col}" stroke-width="2.5"{d}/>')
        out.append(f'<text x="{x + 30}" y="{y + 4}">{escape(label)}</text>')
    return out


def line_chart(
    series: list[tuple[str, str, list[tuple[float, float]], str]],
    title: str,
    xlabel: str,
    ylabel: str,
    log_x: bool = False,
    log_y: bool = False,
    y_from_zero: bool = True,
) -> str:
    """series: (label, color, points, dash pattern or "")."""
    pts = [p for _, _, s, _ in series for p in s if p[1] is not None]
    if not pts:
        return ""
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    xa = Axis(min(xs), max(xs), ML, W - MR, log_x)
    ya = Axis(0 if (y_from_zero and not log_y) else min(ys), max(ys) * (1.0 if log_y else 1.05), H - MB, MT, log_y)
    out = _frame(title, xlabel, ylabel)
    xticks = sorted(set(xs)) if log_x or len(set(xs)) <= 8 else None
    out += _axes(xa, ya, xticks)
    for label, col, s, dash in series:
        s = sorted(p for p in s if p[1] is not None)
        if not s:
            continue
        d = " ".join(f"{xa(x):.1f},{ya(y):.1f}" for x, y in s)
        da = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<polyline points="{d}" fill="none" stroke="{col}" stroke-width="2.5"{da}/>')
        for x, y in s:
            out.append(f'<circle cx="{xa(x):.1f}" cy="{ya(y):.1f}" r="3.2" fill="{col}"><title>{escape(label)}: {fmt(x)}, {y:.4g}</title></circle>')
    out += _legend([(label, col, dash) for label, col, _, dash in series])
    out.append("</svg>")
    return "\n".join(out) + "\n"


def bar_chart(groups: list[str], bars: list[tuple[str, str, list[float | None]]], title: str, ylabel: str, xlabel: str) -> str:
    """groups along x; each bar series has one value per group (None = no bar)."""
    vals = [v for _, _, vs in bars for v in vs if v is not None]
    if not vals or not groups:
        return ""
    ya = Axis(0, max(vals) * 1.08, H - MB, MT, False)
    out = _frame(title, xlabel, ylabel)
    out += _axes(Axis(0, 1, ML, W - MR, False), ya, xticks=[])
    gw = (W - MR - ML) / len(groups)
    bw = gw * 0.8 / max(1, len(bars))
    for gi, g in enumerate(groups):
        gx = ML + gi * gw
        # Two lines (split at the first "_") so long scenario names do not overlap.
        first, _, rest = g.partition("_")
        cx = gx + gw / 2
        out.append(
            f'<text x="{cx:.1f}" y="{H - MB + 16}" text-anchor="middle" font-size="11">{escape(first)}'
            f'<tspan x="{cx:.1f}" dy="13">{escape(rest)}</tspan></text>'
        )
        for bi, (label, col, vs) in enumerate(bars):
            v = vs[gi]
            if v is None:
                continue
            x = gx + gw * 0.1 + bi * bw
            y = ya(v)
            out.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw - 2:.1f}" height="{H - MB - y:.1f}" fill="{col}">'
                f"<title>{escape(label)} {escape(g)}: {v:.4g}</title></rect>"
            )
    out += _legend([(label, col, "") for label, col, _ in bars])
    out.append("</svg>")
    return "\n".join(out) + "\n"
