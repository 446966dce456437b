"""The `s4kv bench` plot as a self-contained SVG: speed per workload and KV capacity per configuration.

Plain SVG text rather than matplotlib, so the plot is written wherever the benchmark runs and the CPU
tests can check it without a plotting stack. Left panel: each workload's speed relative to
bf16 + FA3 (throughput ratio; for wall-time workloads the inverse of the wall-time ratio, so taller
is faster everywhere). Right panel: KV capacity in tokens from the first capacity row.
"""

from __future__ import annotations

from xml.sax.saxutils import escape

from .matrix import FORMATS
from .report import Row

COLORS = {"bf16_fa3": "#4c72b0", "fp8_fa3": "#8172b2", "vllm_int4": "#c44e52",
          "s4kv_kivi": "#55a868", "s4kv_saw": "#dd8452", "s4kv_saw_rotv": "#937860"}
PANEL_W, PANEL_H, MARGIN, TOP = 520, 300, 60, 50


def speed_ratios(rows: list[Row]) -> dict[str, dict[str, float]]:
    """workload -> format -> speed relative to the baseline (wall-time ratios inverted)."""
    speeds: dict[str, dict[str, float]] = {}
    for row in rows:
        if row.key.startswith("kv:"):
            continue
        speeds[row.key] = {
            fmt: (1.0 / cell.ratio if row.unit == "s" else cell.ratio)
            for fmt, cell in row.cells.items() if cell.ratio
        }
    return speeds


def grouped_bars(groups: dict[str, dict[str, float]], formats: list[str], x0: float, label,
                 reference: float | None = None) -> list[str]:
    """Grouped vertical bars in a panel whose plotting area starts at x0, an optional dashed line at `reference`;
    label(format, value) is the text above a bar. Returns SVG elements."""
    top = max([v for g in groups.values() for v in g.values()] + [reference or 0.0], default=1.0) * 1.15 or 1.0
    area_h = PANEL_H - 2 * MARGIN
    base_y = TOP + MARGIN + area_h
    group_w = (PANEL_W - MARGIN) / max(len(groups), 1)
    bar_w = group_w * 0.8 / max(len(formats), 1)
    out = [f'<line x1="{x0}" y1="{base_y}" x2="{x0 + PANEL_W - MARGIN}" y2="{base_y}" stroke="black"/>']
    if reference is not None:
        y = base_y - area_h * reference / top
        out.append(f'<line class="reference" x1="{x0}" y1="{y:.1f}" x2="{x0 + PANEL_W - MARGIN}" y2="{y:.1f}" '
                   f'stroke="gray" stroke-dasharray="4 3"/>')
    for gi, (group, values) in enumerate(groups.items()):
        gx = x0 + gi * group_w + group_w * 0.1
        out.append(f'<text x="{gx + group_w * 0.4:.1f}" y="{base_y + 16}" font-size="11" '
                   f'text-anchor="middle">{escape(group)}</text>')
        for fi, fmt in enumerate(formats):
            if fmt not in values:
                continue
            value = values[fmt]
            h = area_h * value / top
            x = gx + fi * bar_w
            out.append(f'<rect class="bar" data-group="{escape(group)}" data-format="{fmt}" data-value="{value:.10g}" '
                       f'x="{x:.1f}" y="{base_y - h:.1f}" width="{bar_w * 0.9:.1f}" height="{h:.1f}" '
                       f'fill="{COLORS.get(fmt, "#777777")}"/>')
            out.append(f'<text x="{x + bar_w * 0.45:.1f}" y="{base_y - h - 3:.1f}" font-size="9" '
                       f'text-anchor="middle">{escape(label(fmt, value))}</text>')
    return out


def legend(entries: list[tuple[str, str]], y0: float) -> list[str]:
    """A colour swatch and a label per (colour, label) entry, one row each from y0 down. Returns SVG elements."""
    out = []
    for i, (color, label) in enumerate(entries):
        y = y0 + 18 * i
        out.append(f'<rect x="{MARGIN}" y="{y - 10}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{MARGIN + 18}" y="{y}" font-size="12">{escape(label)}</text>')
    return out


def render_svg(rows: list[Row], title: str) -> str:
    formats = list(rows[0].cells) if rows else []
    speeds = speed_ratios(rows)
    capacity_row = next((r for r in rows if r.key.startswith("kv:")), None)
    capacity = {"": {f: c.value for f, c in capacity_row.cells.items() if c.value}} if capacity_row else {}
    width = 2 * PANEL_W + MARGIN
    height = TOP + PANEL_H + 30 + 18 * len(formats)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="22" font-size="15" text-anchor="middle">{escape(title)}</text>',
             f'<text x="{MARGIN}" y="{TOP + 20}" font-size="12">speed relative to '
             f'{escape(FORMATS["bf16_fa3"].label)} (long: 1 / wall-time ratio)</text>']
    parts += grouped_bars(speeds, formats, MARGIN, lambda fmt, v: f"{v:.2f}x", reference=1.0)
    if capacity_row:
        x0 = PANEL_W + MARGIN
        parts.append(f'<text x="{x0}" y="{TOP + 20}" font-size="12">{escape(capacity_row.title)}</text>')

        def capacity_label(fmt: str, tokens: float) -> str:
            ratio = capacity_row.cells[fmt].ratio
            return f"{tokens / 1e6:.2f}M" + (f" ({ratio:.2f}x)" if ratio else "")

        parts += grouped_bars(capacity, formats, x0, capacity_label)
    parts += legend([(COLORS.get(fmt, "#777777"), FORMATS[fmt].label) for fmt in formats], TOP + PANEL_H + 20)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
