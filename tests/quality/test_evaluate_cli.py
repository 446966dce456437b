"""`s4kv eval MODEL --engine torch` end to end: arguments, JSON, plot and table."""

from __future__ import annotations

import json

import pytest

from s4kv.runtime.cli import main

SMALL = ["--short-windows", "2", "--short-len", "48", "--short-prompts", "2", "--short-prompt-len", "8",
         "--short-generate", "4", "--long-windows", "1", "--long-len", "160", "--long-prompts", "1",
         "--long-generate", "6", "--top-k", "5"]


def test_eval_writes_json_plot_and_table(tiny_model, tmp_path, capsys):
    assert main(["eval", str(tiny_model), "--engine", "torch", "--formats", "s4kv_saw,fp8_fa3",
                 "--out-dir", str(tmp_path), *SMALL]) == 0
    name = tiny_model.name
    result = json.loads((tmp_path / f"{name}-torch.json").read_text())
    assert list(result["formats"]) == ["bf16_fa3", "s4kv_saw", "fp8_fa3"]  # the reference always runs first
    assert result["regimes"]["long"]["prompt_len"] == 160 - 6
    for regime, windows, length in (("short", 2, 48), ("long", 1, 159)):  # long windows leave one token to sample
        # one token prefilled; the first forced token comes from that prefill, every later one is scored
        assert result["regimes"][regime]["prefill"] == 1
        assert result["formats"]["bf16_fa3"][regime]["positions"] == windows * (length - 2)
        assert result["formats"]["bf16_fa3"][regime]["mean_kl"] == 0.0
        assert len(result["formats"]["s4kv_saw"][regime]["first_divergence"]) == result["regimes"][regime]["prompts"]
    assert result["command"].startswith("s4kv ")
    assert (tmp_path / f"{name}-torch.png").read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "| s4kv int4_saw (torch ref) |" in table and "long context" in table


def test_prefill_share_prefills_that_share_of_each_window(tiny_model, tmp_path):
    assert main(["eval", str(tiny_model), "--engine", "torch", "--formats", "s4kv_kivi", "--prefill-share", "0.5",
                 "--out-dir", str(tmp_path), *SMALL]) == 0
    result = json.loads((tmp_path / f"{tiny_model.name}-torch.json").read_text())
    assert (result["regimes"]["short"]["prefill"], result["regimes"]["long"]["prefill"]) == (24, 79)
    assert result["formats"]["s4kv_kivi"]["short"]["positions"] == 2 * (48 - 24 - 1)


@pytest.mark.parametrize("bad, message", [
    (["--formats", "int3"], "unknown KV format"),
    (["--long-len", "4096"], "exceeds the model's max_position_embeddings"),
    (["--long-len", "100", "--long-generate", "100"], "leaves no prompt"),
    (["--short-len", "512"], "short regime: windows of 512 tokens"),
    (["--prefill-share", "1"], "--prefill-share must be in"),
])
def test_bad_arguments_fail_with_a_clear_message(tiny_model, tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        main(["eval", str(tiny_model), "--engine", "torch", "--out-dir", str(tmp_path), *SMALL, *bad])


def test_a_failing_format_is_reported_and_the_others_still_measured(tiny_model, tmp_path, monkeypatch, capsys):
    from s4kv.runtime.eval import torch_engine as eval_torch

    def engine_that_will_not_start(prefill_tokens=None):
        raise RuntimeError("vLLM run of fp8_fa3 failed (exit 1)\nValueError: no fp8 here")

    monkeypatch.setitem(eval_torch.TORCH_FORMATS, "fp8_fa3", engine_that_will_not_start)
    assert main(["eval", str(tiny_model), "--engine", "torch", "--formats", "fp8_fa3,s4kv_saw",
                 "--out-dir", str(tmp_path), *SMALL]) == 1
    result = json.loads((tmp_path / f"{tiny_model.name}-torch.json").read_text())
    assert list(result["formats"]) == ["bf16_fa3", "s4kv_saw"]
    assert "no fp8 here" in result["errors"]["fp8_fa3"]
    assert "fp8 e4m3 KV: failed (ValueError: no fp8 here)" in capsys.readouterr().out


def test_a_run_cut_short_keeps_the_formats_it_measured(tiny_model, tmp_path, monkeypatch):
    from s4kv.runtime.eval import report as eval_report, torch_engine as eval_torch

    def cut_here(prefill_tokens=None):  # what a device call's time limit does to the run
        raise KeyboardInterrupt

    monkeypatch.setitem(eval_torch.TORCH_FORMATS, "fp8_fa3", cut_here)
    with pytest.raises(KeyboardInterrupt):
        main(["eval", str(tiny_model), "--engine", "torch", "--formats", "s4kv_saw,fp8_fa3,s4kv_kivi",
              "--out-dir", str(tmp_path), *SMALL])
    partial = json.loads((tmp_path / f"{tiny_model.name}-torch.json").read_text())
    assert list(partial["formats"]) == ["bf16_fa3", "s4kv_saw"]
    assert partial["pending"] == ["fp8_fa3", "s4kv_kivi"]
    table = eval_report.markdown_table(partial)
    assert "| s4kv int4_saw (torch ref) |" in table and "not measured: fp8_fa3, s4kv_kivi" in table


def test_default_formats_are_the_issue_formats_and_every_format_has_a_torch_reference():
    import argparse

    from s4kv.runtime.eval import evaluate
    from s4kv.runtime.bench.matrix import FORMATS, STANDARD_FORMATS
    from s4kv.runtime.eval.torch_engine import TORCH_FORMATS

    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    assert parser.parse_args(["model"]).formats.split(",") == list(STANDARD_FORMATS)
    assert set(TORCH_FORMATS) == set(FORMATS)  # --engine torch runs whatever --formats names


def test_a_format_the_engine_cannot_run_here_is_reported_as_not_run(tiny_model, tmp_path, monkeypatch, capsys):
    from s4kv.runtime.eval import torch_engine as eval_torch
    from s4kv.runtime.eval.evaluate import FormatUnsupported

    def refused(prefill_tokens=None):  # what the worker reports when vLLM raises NotImplementedError at start-up
        raise FormatUnsupported("vLLM cannot run fp8_fa3 on this machine: FP8 KV cache on CPU requires x86 with "
                                "AVX-512 or AMX.")

    monkeypatch.setitem(eval_torch.TORCH_FORMATS, "fp8_fa3", refused)
    assert main(["eval", str(tiny_model), "--engine", "torch", "--formats", "fp8_fa3,s4kv_saw",
                 "--out-dir", str(tmp_path), *SMALL, "--long-windows", "0"]) == 0  # not a failure of the run
    result = json.loads((tmp_path / f"{tiny_model.name}-torch.json").read_text())
    assert list(result["formats"]) == ["bf16_fa3", "s4kv_saw"] and list(result["regimes"]) == ["short"]
    assert "AVX-512" in result["unsupported"]["fp8_fa3"] and "errors" not in result
    captured = capsys.readouterr()
    assert "fp8 e4m3 KV: not run (vLLM cannot run fp8_fa3 on this machine: FP8 KV cache" in captured.out
    assert "`--engine torch` measures its torch reference" in captured.err
