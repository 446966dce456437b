"""Properties of the torch reference (kernels/reference.py): the oracle of every kernel test must itself be right.

CPU only, a few seconds in all.
"""

from __future__ import annotations

import pytest
import torch
from attention_oracle import causal_attention
from kv_batches import (
    HEAD_DIM,
    cache_with_prefix,
    entry_bytes,
    make_paged_batch,
    poisoned_cache,
    random_keys,
    random_values,
    relative_error,
    unquantized_attention,
    written_byte_mask,
)

from s4kv.kernels import reference as ref
from s4kv.kernels.hadamard import block_hadamard, sylvester_hadamard
from s4kv.kernels.layout import PageLayout, bytes_per_token, cache_shape, cdiv, check_head_dim, next_power_of_2
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.staging import allocate_pool, sequence_staging_slots
from s4kv.runtime.schemes import KV_FORMATS, SUPPORTED_HEAD_DIMS

KIVI = Int4Scheme.parse({"scheme": "int4_kivi"})
SAW_SCHEMES = [
    Int4Scheme.parse({"scheme": "int4_saw", "hadamard_block": b, "rotate_values": rv})
    for b, rv in ((128, False), (64, True), (32, False))
]
ALL_SCHEMES = [KIVI, *SAW_SCHEMES]
SCHEME_IDS = ["kivi", "saw128", "saw64-rotv", "saw32"]
# every (scheme, head_dim) the scheme's Hadamard block fits
SCHEMES_BY_HEAD_DIM = [pytest.param(scheme, d, id=f"{name}-d{d}") for scheme, name in zip(ALL_SCHEMES, SCHEME_IDS)
                       for d in SUPPORTED_HEAD_DIMS if scheme.hadamard_block is None or d % scheme.hadamard_block == 0]
FP16_EPS = 2.0**-11  # unit roundoff of fp16


def assert_round_trip_bound(x: torch.Tensor, x_hat: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                            lo: torch.Tensor) -> None:
    """Per element |x - x_hat| <= scale/2, plus what the fp16 rounding of min and scale can add.

    ``scale``, ``minimum`` and ``lo`` (the exact minimum) broadcast against x. Rounding scale to fp16 moves the
    top code by up to 15 * scale * 2^-11 < scale * 2^-7; rounding min moves every code by |lo - min|.
    """
    bound = scale.float() * (0.5 + 2.0**-7) + (lo.float() - minimum.float()).abs() + 1e-6 * x.abs().amax()
    err = (x.float() - x_hat).abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"round-trip error {err.flatten()[worst]:.4g} > bound {bound.expand_as(err).flatten()[worst]:.4g}")


# ---------------------------------------------------------------------------------------------------------------
# quantize / dequantize building blocks
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 128), (37, 3, 128), (5, 7, 2, 128), (9, 2, 64)])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_per_token_round_trip_is_within_half_a_step(gen, shape, magnitude):
    x = (torch.randn(shape, generator=gen) + torch.randn(shape[:-1] + (1,), generator=gen)) * magnitude
    codes, scale, minimum = ref.quantize_per_token(x)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and int(codes.max()) <= 15
    assert scale.dtype == minimum.dtype == torch.float16 and scale.shape == x.shape[:-1]
    assert (scale.float() >= ref.EPS).all()
    x_hat = ref.dequantize_per_token(codes, scale, minimum)
    assert_round_trip_bound(x, x_hat, scale[..., None], minimum[..., None], x.amin(-1, keepdim=True))
    # both ends of the range are used: the step is as fine as the range allows
    assert (codes.amin(-1) == 0).all() and (codes.amax(-1) == 15).all()


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("tokens", [1, 16, 128])
def test_per_channel_round_trip_is_within_half_a_step(gen, tokens, head_dim):
    x = random_keys(gen, tokens, 1, torch.float32, "cpu", head_dim)[:, 0]
    codes, scale, minimum = ref.quantize_per_channel(x)
    assert codes.shape == (tokens, head_dim) and scale.shape == minimum.shape == (head_dim,)
    x_hat = ref.dequantize_per_channel(codes, scale, minimum)
    assert_round_trip_bound(x, x_hat, scale, minimum, x.amin(0))
    # per channel means per channel: a channel scaled by 100 leaves the other channels' params alone
    y = x.clone()
    y[:, 5] *= 100
    _, scale_y, min_y = ref.quantize_per_channel(y)
    others = torch.arange(head_dim) != 5
    assert torch.equal(scale_y[others], scale[others]) and torch.equal(min_y[others], minimum[others])


