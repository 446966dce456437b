"""The largest decode batch in the CUDA-graph capture sizes (runtime/plugin/cuda_graphs.py), judged by vLLM's own
capture-size rule and its own dispatcher: which graph a batch of decodes replays, before and after."""

from __future__ import annotations

import logging
from argparse import Namespace
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.config import CompilationConfig, CUDAGraphMode, VllmConfig  # noqa: E402
from vllm.config.compilation import CompilationMode  # noqa: E402
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher  # noqa: E402

from s4kv.runtime.plugin.cuda_graphs import (cover_largest_decode_batch,  # noqa: E402
                                             sizes_with_largest_decode_batch, warn_missing_decode_graph)


def engine_config(max_num_seqs: int, sizes: list[int] | None = None, mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                  drafts: int = 0, max_size: int | None = None):
    """The parts of a VllmConfig the capture sizes and the dispatcher read, the sizes set by vLLM's own rule."""
    chosen = {} if sizes is None else {"cudagraph_capture_sizes": sizes}
    compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode,
                                    splitting_ops=list(CompilationConfig._attention_ops),
                                    use_inductor_graph_partition=False, max_cudagraph_capture_size=max_size, **chosen)
    config = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False), compilation_config=compilation,
                             num_speculative_tokens=drafts, performance_mode="throughput", lora_config=None,
                             scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1))
    VllmConfig._set_cudagraph_sizes(config)
    compilation.adjust_cudagraph_sizes_for_spec_decode(1 + drafts, 1)  # as the engine does with drafts
    return config


def decode_graphs(config, batches) -> list[str]:
    """The graph vLLM's dispatcher replays for a batch of ``b`` decodes, for each ``b``."""
    dispatcher = CudagraphDispatcher(config)
    q = 1 + config.num_speculative_tokens
    dispatcher.initialize_cudagraph_keys(config.compilation_config.cudagraph_mode, q)
    return [dispatcher.dispatch(b * q, uniform_decode=True)[0].name for b in batches]


@pytest.mark.parametrize("max_num_seqs", [3, 5, 17, 33, 100, 250, 300])
def test_max_num_seqs_off_vllms_stride_gets_a_full_graph_for_every_decode_batch(max_num_seqs):
    default = engine_config(max_num_seqs)
    assert decode_graphs(default, [max_num_seqs]) == ["PIECEWISE"]  # what vLLM's default sizes do
    sizes = sizes_with_largest_decode_batch(default)
    assert sizes == sorted(default.compilation_config.cudagraph_capture_sizes + [max_num_seqs])
    fixed = engine_config(max_num_seqs, sizes)
    assert fixed.compilation_config.cudagraph_capture_sizes == sizes  # vLLM keeps them as given
    assert set(decode_graphs(fixed, range(1, max_num_seqs + 1))) == {"FULL"}
    assert sizes_with_largest_decode_batch(fixed) is None


@pytest.mark.parametrize("max_num_seqs", [1, 2, 16, 24, 256])
def test_max_num_seqs_on_vllms_stride_changes_nothing(max_num_seqs):
    config = engine_config(max_num_seqs)
    assert set(decode_graphs(config, range(1, max_num_seqs + 1))) == {"FULL"}
    assert sizes_with_largest_decode_batch(config) is None


def test_speculative_drafts_count_in_the_largest_decode_batch():
    config = engine_config(17, drafts=2)
    assert decode_graphs(config, [17]) == ["PIECEWISE"]
    sizes = sizes_with_largest_decode_batch(config)
    assert 51 in sizes
    assert decode_graphs(engine_config(17, sizes, drafts=2), [17]) == ["FULL"]


@pytest.mark.parametrize("case", ["past the largest capture size", "no separate decode graphs", "no graphs"])
def test_no_sizes_where_a_size_would_not_give_that_batch_its_graph(case):
    config = {"past the largest capture size": lambda: engine_config(1000),  # sizes stop at 512: no graph at all
              "no separate decode graphs": lambda: engine_config(17, mode=CUDAGraphMode.FULL),
              "no graphs": lambda: engine_config(17, mode=CUDAGraphMode.NONE)}[case]()
    assert sizes_with_largest_decode_batch(config) is None


def test_a_user_max_capture_size_below_max_num_seqs_is_kept():
    config = engine_config(17, max_size=16)
    assert sizes_with_largest_decode_batch(config) is None


def test_the_server_arguments_get_the_sizes_unless_the_user_chose_sizes(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)  # vLLM's loggers stop at "vllm"
    args = Namespace(cudagraph_capture_sizes=None, compilation_config=CompilationConfig())
    assert cover_largest_decode_batch(args, engine_config(17)) == [1, 2, 4, 8, 16, 17, 24, 32]
    assert args.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 17, 24, 32]
    assert cover_largest_decode_batch(args, engine_config(16)) is None

    for chosen in (Namespace(cudagraph_capture_sizes=[1, 8, 16, 32], compilation_config=CompilationConfig()),
                   Namespace(cudagraph_capture_sizes=None,
                             compilation_config=CompilationConfig(cudagraph_capture_sizes=[1, 8, 16, 32]))):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vllm.s4kv"):
            assert cover_largest_decode_batch(chosen, engine_config(17, [1, 8, 16, 32])) is None
        assert chosen.cudagraph_capture_sizes in (None, [1, 8, 16, 32])
        assert "leave out 17" in caplog.text and "add 17 to --cudagraph-capture-sizes" in caplog.text


def test_an_engine_built_without_the_size_says_what_to_add(caplog, monkeypatch):
    """The attention builder's check, for engines `s4kv serve` did not configure (`vllm serve`, the Python API)."""
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="vllm.s4kv"):
        assert warn_missing_decode_graph(engine_config(100)) is True
        assert "[1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 144, 152, 160, " \
               "168, 176, 184, 192, 200] leave out 100" in caplog.text
        caplog.clear()
        assert warn_missing_decode_graph(engine_config(96)) is False
        assert warn_missing_decode_graph(engine_config(100, sizes_with_largest_decode_batch(engine_config(100)))) \
            is False
    assert caplog.text == ""
