"""The Triton paged attention kernel (kernels/attention.py) against the torch reference: int4_saw here, int4_kivi's
read rule (its own block from the original keys) in test_own_block_attention.py.

Without CUDA it runs under the Triton interpreter (set up in conftest.py), fp16, small shapes: a few minutes of
CI. With CUDA the same tests run the compiled kernel. Unused pages, the unwritten tail of the last page of each
sequence and the output are poisoned (random bytes, NaN) before each call.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kv_batches import (assert_poisoned_rows, cache_with_prefix, make_paged_batch, poison_fresh_values, relative_error,
                        scheme_head_dims, unquantized_attention, with_guard_blocks)

from s4kv.kernels import reference as ref
from s4kv.kernels.attention import (CODE_PATHS, DECODE_LAUNCH, PREFILL_LAUNCH, SUBNORMAL_HEAD_DIMS, SplitWorkspace,
                                    paged_attention)
from s4kv.runtime.schemes import SUPPORTED_HEAD_DIMS
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.store import store_kv

# Interpreter noise: it evaluates 1 / l for query rows a program masks out (l = 0, never stored), takes row maxima
# over the NaN scores of poisoned rows, and numpy deprecates how it turns 1-element arrays into loop bounds.
pytestmark = [
    pytest.mark.filterwarnings("ignore:(divide by zero|invalid value) encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
]

KIVI = Int4Scheme("int4_kivi")
SCHEMES = {
    "saw128": Int4Scheme("int4_saw", 128),
    "saw64-rotv": Int4Scheme("int4_saw", 64, rotate_values=True),
    "saw32": Int4Scheme("int4_saw", 32),
    "saw128-rotv": Int4Scheme("int4_saw", 128, rotate_values=True),
}
SOFTMAX_SCALE = 128**-0.5
# (context, q_len): a fresh prefill (more than one 64-row query tile even at GQA 1), chunks over cached prefixes (one
# closes a KIVI block), decodes at block edges
MIXED = [(0, 70), (127, 1), (200, 20), (3, 1), (100, 40), (0, 1), (256, 5)]
DECODE = [(0, 1), (126, 1), (127, 1), (300, 1), (5, 1), (383, 1)]
# MIXED and chunks whose 9-token query tiles (GQA 7) cross a 64-token tile edge with rows before it (59-67, 120-128)
STRADDLING = MIXED + [(50, 30), (120, 20)]
# fp16 output and fp16 P @ V products against the float32 reference
MAX_REL_ERR = 1e-2


def heads_for(group: int) -> tuple[int, int]:
    """(query heads, KV heads) for a GQA ratio, keeping the interpreter's work small."""
    num_kv_heads = 2 if group < 7 else 1
    return group * num_kv_heads, num_kv_heads


def run_kernel(batch, cache, scheme, workspace=None, launch=None) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                    batch.max_query_len, SOFTMAX_SCALE, scheme, out, workspace=workspace, launch=launch)
    return out


def run_reference(batch, cache, scheme) -> torch.Tensor:
    return ref.paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                               SOFTMAX_SCALE, scheme)


def decode_batch(gen, kernel_device, scheme, group: int, num_splits: int | None, head_dim: int):
    """(batch, cache, workspace) of the DECODE contexts at a GQA ratio, stored by the reference, guard blocks around
    the pages; a split workspace of ``num_splits`` (None: one pass) with NaN-poisoned partials."""
    num_q_heads, num_kv_heads = heads_for(group)
    batch = make_paged_batch(gen, DECODE, num_q_heads, num_kv_heads, block_size=128, dtype=torch.float16,
                             device=kernel_device, num_padding=1, head_dim=head_dim)
    cache = with_guard_blocks(cache_with_prefix(batch, scheme, gen, kernel_device), gen)
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
    workspace = None
    if num_splits is not None:
        workspace = SplitWorkspace.allocate(num_q_heads, num_kv_heads, head_dim, kernel_device,
                                            max_num_seqs=len(DECODE), num_splits=num_splits)
        workspace.part_acc.fill_(float("nan"))
        workspace.part_ml.fill_(float("nan"))
    return batch, cache, workspace