@pytest.mark.parametrize("value", [0.0, 1.0, -3.5, 1000.0, 0.1, -123.456, 60000.0])
def test_constant_vector_keeps_a_positive_scale_and_reconstructs(value):
    x = torch.full((4, HEAD_DIM), value)
    for quantize, dequantize, dim in ((ref.quantize_per_token, ref.dequantize_per_token, -1),
                                      (ref.quantize_per_channel, ref.dequantize_per_channel, 0)):
        codes, scale, minimum = quantize(x)
        assert (scale.float() == torch.tensor(ref.EPS).half().float()).all()
        x_hat = dequantize(codes, scale, minimum)
        assert torch.isfinite(x_hat).all()
        # all the error there is comes from storing the value's min in fp16
        rounding = abs(value - float(torch.tensor(value).half()))
        assert (x_hat - x).abs().max() <= rounding + 16 * ref.EPS, f"dim {dim}"
        if rounding == 0:
            assert torch.equal(x_hat, x)


def test_zeros_are_exact():
    x = torch.zeros(3, 2, HEAD_DIM)
    codes, scale, minimum = ref.quantize_per_token(x)
    assert (codes == 0).all() and (minimum == 0).all()
    assert torch.equal(ref.dequantize_per_token(codes, scale, minimum), x)


@pytest.mark.parametrize("outlier", [1e4, -3e4, 60000.0])
def test_huge_outlier_is_kept_and_the_rest_stays_bounded(gen, outlier):
    x = torch.randn(6, HEAD_DIM, generator=gen)
    x[torch.arange(6), torch.randint(0, HEAD_DIM, (6,), generator=gen)] = outlier
    codes, scale, minimum = ref.quantize_per_token(x)
    assert torch.isfinite(scale).all()
    x_hat = ref.dequantize_per_token(codes, scale, minimum)
    assert_round_trip_bound(x, x_hat, scale[:, None], minimum[:, None], x.amin(-1, keepdim=True))
    extreme = x.abs() == abs(outlier)
    assert torch.allclose(x_hat[extreme], x[extreme], rtol=2e-3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 1e6])
def test_nonfinite_or_fp16_overflowing_input_gives_a_nan_scale(gen, bad):
    """Documented behaviour: the broken vector dequantizes to NaN, its neighbours are untouched."""
    x = torch.randn(5, HEAD_DIM, generator=gen)
    x[2, 17] = bad
    codes, scale, minimum = ref.quantize_per_token(x)
    assert torch.isnan(scale[2]) and torch.isfinite(scale[[0, 1, 3, 4]]).all()
    x_hat = ref.dequantize_per_token(codes, scale, minimum)
    assert torch.isnan(x_hat[2]).all()
    good = [0, 1, 3, 4]
    assert_round_trip_bound(x[good], x_hat[good], scale[good, None], minimum[good, None],
                            x[good].amin(-1, keepdim=True))

    codes, scale, minimum = ref.quantize_per_channel(x)
    assert torch.isnan(scale[17]) and torch.isfinite(scale[torch.arange(HEAD_DIM) != 17]).all()
    assert torch.isnan(ref.dequantize_per_channel(codes, scale, minimum)[:, 17]).all()


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_nibble_packing_puts_channel_j_low_and_j_plus_half_high(gen, head_dim):
    codes = torch.randint(0, 16, (9, 3, head_dim), generator=gen, dtype=torch.uint8)
    packed = ref.pack_nibbles(codes)
    half = head_dim // 2
    assert packed.dtype == torch.uint8 and packed.shape == (9, 3, half)
    assert torch.equal(packed & 0xF, codes[..., :half]) and torch.equal(packed >> 4, codes[..., half:])
    assert torch.equal(ref.unpack_nibbles(packed), codes)
    every_byte = torch.arange(256, dtype=torch.uint8).view(4, 64)
    assert torch.equal(ref.pack_nibbles(ref.unpack_nibbles(every_byte)), every_byte)


