"""The Triton paged attention kernel under the read rule (kernels/attention.py, ``new_keys``): int4_kivi reads each
query's own block from the original keys (the step's ``new_keys`` rows, the staging pool for the earlier tokens of
the block the step starts in) and every earlier block per channel; values from the cache. Checked against the
float64 oracle of own_block_oracle.py: decode at offsets 0, 1 and 127 of the own block (127 closes it), chunks that
start mid-block and span three blocks, split-KV, shuffled pages, NaN pool rows and padding rows, a missing slot,
head_dim 64 and 128. Interpreter on the CPU (fp16), compiled on CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kv_batches import assert_poisoned_rows, relative_error
from own_block_oracle import KIVI, batch_rule_attention, stored_step

from s4kv.kernels.attention import CODE_PATHS, DECODE_LAUNCH, PREFILL_LAUNCH, SplitWorkspace, paged_attention
from s4kv.kernels.scheme import Int4Scheme
from s4kv.runtime.schemes import SUPPORTED_HEAD_DIMS

pytestmark = [
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value|overflow) encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]

SOFTMAX_SCALE = 0.1
# decode at offsets 0, 1 and 127 of the own block (127 closes the block in this step), the first token, a long one
DECODE = [(128, 1), (257, 1), (127, 1), (0, 1), (639, 1), (1000, 1)]
# a chunk starting mid-block spanning three blocks and ending inside the third, one closing the block it starts in,
# a prefill from 0 over two blocks, a decode beside them, a chunk inside one block
CHUNKS = [(100, 200), (30, 98), (0, 150), (383, 1), (260, 7)]


def attend(batch, cache, pool, scheme=KIVI, workspace=None, sequence_slots=None, new_keys=None,
           launch=None) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    pool_args = {} if pool is None else dict(
        staged_keys=pool.staged_keys, sequence_slots=pool.sequence_slots if sequence_slots is None else sequence_slots)
    paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, batch.max_query_len,
                    SOFTMAX_SCALE, scheme, out, workspace=workspace, launch=launch,
                    new_keys=batch.key if new_keys is None else new_keys, **pool_args)
    return out


def assert_matches_rule(out, expected, what: str) -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in the output"
    err = relative_error(out.cpu(), expected)
    assert err < 1e-2, f"{what}: relative error {err:.2e} against the rule's float64 oracle"
    torch.testing.assert_close(out.cpu().double(), expected, rtol=2e-2, atol=2e-2, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("head_dim,group,num_splits", [(128, 4, None), (128, 7, 16), (64, 4, 4), (64, 1, None),
                                                      (128, 16, 8)])
def test_decode_reads_the_own_block_from_the_original_keys(gen, kernel_device, head_dim, group, num_splits):
    """One pass and split-KV (at 16 splits some are empty), the store kernel's pages."""
    num_kv = 2 if group < 7 else 1
    batch, cache, pool = stored_step(gen, DECODE, head_dim, kernel_device, num_q_heads=group * num_kv,
                                     num_kv_heads=num_kv, kernel_store=True)
    workspace = None
    if num_splits:
        workspace = SplitWorkspace.allocate(group * num_kv, num_kv, head_dim, kernel_device, num_splits=num_splits)
        workspace.part_acc.fill_(float("nan"))
        workspace.part_ml.fill_(float("nan"))
    expected = batch_rule_attention(batch, SOFTMAX_SCALE, KIVI)
    assert_matches_rule(attend(batch, cache, pool, workspace=workspace), expected,
                        f"GQA {group} splits {num_splits} head_dim {head_dim}")


GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX needs a CUDA GPU")]


@pytest.mark.parametrize("code_path", [pytest.param(name, marks=GPU_ONLY if "ptx" in name else [])
                                       for name in CODE_PATHS if name != "biased"])
@pytest.mark.parametrize("specs", [CHUNKS, DECODE], ids=["chunks", "decode-split"])
def test_other_code_paths_follow_the_rule(gen, kernel_device, specs, code_path):
    """The launch options feeding codes to the MMA as fp16 subnormals and/or unpacked by inline PTX (head_dim 128,
    where the subnormal path is validated): the own-block tiles and the closed ones, prefill and split decode."""
    batch, cache, pool = stored_step(gen, specs, 128, kernel_device)
    decode = batch.max_query_len == 1
    launch = dataclasses.replace(DECODE_LAUNCH[KIVI.name] if decode else PREFILL_LAUNCH, **CODE_PATHS[code_path])
    workspace = SplitWorkspace.allocate(4, 2, 128, kernel_device, num_splits=8) if decode else None
    expected = batch_rule_attention(batch, SOFTMAX_SCALE, KIVI)
    assert_matches_rule(attend(batch, cache, pool, workspace=workspace, launch=launch), expected, code_path)


