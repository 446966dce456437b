"""tools/reference_models/kv_variants.py on a tiny model: every variant is measured against the bf16 reference,
which matches itself
exactly, and the quantized variants differ from it."""

from __future__ import annotations

from tools.reference_models import kv_variants


def test_every_variant_is_compared_with_bf16(tiny_model):
    rows = kv_variants.sweep(str(tiny_model), windows=2, window_len=48,
                             heldout=kv_variants.REPO / "data/eval/heldout.jsonl")
    assert [label for label, _ in rows] == list(kv_variants.VARIANTS)
    metrics = dict(rows)
    assert metrics["bf16"]["mean_kl"] == 0.0 and metrics["bf16"]["top1_agreement"] == 1.0
    assert all(m["mean_kl"] > 0 for label, m in rows if "int4" in label)
    table = kv_variants.markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "| int4_saw rotate_values |" in table
