#!/usr/bin/env python3
"""Hardware counters of one decode step per method (Nsight Compute), beside the kernel table's times.

    python3 tools/device/profile_decode.py --out DIR        # H200, after `. tools/device/env.sh`: 3-4 minutes

Each (method, case) runs in its own process under ``ncu --set full --clock-control none`` (clocks left as the
kernel table finds them), the profiler off except around one eager call made after two warm-up calls that also
JIT-compile. A case is a bench_kernels DecodeProblem filled as the kernel table fills it. Writes DIR/reports.tar.gz
(per call METHOD_SHAPE_BATCHxCONTEXT.ncu-rep, which opens in the Nsight Compute GUI, and per method source_METHOD.csv,
the warp-stall samples per SASS instruction of the first case); DIR/profile_raw.csv (every metric of every kernel)
and DIR/profile.md: per kernel its duration, DRAM bytes and throughput, issue-slot use, achieved occupancy and the
warp stall reasons per issued instruction, largest first; then, per method's first case, the instructions where its
warps stall most.

    python3 -c "import tools.device.profile_decode as p; print(p.hotspots(open('source_METHOD.csv').read()))"
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_METHODS = "fa3_bf16,fa3_fp8,s4kv_kivi,s4kv_saw"
DEFAULT_CASES = "qwen2.5-7b:256x4096,llama-3.1-8b:256x4096,llama-3.1-8b:1x32768"
# (column, metric in ncu's raw page, scale, unit)
SUMMARY_METRICS = (
    ("time", "gpu__time_duration.sum", 1e-3, "us"),
    ("DRAM read", "dram__bytes_read.sum", 1e-6, "MB"),
    ("DRAM", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1, "% of peak"),
    ("issue active", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1, "% of cycles"),
    ("warps active", "sm__warps_active.avg.pct_of_peak_sustained_active", 1, "% of max"),
    ("registers", "launch__registers_per_thread", 1, "per thread"),
    ("grid", "launch__grid_size", 1, "CTAs"),
)
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def ncu_binary() -> str:
    found = shutil.which("ncu") or next((str(p) for p in sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))),
                                        None)
    if found is None:
        raise SystemExit("ncu (Nsight Compute) is not installed on this machine")
    return found


def parse_cases(text: str) -> list[tuple[str, int, int]]:
    cases = []
    for item in text.split(","):
        shape, _, size = item.partition(":")
        batch, _, context = size.partition("x")
        cases.append((shape, int(batch), int(context)))
    return cases


def run_child(methods: list[str], cases: list[tuple[str, int, int]]) -> None:
    """Under ncu: each method on each case, the profiler on for exactly one call."""
    import torch

    sys.path.insert(0, str(ROOT))
    from tools.device import bench_kernels as bk

    generator = torch.Generator().manual_seed(0)
    for shape, batch, context in cases:
        num_q_heads, num_kv_heads = bk.SHAPES[shape]
        pool = torch.randn(2, 1 << 20, num_kv_heads, bk.HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        query = torch.randn(batch, num_q_heads, bk.HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        problem = bk.DecodeProblem(batch, context, query, pool)
        for method in methods:
            block_size, build = bk.DECODE_METHODS[method]
            table = bk.shuffled_block_table(batch, -(-context // block_size), generator).cuda()
            out = torch.full_like(query, float("nan"))
            call = build(problem, table, out)
            call()
            call()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            call()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"profiled {method} {shape} {batch}x{context}", flush=True)
            del call, out
            torch.cuda.empty_cache()
        del pool


def read_raw(ncu: str, report: Path) -> list[dict]:
    # base units (ns, bytes): by default ncu scales each value to its own unit
    text = subprocess.run([ncu, "--import", str(report), "--page", "raw", "--csv", "--print-units", "base"], check=True,
                          capture_output=True, text=True).stdout
    rows = list(csv.reader(io.StringIO(text)))
    header, body = rows[0], rows[2:]  # the second row holds the units
    return [dict(zip(header, row)) for row in body]


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def summary(kernels: list[dict], labels: list[str]) -> str:
    lines = ["| call | kernel | " + " | ".join(f"{name} ({unit})" for name, _, _, unit in SUMMARY_METRICS)
             + " | top stall reasons (cycles per issued instruction) |",
             "|---|---|" + "---|" * len(SUMMARY_METRICS) + "---|"]
    for kernel, label in zip(kernels, labels):
        cells = []
        for _, metric, scale, _ in SUMMARY_METRICS:
            value = number(kernel.get(metric, ""))
            cells.append("n/a" if value is None else f"{value * scale:,.1f}")
        stalls = sorted(((number(v) or 0.0, k[len(STALL_PREFIX):-len(STALL_SUFFIX)]) for k, v in kernel.items()
                         if k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX)), reverse=True)
        top = ", ".join(f"{reason} {value:.2f}" for value, reason in stalls[:5] if value > 0)
        name = kernel.get("Kernel Name", "?")
        lines.append(f"| {label} | {name[:48]} | " + " | ".join(cells) + f" | {top} |")
    return "\n".join(lines) + "\n"


def hotspots(source_csv: str, count: int = 12) -> str:
    """The SASS instructions with the most warp-stall samples in ncu's source page (CSV), each with its share of
    the kernel's samples and its two largest stall reasons."""
    rows = list(csv.reader(io.StringIO(source_csv)))
    header = next((row for row in rows if "Warp Stall Sampling (All Samples)" in row), None)
    if header is None:
        return "no source counters\n"
    body = [dict(zip(header, row)) for row in rows[rows.index(header) + 1:] if len(row) == len(header)]
    samples = "Warp Stall Sampling (All Samples)"
    total = sum(number(row[samples]) or 0.0 for row in body) or 1.0
    reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    lines = ["| share of stall samples | SASS | largest reasons (samples) |", "|---|---|---|"]
    for row in sorted(body, key=lambda r: -(number(r[samples]) or 0.0))[:count]:
        top = sorted(((number(row[c]) or 0.0, c[len("stall_"):]) for c in reasons), reverse=True)[:2]
        named = ", ".join(f"{reason} {value:,.0f}" for value, reason in top if value > 0)
        lines.append(f"| {100 * (number(row[samples]) or 0.0) / total:.1f}% | `{' '.join(row['Source'].split())}` "
                     f"| {named} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("profile-results"))
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="bench_kernels DECODE_METHODS names")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="comma list of SHAPE:BATCHxCONTEXT")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    methods, cases = args.methods.split(","), parse_cases(args.cases)
    if args.child:
        run_child(methods, cases)
        return
    ncu = ncu_binary()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    kernels, labels, spots = [], [], []
    # one process per call, so that each report holds exactly that call's kernels (a decode, and its split merge)
    for shape, batch, context in cases:
        for method in methods:
            label = f"{method} {shape} {batch}x{context}"
            report = args.out / f"{method}_{shape}_{batch}x{context}.ncu-rep"
            command = [ncu, "--set", "full", "--clock-control", "none", "--profile-from-start", "off",
                       "--force-overwrite", "--export", str(report), sys.executable, __file__, "--child",
                       "--methods", method, "--cases", f"{shape}:{batch}x{context}"]
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0 or not report.exists():
                print(f"{label}: ncu failed ({done.returncode})", done.stdout[-2000:], done.stderr[-2000:], flush=True)
                continue
            found = read_raw(ncu, report)
            print(f"{label}: {len(found)} kernels", flush=True)
            kernels += found
            labels += [label] * len(found)
            if (shape, batch, context) == cases[0]:
                source = subprocess.run([ncu, "--import", str(report), "--page", "source", "--csv", "--print-source",
                                         "sass"], capture_output=True, text=True)
                (args.out / f"source_{method}.csv").write_text(source.stdout or source.stderr)
                spots.append(f"\n{label}: where the warps stall\n\n{hotspots(source.stdout)}")
    with open(args.out / "profile_raw.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["call"] + sorted({k for kernel in kernels for k in kernel}))
        writer.writeheader()
        writer.writerows({"call": label, **kernel} for label, kernel in zip(labels, kernels))
    table = summary(kernels, labels) + "".join(spots)
    (args.out / "profile.md").write_text(table)
    # the reports and source pages in one archive: three files to bring back from the GPU machine
    bulky = sorted(args.out.glob("*.ncu-rep")) + sorted(args.out.glob("source_*.csv"))
    with tarfile.open(args.out / "reports.tar.gz", "w:gz") as archive:
        for path in bulky:
            archive.add(path, arcname=path.name)
    for path in bulky:
        path.unlink()
    print(table)


if __name__ == "__main__":
    main()