# ---------------------------------------------------------------------------------------------------------------
# Hadamard rotation
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim,block", [(d, b) for d in SUPPORTED_HEAD_DIMS for b in (1, 2, 32, 64, 128) if b <= d])
def test_block_hadamard_is_orthonormal_symmetric_and_block_diagonal(dim, block):
    r = block_hadamard(block, dim, dtype=torch.float64)
    assert r.shape == (dim, dim) and r.dtype == torch.float64
    torch.testing.assert_close(r @ r.T, torch.eye(dim, dtype=torch.float64))
    assert torch.equal(r, r.T)
    nonzero = r != 0
    same_block = (torch.arange(dim)[:, None] // block) == (torch.arange(dim)[None, :] // block)
    assert torch.equal(nonzero, same_block)
    assert torch.allclose(r[nonzero].abs(), torch.tensor(block**-0.5, dtype=torch.float64))
    h = sylvester_hadamard(block)
    assert torch.equal(h @ h.T, block * torch.eye(block, dtype=torch.float64))


def test_block_hadamard_rejects_bad_sizes():
    with pytest.raises(ValueError, match="power of two"):
        sylvester_hadamard(48)
    with pytest.raises(ValueError, match="power of two"):
        sylvester_hadamard(0)
    with pytest.raises(ValueError, match="does not divide"):
        block_hadamard(64, 96)
    with pytest.raises(ValueError, match="does not divide"):
        block_hadamard(128, 64)


@pytest.mark.parametrize("scheme,head_dim", SCHEMES_BY_HEAD_DIM)
def test_scheme_rotation_is_its_block_hadamard(scheme, head_dim):
    block = head_dim if scheme.hadamard_block is None else scheme.hadamard_block
    assert scheme.hadamard_block_for(head_dim) == block
    assert torch.equal(scheme.rotation(head_dim, "cpu"), block_hadamard(block, head_dim))
    assert scheme.rotation(head_dim, "cpu", dtype=torch.float16).dtype == torch.float16


def test_the_default_rotation_is_the_whole_head_and_a_block_too_large_is_refused():
    """int4_kivi's staging and int4_saw's default rotate over the whole head, 128 or 64 channels; an explicit
    int4_saw hadamard_block of 128 does not fit a 64-channel head and is refused, never shrunk behind the user's
    back."""
    for scheme in (KIVI, Int4Scheme("int4_saw")):
        assert [scheme.hadamard_block_for(d) for d in SUPPORTED_HEAD_DIMS] == list(SUPPORTED_HEAD_DIMS)
    with pytest.raises(ValueError, match=r"hadamard_block 128 does not divide head_dim 64: choose one of \(32, 64\)"):
        Int4Scheme("int4_saw", 128).rotation(64)


# ---------------------------------------------------------------------------------------------------------------
# scheme options
# ---------------------------------------------------------------------------------------------------------------
def test_scheme_parsing_defaults_and_options():
    kivi = Int4Scheme.parse({"scheme": "int4_kivi"})
    assert (kivi.name, kivi.hadamard_block, kivi.rotate_values, kivi.is_kivi) == ("int4_kivi", None, False, True)
    saw = Int4Scheme.parse({"scheme": "int4_saw"})
    assert (saw.name, saw.hadamard_block, saw.rotate_values, saw.is_kivi) == ("int4_saw", None, False, False)
    saw = Int4Scheme.parse({"scheme": "int4_saw", "hadamard_block": 32, "rotate_values": True})
    assert (saw.hadamard_block, saw.rotate_values) == (32, True)
    assert Int4Scheme.parse({"scheme": "int4_saw", "hadamard_block": 64}) == Int4Scheme("int4_saw", 64)


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, "need a \"scheme\""),
        ("int4_saw", "need a \"scheme\""),
        (None, "need a \"scheme\""),
        ({"scheme": "int8"}, "unknown s4kv scheme 'int8'"),
        ({"scheme": "INT4_SAW"}, "unknown s4kv scheme"),
        ({"scheme": "int4_saw", "hadamard_block": 16}, "hadamard_block must be one of"),
        ({"scheme": "int4_saw", "hadamard_block": "64"}, "hadamard_block must be one of"),
        ({"scheme": "int4_saw", "rotate_values": "yes"}, "rotate_values must be true or false"),
        ({"scheme": "int4_saw", "rotate_value": True}, r"unknown option\(s\) \['rotate_value'\]"),
        ({"scheme": "int4_kivi", "hadamard_block": 128}, r"unknown option\(s\) \['hadamard_block'\] for int4_kivi"),
        ({"scheme": "int4_kivi", "rotate_values": False}, "unknown option"),
    ],
)
def test_scheme_parsing_errors_name_the_problem(options, message):
    with pytest.raises(ValueError, match=message):
        Int4Scheme.parse(options)


