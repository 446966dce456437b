#!/usr/bin/env python3
"""A mixed step's time per KV format: decodes alone against the same decodes beside prompts' prefill, and where the
GPU time of each goes.

    python -m tools.device.profile_mixed_step --out DIR        # H200, Llama-3.1-8B shape: 80-135 s per format

One engine per format, each in its own process (vLLM in-process, synchronous scheduling, so one engine step is one
model step and its wall time is that step's time). ``--decodes`` requests of ``--context``-token prompts decode;
every ``DECODES_BETWEEN`` steps ``--prompts`` prompts (default one) of ``--prompt-len`` tokens arrive and are
prefilled in one step beside them (max_tokens 1: they leave after that step, so the batch stays the same decodes).
Reported per format: median wall time of the decode steps and of the mixed steps, and, for one profiled step of
each kind (torch profiler), the GPU time per kernel, the GPU's busy time (the union of its kernels' intervals) and
the step's wall time, so what a format adds to a mixed step shows kernel by kernel and host time shows as the gap
between wall and busy; and, unprofiled, the host time per step inside each function of the attention path
(HOST_TIMED).

A format name with ``:v1`` runs on vLLM's V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``); int4_kivi always does
(runtime/schemes.py), vLLM 0.26 picks V2 for the others. Writes DIR/mixed_step.json, DIR/mixed_step.md and
DIR/mixed_step.svg (the plot); ``--plot JSON`` redraws the last two from a saved run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_CONFIGS = "bf16_fa3,s4kv_saw,s4kv_kivi"
DECODES_BETWEEN = 3
TOP_KERNELS = 14
LARGEST_GAPS = 6
RESULT_PREFIX = "S4KV_MIXED_STEP "
HOST_OP_PREFIX = "vllm::"
V1_SUFFIX = ":v1"
# Host-side functions timed in every step (module, attribute; "Class.method" for methods): the model runner's
# steps (inputs and attention metadata before the model's first kernel, the model, sampling; V2 runner, then the V1
# runner int4_kivi runs on), each format's metadata builder, eager attention and KV-cache update, and within ours
# the kernel wrappers and vLLM's ops they call.
HOST_TIMED = (
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.prepare_inputs"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.prepare_attn"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._build_attention_metadata"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens"),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadataBuilder.build"),
    ("s4kv.runtime.plugin.backend", "S4KVMetadataBuilder.build"),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl.forward"),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl.do_kv_cache_update"),
    ("s4kv.runtime.plugin.backend", "S4KVAttentionImpl.forward"),
    ("s4kv.runtime.plugin.backend", "S4KVAttentionImpl.do_kv_cache_update"),
    ("s4kv.kernels.attention", "paged_attention"),
    ("s4kv.runtime.plugin.backend", "flash_prefill"),
    ("s4kv.kernels.dense", "gather_dense_kv"),
    ("vllm.v1.attention.backends.fa_utils", "flash_attn_varlen_func"),
    ("s4kv.kernels.store", "store_kv"),
    ("s4kv.kernels.store", "stage_open_keys"),
)


def parse_config(name: str) -> tuple[str, bool]:
    """(KV format, forced onto the V1 model runner) of a ``--configs`` entry."""
    from s4kv.runtime.bench.matrix import FORMATS

    fmt, v1 = (name[: -len(V1_SUFFIX)], True) if name.endswith(V1_SUFFIX) else (name, False)
    if fmt not in FORMATS:
        raise SystemExit(f"profile_mixed_step: unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    return fmt, v1


def kernel_profile(prof, wall_us: float) -> dict[str, Any]:
    """GPU time of one profiled step: per kernel name (total us, launches), the busy time (union of the kernels'
    intervals) and the step's wall time; and the host time inside vLLM's custom ops (``vllm::``, attention and
    the KV-cache update among them: what the host spends launching them, eagerly in a mixed step)."""
    from torch.autograd import DeviceType

    per_name: dict[str, list[float]] = {}
    host_ops: dict[str, list[float]] = {}
    intervals = []
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            if event.name.startswith(HOST_OP_PREFIX):
                entry = host_ops.setdefault(event.name, [0.0, 0])
                entry[0] += event.time_range.elapsed_us()
                entry[1] += 1
            continue
        start, end = event.time_range.start, event.time_range.end
        intervals.append((start, end, event.name))
        entry = per_name.setdefault(event.name, [0.0, 0])
        entry[0] += end - start
        entry[1] += 1
    busy, covered_to, gaps = 0.0, float("-inf"), []
    last_name = None
    for start, end, name in sorted(intervals):
        if start > covered_to and last_name is not None:
            gaps.append([start - covered_to, last_name, name])
        if end > covered_to:
            busy += end - max(start, covered_to)
            covered_to, last_name = end, name
    span = covered_to - min(intervals)[0] if intervals else 0.0
    kernels = sorted(([name, us, n] for name, (us, n) in per_name.items()), key=lambda k: -k[1])
    return {"wall_us": wall_us, "busy_us": busy, "kernel_us": sum(k[1] for k in kernels), "kernels": kernels,
            "host_ops": sorted(([name, us, n] for name, (us, n) in host_ops.items()), key=lambda k: -k[1]),
            # the GPU idle inside the kernels' span (waiting for the host mid-step) against the idle before the first
            # kernel and after the last (the step's host work before and after the model: scheduling, input
            # preparation, attention metadata, sampling); the largest gaps with the kernels either side
            "span_us": span, "idle_in_span_us": span - busy,
            "largest_gaps": sorted(gaps, key=lambda g: -g[0])[:LARGEST_GAPS]}


def profiled_step(engine) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.step()
        wall_us = (time.perf_counter() - start) * 1e6
    return kernel_profile(prof, wall_us)


class HostTimers:
    """Wall time the host spends inside each HOST_TIMED function (calls from the engine, so a function that waited
    for the GPU would show it), installed before the engine is built so the backend binds the timed versions."""

    def __init__(self) -> None:
        import functools
        import importlib

        self.totals: dict[str, list[float]] = {}
        for module_name, attribute in HOST_TIMED:
            try:
                owner: Any = importlib.import_module(module_name)
            except ImportError:  # not on this platform (vLLM's CPU engine has no FlashAttention): never called
                continue
            *classes, name = attribute.split(".")
            for class_name in classes:
                owner = getattr(owner, class_name)
            function = getattr(owner, name, None)
            if function is None:  # defined only where its kernels exist (fa_utils on CUDA)
                continue
            entry = self.totals.setdefault(attribute, [0.0, 0])

            def timed(*args, _function=function, _entry=entry, **kwargs):
                start = time.perf_counter()
                try:
                    return _function(*args, **kwargs)
                finally:
                    _entry[0] += time.perf_counter() - start
                    _entry[1] += 1

            setattr(owner, name, functools.wraps(function)(timed))

    def snapshot(self) -> dict[str, tuple[float, int]]:
        return {name: (seconds, calls) for name, (seconds, calls) in self.totals.items()}


def host_per_step(before: dict, after: dict, accumulated: dict[str, list[float]]) -> None:
    for name, (seconds, calls) in after.items():
        entry = accumulated.setdefault(name, [0.0, 0])
        entry[0] += seconds - before[name][0]
        entry[1] += calls - before[name][1]


def timed_step(engine) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = engine.step()
    return (time.perf_counter() - start) * 1e3, outputs


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One format's engine: the timed steps and the two profiled ones."""
    import numpy as np
    from vllm import LLM, SamplingParams

    from s4kv.runtime.bench.engine import FIRST_SPECIAL_TOKEN, warm_up
    from s4kv.runtime.bench.matrix import FORMATS
    from s4kv.runtime.schemes import choose_model_runner

    fmt = FORMATS[spec["format"]]
    kwargs = {
        "model": spec["model"], "load_format": spec["load_format"], "skip_tokenizer_init": True, "dtype": "bfloat16",
        "seed": 0, "max_model_len": spec["max_model_len"], "gpu_memory_utilization": spec["gpu_memory_utilization"],
        "kv_cache_memory_bytes": spec["kv_cache_memory_bytes"], "async_scheduling": False, **fmt.engine_kwargs(),
    }
    choose_model_runner(kwargs.get("additional_config"))
    timers = HostTimers()
    start = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - start
    warm_up(llm, spec["vocab_size"], spec["max_model_len"])
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    high = min(spec["vocab_size"], FIRST_SPECIAL_TOKEN)

    def prompt(n: int) -> dict[str, list[int]]:
        return {"prompt_token_ids": rng.integers(0, high, n).tolist()}

    decodes, repeats = spec["decodes"], spec["repeats"]
    steps_needed = 2 * repeats * (DECODES_BETWEEN + 1) + 8
    keep_decoding = SamplingParams(max_tokens=steps_needed + 64, temperature=0.0, ignore_eos=True)
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(decodes):
        engine.add_request(f"decode-{i}", prompt(spec["context"]), keep_decoding)
    produced: dict[str, int] = {}
    for _ in range(steps_needed):  # until every decode request has its first tokens (its prefill is done)
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
        if len(produced) == decodes and min(produced.values()) >= 2:
            break
    else:
        raise RuntimeError(f"the {decodes} decode requests did not all start within {steps_needed} steps")

    decode_ms, mixed_ms = [], []
    host: dict[str, dict[str, list[float]]] = {"decode": {}, "mixed": {}}
    arrivals = iter(range(10**6))

    def add_prompts() -> set[str]:
        request_ids = [f"prompt-{next(arrivals)}" for _ in range(spec["prompts"])]
        for request_id in request_ids:
            engine.add_request(request_id, prompt(spec["prompt_len"]), one_token)
        return set(request_ids)

    def mixed_step() -> float:
        request_ids = add_prompts()
        elapsed, outputs = timed_step(engine)
        unfinished = request_ids - {out.request_id for out in outputs if out.finished}
        if unfinished:  # a prompt took more than one step: not the step this tool measures
            raise RuntimeError(f"{sorted(unfinished)} not prefilled in one step (raise max_num_batched_tokens or "
                               "lower --prompts)")
        return elapsed

    for _ in range(repeats):
        for _ in range(DECODES_BETWEEN):
            before = timers.snapshot()
            decode_ms.append(timed_step(engine)[0])
            host_per_step(before, timers.snapshot(), host["decode"])
        before = timers.snapshot()
        mixed_ms.append(mixed_step())
        host_per_step(before, timers.snapshot(), host["mixed"])
    decode_profile = profiled_step(engine)
    add_prompts()
    mixed_profile = profiled_step(engine)
    return {
        "startup_s": startup_s,
        "decode_step_ms": statistics.median(decode_ms),
        "mixed_step_ms": statistics.median(mixed_ms),
        "decode_steps_ms": decode_ms,
        "mixed_steps_ms": mixed_ms,
        # per step of each kind: host ms inside each timed function and its calls
        "host_ms": {kind: {name: [1e3 * seconds / count, calls / count] for name, (seconds, calls) in per.items()
                           if calls}
                    for kind, per, count in (("decode", host["decode"], len(decode_ms)),
                                             ("mixed", host["mixed"], len(mixed_ms)))},
        "decode_profile": decode_profile,
        "mixed_profile": mixed_profile,
    }


