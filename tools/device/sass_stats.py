"""Static shape of the decode attention kernel's inner loop on Hopper (sm_90), with no GPU.

What the loop is made of decides how the decode kernel spends its time: the instructions that turn 4-bit codes into
MMA operands, the registers and shared memory that set how many programs share an SM, and how far the software
pipeline keeps loads ahead of the compute (the hardware-counter profile, docs/results/performance.md, found the loop
latency bound on its loads). Triton compiles for sm_90 on any machine (ptxas and nvdisasm ship in the triton wheel);
this compiles ``_paged_attention_kernel`` as ``paged_attention`` launches it for decode (specialized like a real
launch: 16-byte aligned cache/query pointers and strides, metadata pointers unspecialized), disassembles it and
prints, per variant, the instructions of its hottest loop by class, per KV tile and per code, its registers, shared
memory and warps per SM, the asynchronous-copy groups left in flight at the loop's wait (0: no load overlaps the
program's own compute), the CTA barriers per tile (where a program's warps wait for each other) and the instructions
before the first tile (the prologue every program runs once). The last column turns the loop's instructions per
code into a bandwidth: the TB/s of cache bytes at which the loop would take every issue slot it gets, if it gets the
half of them the profile measured. Above that bandwidth the instruction count, not the memory, is the limit.

    python tools/device/sass_stats.py                        # every decode launch of both schemes, bf16 and fp16
    python tools/device/sass_stats.py --code-loads bytes     # the same with codes read a byte per element
    python tools/device/sass_stats.py --masked-full-tiles    # the same with every tile masked
    python tools/device/sass_stats.py --separate-row-sums  # the same with a tile's two row sums reduced apart
    python tools/device/sass_stats.py --group-as-n --schemes int4_saw  # the query rows as the MMA's N, per warp
    python tools/device/sass_stats.py --json out.json        # also each loop's histogram of instructions (mnemonics)

Counts are static: one pass through the first tile loop (in int4_kivi the tiles before a program's own block, keys
per channel; its own-block loop after it runs a tile or two per program; int4_saw's loop over the tiles every row
sees wholly, its masked tail after it, or with --masked-full-tiles its one masked loop). They predict, they do not
measure: the GPU benchmark (tools/device/bench_kernels.py) decides.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hopper_compile import compile_only  # noqa: E402

from s4kv.kernels import attention  # noqa: E402
from s4kv.kernels.layout import KIVI_BLOCK_SIZE, cache_shape, tile_tokens  # noqa: E402
from s4kv.kernels.scheme import Int4Scheme  # noqa: E402

NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
NVDISASM, CUOBJDUMP = NVIDIA_BIN / "nvdisasm", NVIDIA_BIN / "cuobjdump"
HOPPER_REGS_PER_SM, HOPPER_SHARED_PER_SM, HOPPER_MAX_WARPS_PER_SM = 65536, 228 * 1024, 64
# H200 SXM: 132 SMs of 4 schedulers, each issuing one warp instruction (32 lanes) a cycle at up to 1.98 GHz
H200_LANE_ISSUES_PER_S = 132 * 4 * 32 * 1.98e9
# the bytes decode moves per code: a token's K and V codes and both (scale, min) pairs per KV head, 136 bytes for 256
# codes at head_dim 128 (layout.py)
INT4_BYTES_PER_CODE = 136 / 256
# the share of issue slots the decode loops used in the Nsight Compute profile (docs/results/performance.md)
PROFILED_ISSUE_SHARE = 0.5
GROUP, NUM_KV_HEADS, HEAD_DIM = 7, 4, 128  # Qwen2.5-7B: 28 query heads over 4 KV heads of 128 channels

# opcode classes that matter for the unpack-bound loop
CLASSES = {
    "mma": ("HMMA", "HGMMA", "IMMA"),
    "global load": ("LDG",),
    "shared memory": ("LDS", "STS", "LDSM", "STSM", "LDGSTS"),
    "int logic/shift/permute": ("LOP3", "LOP", "SHF", "PRMT", "BFE", "SGXT"),
    "int arith": ("IMAD", "IADD3", "VIADD", "IADD", "ISETP", "IMNMX", "LEA", "ISCADD"),
    "fp16x2 arith": ("HADD2", "HMUL2", "HFMA2", "HSETP2", "HMNMX2"),
    "fp32 arith": ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK"),
    "conversion": ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP"),
    "special function": ("MUFU",),
    "move/select/shuffle": ("MOV", "SEL", "CS2R", "S2R", "R2UR", "UMOV", "SHFL"),
}


def own_block_inputs(scheme: Int4Scheme, num_seqs: int, dtype: torch.dtype) -> dict:
    """int4_kivi's decode as the backend launches it: the step's keys and the staging pool (the own-block tile)."""
    if not scheme.is_kivi:
        return {}
    return dict(new_keys=torch.zeros(num_seqs, NUM_KV_HEADS, HEAD_DIM, dtype=dtype),
                staged_keys=torch.zeros(num_seqs, NUM_KV_HEADS, KIVI_BLOCK_SIZE, HEAD_DIM, dtype=dtype),
                sequence_slots=torch.arange(num_seqs, dtype=torch.int32))


def compile_decode(scheme: Int4Scheme, dtype: torch.dtype, launch: attention.LaunchConfig):
    """The split-KV decode kernel (hopper_compile.Compiled) exactly as paged_attention launches it (block 128,
    GQA 7)."""
    num_q_heads, num_seqs = GROUP * NUM_KV_HEADS, 2
    cache = torch.zeros(cache_shape(8, NUM_KV_HEADS, KIVI_BLOCK_SIZE, HEAD_DIM), dtype=torch.uint8)
    q = torch.zeros(num_seqs, num_q_heads, HEAD_DIM, dtype=dtype)
    with compile_only() as compiled:
        attention.paged_attention(
            q, cache, torch.zeros(num_seqs, 4, dtype=torch.int32), torch.ones(num_seqs, dtype=torch.int32),
            torch.arange(num_seqs + 1, dtype=torch.int32), 1, 0.1, scheme, torch.empty_like(q),
            workspace=attention.SplitWorkspace.allocate(num_q_heads, NUM_KV_HEADS, HEAD_DIM, "cpu", scheme.name),
            launch=launch, **own_block_inputs(scheme, num_seqs, dtype))
    (kernel,) = [c for c in compiled if c.kernel == "_paged_attention_kernel"]
    return kernel


def _inspect(tool: Path, flag: str, cubin: bytes) -> str:
    """What one of the wheel's CUDA binary tools prints for ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], check=True, capture_output=True, text=True).stdout


def resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread and stack frame bytes of the kernel, from cuobjdump -res-usage: ptxas spills registers
    to the stack frame (STACK), not to what cuobjdump calls LOCAL (0 in every kernel here)."""
    text = _inspect(CUOBJDUMP, "-res-usage", cubin)
    return {key: int(re.search(rf"\b{key}:(\d+)", text).group(1)) for key in ("REG", "STACK")}


def local_accesses(loop: list[str]) -> int:
    """The loop's loads and stores of local memory (LDL, STL): spilled registers it reloads and saves every tile."""
    return sum(_opcode(text) in ("LDL", "STL") for text in loop)


def warps_per_sm(regs: int, shared_bytes: int, num_warps: int) -> int:
    """Resident warps per SM (Hopper limits), from registers, shared memory and the 64-warp cap: occupancy."""
    ctas = min(HOPPER_REGS_PER_SM // (regs * 32 * num_warps), HOPPER_SHARED_PER_SM // max(shared_bytes, 1),
               HOPPER_MAX_WARPS_PER_SM // num_warps)
    return ctas * num_warps


def disassemble(cubin: bytes) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """(address, instruction text) of every SASS instruction, and the address of every branch label."""
    text = _inspect(NVDISASM, "-c", cubin)
    instructions, labels, pending = [], {}, []
    for line in text.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            address = int(m.group(1), 16)
            labels.update((name, address) for name in pending)
            pending = []
            instructions.append((address, m.group(2).strip()))
    return instructions, labels


def _mnemonic(instruction: str) -> str:
    """The instruction's name with its modifiers (LDS.U8, HMMA.16816.F32.BF16), without a predicate guard."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", instruction).split()[0]


def _opcode(instruction: str) -> str:
    return _mnemonic(instruction).split(".")[0]


def hottest_loop(instructions: list[tuple[int, str]], labels: dict[str, int]) -> tuple[int, list[str]]:
    """(how many instructions come before it, its instructions) of the first tile loop (the longest span from a
    backward branch's target to the branch among the loops that start first and hold MMA): the tiles before a
    program's own blocks, where decode spends its time; int4_kivi's own-block loop (original keys) comes after it
    and runs at most a tile or two per program. What comes before it every program runs once (its prologue: q's
    load and, for int4_saw, its rotation), which is as much as the loop where a split holds one tile (batch 1)."""
    spans = []
    for index, (address, text) in enumerate(instructions):
        m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", text)
        if not m or labels.get(m.group(1), address) >= address:
            continue
        start = next(i for i, (a, _) in enumerate(instructions) if a >= labels[m.group(1)])
        if any("HMMA" in text for _, text in instructions[start : index + 1]):
            spans.append((start, index))
    first = min(start for start, _ in spans)
    start, end = max((s for s in spans if s[0] == first), key=lambda s: s[1] - s[0])
    return start, [text for _, text in instructions[start : end + 1]]


def copies_in_flight(loop: list[str]) -> int | None:
    """Fewest asynchronous-copy groups the loop's waits leave outstanding (`DEPBAR.LE SB0, N`); None: no wait. At 0
    every copy the loop issued must land before the next tile's compute, so no load overlaps the program's own
    compute (only other programs on the SM hide its latency)."""
    waits = [int(m.group(1), 16) for text in loop if (m := re.search(r"DEPBAR\.LE\s+SB0,\s*(0x[0-9a-f]+)", text))]
    return min(waits) if waits else None


def cta_barriers(loop: list[str]) -> int:
    """`BAR.SYNC` in one pass of the loop: every warp of the program waits for all the others there (a reduction
    across warps, a layout change through shared memory, or the software pipeline's buffer hand-over)."""
    return sum(1 for text in loop if _opcode(text) == "BAR")


def issue_bound_tbps(instructions_per_code: float, issue_share: float = PROFILED_ISSUE_SHARE) -> float:
    """The decode bandwidth (TB/s of cache bytes) at which a loop of this many instructions per code takes every
    issue slot it gets, when it gets ``issue_share`` of them: the ceiling its instruction count sets, whatever the
    memory system could deliver."""
    return H200_LANE_ISSUES_PER_S * issue_share / instructions_per_code * INT4_BYTES_PER_CODE / 1e12


def classify(opcodes: Counter) -> dict[str, int]:
    table = {name: sum(n for op, n in opcodes.items() if op in members) for name, members in CLASSES.items()}
    table["other"] = sum(opcodes.values()) - sum(table.values())
    table["total"] = sum(opcodes.values())
    return table


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_launch(text: str) -> attention.LaunchConfig:
    """TILExWARPSxSTAGES, e.g. 64x4x3 (variants() adds the scheme's kept launch options)."""
    tile, warps, stages = (int(part) for part in text.split("x"))
    return attention.LaunchConfig(tile=tile, num_warps=warps, num_stages=stages)


def launch_label(launch: attention.LaunchConfig) -> str:
    """TILExWARPSxSTAGES of a decode launch as the table names it, with its loop options."""
    tile = tile_tokens(KIVI_BLOCK_SIZE, launch.tile)
    return (f"{tile}x{launch.num_warps}x{launch.num_stages}" + (" wide" if launch.wide_code_loads else "")
            + (" unmasked" if launch.unmasked_full_tiles else "") + (" joint sums" if launch.joint_row_sums else "")
            + (" group as N" if launch.group_as_n else ""))


def variants(scheme_names: list[str], dtypes: list[str], launches: list[str], code_loads: str | None = None,
             masked: bool = False, separate_sums: bool = False, group_as_n: bool = False):
    """(label, scheme, query dtype, launch) of every variant to compile: each launch (default: the scheme's
    DECODE_LAUNCH) with each code path; ``code_loads`` "bytes" or "wide": its codes read a byte or two bytes per
    element (None: as the launch does), ``masked``: every tile masked (the launch's wholly seen tiles too),
    ``separate_sums``: a tile's two row sums in two reductions, ``group_as_n``: the query rows as the MMA's N
    (int4_saw)."""
    for name in scheme_names:
        scheme = Int4Scheme(name)
        kept = attention.kept_launch_options(name)
        for base in ([replace(parse_launch(text), **kept) for text in launches] or [attention.DECODE_LAUNCH[name]]):
            if code_loads is not None:
                base = replace(base, wide_code_loads=code_loads == "wide")
            if masked:
                base = replace(base, unmasked_full_tiles=False)
            if separate_sums:
                base = replace(base, joint_row_sums=False)
            if group_as_n:
                base = base.with_group_as_n()
            for q_dtype in dtypes:
                for code_path, options in attention.CODE_PATHS.items():
                    yield f"{name} {q_dtype} {code_path}", scheme, DTYPES[q_dtype], replace(base, **options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default="int4_kivi,int4_saw")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--launches", default="",
                        help="comma-separated TILExWARPSxSTAGES to compare (default: each scheme's DECODE_LAUNCH)")
    parser.add_argument("--code-loads", choices=("bytes", "wide"),
                        help="read the codes a byte or two bytes per element (LaunchConfig.wide_code_loads); "
                             "default: as each launch does")
    parser.add_argument("--masked-full-tiles", action="store_true",
                        help="every tile masked, the wholly seen ones too (LaunchConfig.unmasked_full_tiles off)")
    parser.add_argument("--separate-row-sums", action="store_true",
                        help="a tile's two row sums in two reductions (LaunchConfig.joint_row_sums off)")
    parser.add_argument("--group-as-n", action="store_true",
                        help="the query rows as the MMA's N, each warp its own tokens (LaunchConfig.group_as_n; "
                             "int4_saw)")
    parser.add_argument("--json", type=Path, help="also write every variant's loop histogram (mnemonics) here")
    args = parser.parse_args(argv)

    rows, histograms = [], {}
    for label, scheme, q_dtype, launch in variants(args.schemes.split(","), args.dtypes.split(","),
                                                    [t for t in args.launches.split(",") if t], args.code_loads,
                                                    args.masked_full_tiles, args.separate_row_sums, args.group_as_n):
        print(f"[sass] compiling {label} (tile {launch.tile}, {launch.num_warps} warps)", file=sys.stderr)
        kernel = compile_decode(scheme, q_dtype, launch)
        prologue, loop = hottest_loop(*disassemble(kernel.cubin))
        usage = resources(kernel.cubin)
        opcodes = Counter(_opcode(text) for text in loop)
        tile = tile_tokens(KIVI_BLOCK_SIZE, launch.tile)
        label = f"{label} {launch_label(launch)}"
        histograms[label] = dict(Counter(_mnemonic(text) for text in loop).most_common())
        codes_per_thread = 2 * tile * 128 / (32 * launch.num_warps)  # K and V codes of one tile, per thread
        occupancy = warps_per_sm(usage["REG"], kernel.shared_bytes, launch.num_warps)
        rows.append((label, classify(opcodes), codes_per_thread, usage, local_accesses(loop), kernel.shared_bytes,
                     occupancy, copies_in_flight(loop), cta_barriers(loop), prologue))

    names = list(CLASSES) + ["other", "total"]
    # a thread's instructions per tile over its share of the tile's codes = issue slots per code, comparable
    # across tiles and warp counts
    print("| variant (tile x warps x stages) | " + " | ".join(names) + " | instructions per code "
          "| registers | stack bytes (spills) | spill loads and stores per tile | shared memory bytes | warps per SM "
          "| copy groups in flight at the wait "
          "| CTA barriers per tile | instructions before the first tile "
          f"| TB/s at which the loop fills {PROFILED_ISSUE_SHARE:.0%} of the issue slots (H200) |")
    print("|---|" + "---|" * len(names) + "---|---|---|---|---|---|---|---|---|---|")
    for label, table, codes, usage, spill_accesses, shared_bytes, occupancy, in_flight, barriers, prologue in rows:
        print(f"| {label} | " + " | ".join(str(table[n]) for n in names) + f" | {table['total'] / codes:.2f} "
              f"| {usage['REG']} | {usage['STACK']} | {spill_accesses} | {shared_bytes:,} | {occupancy} "
              f"| {'no wait' if in_flight is None else in_flight} | {barriers} | {prologue} "
              f"| {issue_bound_tbps(table['total'] / codes):.2f} |")
    if args.json:
        args.json.write_text(json.dumps(histograms, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