def assert_attention_close(out, expected, what: str) -> None:
    assert out.shape == expected.shape, f"{what}: output shape {tuple(out.shape)}"
    nan_rows = torch.isnan(out).flatten(1).any(1)
    assert not nan_rows.any(), f"{what}: NaN in output rows {nan_rows.nonzero().flatten().tolist()}"
    err = relative_error(out, expected)
    assert err < MAX_REL_ERR, f"{what}: relative error {err:.2e} against the reference"
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("group", [1, 4, 7, 16])
@pytest.mark.parametrize("scheme_name,head_dim", scheme_head_dims(SCHEMES))
def test_mixed_prefill_and_decode_batch(gen, kernel_device, scheme_name, head_dim, group):
    scheme = SCHEMES[scheme_name]
    num_q_heads, num_kv_heads = heads_for(group)
    batch = make_paged_batch(gen, MIXED, num_q_heads, num_kv_heads, block_size=128, dtype=torch.float16,
                             device=kernel_device, num_padding=2, head_dim=head_dim)
    cache = cache_with_prefix(batch, scheme, gen, kernel_device)
    kernel_cache = cache.clone()
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
    expected = run_reference(batch, cache, scheme)
    what = f"{scheme_name} GQA {group} head_dim {head_dim}"
    assert_attention_close(run_kernel(batch, cache, scheme), expected, what)
    # the whole kernel path: the kernel's own store, then attention (rare +-1 codes move the output a little)
    store_kv(batch.key, batch.value, kernel_cache, batch.slot_mapping, scheme)
    assert_attention_close(run_kernel(batch, kernel_cache, scheme), expected, f"{what}, kernel store")


@pytest.mark.parametrize(
    "scheme_name, group, num_splits, head_dim",
    [
        ("saw128", 1, 16, 128), ("saw128", 4, None, 128), ("saw128", 7, 8, 128), ("saw64-rotv", 4, 16, 128),
        ("saw32", 7, None, 128), ("saw128-rotv", 1, 8, 128), ("saw64-rotv", 4, 16, 64), ("saw32", 1, 4, 64),
        ("saw128", 7, None, 128), ("saw128-rotv", 4, 8, 128), ("saw32", 1, 16, 128), ("saw64-rotv", 4, 4, 64),
        # GQA 16 (Llama-3.1-405B, MAX_GQA_GROUP): every row of the 16-row tile live
        ("saw128", 16, 8, 128), ("saw64-rotv", 16, None, 64),
    ],
)
def test_decode_batch_with_and_without_split_workspace(gen, kernel_device, scheme_name, group, num_splits,
                                                       head_dim):
    """max_query_len 1. num_splits None: no workspace (one pass); 4-16 splits (at 16, some empty); contexts at page
    edges and within a tile's first tokens."""
    scheme = SCHEMES[scheme_name]
    batch, cache, workspace = decode_batch(gen, kernel_device, scheme, group, num_splits, head_dim)
    assert_attention_close(run_kernel(batch, cache, scheme, workspace), run_reference(batch, cache, scheme),
                           f"{scheme_name} GQA {group} num_splits {num_splits} head_dim {head_dim}")


@pytest.mark.parametrize("head_dim", [128, 64])
def test_paired_parameter_loads_give_the_same_output(gen, kernel_device, head_dim):
    """(scale, min) read as one 32-bit word or as two fp16 values: the same numbers, so the same output bit for
    bit (int4_saw's per-token keys and values here; int4_kivi's per-channel keys in test_own_block_attention)."""
    scheme = SCHEMES["saw64-rotv"]
    num_q_heads, num_kv_heads = heads_for(4)
    batch = make_paged_batch(gen, DECODE, num_q_heads, num_kv_heads, block_size=128, dtype=torch.float16,
                             device=kernel_device, num_padding=1, head_dim=head_dim)
    cache = cache_with_prefix(batch, scheme, gen, kernel_device)
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
    workspace = SplitWorkspace.allocate(num_q_heads, num_kv_heads, head_dim, kernel_device, max_num_seqs=len(DECODE),
                                        num_splits=4)
    outputs = []
    for paired in (False, True):
        launch = dataclasses.replace(DECODE_LAUNCH[scheme.name], ptx_unpack=kernel_device.type == "cuda",
                                     paired_param_loads=paired,
                                     subnormal_codes=(DECODE_LAUNCH[scheme.name].subnormal_codes
                                                      and head_dim in SUBNORMAL_HEAD_DIMS))
        outputs.append(run_kernel(batch, cache, scheme, workspace, launch))
    assert_attention_close(outputs[1], run_reference(batch, cache, scheme), f"paired loads, head_dim {head_dim}")
    assert torch.equal(outputs[0], outputs[1])


