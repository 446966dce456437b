"""The decode loop's compiled shape for sm_90, checked on a machine with no GPU (tools/device/sass_stats.py).

Not a speed test: these are the structural properties that docs/archive/2026-11-30-performance.md ("Static
instruction counts") builds its prediction on, guarded so that a later change cannot silently undo them. V's
tensor-core fragments come from vector loads (channel-major V, no byte gathers); the PTX unpack needs far fewer
integer instructions than the Triton-op unpack and changes nothing else in the loop.
"""

from __future__ import annotations

import json

import pytest
import torch
from repo_tools import code_path_of, run_compile_only_tool

from tools.device.sass_stats import launch_label


def _logic(histogram: dict[str, int]) -> int:
    return sum(n for name, n in histogram.items() if name.split(".")[0] in ("LOP3", "PRMT", "SHF"))


pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-side check: no device time for it")


def sass_stats(tmp_path_factory, scheme_name: str, *launches: str, code_loads: str | None = None,
               options: tuple[str, ...] = ()) -> tuple[str, dict]:
    """sass_stats' printed table and loop histograms (label -> mnemonic counts) of a scheme's decode with bf16
    queries, for each code path: at its default launch, or at each of ``launches`` (TILExWARPSxSTAGES);
    ``code_loads``: "bytes" or "wide" (codes read a byte or two bytes per element), None as the launch does;
    ``options``: more sass_stats flags (e.g. --separate-row-sums)."""
    tmp = tmp_path_factory.mktemp(f"sass-{scheme_name}")
    launch_args = ((("--launches", ",".join(launches)) if launches else ())
                   + (("--code-loads", code_loads) if code_loads else ()))
    result = run_compile_only_tool("sass_stats", "--schemes", scheme_name, "--dtypes", "bf16", *launch_args, *options,
                                   "--json", str(tmp / "loops.json"), cache_dir=tmp / "triton-cache")
    assert result.returncode == 0, result.stderr[-6000:]
    return result.stdout, json.loads((tmp / "loops.json").read_text())


def test_group_as_n_halves_the_mma_and_meets_only_for_the_pipeline(saw_stats, tmp_path_factory):
    """int4_saw's decode with the query rows as the MMA's N, each warp its own tokens (LaunchConfig.group_as_n): half
    the tile loop's MMAs, and the warps meet only where the software pipeline hands its buffers over (the tile loop
    meets at every cross-warp reduction and at P's layout change), in fewer instructions."""
    table, loops = saw_stats
    group_table, group_loops = sass_stats(tmp_path_factory, "int4_saw", options=("--group-as-n",))
    for path in ("biased+ptx", "subnormal+ptx"):
        label = f"int4_saw bf16 {path} 128x4x5 wide"
        tile_loop, group_loop = loops[f"{label} unmasked joint sums"], group_loops[f"{label} group as N"]

        def count(histogram, prefix):
            return sum(n for name, n in histogram.items() if name.startswith(prefix))

        assert 2 * count(group_loop, "HMMA") == count(tile_loop, "HMMA") == 64, (tile_loop, group_loop)
        row, group_row = table_row(table, f"{label} unmasked joint sums"), table_row(group_table, f"{label} group as N")
        assert int(group_row["CTA barriers per tile"]) <= 2 < int(row["CTA barriers per tile"]), (row, group_row)
        assert sum(group_loop.values()) < sum(tile_loop.values()), (path, sum(tile_loop.values()),
                                                                    sum(group_loop.values()))


def table_row(table: str, label: str) -> dict[str, str]:
    """The printed table's row of one variant (its label: scheme, dtype, code path, TILExWARPSxSTAGES), by column."""
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    (row,) = [line for line in lines if line.startswith(f"| {label} |")]
    return dict(zip(header, (cell.strip() for cell in row.strip("|").split("|"))))


@pytest.fixture(scope="module")
def saw_stats(tmp_path_factory):
    """sass_stats' table and loop histograms of int4_saw's default decode launch (bf16 queries)."""
    return sass_stats(tmp_path_factory, "int4_saw")


@pytest.fixture(scope="module")
def saw_loops(saw_stats):
    """Loop histograms of int4_saw's DECODE_LAUNCH (the tile loop) with bf16 queries, by code path."""
    table, loops = saw_stats
    assert "| int4_saw bf16 biased+ptx" in table  # the printed table
    return {label.split()[2]: histogram for label, histogram in loops.items()}


def test_every_code_path_runs_the_same_tensor_core_work(saw_loops):
    assert set(saw_loops) == {"biased", "subnormal", "biased+ptx", "subnormal+ptx"}
    mma = {path: sum(n for name, n in h.items() if name.startswith("HMMA")) for path, h in saw_loops.items()}
    # 128-token tile, 4 warps: per warp 32 tokens x 128 channels for Q K^T and 128 tokens x 32 channels for P @ V
    assert set(mma.values()) == {64}, mma