@pytest.mark.parametrize("code_path", [pytest.param(name, marks=GPU_ONLY if "ptx" in name else [])
                                       for name in CODE_PATHS])
@pytest.mark.parametrize("specs,head_dim", [(CHUNKS, 128), (DECODE, 128), (DECODE, 64)],
                         ids=["chunks", "decode-split", "decode-split-64"])
def test_wide_code_loads_follow_the_rule(gen, kernel_device, specs, head_dim, code_path):
    """Codes read two bytes per element (LaunchConfig.wide_code_loads): the per-channel keys in four channel
    quarters, each with its own channels' params, and the values over even and odd tokens, on closed and own-block
    tiles."""
    if CODE_PATHS[code_path]["subnormal_codes"] and head_dim != 128:
        pytest.skip(f"the subnormal path is refused at head_dim {head_dim}")
    batch, cache, pool = stored_step(gen, specs, head_dim, kernel_device)
    decode = batch.max_query_len == 1
    launch = dataclasses.replace(DECODE_LAUNCH[KIVI.name] if decode else PREFILL_LAUNCH, **CODE_PATHS[code_path],
                                 wide_code_loads=True)
    workspace = SplitWorkspace.allocate(4, 2, head_dim, kernel_device, num_splits=8) if decode else None
    expected = batch_rule_attention(batch, SOFTMAX_SCALE, KIVI)
    assert_matches_rule(attend(batch, cache, pool, workspace=workspace, launch=launch), expected,
                        f"wide {code_path} head_dim {head_dim}")


@pytest.mark.parametrize("specs,head_dim", [(CHUNKS, 128), (DECODE, 128), (DECODE, 64)],
                         ids=["chunks", "decode-split", "decode-split-64"])
def test_joint_row_sums_follow_the_rule(gen, kernel_device, specs, head_dim):
    """A tile's row sums in one reduction (LaunchConfig.joint_row_sums), on closed and own-block tiles, at the
    scheme's launches with the device's code path."""
    batch, cache, pool = stored_step(gen, specs, head_dim, kernel_device)
    decode = batch.max_query_len == 1
    launch = dataclasses.replace(DECODE_LAUNCH[KIVI.name] if decode else PREFILL_LAUNCH, joint_row_sums=True,
                                 ptx_unpack=kernel_device.type == "cuda",
                                 subnormal_codes=decode and kernel_device.type == "cuda" and head_dim == 128)
    workspace = SplitWorkspace.allocate(4, 2, head_dim, kernel_device, num_splits=8) if decode else None
    expected = batch_rule_attention(batch, SOFTMAX_SCALE, KIVI)
    assert_matches_rule(attend(batch, cache, pool, workspace=workspace, launch=launch), expected,
                        f"joint row sums head_dim {head_dim}")


@pytest.mark.parametrize("wide", [False, True], ids=["byte-codes", "wide-codes"])
@pytest.mark.parametrize("specs,head_dim,tile,num_splits", [(CHUNKS, 128, None, None), (DECODE, 128, 128, None),
                                                            (DECODE, 128, 128, 8), (DECODE, 64, 64, 4)],
                         ids=["chunks", "decode", "decode-split", "decode-split-64-tile64"])
def test_unmasked_full_tiles_follow_the_rule(gen, kernel_device, specs, head_dim, tile, num_splits, wide):
    """The tiles before a program's own blocks without the masks (LaunchConfig.unmasked_full_tiles), its own-block
    tail masked: decode at offsets 0, 1 and 127 of the own block, one pass and split (the splits before the own
    block's have no tail), chunks over cached prefixes spanning blocks, GQA 7 (dead rows in every program). Against
    the rule's oracle, and under the interpreter bit for bit the masked run."""
    batch, cache, pool = stored_step(gen, specs, head_dim, kernel_device, num_q_heads=7, num_kv_heads=1)
    base = dataclasses.replace(DECODE_LAUNCH[KIVI.name], tile=tile) if tile else PREFILL_LAUNCH
    masked = dataclasses.replace(base, ptx_unpack=kernel_device.type == "cuda", wide_code_loads=wide,
                                 subnormal_codes=base.subnormal_codes and head_dim == 128, unmasked_full_tiles=False)
    workspace = None
    if num_splits:
        workspace = SplitWorkspace.allocate(7, 1, head_dim, kernel_device, num_splits=num_splits)
        workspace.part_acc.fill_(float("nan"))
        workspace.part_ml.fill_(float("nan"))
    out = attend(batch, cache, pool, workspace=workspace, launch=dataclasses.replace(masked, unmasked_full_tiles=True))
    assert_matches_rule(out, batch_rule_attention(batch, SOFTMAX_SCALE, KIVI),
                        f"unmasked full tiles, head_dim {head_dim}, tile {tile}, splits {num_splits}, wide {wide}")
    if kernel_device.type == "cpu":
        assert torch.equal(out, attend(batch, cache, pool, workspace=workspace, launch=masked))


