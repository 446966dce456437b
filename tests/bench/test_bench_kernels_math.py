"""CPU checks of tools/device/bench_kernels.py: the bytes it counts, its shuffled page tables and slot ids, its
tables."""

import pytest
import torch
from attention_oracle import causal_attention
from tools.device import bench_kernels


@pytest.fixture(scope="module")
def bk():
    return bench_kernels


def test_decode_bytes_count_kv_plus_q_and_out(bk):
    q_and_out = 2 * 256 * 28 * 128 * 2
    assert bk.decode_bytes(256, 32768, "int4") == 256 * 32768 * 4 * 136 + q_and_out
    assert bk.decode_bytes(256, 32768, "bf16") == 256 * 32768 * 4 * 512 + q_and_out
    # at long contexts int4 must read 512/136 = 3.76x fewer bytes: the ceiling on its speed-up over FA3
    ratio = bk.decode_bytes(32, 32768, "bf16") / bk.decode_bytes(32, 32768, "int4")
    assert ratio == pytest.approx(512 / 136, rel=1e-3)


def test_store_bytes_read_bf16_write_int4(bk):
    assert bk.store_bytes(8192, "int4") == 8192 * 4 * (512 + 136)


def test_block_table_is_a_shuffled_partition_of_the_pages(bk):
    seed = int(torch.randint(0, 2**31, ()))
    batch, pages = 7, 13
    table = bk.shuffled_block_table(batch, pages, torch.Generator().manual_seed(seed))
    assert table.shape == (batch, pages) and table.dtype == torch.int32
    assert torch.equal(table.flatten().sort().values, torch.arange(batch * pages, dtype=torch.int32))
    assert not torch.equal(table.flatten(), torch.arange(batch * pages, dtype=torch.int32))


def test_slots_follow_the_block_table(bk):
    table = bk.shuffled_block_table(5, 6, torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()))))
    block = 16
    seqs = torch.randint(0, 5, (50,))
    positions = torch.randint(0, 6 * block, (50,))
    slots = bk.slots_for(table, seqs, positions, block)
    for s, p, slot in zip(seqs.tolist(), positions.tolist(), slots.tolist()):
        assert slot // block == table[s, p // block] and slot % block == p % block
    # every (sequence, position) has its own slot
    all_seqs = torch.arange(5).repeat_interleave(6 * block)
    all_pos = torch.arange(6 * block).repeat(5)
    assert len(set(bk.slots_for(table, all_seqs, all_pos, block).tolist())) == 5 * 6 * block


def test_decode_table_reports_gbps_and_speed_vs_fa3(bk):
    fa3 = bk.Timing("fa3_bf16", 32, 16384, 2.0, bk.decode_bytes(32, 16384, "bf16"))
    saw = bk.Timing("s4kv_saw", 32, 16384, 0.8, bk.decode_bytes(32, 16384, "int4"), 0.08)
    broken = bk.Timing("vllm_int4", 32, 16384, None, 1, error="RuntimeError: illegal memory access\ntrace")
    assert saw.gbps == pytest.approx(bk.decode_bytes(32, 16384, "int4") / 0.8e-3 / 1e9)
    table = bk.render_decode_table([saw, broken, fa3], copy_gbps=4300.0)
    header, _, row = table.splitlines()[:3]
    assert header == "| shape (GQA) | batch | context | fa3_bf16 | vllm_int4 | s4kv_saw |"
    assert row.startswith("| qwen2.5-7b (7) | 32 | 16,384 | 2,000 us")
    assert f"{saw.gbps:,.0f} GB/s, 2.50x" in row
    assert "failed: RuntimeError: illegal memory access |" in row
    assert "copy ceiling 4,300 GB/s" in table


