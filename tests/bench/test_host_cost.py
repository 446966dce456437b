"""tools/host_cost.py: the attention path's host time per layer with every launch stubbed, run as its command (in a
process of its own: it replaces the kernels module-wide)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_host_cost_times_both_schemes_layers_and_wrappers(tmp_path):
    out = tmp_path / "host.json"
    run = subprocess.run([sys.executable, "-m", "tools.host_cost", "--decodes", "3", "--context", "300",
                          "--prompt", "256", "--calls", "20", "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    both = ("decode layer: KV update + forward", "mixed layer: KV update + forward", "store_kv",
            "paged_attention (the decodes)", "gather_dense_kv")
    for label in both:
        assert set(rows[label]) == {"int4_saw", "int4_kivi"}, label
    # int4_kivi launches one kernel a layer more than int4_saw, its block close (its staging is in the store's launch)
    for kind in ("decode", "mixed"):
        launches = rows[f"{kind} layer: Triton launches"]
        assert launches["int4_kivi"] == launches["int4_saw"] + 1, (kind, launches)
    assert rows["mixed layer: Triton launches"]["int4_saw"] == rows["decode layer: Triton launches"]["int4_saw"] + 1
    assert all(us > 0 for per_scheme in rows.values() for us in per_scheme.values())
    # a mixed layer runs the decode layer's calls and the prefill's on top
    for scheme in ("int4_saw", "int4_kivi"):
        assert rows["mixed layer: KV update + forward"][scheme] > rows["decode layer: KV update + forward"][scheme]
    assert "| mixed layer: KV update + forward |" in run.stdout


def test_host_cost_refuses_a_prompt_that_is_not_whole_blocks():
    run = subprocess.run([sys.executable, "-m", "tools.host_cost", "--prompt", "200"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "--prompt must be a positive multiple of 128" in run.stderr
