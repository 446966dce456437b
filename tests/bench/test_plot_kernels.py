"""tools/device/plot_kernels.py on the committed H200 kernel results: the numbers it plots and the image it writes."""

import json
from pathlib import Path

import pytest
from tools.device import plot_kernels

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "archive" / "2026-11-30-h200-s2" / "call1_kernels.json"


@pytest.fixture(scope="module")
def pk():
    return plot_kernels


def test_series_are_fa3_time_over_each_methods_time(pk):
    results = json.loads(RESULTS.read_text())
    labels, speed, gbps = pk.decode_series(results)
    assert labels[0] == "1 x 1k" and labels[-1] == "256 x 32k" and len(labels) == 12
    assert speed["fa3_bf16"] == [1.0] * 12
    ms = {(r["method"], r["batch"], r["context"]): r["ms"] for r in results["decode"]}
    assert speed["s4kv_saw"][-1] == pytest.approx(ms[("fa3_bf16", 256, 32768)] / ms[("s4kv_saw", 256, 32768)])
    assert 0.8 < speed["s4kv_saw"][-1] < 0.9  # the 10:10 UTC table in docs/archive/2026-11-30-performance.md: 0.84x
    assert gbps["fa3_bf16"][-1] == pytest.approx(4489, rel=1e-3)


def test_a_failed_method_leaves_a_gap_not_a_bar(pk, tmp_path):
    results = json.loads(RESULTS.read_text())
    broken = next(r for r in results["decode"] if r["method"] == "s4kv_kivi" and r["batch"] == 32)
    broken.update(ms=None, gbps=None, error="RuntimeError: boom")
    _, speed, _ = pk.decode_series(results)
    assert speed["s4kv_kivi"].count(None) == 1
    source = tmp_path / "kernels.json"
    source.write_text(json.dumps(results))
    assert pk.main([str(source), "--out", str(tmp_path / "kernels.png")]) == 0
    assert (tmp_path / "kernels.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_methods_picks_and_orders_the_bars(pk, tmp_path, capsys):
    """--methods plots only those methods, in that order; a name not in the results, or a list without FA3 (every
    bar's reference), is an error that says so."""
    results = json.loads(RESULTS.read_text())
    source = tmp_path / "kernels.json"
    source.write_text(json.dumps(results))
    out = tmp_path / "two.svg"
    assert pk.main([str(source), "--methods", "s4kv_saw,fa3_bf16", "--out", str(out)]) == 0
    svg = out.read_text()  # the legend's labels, as SVG comments, in plotting order
    assert "s4kv_kivi" not in svg and -1 < svg.index("<!-- s4kv_saw -->") < svg.index("<!-- fa3_bf16 -->")
    for bad, message in (("fa3_bf16,s4kv_nope", "s4kv_nope not in"), ("s4kv_saw", "fa3_bf16 is the reference")):
        with pytest.raises(SystemExit):
            pk.main([str(source), "--methods", bad, "--out", str(tmp_path / "bad.svg")])
        assert message in capsys.readouterr().err