def engine_process(config: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run one format in a fresh process (its own GPU memory, CUDA graphs and compile state); its result or why not."""
    fmt, v1 = parse_config(config)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if v1:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    job = json.dumps({**spec, "format": fmt})
    try:
        proc = subprocess.run([sys.executable, "-m", "tools.device.profile_mixed_step", "--one", job], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"config": config, "status": "timeout", "timeout_s": timeout_s}
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
        return {"config": config, "status": "failed", "returncode": proc.returncode, "log_tail": tail}
    return {"config": config, "status": "ok", **json.loads(lines[-1][len(RESULT_PREFIX):])}


def table(results: list[dict[str, Any]], spec: dict[str, Any]) -> str:
    ok = [r for r in results if r["status"] == "ok"]
    lines = [
        f"{spec['decodes']} decodes of {spec['context']}-token prompts; a mixed step adds the prefill of "
        f"{prompts_text(spec)}. Medians of {spec['repeats']} mixed and "
        f"{spec['repeats'] * DECODES_BETWEEN} decode steps (wall, synchronous scheduling); GPU busy and kernel time "
        "from one profiled step of each kind.",
        "",
        "| configuration | decode step ms | mixed step ms | mixed - decode | mixed: GPU busy ms | mixed: wall - busy | "
        "mixed: GPU idle mid-step | mixed: before first + after last kernel | mixed: host ms in vllm:: ops |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ok:
        mp = r["mixed_profile"]
        lines.append(f"| {r['config']} | {r['decode_step_ms']:.2f} | {r['mixed_step_ms']:.2f} | "
                     f"{r['mixed_step_ms'] - r['decode_step_ms']:.2f} | {mp['busy_us'] / 1e3:.2f} | "
                     f"{(mp['wall_us'] - mp['busy_us']) / 1e3:.2f} | {idle_cells(mp)} | "
                     f"{sum(op[1] for op in mp['host_ops']) / 1e3:.2f} |")
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {r['status']} | | | | | | | |")
    # one row per attribute: both runners' execute_model and sample_tokens share theirs (an engine runs one runner)
    names = [attribute for attribute in dict.fromkeys(attribute for _, attribute in HOST_TIMED)
             if any(attribute in r["host_ms"]["mixed"] for r in ok)]
    if names:
        lines += ["", "Host ms per mixed step inside each function (calls per step), the mean over the timed mixed "
                  "steps:", "",
                  "| function | " + " | ".join(r["config"] for r in ok) + " |", "|---|" + "---:|" * len(ok)]
        for name in names:
            cells = [f"{r['host_ms']['mixed'][name][0]:.2f} ({r['host_ms']['mixed'][name][1]:.0f})"
                     if name in r["host_ms"]["mixed"] else "-" for r in ok]
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    for r in ok:
        for kind in ("mixed", "decode"):
            p = r[f"{kind}_profile"]
            lines += ["", f"{r['config']}, {kind} step: GPU kernel time {p['kernel_us'] / 1e3:.2f} ms, busy "
                      f"{p['busy_us'] / 1e3:.2f} ms, wall {p['wall_us'] / 1e3:.2f} ms", "",
                      "| kernel | ms | launches |", "|---|---:|---:|"]
            lines += [f"| `{name[:90]}` | {us / 1e3:.3f} | {n} |" for name, us, n in p["kernels"][:TOP_KERNELS]]
            lines += [f"| host: `{name}` | {us / 1e3:.3f} | {n} |" for name, us, n in p["host_ops"]]
            lines += ["", "| GPU idle between kernels, ms | kernel before | kernel after |", "|---:|---|---|"]
            lines += [f"| {us / 1e3:.3f} | `{before[:60]}` | `{after[:60]}` |"
                      for us, before, after in p.get("largest_gaps", [])]
    return "\n".join(lines) + "\n"


def idle_cells(profile: dict[str, Any]) -> str:
    """The GPU's idle mid-step and before its first kernel + after its last, ms ("-" in runs saved without them)."""
    if "span_us" not in profile:
        return "- | -"
    return f"{profile['idle_in_span_us'] / 1e3:.2f} | {(profile['wall_us'] - profile['span_us']) / 1e3:.2f}"


def prompts_text(spec: dict[str, Any]) -> str:
    prompts = spec.get("prompts", 1)  # runs saved before --prompts had one
    return f"{'one' if prompts == 1 else prompts} {spec['prompt_len']}-token prompt{'s' if prompts > 1 else ''}"


def host_in_attention_ms(result: dict[str, Any]) -> float:
    """Host ms per mixed step inside the format's attention forward and KV-cache update."""
    return sum(ms for name, (ms, _) in result["host_ms"]["mixed"].items()
               if name.endswith((".forward", ".do_kv_cache_update")))


def plot_svg(results: list[dict[str, Any]], spec: dict[str, Any]) -> str:
    """The mixed step per configuration: its wall time, the GPU's busy time in it and the host's time in attention."""
    from xml.sax.saxutils import escape

    from s4kv.runtime.bench.matrix import FORMATS
    from s4kv.runtime.bench.plot import COLORS, MARGIN, PANEL_H, PANEL_W, TOP, grouped_bars, legend

    ok = [r for r in results if r["status"] == "ok"]
    configs = [r["config"] for r in ok]
    groups = {
        "mixed step (wall)": {r["config"]: r["mixed_step_ms"] for r in ok},
        "GPU busy": {r["config"]: r["mixed_profile"]["busy_us"] / 1e3 for r in ok},
        "host in attention": {r["config"]: host_in_attention_ms(r) for r in ok},
    }
    width, height = PANEL_W + MARGIN, TOP + PANEL_H + 30 + 18 * len(configs)
    title = f"A step of {spec['decodes']} decodes and the prefill of {prompts_text(spec)}, ms"
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="22" font-size="14" text-anchor="middle">{escape(title)}</text>']
    parts += grouped_bars(groups, configs, MARGIN, lambda config, ms: f"{ms:.1f}")
    labels = [(FORMATS[fmt].label + (", V1 model runner" if v1 else "")) for fmt, v1 in map(parse_config, configs)]
    parts += legend([(COLORS.get(config, "#777777"), label) for config, label in zip(configs, labels)],
                    TOP + PANEL_H + 20)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_outputs(out: Path, results: list[dict[str, Any]], spec: dict[str, Any]) -> None:
    (out / "mixed_step.json").write_text(json.dumps({"spec": spec, "results": results}, indent=1))
    (out / "mixed_step.md").write_text(table(results, spec))
    (out / "mixed_step.svg").write_text(plot_svg(results, spec))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the engine process's job (JSON)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--plot", type=Path, metavar="MIXED_STEP_JSON",
                        help="write the table and plot of a saved run into --out; runs nothing")
    parser.add_argument("--model", type=Path, default=Path("configs/llama-3.1-8b-instruct.json"),
                        help="a config.json (dummy weights) or a model directory")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=1, help="prompts prefilled in each mixed step")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--timeout-s", type=float, default=240, help="per engine process")
    parser.add_argument("--budget-s", type=float, default=math.inf,
                        help="start no engine that would not end within this many seconds of the start (each "
                             "taken as long as the longest one before it)")
    args = parser.parse_args(argv)
    if args.prompts < 1:
        parser.error("--prompts must be at least 1")
    if args.one:
        print(RESULT_PREFIX + json.dumps(run_one(json.loads(args.one))), flush=True)
        sys.stdout.flush()
        os._exit(0)  # skip vLLM's interpreter-exit teardown, which can stall

    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        saved = json.loads(args.plot.read_text())
        write_outputs(args.out, saved["results"], saved["spec"])
        return 0

    from s4kv.runtime.bench.runner import prepare_model

    configs = [c for c in args.configs.split(",") if c]
    for config in configs:
        parse_config(config)
    model_dir = prepare_model(args.model, args.out / "model")
    spec = {
        "model": str(model_dir.resolve()), "load_format": args.load_format,
        "vocab_size": json.loads((model_dir / "config.json").read_text())["vocab_size"],
        "decodes": args.decodes, "context": args.context, "prompt_len": args.prompt_len, "prompts": args.prompts,
        "repeats": args.repeats,
        "max_model_len": args.max_model_len, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    results = []
    began, longest = time.perf_counter(), 0.0
    for i, config in enumerate(configs, 1):
        start = time.perf_counter()
        if start - began + longest > args.budget_s:
            print(f"[mixed-step] {i}/{len(configs)} {config}: skipped, would end past --budget-s", flush=True)
            results.append({"config": config, "status": "skipped"})
            continue
        print(f"[mixed-step] {i}/{len(configs)} {config} ...", flush=True)
        result = engine_process(config, spec, min(args.timeout_s, args.budget_s - (start - began)))
        longest = max(longest, time.perf_counter() - start)
        results.append(result)
        summary = (f"decode {result['decode_step_ms']:.2f} ms, mixed {result['mixed_step_ms']:.2f} ms"
                   if result["status"] == "ok" else result["status"] + "\n  " + "\n  ".join(result.get("log_tail", [])))
        print(f"[mixed-step] {config}: {summary} ({time.perf_counter() - start:.0f} s)", flush=True)
        write_outputs(args.out, results, spec)  # after each engine: a later one may not finish
    write_outputs(args.out, results, spec)
    print(table(results, spec))
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