def test_no_byte_gathers_from_shared_memory(saw_loops):
    for path, histogram in saw_loops.items():
        byte_loads = {name: n for name, n in histogram.items() if name.startswith("LDS") and ".U8" in name}
        assert not byte_loads, f"{path}: byte-wise shared-memory loads {byte_loads} (token-major V is back?)"


def test_ptx_unpack_halves_the_integer_logic(saw_loops):
    for codes in ("biased", "subnormal"):
        triton_ops, ptx = _logic(saw_loops[codes]), _logic(saw_loops[f"{codes}+ptx"])
        assert ptx < 0.6 * triton_ops, f"{codes}: {ptx} logic instructions with PTX vs {triton_ops} without"
        assert sum(saw_loops[f"{codes}+ptx"].values()) < sum(saw_loops[codes].values())


def committed_row(table: str, scheme_name: str) -> dict[str, str]:
    """The printed table's row of a scheme's committed decode launch (bf16 queries), by column, and its label."""
    from s4kv.kernels.attention import DECODE_LAUNCH
    label = f"{scheme_name} bf16 {code_path_of(DECODE_LAUNCH[scheme_name])} {launch_label(DECODE_LAUNCH[scheme_name])}"
    return {"label": label, **table_row(table, label)}



@pytest.fixture(scope="module")
def kivi_decode(tmp_path_factory):
    """int4_kivi's committed decode launch with bf16 queries: (loop histogram, printed table row by column)."""
    table, loops = sass_stats(tmp_path_factory, "int4_kivi")
    cells = committed_row(table, "int4_kivi")
    return loops[cells["label"]], cells


def test_kivi_decode_loop_has_no_synchronous_global_loads(kivi_decode):
    # 2-byte parameter loads cannot be asynchronous copies: they were the largest stall in the profile
    histogram, _ = kivi_decode
    synchronous = {name: n for name, n in histogram.items() if name.startswith("LDG.")}
    assert not synchronous, f"synchronous global loads in the loop: {synchronous}"
    assert any(name.startswith("LDGSTS") for name in histogram)  # the loads are there, as asynchronous copies


def test_kivi_decode_keeps_four_programs_per_sm(kivi_decode):
    """At its 128-register cap int4_kivi's loop keeps four programs per SM; ptxas spills a few values that live
    across the tile (9 local loads and stores a tile, against about 700 instructions): that must not grow."""
    _, cells = kivi_decode
    assert int(cells["registers"]) <= 128 and int(cells["spill loads and stores per tile"]) <= 10, cells
    assert int(cells["warps per SM"]) == 16, cells


def test_committed_decode_loops_overlap_their_loads_with_their_compute(kivi_decode, saw_stats):
    # the block-table read is a level of indirection that halves the pipeliner's prefetch distance: at 3 stages the
    # loop waited for all its copies before each tile (0 in flight), and both schemes' decode ran 4-15% slower at
    # batch >= 32
    _, kivi_cells = kivi_decode
    saw_table, _ = saw_stats
    for cells in (kivi_cells, committed_row(saw_table, "int4_saw")):
        assert cells["copy groups in flight at the wait"] not in ("0", "no wait"), cells


def test_copies_in_flight_reads_the_pipeline_depth(tmp_path_factory):
    """The column against what the stage count must give: none in flight at 3 stages, some at 5."""
    table, _ = sass_stats(tmp_path_factory, "int4_kivi", "128x4x3", "128x4x5", code_loads="bytes")
    in_flight = {stages: table_row(table, f"int4_kivi bf16 subnormal+ptx {stages}")["copy groups in flight at the wait"]
                 for stages in ("128x4x3 unmasked joint sums", "128x4x5 unmasked joint sums")}
    assert in_flight["128x4x3 unmasked joint sums"] == "0" and int(in_flight["128x4x5 unmasked joint sums"]) > 0, \
        in_flight


def test_int4_saw_rotates_q_in_a_short_prologue(kivi_decode, saw_stats):
    """A decode split at batch 1 holds one tile, so what a program runs before its first tile weighs as much as the
    loop. int4_saw's is q's rotation: built from one sign quadrant and two dots it stays within 3x int4_kivi's
    prologue (no rotation) and 1.8x the tile loop (which the wide subnormal loads, the folded dead rows, the
    per-tile pointers and the unmasked tiles took to about 550 instructions); four generated quadrants and four dots
    made it 6x (1,771 against 288 instructions) and 1.6x the byte loop of then (1,100)."""
    _, kivi_cells = kivi_decode
    saw_table, _ = saw_stats
    saw_cells = committed_row(saw_table, "int4_saw")
    saw_prologue = int(saw_cells["instructions before the first tile"])
    assert saw_prologue < 3 * int(kivi_cells["instructions before the first tile"]), (saw_cells, kivi_cells)
    assert saw_prologue < 1.8 * int(saw_cells["total"]), saw_cells