@pytest.mark.parametrize("with_workspace", [False, True])
def test_cuda_graph_padding_rows_and_empty_sequences(gen, kernel_device, with_workspace):
    """As vLLM pads a decode batch to a CUDA-graph size: query and key rows past the step (NaN), padded sequences with
    no query tokens (seq_len 0, or 1 as set at capture), null block-table rows and slot -1."""
    batch, cache, pool = stored_step(gen, DECODE[:4], 64, kernel_device)
    expected = batch_rule_attention(batch, SOFTMAX_SCALE, KIVI)
    n = batch.num_tokens
    query = torch.cat([batch.query, torch.full((3, *batch.query.shape[1:]), float("nan"), dtype=batch.query.dtype,
                                               device=kernel_device)])
    last = batch.query_start_loc[-1:]
    query_start_loc = torch.cat([batch.query_start_loc, last, last])
    seq_lens = torch.cat([batch.seq_lens, torch.tensor([0, 1], dtype=torch.int32, device=kernel_device)])
    block_table = torch.cat([batch.block_table, torch.zeros_like(batch.block_table[:2])])
    slots = torch.cat([pool.sequence_slots, torch.full((2,), -1, dtype=torch.int32, device=kernel_device)])
    workspace = SplitWorkspace.allocate(4, 2, 64, kernel_device, num_splits=16) if with_workspace else None
    out = torch.full_like(query, float("nan"))
    paged_attention(query, cache, block_table, seq_lens, query_start_loc, 1, SOFTMAX_SCALE, KIVI, out,
                    workspace=workspace, new_keys=batch.key, staged_keys=pool.staged_keys, sequence_slots=slots)
    assert_matches_rule(out[:n], expected, "padded batch")


@pytest.mark.parametrize("unmasked_full_tiles", [False, True], ids=["masked", "unmasked-full-tiles"])
def test_a_broken_value_poisons_only_the_queries_that_see_it(gen, kernel_device, unmasked_full_tiles):
    """A NaN value in a chunk from 0 and in one over a cached prefix spanning a block edge: exactly the queries at or
    after it are NaN (the oracle slices what each query sees), the others follow the rule; also with the tiles before
    a program's own blocks unmasked (LaunchConfig.unmasked_full_tiles)."""
    batch, cache, pool = stored_step(gen, [(0, 70), (100, 40)], 64, kernel_device, poison={0: 30, 1: 120})
    out = attend(batch, cache, pool,
                 launch=dataclasses.replace(PREFILL_LAUNCH, unmasked_full_tiles=True) if unmasked_full_tiles else None)
    expected = batch_rule_attention(batch, SOFTMAX_SCALE, KIVI)
    assert_poisoned_rows(out.cpu(), expected, "int4_kivi")
    finite = ~torch.isnan(expected).any(-1)
    torch.testing.assert_close(out.cpu().double()[finite], expected[finite], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 4])
def test_chunks_spanning_blocks_read_each_query_s_own_block_from_the_original_keys(gen, kernel_device, head_dim,
                                                                                   group):
    """Query tiles of 64 // group rows straddle block edges: per row, its own block from the originals, the block
    before per channel."""
    batch, cache, pool = stored_step(gen, CHUNKS, head_dim, kernel_device, num_q_heads=2 * group)
    expected = batch_rule_attention(batch, SOFTMAX_SCALE, KIVI)
    assert_matches_rule(attend(batch, cache, pool), expected, f"GQA {group}")


