"""Plot tools/device/bench_kernels.py's decode results: speed against FA3 and achieved bandwidth, per shape and method.

    python tools/device/plot_kernels.py docs/archive/2026-11-30-h200-s2/call1_kernels.json --out kernels.svg
    python -m tools.device.plot_kernels --sweep docs/archive/2026-12-04-h200-s2/3_sweep_splits.json --out decode.svg
    python tools/device/plot_kernels.py kernels.json --methods fa3_bf16,s4kv_kivi,s4kv_saw --out three.svg

With --sweep, the input is a split sweep (tools/device/sweep_splits.py) and each scheme is plotted at the candidate
the committed DECODE_SPLITS picks per case.

Top: FA3's time / the method's time (above 1 = faster than bf16 FlashAttention-3). Bottom: bytes that must
move / time, against the device-to-device copy ceiling measured in the same run. Shapes are batch x context.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

DEFAULT_SHAPE = "qwen2.5-7b"  # results written before the benchmark had several attention shapes

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def decode_series(results: dict) -> tuple[list[str], dict[str, list[float | None]], dict[str, list[float | None]]]:
    """Shape labels, and per method its speed vs FA3 and its GB/s per shape (None where it failed). A shape is a
    batch x context, prefixed with the model's attention shape when the results hold more than one."""
    rows = results["decode"]
    key = lambda r: (r.get("shape", DEFAULT_SHAPE), r["batch"], r["context"])  # noqa: E731
    models = list(dict.fromkeys(r.get("shape", DEFAULT_SHAPE) for r in rows))
    shapes = sorted({key(r) for r in rows}, key=lambda k: (models.index(k[0]), k[1], k[2]))
    fa3 = {key(r): r["ms"] for r in rows if r["method"] == "fa3_bf16"}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    speed, gbps = {m: [] for m in methods}, {m: [] for m in methods}
    for method in methods:
        by_shape = {key(r): r for r in rows if r["method"] == method}
        for shape in shapes:
            r = by_shape.get(shape)
            ok = r is not None and r["ms"] and fa3.get(shape)
            speed[method].append(fa3[shape] / r["ms"] if ok else None)
            gbps[method].append(r["gbps"] if ok else None)
    prefix = (lambda m: f"{m} ") if len(models) > 1 else (lambda m: "")
    return [f"{prefix(m)}{b} x {c // 1024}k" for m, b, c in shapes], speed, gbps


def plot(results: dict, out: Path, title: str) -> None:
    labels, speed, gbps = decode_series(results)
    methods = list(speed)
    width = 0.8 / len(methods)
    colors = plt.get_cmap("tab20" if len(methods) > 10 else "tab10").colors  # a color per method
    # one panel above the other, as wide as the shapes need (a split sweep has 48)
    fig, (left, right) = plt.subplots(2, 1, figsize=(max(10.0, 0.3 * len(labels)), 9))
    for i, method in enumerate(methods):
        xs = [x + (i - (len(methods) - 1) / 2) * width for x in range(len(labels))]
        for axis, values in ((left, speed[method]), (right, gbps[method])):
            axis.bar([x for x, v in zip(xs, values) if v is not None], [v for v in values if v is not None],
                     width, label=method, color=colors[i % len(colors)])
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_ylabel("FA3 time / time (higher is faster)")
    ceiling = results.get("meta", {}).get("copy_gbps")
    if ceiling:
        right.axhline(ceiling, color="black", linewidth=0.8, linestyle="--", label="copy ceiling")
    right.set_ylabel("GB/s (bytes that must move / time)")
    for axis in (left, right):
        axis.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
        axis.set_xlabel("batch x context")
    right.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="kernels.json from tools/device/bench_kernels.py")
    parser.add_argument("--sweep", action="store_true",
                        help="results is sweep_splits.json: plot each scheme at the committed rule's candidate")
    parser.add_argument("--methods", help="comma list of the methods to plot, in this order (default: all)")
    parser.add_argument("--out", type=Path, required=True, help="image to write (.svg or .png)")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    if args.sweep:
        from tools.device.sweep_splits import committed_rows

        results = {"decode": committed_rows(results)}
        title = f"Decode attention per layer at the committed split rule ({args.results.name})"
    else:
        meta = results.get("meta", {})
        when = meta.get("date", "")[:16].replace("T", " ")
        title = f"Decode attention per layer, {meta.get('gpu', 'GPU')}" + (f", {when} UTC" if when else "")
    if args.methods:  # after --sweep's conversion: both then hold decode rows
        wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
        missing = sorted(set(wanted) - {r["method"] for r in results["decode"]})
        if missing or "fa3_bf16" not in wanted:
            parser.error(f"--methods: {', '.join(missing)} not in {args.results}" if missing
                         else "--methods: fa3_bf16 is the reference every bar is measured against")
        results = {**results, "decode": sorted((r for r in results["decode"] if r["method"] in wanted),
                                               key=lambda r: wanted.index(r["method"]))}
    plot(results, args.out, title)
    print(f"[plot_kernels] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