# inline PTX cannot run under the interpreter: those paths run with the GPU tests (tests/kernels/run_gpu.sh)
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX needs a CUDA GPU")]
OTHER_CODE_PATHS = [pytest.param(name, marks=GPU_ONLY if "ptx" in name else []) for name in CODE_PATHS
                    if name != "biased"]


@pytest.mark.parametrize("code_path", OTHER_CODE_PATHS)
@pytest.mark.parametrize("specs", [MIXED, DECODE], ids=["mixed", "decode-split"])
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("scheme_name", ["saw64-rotv"])
def test_other_code_paths_match_the_reference(gen, kernel_device, scheme_name, head_dim, specs, code_path):
    """The launch options that feed codes to the MMA as fp16 subnormals (code * 2^-24, rescaled in fp32) and/or
    unpack them with inline PTX: same attention as the reference, on the one-pass prefill path and the split-KV
    decode path (the default path is every other test's)."""
    scheme = SCHEMES[scheme_name]
    batch = make_paged_batch(gen, specs, 8, 2, block_size=128, dtype=torch.float16, device=kernel_device,
                             head_dim=head_dim)
    cache = cache_with_prefix(batch, scheme, gen, kernel_device)
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
    decode = batch.max_query_len == 1
    launch = dataclasses.replace(DECODE_LAUNCH[scheme.name] if decode else PREFILL_LAUNCH, **CODE_PATHS[code_path])
    workspace = SplitWorkspace.allocate(8, 2, head_dim, kernel_device, num_splits=8) if decode else None
    if launch.subnormal_codes and head_dim not in SUBNORMAL_HEAD_DIMS:
        # refused, not run: the compiled subnormal path faults on the H200 at this head_dim
        with pytest.raises(ValueError, match=f"subnormal_codes is validated on the GPU at head_dim .* not {head_dim}"):
            run_kernel(batch, cache, scheme, workspace, launch)
        return
    assert_attention_close(run_kernel(batch, cache, scheme, workspace, launch), run_reference(batch, cache, scheme),
                           f"{scheme_name} {code_path} codes head_dim {head_dim}")


@pytest.mark.parametrize("code_path", [pytest.param(name, marks=GPU_ONLY if "ptx" in name else [])
                                       for name in CODE_PATHS])
@pytest.mark.parametrize("specs", [MIXED, DECODE], ids=["mixed", "decode-split"])
@pytest.mark.parametrize("scheme_name,head_dim", [("saw128", 128), ("saw64-rotv", 64)])
def test_wide_code_loads_match_the_reference(gen, kernel_device, scheme_name, head_dim, specs, code_path):
    """Codes read two bytes per element (LaunchConfig.wide_code_loads: keys as four channel quarters, values as the
    even and odd tokens of a tile): the same attention as the reference with every code path, prefill and split
    decode, GQA 7 (int4_kivi's per-channel keys: test_own_block_attention)."""
    if CODE_PATHS[code_path]["subnormal_codes"] and head_dim not in SUBNORMAL_HEAD_DIMS:
        pytest.skip(f"the subnormal path is refused at head_dim {head_dim}")
    assert_launch_matches_reference(gen, kernel_device, SCHEMES[scheme_name], specs, head_dim,
                                     dict(CODE_PATHS[code_path], wide_code_loads=True),
                                     f"{scheme_name} wide {code_path} codes head_dim {head_dim}")


@pytest.mark.parametrize("specs", [MIXED, DECODE], ids=["mixed", "decode-split"])
@pytest.mark.parametrize("scheme_name,head_dim", [("saw128", 128), ("saw64-rotv", 64)])
def test_joint_row_sums_match_the_reference(gen, kernel_device, scheme_name, head_dim, specs):
    """A tile's row sums in one reduction (LaunchConfig.joint_row_sums): GQA 7 (dead rows in every program),
    prefill, chunks and split decode; subnormal codes where the head_dim allows them, the PTX unpack on the GPU."""
    assert_launch_matches_reference(gen, kernel_device, SCHEMES[scheme_name], specs, head_dim,
                                    dict(joint_row_sums=True, ptx_unpack=kernel_device.type == "cuda",
                                         subnormal_codes=head_dim in SUBNORMAL_HEAD_DIMS),
                                    f"{scheme_name} joint row sums, head_dim {head_dim}")


