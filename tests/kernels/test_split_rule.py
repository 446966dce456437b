"""The split-KV rule of decode attention (kernels.attention.DECODE_SPLITS) and the workspace it sizes: a function
of the batch size only (CUDA graphs are captured per batch size), buffers sized for vLLM's max_num_seqs."""

from __future__ import annotations

import math

import pytest
import torch
from kv_batches import relative_error
from own_block_oracle import batch_rule_attention, stored_step

from s4kv.kernels.attention import (DECODE_LAUNCH, DECODE_SPLITS, DecodePlan, SplitWorkspace, decode_plan,
                                    paged_attention)
from s4kv.kernels.layout import tile_tokens
from s4kv.kernels.scheme import Int4Scheme
from s4kv.runtime.schemes import SCHEMES


@pytest.mark.parametrize("scheme_name", SCHEMES)
def test_every_scheme_has_an_ordered_table_that_ends_unbounded(scheme_name):
    table = DECODE_SPLITS[scheme_name]
    bounds = [entry[0] for entry in table]
    assert bounds == sorted(bounds) and bounds[-1] == math.inf
    plans = [DecodePlan(*entry[1:]) for entry in table]
    for plan in plans:  # the merge kernel tiles splits by a power of 2
        assert plan.splits >= 1 and plan.splits & (plan.splits - 1) == 0 and plan.min_split_tiles >= 1
    splits = [plan.splits for plan in plans]  # a larger batch never gets more splits
    assert splits == sorted(splits, reverse=True)


def test_rule_reads_kv_head_programs_per_sm():
    table = ((0.25, 64, 1), (1.0, 8, 2), (4.0, 2, 1), (math.inf, 1, 1))
    assert decode_plan(1, 4, 132, table) == DecodePlan(64, 1)  # 4 / 132 per SM
    assert decode_plan(33, 4, 132, table) == DecodePlan(8, 2)  # 132 / 132 = 1.0: inclusive bound
    assert decode_plan(34, 4, 132, table) == DecodePlan(2, 1)
    assert decode_plan(66, 8, 132, table) == DecodePlan(2, 1)  # 528 / 132 = 4.0
    assert decode_plan(256, 8, 132, table) == DecodePlan(1, 1)
    # the same batch on a device with twice the SMs spreads twice as thin: more splits
    assert decode_plan(34, 4, 264, table) == DecodePlan(8, 2)


@pytest.mark.parametrize("scheme_name", SCHEMES)
@pytest.mark.parametrize("num_q_heads, num_kv_heads, max_num_seqs", [(28, 4, 256), (32, 8, 1), (8, 2, 1024)])
def test_workspace_holds_the_largest_batch_times_its_splits(scheme_name, num_q_heads, num_kv_heads, max_num_seqs):
    ws = SplitWorkspace.allocate(num_q_heads, num_kv_heads, 128, "cpu", scheme_name, max_num_seqs=max_num_seqs,
                                 num_sms=132)
    table = DECODE_SPLITS[scheme_name]
    assert ws.max_num_seqs == max_num_seqs
    for n in range(1, max_num_seqs + 1):
        assert ws.plan(n) == decode_plan(n, num_kv_heads, 132, table)
    need = max(n * ws.plan(n).splits for n in range(1, max_num_seqs + 1)) * num_q_heads
    assert ws.part_acc.shape == (need, 128) and ws.part_ml.shape == (need, 2)
    assert ws.part_acc.dtype == ws.part_ml.dtype == torch.float32


def test_live_splits_follow_the_plan():
    assert DecodePlan(64).live_splits(8) == 8  # 8 tiles, one each
    assert DecodePlan(64, 4).live_splits(8) == 2
    assert DecodePlan(4, 16).live_splits(256) == 4  # 64 tiles each, above the minimum
    assert DecodePlan(4, 16).live_splits(32) == 2
    assert DecodePlan(16).live_splits(40) == 14  # 3 tiles each: the 14th holds the last one
    assert DecodePlan(1, 1).live_splits(256) == 1


def test_workspace_refuses_a_batch_above_max_num_seqs():
    ws = SplitWorkspace.allocate(8, 2, 128, "cpu", "int4_saw", max_num_seqs=16)
    with pytest.raises(ValueError, match="max_num_seqs 16"):
        ws.plan(17)


