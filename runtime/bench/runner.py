"""`s4kv bench`: end-to-end throughput of each KV format on the standard workloads, one engine per configuration.

For every selected engine setting (workloads that share their memory budget and max_num_seqs run in
one engine) and every selected KV format, a fresh ``python -m s4kv.runtime.bench.engine`` process
starts vLLM with dummy weights from a config.json, runs the workloads and reports; this process only
orchestrates, so it imports neither torch nor vLLM. Results are saved after every engine, so a run
cut short by a device-call limit keeps what it measured; ``--merge`` joins the results of several
calls into one table and plot.

Several GPUs: ``--tensor-parallel-size N`` goes to vLLM as ``tensor_parallel_size``, as the CDK toolkit's
``--tensor-parallel-size`` (runtime/sizing/capacity.py) does; ``--data-parallel-size M`` starts M independent engines,
each on its own N GPUs (CUDA_VISIBLE_DEVICES) with its share of the requests, which is what ``vllm serve
--data-parallel-size M`` runs for a dense model, and sums their throughput over the interval from the first start
to the last end (the replicas start each workload together).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import report as bench_report
from . import serve as bench_serve
from s4kv.runtime.sizing import model_shapes
from .matrix import (ALL_WORKLOADS, FORMATS, MEASURED_MARGIN, STANDARD_FORMATS, WORKLOADS, EngineSettings,
                           ModelScale, Workload, engine_groups, expected_engine_s, expected_workload_s,
                           parse_names)
from .plot import render_svg

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "configs" / "qwen2.5-7b-instruct.json"
ENGINE_MODULE = "s4kv.runtime.bench.engine"  # the tests swap in a stand-in engine
EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Interrupt)\b")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default="all",
                        help=f"comma list of KV formats ({', '.join(FORMATS)}) or 'all' "
                             f"({', '.join(STANDARD_FORMATS)})")
    parser.add_argument("--in-order", action="store_true",
                        help="start the configurations in the order --configs lists them (most important first, so "
                             "a time budget skips the last), not in table order")
    parser.add_argument("--workloads", default="all",
                        help=f"comma list of workloads ({', '.join(ALL_WORKLOADS)}) or 'all' ({', '.join(WORKLOADS)})")
    parser.add_argument("--tensor-parallel-size", type=_positive_int, default=1, metavar="N",
                        help="GPUs per engine (vLLM tensor_parallel_size), as the CDK toolkit's --tensor-parallel-size")
    parser.add_argument("--data-parallel-size", type=_positive_int, default=1, metavar="M",
                        help="independent engines, each on its own N GPUs with 1/M of the requests (what vllm serve "
                             "--data-parallel-size M runs for a dense model); throughput is summed")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="a config.json (dummy weights) or a model directory (default: Qwen2.5-7B-Instruct shape)")
    parser.add_argument("--load-format", default="dummy",
                        help="vLLM load_format; 'dummy' needs only config.json (default)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="folder for results.json, table.md, plot.svg and engine logs")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget for all engines: an engine whose start plus workloads (at the speed "
                             "measured on the H200 for its format, else the slowest, scaled to the model and the "
                             "parallel layout; after a first engine, its measured start) would not fit is skipped, "
                             "not started")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="RESULTS_JSON",
                        help="run nothing: merge results.json files of earlier calls into one table and plot")
    parser.add_argument("--repeats", type=_positive_int, default=1, metavar="R",
                        help="start every engine R times, round by round (each round starts every configuration "
                             "once), so that a slow host or engine shows as spread between runs instead of as the "
                             "result; each cell is then the median of its runs")
    parser.add_argument("--dry-run", action="store_true", help="print the engines that would run, then stop")
    bench_serve.add_arguments(parser)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def model_label(model: Path) -> str:
    """A short name for a model in tables: the config file's stem or the folder's name."""
    return model.stem if model.suffix == ".json" else model.name


def model_scale(model: Path) -> tuple[ModelScale, model_shapes.ModelShape | None]:
    """Parameter count and depth for the time estimates; the 7B reference when the config cannot be read."""
    try:
        shape = model_shapes.load(str(model))
    except (ValueError, OSError):
        return ModelScale(), None
    return ModelScale(params=float(shape.num_params), layers=shape.num_layers), shape


def parallel_error(shape: model_shapes.ModelShape | None, tp: int) -> str | None:
    """Why the model cannot be split over ``tp`` GPUs (vLLM splits attention heads; KV heads are split or
    replicated, so one count must divide the other), or None."""
    if shape is None or tp == 1:
        return None
    if shape.num_heads % tp:
        return f"{shape.num_heads} attention heads cannot be split over tensor parallel size {tp}"
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        return f"{shape.num_kv_heads} KV heads cannot be split or replicated over tensor parallel size {tp}"
    return None


def with_layout(settings: EngineSettings, tp: int, dp: int) -> EngineSettings:
    return dataclasses.replace(settings, tensor_parallel_size=tp, data_parallel_size=dp)


def build_plan(args: argparse.Namespace) -> list[tuple[str, EngineSettings, list[str]]]:
    """(format, engine settings with the parallel layout, workload names) per engine, in the order they start:
    engine setting by engine setting, formats in table order or, with --in-order, as --configs lists them."""
    formats = parse_names(args.configs, FORMATS, "configs", all_names=list(STANDARD_FORMATS), keep_order=args.in_order)
    workloads = parse_names(args.workloads, ALL_WORKLOADS, "workloads", all_names=list(WORKLOADS))
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    return [(fmt, with_layout(settings, tp, dp), names) for settings, names in engine_groups(workloads)
            for fmt in formats]


def run(args: argparse.Namespace) -> int:
    if args.serve:
        if args.repeats != 1:
            print("s4kv bench: --repeats applies to the offline benchmark, not to --serve", file=sys.stderr)
            return 2
        return bench_serve.run(args)
    if args.merge:
        doc = bench_report.load(args.merge)
        write_outputs(doc, args.out)
        return 0
    try:
        plan = build_plan(args)
    except ValueError as err:
        print(f"s4kv bench: {err}", file=sys.stderr)
        return 2
    scale, shape = model_scale(args.model)
    tp = args.tensor_parallel_size
    problem = parallel_error(shape, tp)
    if problem:
        print(f"s4kv bench: {model_label(args.model)}: {problem}", file=sys.stderr)
        return 2
    for fmt, settings, names in plan:
        need = expected_engine_s(fmt, names, scale, settings)
        layout = f" on {settings.num_gpus} GPUs: {settings.parallel_label}" if settings.parallel else ""
        print(f"[bench] plan: {fmt:10s} {settings.key:18s} {','.join(names):12s} up to {need:.0f} s{layout}")
    if args.repeats > 1:
        print(f"[bench] plan: {args.repeats} rounds of the engines above")
    if args.dry_run:
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(args.model, args.out / "model")
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    label = model_label(args.model)
    doc = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "command": " ".join(["s4kv", *sys.argv[1:]]), "model": str(args.model)},
           "runs": []}
    deadline = time.monotonic() + args.budget_s if args.budget_s is not None else None
    measured_start: dict[EngineSettings, float] = {}  # slowest start + warm-up seen so far, per engine setting
    measured_pace: dict[str, float] = {}  # per workload: the slowest measured wall over its estimate so far
    for attempt, (fmt, settings, names) in ((a, entry) for a in range(1, args.repeats + 1) for entry in plan):
        left = deadline - time.monotonic() if deadline else None
        seen = measured_start.get(settings)
        need = expected_engine_s(fmt, names, scale, settings,
                                 start_s=seen * MEASURED_MARGIN if seen is not None else None,
                                 pace={name: p * MEASURED_MARGIN for name, p in measured_pace.items()})
        if left is not None and left < need:
            record = {"status": "skipped", "error": f"time budget: {left:.0f} s left, the engine may need {need:.0f} s"}
        else:
            record = run_engine(fmt, [dataclasses.replace(ALL_WORKLOADS[n], engine=settings) for n in names],
                                model_dir, args.load_format, vocab_size, args.out, left, attempt)
        record = {"format": fmt, "model": label, "engine": settings.as_dict(), "workloads": names, **record}
        if args.repeats > 1:
            record["round"] = attempt
        if record["status"] == "ok":
            took = record["startup_s"] + record.get("warmup_s", 0.0)
            measured_start[settings] = max(took, measured_start.get(settings, 0.0))
            for name, result in record["results"].items():
                pace = result["wall_s"] / expected_workload_s(fmt, name, scale, settings)
                measured_pace[name] = max(pace, measured_pace.get(name, 0.0))
        doc["runs"].append(record)
        if record.get("gpu") and "gpu" not in doc["meta"]:
            doc["meta"].update(gpu=record["gpu"], vllm=record.get("vllm"))
        print("[bench] " + summarize(record), flush=True)
        (args.out / "results.json").write_text(json.dumps(doc, indent=1))
    write_outputs(doc, args.out)
    return 1 if any(r["status"] == "failed" for r in doc["runs"]) else 0


def prepare_model(model: Path, folder: Path) -> Path:
    """A model directory for vLLM: the given one, or a fresh folder holding the given config.json."""
    if model.is_dir():
        if not (model / "config.json").is_file():
            raise SystemExit(f"s4kv bench: {model} has no config.json")
        return model
    if not model.is_file():
        raise SystemExit(f"s4kv bench: model config {model} not found (pass --model CONFIG_JSON_OR_DIR)")
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model, folder / "config.json")
    return folder


def replica_env(rank: int, engine: EngineSettings, base: dict[str, str]) -> dict[str, str]:
    """Environment of one engine process. Alone (data_parallel_size 1): the caller's. A data-parallel replica sees
    only its own tensor_parallel_size GPUs of those the caller sees (CUDA_VISIBLE_DEVICES, else 0, 1, ...) and
    compiles into its own vLLM cache folder: side by side, both would be DP rank 0 and share one."""
    env = dict(base)
    if engine.data_parallel_size == 1:
        return env
    tp = engine.tensor_parallel_size
    visible = base.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else \
        [str(i) for i in range(engine.num_gpus)]
    if len(devices) < engine.num_gpus:
        raise ValueError(f"{engine.num_gpus} GPUs needed (TP {tp} x DP {engine.data_parallel_size}), "
                         f"CUDA_VISIBLE_DEVICES={visible} lists {len(devices)}")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[rank * tp:(rank + 1) * tp])
    cache_root = base.get("VLLM_CACHE_ROOT") or os.path.join(
        base.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm")
    env["VLLM_CACHE_ROOT"] = os.path.join(cache_root, f"dp-replica{rank}")
    return env


def run_engine(fmt: str, workloads: list[Workload], model_dir: Path, load_format: str, vocab_size: int, out: Path,
               timeout: float | None, attempt: int = 1) -> dict:
    """One engine process (``python -m ENGINE_MODULE SPEC``) for workloads that share one engine setting, or one per
    data-parallel replica; returns the run record (status, capacity, results or the error). A replica that fails
    ends the others at once (they would wait for it). ``attempt``: which start of this engine (--repeats), so that
    each start keeps its own log."""
    engine = workloads[0].engine
    dp = engine.data_parallel_size
    name = f"{fmt}-{engine.key}" + (f"-run{attempt}" if attempt > 1 else "")
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    barrier = logs / f"{name}.barrier"
    if dp > 1:
        shutil.rmtree(barrier, ignore_errors=True)
    spec = {"format": fmt, "workloads": [w.to_spec() for w in workloads], "model": str(model_dir),
            "load_format": load_format, "vocab_size": vocab_size}
    try:
        envs = [replica_env(rank, engine, dict(os.environ)) for rank in range(dp)]
    except ValueError as err:
        return {"kv_cache_tokens": None, "log": None, "status": "failed", "error": str(err)}
    procs, log_paths = [], []
    with contextlib.ExitStack() as files:
        try:
            for rank in range(dp):
                suffix = f"-r{rank}" if dp > 1 else ""
                spec_path, log_path = logs / f"{name}{suffix}.spec.json", logs / f"{name}{suffix}.log"
                replica = {"replica": {"rank": rank, "size": dp, "barrier": str(barrier)}} if dp > 1 else {}
                spec_path.write_text(json.dumps({**spec, **replica}))
                log = files.enter_context(open(log_path, "w"))
                log_paths.append(log_path)
                # Own process group: vLLM starts an engine-core child (and workers), which a timeout must end too.
                procs.append(subprocess.Popen([sys.executable, "-m", ENGINE_MODULE, str(spec_path)],
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                              env=envs[rank]))
            errors = _wait_all(procs, timeout)
        finally:
            for proc in procs:
                _end_group(proc)
    records = [_read_record(path, error) for path, error in zip(log_paths, errors)]
    return records[0] if dp == 1 else combine_replicas(records)


def _wait_all(procs: list[subprocess.Popen], timeout: float | None) -> list[str | None]:
    """Wait for every process; per process None (exit 0) or what went wrong. On the first non-zero exit or at the
    timeout, the processes still running are left to the caller to end."""
    deadline = time.monotonic() + timeout if timeout is not None else None
    errors: list[str | None] = [None] * len(procs)
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if failed or all(code is not None for code in codes):
            for i, code in enumerate(codes):
                if code is None:
                    errors[i] = f"stopped: replica {failed[0]} failed first"
                elif code != 0:
                    errors[i] = f"exit code {code}"
            return errors
        if deadline is not None and time.monotonic() > deadline:
            for i, code in enumerate(codes):
                errors[i] = f"timed out after {timeout:.0f} s" if code is None else None
            return errors
        time.sleep(0.2)


def _read_record(log_path: Path, error: str | None) -> dict:
    """The run record of one engine process, from its log."""
    text = log_path.read_text(errors="replace")
    payload = bench_report.parse_engine_result(text)
    record = {"kv_cache_tokens": bench_report.parse_kv_cache_tokens(text), "log": str(log_path),
              "jit_compiled": bench_report.parse_jit_compiled(text),
              "staging_room_tokens": bench_report.parse_staging_room(text)}
    # A printed result stands even if the process then failed to shut down cleanly: the numbers were taken.
    if payload is None:
        lines = [line for line in text.splitlines() if line.strip()]
        # the exception that ended the engine says more than the shutdown noise vLLM prints after it
        raised = [line for line in lines if EXCEPTION_LINE.match(line)]
        cause = (raised or lines or ["empty log"])[-1].strip()
        tail = "\n".join(lines[-15:])
        return {**record, "status": "failed", "error": f"{error or 'no result line'}: {cause}\nlog tail:\n{tail}"}
    if record["kv_cache_tokens"] is None:
        return {**record, "status": "failed", "error": "no 'GPU KV cache size' line in the engine log"}
    return {**record, "status": "ok", "startup_s": payload["startup_s"], "warmup_s": payload.get("warmup_s", 0.0),
            "gpu": payload["gpu"], "vllm": payload["vllm"], "results": payload["workloads"],
            "gpu_memory_utilization": payload.get("gpu_memory_utilization"),
            "max_num_seqs": payload.get("max_num_seqs"), "exit": error or "clean"}


def combine_replicas(records: list[dict]) -> dict:
    """One run record from the records of data-parallel replicas: ok only if every replica is; capacity is per
    engine (each replica's own GPUs; the smallest if they differ) with the replicas' list beside it; throughput is
    all output tokens over the interval from the first replica's start to the last one's end."""
    kv = [r.get("kv_cache_tokens") for r in records]
    base = {"kv_cache_tokens": min(kv) if all(v is not None for v in kv) else None, "kv_cache_tokens_replicas": kv,
            "staging_room_tokens": records[0].get("staging_room_tokens"),  # the same settings on every replica
            "log": [r["log"] for r in records],
            "jit_compiled": [name for r in records for name in r.get("jit_compiled", [])]}
    bad = [(i, r) for i, r in enumerate(records) if r["status"] != "ok"]
    if bad:
        first_error = next((r for _, r in bad if not r["error"].startswith("stopped:")), bad[0][1])["error"]
        failed = ", ".join(str(i) for i, r in bad if not r["error"].startswith("stopped:")) or str(bad[0][0])
        return {**base, "status": "failed", "error": f"replica {failed}: {first_error}"}
    results: dict[str, dict] = {}
    for name in records[0]["results"]:
        parts = [r["results"][name] for r in records]
        wall = max(p["end_unix"] for p in parts) - min(p["start_unix"] for p in parts)
        output_tokens = sum(p["output_tokens"] for p in parts)
        input_tokens = sum(p["input_tokens"] for p in parts)
        results[name] = {"wall_s": wall, "output_tokens": output_tokens, "input_tokens": input_tokens,
                         "output_tok_s": output_tokens / wall, "total_tok_s": (output_tokens + input_tokens) / wall,
                         "triton_compiles": sum(p["triton_compiles"] for p in parts), "replicas": parts}
    exits = sorted({r["exit"] for r in records})
    return {**base, "status": "ok", "startup_s": max(r["startup_s"] for r in records),
            "warmup_s": max(r.get("warmup_s", 0.0) for r in records), "gpu": records[0]["gpu"],
            "vllm": records[0]["vllm"], "gpu_memory_utilization": records[0].get("gpu_memory_utilization"),
            "max_num_seqs": records[0].get("max_num_seqs"), "results": results, "exit": "; ".join(exits)}


def _end_group(proc: subprocess.Popen) -> None:
    """Stop whatever is left of the engine's process group (the engine core outlives a killed parent)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        for _ in range(20):  # up to 10 s for the group to exit and release the GPU
            time.sleep(0.5)
            proc.poll()  # reap our own child, or its zombie keeps the group alive
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
        else:
            continue
        break
    proc.wait()


def summarize(record: dict) -> str:
    head = f"{record['format']:10s} {EngineSettings(**record['engine']).key:18s} {record['status']}"
    if record["status"] != "ok":
        return f"{head}: {record['error'].splitlines()[0]}"
    parts = [f"KV {record['kv_cache_tokens']:,} tokens", f"start {record['startup_s']:.0f} s"]
    for name, result in record["results"].items():
        metric = ALL_WORKLOADS[name].metric
        parts.append(f"{name} {result[metric]:,.1f} s" if metric == "wall_s"
                     else f"{name} {result[metric]:,.0f} tok/s")
        # records of an engine before the count was kept (an archived results.json) have no such field
        if result.get("triton_compiles"):
            parts.append(f"{name} timed a compilation: {result['triton_compiles']} Triton kernels compiled inside it")
    return f"{head}: " + ", ".join(parts)


def write_outputs(doc: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = bench_report.build_table(doc)
    table = bench_report.render_markdown(rows)
    meta = doc.get("meta", {})
    title = f"s4kv bench on {meta.get('gpu', 'unknown GPU')}, vLLM {meta.get('vllm', '?')}, {meta.get('date', '')}"
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    runs = doc.get("runs", [])
    notes = "".join(f"\n{note}" for note in (bench_report.staging_note(runs), bench_report.jit_note(runs)) if note)
    (out / "table.md").write_text(f"{title}\n\n{table}{notes}")
    (out / "plot.svg").write_text(render_svg(rows, title))
    print(f"\n{title}\n\n{table}{notes}")
    for fmt in ("s4kv_kivi", "s4kv_saw"):
        verdicts = bench_report.target_check(rows, fmt)
        if verdicts:
            print(f"{fmt}: " + "; ".join(verdicts))
    print(f"[bench] wrote {out / 'results.json'}, {out / 'table.md'}, {out / 'plot.svg'}")