def test_a_needed_pool_read_without_a_slot_poisons_exactly_its_queries(gen, kernel_device):
    """Sequence 0's chunk starts at 100: its queries in block 0 need pool rows 0-99 (NaN without a slot), those in
    blocks 1 and 2 see block 0 per channel and their own block from new_keys (finite). A decode at offset 0 of its
    block needs no pool row."""
    batch, cache, pool = stored_step(gen, [(100, 200), (256, 1)], 64, kernel_device)
    expected = batch_rule_attention(batch, SOFTMAX_SCALE, KIVI)
    missing = pool.sequence_slots.clone()
    missing[0] = -1
    out = attend(batch, cache, pool, sequence_slots=missing)
    nan_rows = torch.isnan(out).any(-1).all(-1).cpu()
    assert nan_rows.tolist() == [p < 128 for p in range(100, 300)] + [False]
    torch.testing.assert_close(out[~nan_rows].cpu().double(), expected[~nan_rows], rtol=2e-2, atol=2e-2)


def test_new_keys_not_the_cache_codes_decide_the_own_block(gen, kernel_device):
    """Changing this step's key rows after the store moves exactly the outputs the rule says read them."""
    batch, cache, pool = stored_step(gen, [(100, 40), (300, 1)], 64, kernel_device)
    before = attend(batch, cache, pool)
    keys = batch.key.clone()
    keys[39] += 3.0  # sequence 0's last token (position 139): only the query at 139 sees it
    after = attend(batch, cache, pool, new_keys=keys)
    moved = (after - before).abs().amax((-1, -2)).cpu() > 1e-3
    assert moved.tolist() == [False] * 39 + [True, False]


def test_int4_saw_reads_every_key_from_the_cache(gen, kernel_device):
    """new_keys is ignored: keys and (rotated) values from the cache (test_attention_kernel.py has the rest)."""
    scheme = Int4Scheme("int4_saw", 64, rotate_values=True)
    batch, cache, _ = stored_step(gen, CHUNKS, 64, kernel_device, scheme=scheme)
    expected = batch_rule_attention(batch, SOFTMAX_SCALE, scheme)
    assert_matches_rule(attend(batch, cache, None, scheme=scheme, new_keys=None), expected, scheme.name)


def test_bad_new_keys_get_clear_errors(gen, kernel_device):
    batch, cache, pool = stored_step(gen, [(100, 1)], 64, kernel_device)
    out = torch.empty_like(batch.query)
    args = (batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 1, SOFTMAX_SCALE, KIVI, out)
    pool_args = dict(staged_keys=pool.staged_keys, sequence_slots=pool.sequence_slots)
    with pytest.raises(ValueError, match="int4_kivi attention needs new_keys"):
        paged_attention(*args, **pool_args)
    with pytest.raises(ValueError, match=r"new_keys must be \[>= 1, 2, 64\] torch.float16"):
        paged_attention(*args, **pool_args, new_keys=batch.key.float())
    with pytest.raises(ValueError, match=r"new_keys must be \[>= 1, 2, 64\]"):
        paged_attention(*args, **pool_args, new_keys=batch.key[:, :1])


def test_bad_pool_arguments_get_clear_errors(gen, kernel_device):
    batch, cache, pool = stored_step(gen, [(100, 1)], 64, kernel_device)
    out = torch.empty_like(batch.query)
    args = (batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 1, SOFTMAX_SCALE)
    new_keys = {"new_keys": batch.key}
    with pytest.raises(ValueError, match="int4_kivi needs its staging pool: staged_keys and sequence_slots"):
        paged_attention(*args, KIVI, out, **new_keys)
    with pytest.raises(ValueError, match="int4_kivi needs its staging pool"):
        paged_attention(*args, KIVI, out, staged_keys=pool.staged_keys, **new_keys)
    with pytest.raises(ValueError, match="int4_saw takes no staging pool"):
        paged_attention(*args, Int4Scheme("int4_saw"), out, staged_keys=pool.staged_keys,
                        sequence_slots=pool.sequence_slots)
    with pytest.raises(ValueError, match=r"sequence_slots must be int32 \[1\]"):
        paged_attention(*args, KIVI, out, staged_keys=pool.staged_keys, sequence_slots=pool.sequence_slots.long(),
                        **new_keys)
    with pytest.raises(ValueError, match=r"staged_keys must be \[slots, 2, 128, 64\]"):
        paged_attention(*args, KIVI, out, staged_keys=pool.staged_keys[:, :1], sequence_slots=pool.sequence_slots,
                        **new_keys)
    with pytest.raises(ValueError, match="staged_keys must be torch.float16"):
        paged_attention(*args, KIVI, out, staged_keys=pool.staged_keys.float(), sequence_slots=pool.sequence_slots,
                        **new_keys)