def test_each_attention_shape_has_its_rows_bytes_and_fa3(bk):
    """Llama-3.1-8B's 8 KV heads move twice Qwen2.5-7B's 4 per token; each shape's ratio is to its own FA3."""
    assert bk.decode_bytes(32, 4096, "int4", *bk.SHAPES["llama-3.1-8b"]) == 32 * 4096 * 8 * 136 + 2 * 32 * 32 * 128 * 2
    timings = [bk.Timing("fa3_bf16", 32, 4096, 1.0, 10**9, shape="llama-3.1-8b"),
               bk.Timing("s4kv_kivi", 32, 4096, 0.5, 10**9, 0.1, shape="llama-3.1-8b"),
               bk.Timing("fa3_bf16", 32, 4096, 2.0, 10**9),
               bk.Timing("s4kv_kivi", 32, 4096, 0.5, 10**9, 0.1)]
    rows = bk.render_decode_table(timings, None).splitlines()[2:4]
    assert rows[0].startswith("| qwen2.5-7b (7) | 32 | 4,096 |") and rows[0].endswith("4.00x |")
    assert rows[1].startswith("| llama-3.1-8b (4) | 32 | 4,096 |") and rows[1].endswith("2.00x |")


def test_fill_chunks_store_every_token_once_with_the_documented_rows(bk, monkeypatch):
    monkeypatch.setattr(bk, "FILL_CHUNK_TOKENS", 80)  # several chunks: 2 sequences of 37 tokens each
    batch, context, block = 5, 37, 16
    pool = torch.randn(2, 80, bk.NUM_KV_HEADS, bk.HEAD_DIM)
    problem = bk.DecodeProblem(batch, context, torch.randn(batch, bk.NUM_Q_HEADS, bk.HEAD_DIM), pool)
    assert problem.seqs_per_chunk == 2
    table = bk.shuffled_block_table(batch, -(-context // block), torch.Generator().manual_seed(7))
    cache = torch.full((table.numel() * block, bk.NUM_KV_HEADS, bk.HEAD_DIM), float("nan"))
    written = torch.zeros(table.numel() * block, dtype=torch.int64)
    for key, value, slots in problem.chunks(table, block):
        assert key.shape[0] == value.shape[0] == slots.shape[0]
        cache[slots] = key
        written[slots] += 1
    expected_slots = bk.slots_for(table, torch.arange(batch).repeat_interleave(context),
                                  torch.arange(context).repeat(batch), block)
    assert written[expected_slots].eq(1).all() and written.sum() == batch * context
    for s in range(batch):
        rows = (s % problem.seqs_per_chunk) * context + torch.arange(context)
        got = cache[bk.slots_for(table, torch.full((context,), s), torch.arange(context), block)]
        assert torch.equal(got, pool[0, rows])
    assert torch.equal(problem.seq_lens, torch.full((batch,), context, dtype=torch.int32))
    assert torch.equal(problem.query_start_loc, torch.arange(batch + 1, dtype=torch.int32))


def test_every_code_path_of_the_kernel_is_benchmarked_for_both_schemes(bk):
    from s4kv.kernels.attention import CODE_PATHS

    assert set(bk.CODE_PATH_SUFFIX) == set(CODE_PATHS) | {None}
    # s4kv_kivi / s4kv_saw: the launch the backend runs (DECODE_LAUNCH), no code path forced
    assert [bk.DECODE_METHODS[f"s4kv_{s}"][1].args for s in ("kivi", "saw")] == [
        ({"scheme": "int4_kivi"}, None), ({"scheme": "int4_saw"}, None)]
    ours = {m for m in bk.DECODE_METHODS if m.startswith("s4kv_")}
    assert ours == ({f"s4kv_{s}{x}" for s in ("kivi", "saw") for x in bk.CODE_PATH_SUFFIX.values()}
                    | {"s4kv_saw_rotv"})
    assert set(bk.METHODS) == set(bk.DECODE_METHODS) and bk.METHODS[0] == "fa3_bf16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on the GPU tools/device/bench_kernels.py itself runs these")
def test_s4kv_methods_compute_attention_on_the_cpu(bk):
    """The benchmark's own s4kv builders (store through store_kv, read through paged_attention with each code
    path) under the Triton interpreter on a tiny problem: their outputs are the attention over the pool's K/V.
    The inline-PTX paths need the GPU: building them works, calling them is refused (the benchmark records it)."""
    gen = torch.Generator().manual_seed(11)
    batch, context = 2, 200
    pool = torch.randn(2, batch * context, bk.NUM_KV_HEADS, bk.HEAD_DIM, generator=gen).half()
    query = torch.randn(batch, bk.NUM_Q_HEADS, bk.HEAD_DIM, generator=gen).half()
    problem = bk.DecodeProblem(batch, context, query, pool)
    table = bk.shuffled_block_table(batch, -(-context // bk.S4KV_BLOCK_SIZE), gen)
    # unquantized attention: sequence s holds pool rows (s % seqs_per_chunk) * context + t
    expected = []
    for s in range(batch):
        rows = (s % problem.seqs_per_chunk) * context + torch.arange(context)
        expected.append(causal_attention(query[s : s + 1], pool[0, rows], pool[1, rows], bk.HEAD_DIM ** -0.5))
    expected = torch.cat(expected)
    for method, (block_size, build) in bk.DECODE_METHODS.items():
        if not method.startswith("s4kv_"):
            continue
        out = torch.full_like(query, float("nan"))
        call = build(problem, table, out)
        # forced code paths with PTX, and DECODE_LAUNCH with fields replaced (--launch), whose unpack is inline PTX
        if method.endswith("ptx") or build.keywords.get("launch_options"):
            with pytest.raises(ValueError, match="inline PTX"):
                call()
            continue
        call()
        err = float((out.double() - expected).norm() / expected.norm())
        assert err < 0.25, f"{method}: relative error {err:.3f} against unquantized attention"


def test_launch_methods_replace_fields_of_the_decode_launch(bk, monkeypatch):
    """--launch NAME=SCHEME:FIELD=VALUE,...: a method timing SCHEME's DECODE_LAUNCH with those LaunchConfig fields
    replaced, run beside the fixed methods; a bad spec is an error that names what is wrong."""
    monkeypatch.setattr(bk, "DECODE_METHODS", dict(bk.DECODE_METHODS))
    monkeypatch.setattr(bk, "FORMAT_OF", dict(bk.FORMAT_OF))
    spec = "s4kv_saw_w96=int4_saw:wide_code_loads=true,subnormal_codes=false,max_registers=96"
    assert bk.parse_launch_method(spec) == (
        "s4kv_saw_w96", "int4_saw", {"wide_code_loads": True, "subnormal_codes": False, "max_registers": 96})
    assert bk.add_launch_method(spec) == "s4kv_saw_w96"
    block_size, build = bk.DECODE_METHODS["s4kv_saw_w96"]
    assert block_size == bk.S4KV_BLOCK_SIZE and bk.FORMAT_OF["s4kv_saw_w96"] == "int4"
    assert build.args == ({"scheme": "int4_saw"}, None)
    assert build.keywords == {"launch_options": {"wide_code_loads": True, "subnormal_codes": False,
                                                 "max_registers": 96}}
    assert bk.parse_launch_method("s4kv_saw_um=int4_saw:unmasked_full_tiles=true") == (
        "s4kv_saw_um", "int4_saw", {"unmasked_full_tiles": True})
    assert bk.parse_launch_method("s4kv_kivi_2=int4_kivi:num_warps=2,max_registers=none") == (
        "s4kv_kivi_2", "int4_kivi", {"num_warps": 2, "max_registers": None})
    # no field: the committed launch once more, a control column for the harness's order effect
    assert bk.parse_launch_method("s4kv_kivi_again=int4_kivi:") == ("s4kv_kivi_again", "int4_kivi", {})
    for bad, message in (("saw_w96=int4_saw:max_registers=96", "expected s4kv_NAME"),
                         ("s4kv_x=int4_saw", "expected s4kv_NAME"),
                         ("s4kv_saw=int4_saw:max_registers=96", "already a method"),
                         ("s4kv_x=int4_fp8:max_registers=96", "not one of"),
                         ("s4kv_x=int4_saw:registers=96", "LaunchConfig field"),
                         ("s4kv_x=int4_saw:max_registers=many", "neither true, false, none nor an integer")):
        with pytest.raises(ValueError, match=message):
            bk.parse_launch_method(bad)


def test_sm_clock_is_read_when_nvml_answers_and_left_out_when_not(bk, monkeypatch):
    monkeypatch.setattr(bk.torch.cuda, "clock_rate", lambda: 1755.0)
    assert bk.sm_clock_mhz() == 1755

    def no_nvml():
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    monkeypatch.setattr(bk.torch.cuda, "clock_rate", no_nvml)
    assert bk.sm_clock_mhz() is None