def test_scheme_constructor_validates_too():
    with pytest.raises(ValueError, match="unknown s4kv scheme"):
        Int4Scheme("int4")
    with pytest.raises(ValueError, match="int4_kivi takes no rotation options"):
        Int4Scheme("int4_kivi", rotate_values=True)
    with pytest.raises(ValueError, match="int4_kivi takes no rotation options"):
        Int4Scheme("int4_kivi", hadamard_block=64)


# ---------------------------------------------------------------------------------------------------------------
# page layout and views
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_page_layout_regions_tile_the_page(block_size, head_dim):
    lay = PageLayout(block_size, head_dim)
    b, d = block_size, head_dim
    assert (lay.k_codes, lay.v_codes, lay.v_params, lay.k_params, lay.page_bytes) == (
        0, d // 2 * b, d * b, (d + 4) * b, (d + 8) * b)
    assert cache_shape(7, 4, block_size, head_dim) == (7, 4, (d + 8) * block_size)


def test_bytes_per_token_and_density_against_bf16():
    """docs/format.md's density table: vLLM's int4_per_token_head budget, head_dim + 8 bytes."""
    bf16 = KV_FORMATS["bf16"].bytes_per_head_token
    assert [bytes_per_token(d) for d in (64, 128)] == [72, 136]
    assert [bf16(d) for d in (64, 128)] == [256, 512]
    assert [round(bf16(d) / bytes_per_token(d), 2) for d in (64, 128)] == [3.56, 3.76]


@pytest.mark.parametrize("block_size", [0, 8, 100, -16])
def test_page_layout_rejects_bad_block_sizes(block_size):
    with pytest.raises(ValueError, match="multiple of 16"):
        PageLayout(block_size, 128)


@pytest.mark.parametrize("head_dim", [32, 80, 96, 256])
def test_page_layout_rejects_other_head_dims(head_dim):
    with pytest.raises(ValueError, match=f"support head_dim 64 and 128, got {head_dim}"):
        PageLayout(128, head_dim)
    with pytest.raises(ValueError, match=f"support head_dim 64 and 128, got {head_dim}"):
        check_head_dim(head_dim)


def test_layout_of_a_cache_reads_its_page_bytes_and_rejects_other_shapes():
    cache = torch.zeros(3, 2, 136 * 128, dtype=torch.uint8)
    assert PageLayout.of_cache(cache, 128) == PageLayout(128, 128)
    assert PageLayout.of_cache(torch.zeros(1, 1, 72 * 16, dtype=torch.uint8), 64) == PageLayout(16, 64)
    with pytest.raises(ValueError, match="blocks, kv_heads, page bytes"):
        PageLayout.of_cache(cache.view(6, -1), 128)
    with pytest.raises(ValueError, match="block_size \\* 136\\] for head_dim 128, got pages of 2192 bytes"):
        PageLayout.of_cache(torch.zeros(1, 1, 137 * 16, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match="support head_dim 64 and 128, got 96"):
        PageLayout.of_cache(cache, 96)


def test_host_grid_arithmetic_matches_tritons():
    """The wrappers' grid arithmetic gives what triton.cdiv and triton.next_power_of_2 (which it replaces) give."""
    import triton

    for a in range(0, 300):
        for b in (1, 2, 16, 128):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for n in range(1, 300):
        assert next_power_of_2(n) == triton.next_power_of_2(n)


def test_page_views_reject_a_cache_of_the_wrong_kind():
    with pytest.raises(ValueError, match="uint8"):
        ref.PageViews(torch.zeros(2, 1, 136 * 16, dtype=torch.float16), 128)
    with pytest.raises(ValueError, match="uint8"):
        ref.PageViews(torch.zeros(2, 136 * 16, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match="block_size \\* 136\\] for head_dim 128"):
        ref.PageViews(torch.zeros(2, 1, 137 * 16, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match="block_size \\* 72\\] for head_dim 64"):
        ref.PageViews(torch.zeros(2, 1, 136 * 16, dtype=torch.uint8), 64)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("block_size", [16, 128])
def test_each_page_view_writes_only_its_documented_bytes(gen, block_size, head_dim):
    """Poison a cache, write one entry through each view, check exactly the documented bytes changed."""
    num_blocks, num_heads = 3, 2
    lay = PageLayout(block_size, head_dim)
    for name in ("k_codes", "v_codes", "v_params", "k_params"):
        blk, head, entry = 1, 1, int(torch.randint(0, block_size, (1,), generator=gen))
        cache = poisoned_cache(num_blocks, num_heads, block_size, gen, "cpu", head_dim)
        before = cache.clone()
        view = getattr(ref.PageViews(cache, head_dim), name)
        documented = entry_bytes(lay, name, entry)
        if name.endswith("codes"):
            view[blk, head, entry] = ~before[blk, head, documented]
        else:
            view[blk, head, entry] = torch.tensor([1.5, -2.25], dtype=torch.float16)
        changed = (cache != before).nonzero().tolist()
        expected = sorted([blk, head, byte] for byte in documented)
        if name.endswith("params"):  # some bytes of the new fp16 pair may equal the poison by chance
            assert set(map(tuple, changed)) <= set(map(tuple, expected)) and changed
            assert cache[blk, head, documented].view(torch.float16).tolist() == [1.5, -2.25]
        else:
            assert changed == expected, name


# ---------------------------------------------------------------------------------------------------------------
# store
# ---------------------------------------------------------------------------------------------------------------
def stored_keys_rotated(cache, slots, head_dim):
    """Per-token dequantized keys of ``slots`` in the rotated space, with their params: ([n, H, D], scale, min)."""
    pages = ref.PageViews(cache, head_dim)
    blk, off = slots // pages.block_size, slots % pages.block_size
    params = pages.k_params[blk, :, off]
    codes = ref.unpack_nibbles(pages.k_codes[blk, :, off])
    return ref.dequantize_per_token(codes, params[..., 0], params[..., 1]), params


@pytest.mark.parametrize("scheme,head_dim", SCHEMES_BY_HEAD_DIM)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_writes_only_its_slots_and_skips_padding(gen, scheme, head_dim, dtype):
    block_size = 128 if scheme.is_kivi else 32
    num_blocks, num_heads = 4, 3
    cache = poisoned_cache(num_blocks, num_heads, block_size, gen, "cpu", head_dim)
    before = cache.clone()
    # random distinct slots that leave every block open (kivi closing is tested on its own), -1 rows hold NaN
    open_slots = torch.arange(num_blocks * block_size).view(num_blocks, block_size)[1:, :-1].flatten()
    slots = open_slots[torch.randperm(open_slots.numel(), generator=gen)[:40]]
    slots[torch.randperm(40, generator=gen)[:7]] = -1
    key = random_keys(gen, 40, num_heads, dtype, "cpu", head_dim)
    value = random_values(gen, 40, num_heads, dtype, "cpu", head_dim)
    key[slots < 0] = float("nan")
    value[slots < 0] = float("nan")
    # int4_kivi: every row its own slot of a NaN pool (the blocks stay open: nothing is read back from it)
    staging = dict(staged_keys=allocate_pool(40, num_heads, 128, head_dim, dtype, "cpu").fill_(float("nan")),
                   staging_slots=torch.arange(40)) if scheme.is_kivi else {}
    ref.store_kv(key, value, cache, slots, scheme, **staging)

    mask = written_byte_mask(slots, cache, scheme, head_dim).expand_as(cache)
    assert torch.equal(cache[~mask], before[~mask]), "store changed bytes outside its slots"
    live = slots >= 0
    rot = scheme.rotation(head_dim, "cpu")
    k_rot, kp = stored_keys_rotated(cache, slots[live], head_dim)
    x = key[live].float() @ rot
    assert_round_trip_bound(x, k_rot, kp[..., 0, None], kp[..., 1, None], x.amin(-1, keepdim=True))
    pages = ref.PageViews(cache, head_dim)
    blk, off = slots[live] // block_size, slots[live] % block_size
    vp = pages.v_params[blk, :, off]
    v_hat = ref.dequantize_per_token(ref.unpack_nibbles(pages.v_codes[blk, :, off]), vp[..., 0], vp[..., 1])
    v = value[live].float() @ rot if scheme.rotate_values else value[live].float()
    assert_round_trip_bound(v, v_hat, vp[..., 0, None], vp[..., 1, None], v.amin(-1, keepdim=True))


@pytest.mark.parametrize("scheme,head_dim", SCHEMES_BY_HEAD_DIM)
def test_store_then_dequantize_follows_a_shuffled_block_table(gen, scheme, head_dim):
    block_size = 128 if scheme.is_kivi else 16
    batch = make_paged_batch(gen, [(0, 300), (150, 9), (5, 1), (0, 40)], num_q_heads=4, num_kv_heads=2,
                             block_size=block_size, dtype=torch.float16, device="cpu", num_padding=3,
                             head_dim=head_dim)
    cache = cache_with_prefix(batch, scheme, gen, "cpu")
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme, **batch.step_staging(scheme))
    for i, (k, v) in enumerate(zip(batch.seq_keys, batch.seq_values)):
        k_hat, v_hat = ref.dequantize_sequence(cache, batch.block_table[i], int(batch.seq_lens[i]), scheme, head_dim)
        assert k_hat.shape == v_hat.shape == k.shape and torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all()
        # int4 over ~N(0, 1) data: the rms error is a small fraction of the data's rms, never more than a step
        assert relative_error(k_hat, k) < 0.12, f"sequence {i}"
        assert relative_error(v_hat, v) < 0.12, f"sequence {i}"


def test_kivi_needs_block_size_128(gen):
    cache = poisoned_cache(2, 1, 64, gen, "cpu")
    key = torch.randn(1, 1, HEAD_DIM, generator=gen)
    with pytest.raises(ValueError, match="int4_kivi needs block_size 128"):
        ref.store_kv(key, key, cache, torch.tensor([3]), KIVI, **one_sequence_pool(key))


def one_sequence_pool(key: torch.Tensor) -> dict:
    """store_kv's staging arguments for keys [T, H, D] of one sequence stored in one batch: pool slot 0."""
    return dict(staged_keys=allocate_pool(1, key.shape[1], 128, key.shape[2], key.dtype, "cpu"),
                staging_slots=sequence_staging_slots([key.shape[0]], "cpu"))


def test_kivi_store_refuses_a_missing_pool_and_saw_a_given_one(gen):
    """int4_kivi closes every page per channel from its original keys, so its store always takes the pool."""
    cache = poisoned_cache(2, 1, 128, gen, "cpu")
    key = torch.randn(3, 1, HEAD_DIM, generator=gen)
    pool = one_sequence_pool(key)
    with pytest.raises(ValueError, match=r"int4_kivi needs its staging pool: staged_keys and staging_slots"):
        ref.store_kv(key, key, cache, torch.arange(3), KIVI)
    with pytest.raises(ValueError, match=r"int4_kivi needs its staging pool"):
        ref.store_kv(key, key, cache, torch.arange(3), KIVI, staged_keys=pool["staged_keys"])
    with pytest.raises(ValueError, match=r"int4_saw takes no staging pool"):
        ref.store_kv(key, key, cache, torch.arange(3), SAW_SCHEMES[0], **pool)


def staged(keys: torch.Tensor) -> torch.Tensor:
    """What an open KIVI block holds for keys [n, H, D]: per token after the full rotation, dequantized back."""
    rot = KIVI.rotation(keys.shape[-1], "cpu")
    return ref.dequantize_per_token(*ref.quantize_per_token(keys.float() @ rot)) @ rot


def closed_block(cache, blk, head_dim):
    """The per-channel codes and params of every head of a closed KIVI block: [H, 128, D], [H, D], [H, D]."""
    pages = ref.PageViews(cache, head_dim)
    params = pages.k_params[blk, :, :head_dim]
    return ref.unpack_nibbles(pages.k_codes[blk]), params[..., 0], params[..., 1]


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_kivi_block_filled_in_one_batch_is_per_channel_from_the_original_keys(gen, head_dim):
    """A prefill of 300 tokens closes two blocks exactly from the original keys; the third stays open."""
    batch = make_paged_batch(gen, [(0, 300)], num_q_heads=2, num_kv_heads=2, block_size=128,
                             dtype=torch.bfloat16, device="cpu", head_dim=head_dim)
    cache = poisoned_cache(batch.num_blocks, 2, 128, gen, "cpu", head_dim)
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, KIVI, **batch.step_staging(KIVI))
    keys = batch.seq_keys[0].float()
    for j in range(2):
        blk = int(batch.block_table[0, j])
        codes, scale, minimum = closed_block(cache, blk, head_dim)
        for h in range(2):
            want = ref.quantize_per_channel(keys[128 * j : 128 * (j + 1), h])
            assert torch.equal(codes[h], want[0]) and torch.equal(scale[h], want[1])
            assert torch.equal(minimum[h], want[2])
        # below head_dim 128 the K params past the channels' are cleared: the block's bytes are its keys' alone
        assert (ref.PageViews(cache, head_dim).k_params[blk, :, head_dim:] == 0).all()
    k_hat, _ = ref.dequantize_sequence(cache, batch.block_table[0], 300, KIVI, head_dim)
    torch.testing.assert_close(k_hat[256:], staged(keys[256:]), rtol=0, atol=1e-5)


def test_kivi_per_channel_close_of_a_broken_key_reads_back_nan_in_its_head(gen):
    """A NaN key in a block closed per channel gives NaN scales: the block reads as NaN in that head (as a broken
    input must), the other head untouched."""
    keys = random_keys(gen, 128, 2, torch.float32, "cpu")
    keys[5, 0, 0] = float("nan")
    cache = poisoned_cache(1, 2, 128, gen, "cpu")
    ref.store_kv(keys, keys, cache, torch.arange(128), KIVI, **one_sequence_pool(keys))
    k_hat, _ = ref.dequantize_sequence(cache, torch.tensor([0]), 128, KIVI, HEAD_DIM)
    assert torch.isnan(k_hat[:, 0, 0]).all() and torch.isfinite(k_hat[:, 1]).all()


def test_kivi_open_block_reads_back_the_staged_keys(gen):
    batch = make_paged_batch(gen, [(20, 30), (0, 1)], num_q_heads=3, num_kv_heads=3, block_size=128,
                             dtype=torch.float32, device="cpu")
    cache = cache_with_prefix(batch, KIVI, gen, "cpu")
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, KIVI, **batch.step_staging(KIVI))
    for i in range(2):
        k_hat, _ = ref.dequantize_sequence(cache, batch.block_table[i], int(batch.seq_lens[i]), KIVI, HEAD_DIM)
        torch.testing.assert_close(k_hat, staged(batch.seq_keys[i]), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# paged attention
# ---------------------------------------------------------------------------------------------------------------
# (context, q_len): a fresh prefill, chunked prefills over cached prefixes that cross block boundaries, decodes
MIXED_BATCH = [(0, 37), (130, 1), (250, 20), (3, 1), (128, 1), (90, 45)]


@pytest.mark.parametrize("scheme,head_dim", [p for p in SCHEMES_BY_HEAD_DIM if not p.values[0].is_kivi])
@pytest.mark.parametrize("group", [1, 4, 7])
def test_saw_paged_attention_is_plain_attention_over_the_dequantized_cache(gen, scheme, head_dim, group):
    """int4_saw reads every key and value as stored, at any page size (here 32 tokens); int4_kivi's read rule
    (its own block from the original keys): test_reference_read_rule.py."""
    num_kv_heads = 2 if group < 7 else 1
    block_size = 32
    batch = make_paged_batch(gen, MIXED_BATCH, num_q_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                             block_size=block_size, dtype=torch.float16, device="cpu", num_padding=2,
                             head_dim=head_dim)
    cache = cache_with_prefix(batch, scheme, gen, "cpu")
    ref.store_kv(batch.key, batch.value, cache, batch.slot_mapping, scheme)
    softmax_scale = head_dim**-0.5
    out = ref.paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                              softmax_scale, scheme)
    assert out.dtype == torch.float32 and out.shape == batch.query.shape and torch.isfinite(out).all()

    starts = batch.query_start_loc.tolist()
    for i in range(len(MIXED_BATCH)):
        k_hat, v_hat = ref.dequantize_sequence(cache, batch.block_table[i], int(batch.seq_lens[i]), scheme, head_dim)
        want = causal_attention(batch.query[starts[i] : starts[i + 1]], k_hat, v_hat, softmax_scale)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), want, rtol=1e-4, atol=1e-5)

    # against attention over the unquantized K/V: 16 levels over ~N(0, 1) data leave ~10% rms error per vector
    # and the output inherits it (measured 0.15-0.18 here); a misread page or block table gives ~100%
    err = relative_error(out, unquantized_attention(batch, softmax_scale))
    assert err < 0.25, f"{scheme.name}: relative error {err:.3f} against unquantized attention"


