"""`s4kv bench`: end-to-end throughput of each KV format on the issue-4 workloads, one engine per configuration.

For every selected engine setting (workloads that share gpu_memory_utilization and max_num_seqs run in
one engine) and every selected KV format, a fresh ``python -m s4kv.runtime.bench_engine`` process
starts vLLM with dummy weights from a config.json, runs the workloads and reports; this process only
orchestrates, so it imports neither torch nor vLLM. Results are saved after every engine, so a run
cut short by a device-call limit keeps what it measured; ``--merge`` joins the results of several
calls into one table and plot.
"""

from __future__ import annotations

import argparse
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

from . import bench_report
from .bench_matrix import (FORMATS, WORKLOADS, EngineSettings, Workload, engine_groups, expected_engine_s,
                           parse_names)
from .bench_plot import render_svg

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "configs" / "qwen2.5-7b-instruct.json"
ENGINE_MODULE = "s4kv.runtime.bench_engine"  # the tests swap in a stand-in engine
EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Interrupt)\b")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", default="all",
                        help=f"comma list of KV formats ({', '.join(FORMATS)}) or 'all'")
    parser.add_argument("--workloads", default="all",
                        help=f"comma list of workloads ({', '.join(WORKLOADS)}) or 'all'")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="a config.json (dummy weights) or a model directory (default: Qwen2.5-7B-Instruct shape)")
    parser.add_argument("--load-format", default="dummy",
                        help="vLLM load_format; 'dummy' needs only config.json (default)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="folder for results.json, table.md, plot.svg and engine logs")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget for all engines: an engine whose start plus workloads (at the speed "
                             "issue 4 measured for its format, else the slowest) would not fit is skipped, not started")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="RESULTS_JSON",
                        help="run nothing: merge results.json files of earlier calls into one table and plot")
    parser.add_argument("--dry-run", action="store_true", help="print the engines that would run, then stop")


def run(args: argparse.Namespace) -> int:
    if args.merge:
        doc = bench_report.load(args.merge)
        write_outputs(doc, args.out)
        return 0
    try:
        formats = parse_names(args.configs, FORMATS, "configs")
        workloads = parse_names(args.workloads, WORKLOADS, "workloads")
    except ValueError as err:
        print(f"s4kv bench: {err}", file=sys.stderr)
        return 2
    plan = [(fmt, settings, names) for settings, names in engine_groups(workloads) for fmt in formats]
    for fmt, settings, names in plan:
        need = expected_engine_s(fmt, names)
        print(f"[bench] plan: {fmt:10s} {settings.key:18s} {','.join(names):12s} up to {need:.0f} s")
    if args.dry_run:
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(args.model, args.out / "model")
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    doc = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "command": " ".join(["s4kv", *sys.argv[1:]]), "model": str(args.model)},
           "runs": []}
    deadline = time.monotonic() + args.budget_s if args.budget_s else None
    for fmt, settings, names in plan:
        left = deadline - time.monotonic() if deadline else None
        need = expected_engine_s(fmt, names)
        if left is not None and left < need:
            record = {"status": "skipped", "error": f"time budget: {left:.0f} s left, the engine may need {need:.0f} s"}
        else:
            record = run_engine(fmt, [WORKLOADS[n] for n in names], model_dir, args.load_format, vocab_size,
                                args.out, left)
        record = {"format": fmt, "engine": settings.as_dict(), "workloads": names, **record}
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


def run_engine(fmt: str, workloads: list[Workload], model_dir: Path, load_format: str, vocab_size: int, out: Path,
               timeout: float | None) -> dict:
    """One engine process (``python -m ENGINE_MODULE SPEC``) for workloads that share one engine setting;
    returns the run record (status, capacity, results or the error)."""
    name = f"{fmt}-{workloads[0].engine.key}"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    spec_path = out / "logs" / f"{name}.spec.json"
    log_path = out / "logs" / f"{name}.log"
    spec_path.write_text(json.dumps({"format": fmt, "workloads": [w.to_spec() for w in workloads],
                                     "model": str(model_dir), "load_format": load_format, "vocab_size": vocab_size}))
    with open(log_path, "w") as log:
        # Own process group: vLLM starts an engine-core child, which a timeout must take down too.
        proc = subprocess.Popen([sys.executable, "-m", ENGINE_MODULE, str(spec_path)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
            error = None if code == 0 else f"exit code {code}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s"
        finally:
            _end_group(proc)
    text = log_path.read_text(errors="replace")
    payload = bench_report.parse_engine_result(text)
    record = {"kv_cache_tokens": bench_report.parse_kv_cache_tokens(text), "log": str(log_path)}
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
    return {**record, "status": "ok", "startup_s": payload["startup_s"], "gpu": payload["gpu"],
            "vllm": payload["vllm"], "results": payload["workloads"], "exit": error or "clean"}


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
        metric = WORKLOADS[name].metric
        parts.append(f"{name} {result[metric]:,.1f} s" if metric == "wall_s"
                     else f"{name} {result[metric]:,.0f} tok/s")
    return f"{head}: " + ", ".join(parts)


def write_outputs(doc: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = bench_report.build_table(doc)
    table = bench_report.render_markdown(rows)
    meta = doc.get("meta", {})
    title = f"s4kv bench on {meta.get('gpu', 'unknown GPU')}, vLLM {meta.get('vllm', '?')}, {meta.get('date', '')}"
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "table.md").write_text(f"{title}\n\n{table}")
    (out / "plot.svg").write_text(render_svg(rows, title))
    print(f"\n{title}\n\n{table}")
    for fmt in ("s4kv_kivi", "s4kv_saw"):
        verdicts = bench_report.target_check(rows, fmt)
        if verdicts:
            print(f"{fmt}: " + "; ".join(verdicts))
    print(f"[bench] wrote {out / 'results.json'}, {out / 'table.md'}, {out / 'plot.svg'}")
