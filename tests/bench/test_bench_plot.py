"""The SVG plot: one bar per measured (workload, format), heights proportional to the ratios."""

import random
import xml.etree.ElementTree as ET

import pytest

from s4kv.runtime.bench import report as bench_report
from s4kv.runtime.bench.matrix import FULL_CARD
from s4kv.runtime.bench.plot import render_svg, speed_ratios

SVG = "{http://www.w3.org/2000/svg}"


def make_doc():
    base_short, base_long = random.uniform(6000, 8000), random.uniform(10, 20)
    formats = {"bf16_fa3": (2_043_840, 1.0, 1.0), "vllm_int4": (7_694_464, 0.61, 5.4),
               "s4kv_saw": (7_694_464, random.uniform(0.8, 1.3), random.uniform(0.7, 1.2))}
    runs = [{"format": fmt, "engine": FULL_CARD.as_dict(), "workloads": ["short", "long"], "status": "ok",
             "kv_cache_tokens": kv, "startup_s": 55.0,
             "results": {"short": {"output_tok_s": base_short * s}, "long": {"wall_s": base_long * w}}}
            for fmt, (kv, s, w) in formats.items()]
    return {"meta": {"gpu": "NVIDIA H200"}, "runs": runs}, formats


def bars(svg_text):
    root = ET.fromstring(svg_text)
    return [r for r in root.iter(SVG + "rect") if r.get("class") == "bar"]


def test_speed_ratios_invert_wall_time():
    doc, formats = make_doc()
    speeds = speed_ratios(bench_report.build_table(doc))
    assert speeds["short"]["s4kv_saw"] == pytest.approx(formats["s4kv_saw"][1])
    assert speeds["long"]["vllm_int4"] == pytest.approx(1 / 5.4)
    assert speeds["long"]["bf16_fa3"] == pytest.approx(1.0)


def test_svg_has_a_bar_per_value_with_proportional_heights():
    doc, formats = make_doc()
    svg = render_svg(bench_report.build_table(doc), "test plot <H200>")
    found = bars(svg)
    # 2 workloads x 3 formats of speed + 3 capacity bars
    assert len(found) == 9
    short = {b.get("data-format"): b for b in found if b.get("data-group") == "short"}
    ratio = float(short["s4kv_saw"].get("height")) / float(short["bf16_fa3"].get("height"))
    assert ratio == pytest.approx(formats["s4kv_saw"][1], rel=0.02)
    capacity = {b.get("data-format"): b for b in found if b.get("data-group") == ""}
    assert float(capacity["vllm_int4"].get("data-value")) == 7_694_464
    assert float(capacity["vllm_int4"].get("height")) / float(capacity["bf16_fa3"].get("height")) == \
        pytest.approx(7_694_464 / 2_043_840, rel=0.02)
    assert "test plot &lt;H200&gt;" in svg
    assert "2.04M (1.00x)" in svg and "7.69M (3.76x)" in svg
    # the dashed 1.0x line sits exactly at the top of the baseline's speed bar
    line = next(e for e in ET.fromstring(svg).iter(SVG + "line") if e.get("class") == "reference")
    top_of_bf16 = float(short["bf16_fa3"].get("y"))
    assert float(line.get("y1")) == pytest.approx(top_of_bf16, abs=0.11)


def test_failed_format_has_no_bar_but_stays_in_legend():
    doc, _ = make_doc()
    doc["runs"].append({"format": "s4kv_kivi", "engine": FULL_CARD.as_dict(), "workloads": ["short", "long"],
                        "status": "failed", "error": "boom"})
    svg = render_svg(bench_report.build_table(doc), "t")
    assert not [b for b in bars(svg) if b.get("data-format") == "s4kv_kivi"]
    assert "s4kv int4_kivi" in svg