def assert_launch_matches_reference(gen, kernel_device, scheme, specs, head_dim, options: dict, what: str) -> None:
    """Attention over ``specs`` at GQA 7 (dead rows in every program) against the reference: the scheme's decode
    launch (split in 4, NaN-poisoned partials) or the prefill launch, with ``options`` (LaunchConfig fields)."""
    num_q_heads, num_kv_heads = heads_for(7)
    batch = make_paged_batch(gen, specs, num_q_heads, num_kv_heads, block_size=128, dtype=torch.float16,
                             device=kernel_device, num_padding=1, head_dim=head_dim)
    cache = with_guard_blocks(cache_with_prefix(batch, scheme, gen, kernel_device), gen)
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
    decode = batch.max_query_len == 1
    launch = dataclasses.replace(DECODE_LAUNCH[scheme.name] if decode else PREFILL_LAUNCH, **options)
    workspace = None
    if decode:
        workspace = SplitWorkspace.allocate(num_q_heads, num_kv_heads, head_dim, kernel_device,
                                            max_num_seqs=len(specs), num_splits=4)
        workspace.part_acc.fill_(float("nan"))
    assert_attention_close(run_kernel(batch, cache, scheme, workspace, launch), run_reference(batch, cache, scheme),
                           what)


@pytest.mark.parametrize("wide", [False, True], ids=["byte-codes", "wide-codes"])
@pytest.mark.parametrize("specs,tile,num_splits", [(STRADDLING, None, None), (DECODE, 128, None), (DECODE, 128, 4),
                                                   (DECODE, 64, 8)],
                         ids=["mixed", "decode", "decode-split", "decode-split-tile64"])
@pytest.mark.parametrize("scheme_name,head_dim", [("saw128", 128), ("saw64-rotv", 64)])
def test_unmasked_full_tiles_match_the_reference(gen, kernel_device, scheme_name, head_dim, specs, tile, num_splits,
                                                 wide):
    """The tiles every live row of a program sees wholly without the masks, the rest masked
    (LaunchConfig.unmasked_full_tiles): contexts ending mid-tile, on a tile edge and inside the first tile, split
    decode (the splits before a sequence's last have no masked tail), prefill and chunks over cached prefixes, GQA 7
    (dead rows in every program), query tiles across a tile edge. Against the reference, and under the interpreter
    bit for bit the masked run: in a tile a row sees wholly the masks change no number. With the wide code loads
    several queries a program are refused."""
    scheme = SCHEMES[scheme_name]
    num_q_heads, num_kv_heads = heads_for(7)
    batch = make_paged_batch(gen, specs, num_q_heads, num_kv_heads, block_size=128, dtype=torch.float16,
                             device=kernel_device, num_padding=1, head_dim=head_dim)
    cache = with_guard_blocks(cache_with_prefix(batch, scheme, gen, kernel_device), gen)
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
    base = dataclasses.replace(DECODE_LAUNCH[scheme.name], tile=tile) if tile else PREFILL_LAUNCH
    masked = dataclasses.replace(base, ptx_unpack=kernel_device.type == "cuda", subnormal_codes=False,
                                 wide_code_loads=wide, unmasked_full_tiles=False)
    if wide and batch.max_query_len > 1:
        # refused: on the GPU the two together gave NaN and an illegal address with several queries a program
        with pytest.raises(ValueError, match="wide_code_loads with unmasked_full_tiles"):
            run_kernel(batch, cache, scheme, None, dataclasses.replace(masked, unmasked_full_tiles=True))
        return
    workspace = None
    if num_splits:
        workspace = SplitWorkspace.allocate(num_q_heads, num_kv_heads, head_dim, kernel_device,
                                            max_num_seqs=len(specs), num_splits=num_splits)
        workspace.part_acc.fill_(float("nan"))
        workspace.part_ml.fill_(float("nan"))
    out = run_kernel(batch, cache, scheme, workspace, dataclasses.replace(masked, unmasked_full_tiles=True))
    assert_attention_close(out, run_reference(batch, cache, scheme),
                           f"{scheme_name} unmasked full tiles, tile {tile}, splits {num_splits}, wide {wide}")
    if kernel_device.type == "cpu":
        assert torch.equal(out, run_kernel(batch, cache, scheme, workspace, masked))