def test_worked_example_of_docs_format_md():
    """The addresses and bytes docs/format.md works out by hand for token 261, KV head 1, block table [7, 2, 9]."""
    channels = torch.arange(HEAD_DIM, dtype=torch.float32)
    v = (2 * torch.sin(0.7 * channels) + 0.5 * torch.cos(0.13 * channels)).round(decimals=3)
    cache = torch.zeros(cache_shape(10, 4, 128, HEAD_DIM), dtype=torch.uint8)
    block_table_row = torch.tensor([7, 2, 9])
    slot = int(block_table_row[261 // 128]) * 128 + 261 % 128
    assert slot == 1157
    value = torch.zeros(1, 4, HEAD_DIM)
    value[0, 1] = v
    ref.store_kv(value, value, cache, torch.tensor([slot]), SAW_SCHEMES[0])
    flat = cache.flatten()
    region = (9 * 4 + 1) * 17408
    assert region == 644_096
    assert flat[region + 16404 : region + 16408].tolist() == [0x43, 0x35, 0xE5, 0xC0]
    assert int(flat[region + 8197]) == 0xB9  # V code byte 0 of slot 5, channel-major: 8192 + 0 * 128 + 5
    _, v_hat = ref.dequantize_sequence(cache, block_table_row, 262, SAW_SCHEMES[0], HEAD_DIM)
    assert abs(float(v_hat[261, 1, 0]) - 0.5125) < 1e-4 and abs(float(v_hat[261, 1, 64]) - 1.1702) < 1e-4
    assert abs(float((v_hat[261, 1] - v).abs().max()) - 0.1634) < 1e-4