def test_wide_code_loads_drop_the_operand_moves_and_the_byte_spreading(saw_stats, tmp_path_factory):
    """int4_saw's tile loop with its codes read two bytes per element (LaunchConfig.wide_code_loads), with each PTX
    code path: the same tensor-core work, no PRMT spreading bytes over 16-bit lanes (one per two codes read a byte
    per element; the few left place P's halves beside the folded dead rows for its exchange), a fraction of the
    register moves that fed q and P to the MMA (from 8-bit elements their fragments took four values per thread), a
    fifth fewer instructions, no more registers."""
    wide_table, wide_loops = saw_stats
    table, loops = sass_stats(tmp_path_factory, "int4_saw", "128x4x5", code_loads="bytes")
    for path in ("biased+ptx", "subnormal+ptx"):
        label = f"int4_saw bf16 {path} 128x4x5"
        narrow, wide = loops[f"{label} unmasked joint sums"], wide_loops[f"{label} wide unmasked joint sums"]

        def count(histogram, prefix):
            return sum(n for name, n in histogram.items() if name.startswith(prefix))

        assert count(wide, "HMMA") == count(narrow, "HMMA") == 64, (narrow, wide)
        assert 16 * count(wide, "PRMT") <= count(narrow, "PRMT"), (narrow, wide)
        assert 3 * count(wide, "IMAD.MOV") < count(narrow, "IMAD.MOV"), (narrow, wide)
        assert sum(wide.values()) < 0.85 * sum(narrow.values()), (path, sum(narrow.values()), sum(wide.values()))
        narrow_row, wide_row = (table_row(table, f"{label} unmasked joint sums"),
                                 table_row(wide_table, f"{label} wide unmasked joint sums"))
        assert int(wide_row["registers"]) <= int(narrow_row["registers"]), (narrow_row, wide_row)
        # at the 96-register cap the unmasked loop keeps one value across the tile in local memory
        assert int(wide_row["spill loads and stores per tile"]) <= 1, wide_row


def test_dead_mma_rows_fold_away(kivi_decode, saw_stats, tmp_path_factory):
    """A GQA group of at most 8 fills the first half of the 16-row MMA tile, and a thread holds rows r and r + 8:
    the second row is dead, and its softmax must fold away (one exp2 per score a thread holds, 8 of a tile's 128
    columns, and one for the row's rescale), in the unmasked tiles and with every tile masked. Without selects on a
    row bound the compiler can prove, it lost the dead row's -inf maximum at the cross-warp reduction and ran part of
    its softmax (11 exp2 a tile), and all of it in the unmasked tiles (18)."""
    _, masked_loops = sass_stats(tmp_path_factory, "int4_saw", options=("--masked-full-tiles",))
    saw_table, saw_loops = saw_stats
    saw_label = committed_row(saw_table, "int4_saw")["label"]
    kivi_loop, _ = kivi_decode
    for name, loop in (("int4_saw", saw_loops[saw_label]), ("int4_kivi", kivi_loop),
                       ("int4_saw masked", masked_loops[saw_label.replace(" unmasked", "")])):
        exp2 = sum(n for mnemonic, n in loop.items() if mnemonic.startswith("MUFU.EX2"))
        assert exp2 == 8 + 1, (name, exp2)


def test_joint_row_sums_take_a_reduction_round_trip_out_of_the_tile(saw_stats, tmp_path_factory):
    """A tile's two row sums in one reduction (LaunchConfig.joint_row_sums, in DECODE_LAUNCH): the same tensor-core
    work and about the same instructions as two reductions, three CTA barriers a tile fewer (each cross-warp
    reduction is a shared-memory round trip)."""
    joint_table, joint_loops = saw_stats
    table, loops = sass_stats(tmp_path_factory, "int4_saw", options=("--separate-row-sums",))
    for path in ("biased+ptx", "subnormal+ptx"):
        label = f"int4_saw bf16 {path} 128x4x5 wide unmasked"
        row, joint_row = table_row(table, label), table_row(joint_table, f"{label} joint sums")
        assert int(joint_row["CTA barriers per tile"]) == int(row["CTA barriers per tile"]) - 3, (row, joint_row)
        plain, joint = loops[label], joint_loops[f"{label} joint sums"]
        assert sum(joint.values()) <= 1.01 * sum(plain.values()), (path, sum(plain.values()), sum(joint.values()))
        assert int(joint_row["spill loads and stores per tile"]) <= 1, joint_row