@pytest.mark.parametrize(
    "scheme_name, group, num_splits, head_dim, code_path",
    [("saw128", 7, None, 128, "subnormal"), ("saw128-rotv", 4, 8, 128, "subnormal"), ("saw32", 1, 4, 128, "biased"),
     ("saw128", 8, 16, 128, "biased"), ("saw64-rotv", 4, 16, 64, "biased"), ("saw32", 7, None, 64, "biased")],
)
def test_group_as_n_matches_the_reference(gen, kernel_device, scheme_name, group, num_splits, head_dim, code_path):
    """Decode with the query rows as the MMA's N and each warp its own tokens (LaunchConfig.group_as_n): GQA 1-8
    (dead columns past the group), one pass and split (16 splits leave some empty), contexts at page edges and within
    a warp's first tokens, rotated values, head_dim 64 and 128, against the reference and against the tile loop,
    which only sums in another order."""
    scheme = SCHEMES[scheme_name]
    batch, cache, workspace = decode_batch(gen, kernel_device, scheme, group, num_splits, head_dim)
    tile_loop = dataclasses.replace(DECODE_LAUNCH[scheme.name], ptx_unpack=kernel_device.type == "cuda",
                                    **{k: v for k, v in CODE_PATHS[code_path].items() if k != "ptx_unpack"})
    out = run_kernel(batch, cache, scheme, workspace, tile_loop.with_group_as_n())
    assert_attention_close(out, run_reference(batch, cache, scheme),
                           f"{scheme_name} group as N, GQA {group}, splits {num_splits}, head_dim {head_dim}")
    torch.testing.assert_close(out, run_kernel(batch, cache, scheme, workspace, tile_loop), rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("options, match", [
    (dict(), "a decode batch"), (dict(scheme="int4_kivi"), "keys per token"),
    (dict(wide_code_loads=False), "codes read two bytes per element"), (dict(tile=64), "at least 32 tokens a warp"),
    (dict(unmasked_full_tiles=True), "no tile-loop option"), (dict(joint_row_sums=True), "no tile-loop option"),
])
def test_group_as_n_is_refused_where_it_does_not_apply(gen, options, match):
    """Prefill rows, int4_kivi's per-channel keys, byte codes, fewer than 32 tokens a warp and the tile loop's
    options get a clear error, never another loop."""
    options = dict(options)
    scheme = KIVI if options.pop("scheme", None) else SCHEMES["saw128"]
    launch = dataclasses.replace(DECODE_LAUNCH["int4_saw"].with_group_as_n(), ptx_unpack=False, **options)
    specs = [(0, 3)] if match == "a decode batch" else [(40, 1)]
    batch = make_paged_batch(gen, specs, 8, 2, block_size=128, dtype=torch.float16, device="cpu")
    own_block = {}
    if scheme.is_kivi:
        own_block = dict(new_keys=batch.key, staged_keys=batch.key.new_zeros(1, 2, 128, 128),
                         sequence_slots=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match=f"group_as_n needs {match}"):
        paged_attention(batch.query, torch.zeros(4, 2, 136 * 128, dtype=torch.uint8), batch.block_table,
                        batch.seq_lens, batch.query_start_loc, batch.max_query_len, SOFTMAX_SCALE, scheme,
                        torch.empty_like(batch.query), launch=launch, **own_block)


def test_ptx_unpack_is_refused_by_the_interpreter():
    """Off the GPU the option is an error naming the cause, never a silent fall-back to another path."""
    if torch.cuda.is_available():
        pytest.skip("the GPU runs inline PTX")
    scheme = SCHEMES["saw128"]
    q = torch.zeros(1, 8, 128, dtype=torch.float16)
    launch = dataclasses.replace(DECODE_LAUNCH[scheme.name], ptx_unpack=True)
    with pytest.raises(ValueError, match="inline PTX"):
        paged_attention(q, torch.zeros(2, 2, 136 * 128, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.int32),
                        torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1, 0.1, scheme,
                        torch.empty_like(q), launch=launch)


def test_split_kv_agrees_with_the_one_pass_tile_loop(gen, kernel_device):
    """Split-KV only reorders the softmax sums: it agrees with the one-pass tile loop far tighter than either does
    with fp32."""
    scheme = SCHEMES["saw128"]
    batch = make_paged_batch(gen, DECODE, 8, 2, block_size=128, dtype=torch.float16, device=kernel_device)
    cache = cache_with_prefix(batch, scheme, gen, kernel_device)
    store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
    workspace = SplitWorkspace.allocate(8, 2, 128, kernel_device, num_splits=16)
    one_pass = run_kernel(batch, cache, scheme)
    torch.testing.assert_close(run_kernel(batch, cache, scheme, workspace), one_pass, rtol=5e-3, atol=5e-3)


def test_shuffled_block_table_changes_nothing_but_the_page_order(gen, kernel_device):
    """The same tokens stored through two different block tables give bit-identical attention outputs."""
    scheme = SCHEMES["saw128"]
    specs = [(0, 203), (0, 1)]
    first = make_paged_batch(gen, specs, 4, 1, block_size=128, dtype=torch.float16, device=kernel_device)
    second = make_paged_batch(gen, specs, 4, 1, block_size=128, dtype=torch.float16, device=kernel_device,
                              spare_blocks=5)
    assert not torch.equal(first.block_table, second.block_table)
    second.key, second.value, second.query = first.key, first.value, first.query
    outs = []
    for batch in (first, second):
        cache = cache_with_prefix(batch, scheme, gen, kernel_device)
        store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
        outs.append(run_kernel(batch, cache, scheme))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@pytest.mark.parametrize("specs", [DECODE, MIXED[:4]], ids=["decode", "mixed"])
@pytest.mark.parametrize("with_workspace", [False, True])
def test_cuda_graph_padding_rows_and_empty_sequences(gen, kernel_device, specs, with_workspace):
    """As vLLM pads a batch to a CUDA-graph size: extra query rows past query_start_loc[-1], and padded
    sequences with no query tokens (seq_len 0, or 1 as set at capture) whose block-table rows are null."""
    scheme = SCHEMES["saw128"]
    batch = make_paged_batch(gen, specs, 8, 2, block_size=128, dtype=torch.float16, device=kernel_device)
    cache = cache_with_prefix(batch, scheme, gen, kernel_device)
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
    expected = run_reference(batch, cache, scheme)

    num_tokens = batch.num_tokens
    query = torch.cat([batch.query, torch.full((3, 8, 128), float("nan"), dtype=torch.float16, device=kernel_device)])
    last = batch.query_start_loc[-1:]
    query_start_loc = torch.cat([batch.query_start_loc, last, last])
    seq_lens = torch.cat([batch.seq_lens, torch.tensor([0, 1], dtype=torch.int32, device=kernel_device)])
    block_table = torch.cat([batch.block_table, torch.zeros_like(batch.block_table[:2])])
    workspace = SplitWorkspace.allocate(8, 2, 128, kernel_device, num_splits=16) if with_workspace else None
    out = torch.full_like(query, float("nan"))
    paged_attention(query, cache, block_table, seq_lens, query_start_loc, batch.max_query_len, SOFTMAX_SCALE,
                    scheme, out, workspace=workspace)
    assert_attention_close(out[:num_tokens], expected, "padded batch")


@pytest.mark.parametrize("unmasked_full_tiles", [False, True], ids=["masked", "unmasked-full-tiles"])
@pytest.mark.parametrize("scheme_name", ["saw64-rotv"])
def test_a_broken_value_poisons_only_the_queries_that_see_it(gen, kernel_device, scheme_name, unmasked_full_tiles):
    """A NaN value (stored with a NaN scale) in a fresh prefill and in a chunk over a cached prefix: the queries
    before it must not see it (p = 0 there, and 0 * NaN is NaN), those after it must be NaN. Which rows are NaN
    comes from the oracle that gives each query only the keys it may see; the other rows match the reference. With
    LaunchConfig.unmasked_full_tiles the poisoned tile is a full one for the later query tiles of both sequences."""
    scheme = SCHEMES[scheme_name]
    batch = make_paged_batch(gen, [(0, 70), (100, 40)], 8, 2, block_size=128, dtype=torch.float16,
                             device=kernel_device)
    poison_fresh_values(batch, {0: 30, 1: 120})
    cache = cache_with_prefix(batch, scheme, gen, kernel_device)
    store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
    out = run_kernel(batch, cache, scheme,
                     launch=dataclasses.replace(PREFILL_LAUNCH, unmasked_full_tiles=True) if unmasked_full_tiles
                     else None)
    assert_poisoned_rows(out, unquantized_attention(batch, SOFTMAX_SCALE), scheme_name)
    expected = run_reference(batch, cache, scheme)
    finite = ~torch.isnan(expected).any(-1)
    torch.testing.assert_close(out.float()[finite], expected[finite], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 96])