def test_fixed_split_count_for_every_batch_size():
    ws = SplitWorkspace.allocate(8, 2, 64, "cpu", max_num_seqs=5, num_splits=16)
    assert {ws.plan(n) for n in range(1, 6)} == {DecodePlan(16, 1)}
    assert ws.part_acc.shape == (5 * 16 * 8, 64)
    with pytest.raises(ValueError, match="power of two"):
        SplitWorkspace.allocate(8, 2, 64, "cpu", num_splits=12)
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        SplitWorkspace.allocate(8, 2, 64, "cpu", num_splits=4, max_num_seqs=0)
    with pytest.raises(ValueError, match="or a fixed num_splits"):
        SplitWorkspace.allocate(8, 2, 64, "cpu")
    with pytest.raises(ValueError, match="or a fixed num_splits"):
        SplitWorkspace.allocate(8, 2, 64, "cpu", "int4_saw", num_splits=4)
    with pytest.raises(ValueError, match="no split rule for 'int8'"):
        SplitWorkspace.allocate(8, 2, 64, "cpu", "int8")


# The counts the H200 table picks, run by the kernel under the interpreter: the largest (batch 1) and one from a
# batch of eight, with the workspace poisoned, against the read rule's float64 oracle.
RULE_CASES = {1: [(1000, 1)], 8: [(0, 1), (126, 1), (127, 1), (300, 1), (5, 1), (383, 1), (900, 1), (64, 1)]}


def decode_with_rule(gen, kernel_device, scheme_name, num_seqs):
    """One decode step of RULE_CASES[num_seqs] at GQA 7 with one KV head (the fewest programs, so the rule splits
    most) through the workspace DECODE_SPLITS[scheme_name] sizes, NaN-poisoned, against the read rule's float64
    oracle; then the partials: every live split wrote, every split past the context (DecodePlan: cdiv(tiles,
    splits) tiles each, at least min_split_tiles) wrote nothing. Returns the plan."""
    scheme = Int4Scheme(scheme_name)
    num_q_heads, num_kv_heads = 7, 1
    ws = SplitWorkspace.allocate(num_q_heads, num_kv_heads, 128, kernel_device, scheme_name, max_num_seqs=num_seqs,
                                 num_sms=132)
    plan = ws.plan(num_seqs)
    assert plan == decode_plan(num_seqs, num_kv_heads, 132, DECODE_SPLITS[scheme_name])
    ws.part_acc.fill_(float("nan"))
    ws.part_ml.fill_(float("nan"))
    batch, cache, pool = stored_step(gen, RULE_CASES[num_seqs], 128, kernel_device, num_q_heads, num_kv_heads,
                                     scheme)
    own_block = {} if pool is None else dict(new_keys=batch.key, staged_keys=pool.staged_keys,
                                             sequence_slots=pool.sequence_slots)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc, 1, 128**-0.5,
                    scheme, out, workspace=ws, **own_block)
    expected = batch_rule_attention(batch, 128**-0.5, scheme)
    assert not torch.isnan(out).any(), f"{scheme_name}, {plan}: unwritten output"
    assert relative_error(out.cpu(), expected) < 1e-2, f"{scheme_name}, {plan}"
    launch = DECODE_LAUNCH[scheme_name]
    splits = plan.splits
    partials = ws.part_ml[: num_seqs * num_q_heads * splits].view(num_seqs, num_q_heads, splits, 2).cpu()
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        live = plan.live_splits(math.ceil(seq_len / tile_tokens(128, launch.tile)))
        assert not partials[seq, :, :live].isnan().any(), f"{scheme_name}, sequence {seq}: a live split unwritten"
        assert partials[seq, :, live:].isnan().all(), f"{scheme_name}, sequence {seq}: a split past the context ran"
    return plan


@pytest.mark.filterwarnings("ignore:(divide by zero|invalid value) encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
@pytest.mark.parametrize("num_seqs", sorted(RULE_CASES))
@pytest.mark.parametrize("scheme_name", SCHEMES)
def test_kernel_matches_the_reference_at_the_counts_the_h200_table_picks(gen, kernel_device, scheme_name, num_seqs):
    assert decode_with_rule(gen, kernel_device, scheme_name, num_seqs).splits >= 32


@pytest.mark.filterwarnings("ignore:(divide by zero|invalid value) encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
@pytest.mark.parametrize("scheme_name", SCHEMES)
def test_min_split_tiles_fill_fewer_splits_for_short_contexts(gen, kernel_device, monkeypatch, scheme_name):
    """A plan's min_split_tiles: the batch of eight's 1-8 tile contexts fill 1-2 of 16 splits at 4 tiles each, and
    the output is the same attention."""
    monkeypatch.setitem(DECODE_SPLITS, scheme_name, ((math.inf, 16, 4),))
    assert decode_with_rule(gen, kernel_device, scheme_name, 8) == DecodePlan(16, 4)