def test_any_page_size_is_read_right_or_rejected(gen, kernel_device, block_size):
    """int4_saw pages of any multiple of 16 are stored fine (vLLM uses 128); attention must read them right or
    refuse them with a ValueError that names the block size."""
    scheme = SCHEMES["saw128"]
    batch = make_paged_batch(gen, [(100, 5), (40, 1)], 4, 2, block_size=block_size, dtype=torch.float16,
                             device=kernel_device)
    cache = with_guard_blocks(cache_with_prefix(batch, scheme, gen, kernel_device), gen)
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
    try:
        out = run_kernel(batch, cache, scheme)
    except ValueError as error:
        assert "block_size" in str(error)
        return
    assert_attention_close(out, run_reference(batch, cache, scheme), f"block_size {block_size}")


def test_bad_inputs_get_clear_errors(gen, kernel_device):
    query = torch.zeros(2, 6, 128, dtype=torch.float16, device=kernel_device)
    cache = torch.zeros(3, 4, 128 * 136, dtype=torch.uint8, device=kernel_device)
    args = (torch.zeros(2, 2, dtype=torch.int32, device=kernel_device),
            torch.ones(2, dtype=torch.int32, device=kernel_device),
            torch.arange(3, dtype=torch.int32, device=kernel_device), 1, SOFTMAX_SCALE)
    with pytest.raises(ValueError, match="multiple of 4"):
        paged_attention(query, cache, *args, SCHEMES["saw128"], torch.empty_like(query))
    query = torch.zeros(2, 8, 128, dtype=torch.float32, device=kernel_device)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        paged_attention(query, cache, *args, SCHEMES["saw128"], torch.empty_like(query))
    query = query.half()

    def kivi_pool(head_dim: int) -> dict:  # a well-formed staging pool, so that the check under test is reached
        return dict(staged_keys=query.new_zeros(1, 4, 128, head_dim),
                    sequence_slots=torch.zeros(2, dtype=torch.int32, device=kernel_device))

    with pytest.raises(ValueError, match="int4_kivi needs block_size 128"):
        paged_attention(query, cache[..., : 64 * 136], *args, KIVI, torch.empty_like(query), **kivi_pool(128))
    with pytest.raises(ValueError, match="support head_dim 64 and 128, got 96"):
        paged_attention(query[..., :96], cache, *args, KIVI, torch.empty_like(query[..., :96]), **kivi_pool(96))
    with pytest.raises(ValueError, match=r"block_size \* 72\] for head_dim 64"):
        paged_attention(query[..., :64], cache[..., : 128 * 136 - 8], *args, KIVI,
                        torch.empty_like(query[..., :64]), **kivi_pool(64))
    cache64 = torch.zeros(3, 4, 128 * 72, dtype=torch.uint8, device=kernel_device)
    with pytest.raises(ValueError, match="hadamard_block 128 does not divide head_dim 64"):
        paged_attention(query[..., :64], cache64, *args, SCHEMES["saw128"], torch.empty_like(query[..., :64]))
    workspace = SplitWorkspace.allocate(8, 4, 128, kernel_device, num_splits=16)
    with pytest.raises(ValueError, match="another head_dim"):
        paged_attention(query[..., :64], cache64, *args, KIVI, torch.empty_like(query[..., :64]),
                        workspace=workspace, new_keys=query.new_zeros(2, 4, 64), **kivi_pool(64))
