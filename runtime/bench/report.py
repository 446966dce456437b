"""Results of `s4kv bench`: parse engine logs, merge runs from several calls, build the table with ratios.

A results document is ``{"meta": {...}, "runs": [run, ...]}``; a run is one engine process (or the replicas of a
data-parallel run): ``{"format", "model", "engine": EngineSettings.as_dict(), "workloads": [names], "status": "ok" |
"failed" | "skipped", "kv_cache_tokens", "staging_room_tokens" (int4_kivi), "max_num_seqs" (as the engine ran),
"startup_s", "results": {workload: {"wall_s", "output_tok_s", ...}}, "error", "call"}``. Runs from several device calls
are concatenated, each tagged with its call (its document's date and place in the merge). A cell with several ok runs
shows the median value and the median of each run's ratio to the baseline measured in the same call: speed differs from
one machine to the next by more than the differences measured here, so a ratio is only taken across calls when the call
has no baseline run (marked). Rows of one GPU keep their plain keys ("short", "kv:gmu0.90-seqs256"); a parallel layout
adds "@tp2" / "-tp2", and a document with several models adds ":model".
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .engine import RESULT_PREFIX
from .matrix import ALL_WORKLOADS, BASELINE, FORMATS, EngineSettings

KV_CACHE_LINE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
# The targets of our schemes, as ratios to bf16 + FA3
THROUGHPUT_TARGET = 1.0
WALL_TARGET = 1.0
CAPACITY_TARGET = 3.7
OTHER_CALL_MARK = " †"
JIT_MONITOR_LINE = re.compile(r"Triton kernel JIT compilation during inference: (\w+)")
# The plugin's start-up line for int4_kivi's staging pool (runtime/plugin/backend.py)
STAGING_POOL_LINE = re.compile(r"int4_kivi staging pool: \d+ slots .* the room of (\d+) int4 tokens")


def parse_kv_cache_tokens(log: str) -> int | None:
    """vLLM's "GPU KV cache size: 2,043,840 tokens" (the last one, if the log holds several)."""
    matches = KV_CACHE_LINE.findall(log)
    return int(matches[-1].replace(",", "")) if matches else None


def parse_jit_compiled(log: str) -> list[str]:
    """The Triton kernels vLLM 0.26's JIT monitor (mode warn) saw compiled after the engine's start-up warm-up, in
    order: each compile held every running request for as long as it took."""
    return JIT_MONITOR_LINE.findall(log)


def jit_note(runs: list[dict[str, Any]]) -> str:
    """One line per engine whose log showed kernels compiled after its start-up (the warm-up requests included),
    or one line saying none did; empty where no run recorded it."""
    recorded = [run for run in runs if run.get("jit_compiled") is not None]
    if not recorded:
        return ""
    compiled = [run for run in recorded if run["jit_compiled"]]
    if not compiled:
        return "Triton kernels compiled after an engine's start-up (vLLM's JIT monitor): none.\n"
    lines = ["Triton kernels compiled after an engine's start-up (vLLM's JIT monitor, the warm-up requests included):"]
    for run in compiled:
        label = FORMATS[run["format"]].label if run.get("format") in FORMATS else run.get("format", "?")
        log = run.get("log")
        where = f" ({Path(log).name})" if isinstance(log, str) else ""
        lines.append(f"- {label}{where}: " + ", ".join(f"`{name}`" for name in run["jit_compiled"]))
    return "\n".join(lines) + "\n"


def parse_staging_room(log: str) -> int | None:
    """The int4 tokens of KV cache that int4_kivi's staging pool takes the room of, as the plugin logs it; None
    without the line (another format)."""
    match = STAGING_POOL_LINE.search(log)
    return int(match.group(1)) if match else None


def staging_note(runs: list[dict[str, Any]]) -> str:
    """One line per int4_kivi engine whose log gave its staging pool: the tokens the pool takes the room of, beside
    the cache's (the capacity row counts the cache alone, which is what the engine can hold), and its max_num_seqs
    where the staging cap (``KVFormat.deployed_max_num_seqs``) took it below the engine setting's."""
    lines = []
    for run in runs:
        room, tokens = run.get("staging_room_tokens"), run.get("kv_cache_tokens")
        if run.get("status") != "ok" or room is None or tokens is None:
            continue
        engine = EngineSettings(**run["engine"])
        slots = run.get("max_num_seqs") or engine.max_num_seqs  # runs saved before the cap carry none
        capped = f", capped from the setting's {engine.max_num_seqs}" if slots != engine.max_num_seqs else ""
        lines.append(f"int4_kivi's staging pool at max_num_seqs {slots}{capped} ({engine.memory_label}) "
                     f"takes the room of {room:,} int4 tokens: "
                     f"{tokens:,} in the cache, {tokens + room:,} with the pool's room.")
    return "\n".join(lines) + "\n" if lines else ""


def parse_engine_result(log: str) -> dict[str, Any] | None:
    """The JSON payload bench_engine prints on its last result line, or None if it never got there."""
    for line in reversed(log.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return None


def merge(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """One document from several calls: runs in call order, each tagged with its call; meta from the first that has a
    GPU name, its date replaced by the span of the calls."""
    meta: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    dates = []
    for index, doc in enumerate(documents):
        if "runs" not in doc:
            raise ValueError("not an s4kv bench results document (no 'runs')")
        if not meta.get("gpu") and doc.get("meta", {}).get("gpu"):
            meta = dict(doc["meta"])
        date = doc.get("meta", {}).get("date")
        dates += [date] if date else []
        # one document is one `s4kv bench` run (two started together on two GPUs share a date: the index
        # tells them apart); a run merged before keeps the call it came from
        call = f"{date or 'undated'} #{index + 1}"
        runs.extend({**run, "call": run.get("call") or call} for run in doc["runs"])
    if len(documents) > 1 and dates:  # the table's heading names the span of the calls, not the first one's date
        meta = {**meta, "date": f"{min(dates)} to {max(dates)} ({len(documents)} calls)"}
    return {"meta": meta, "runs": runs}


def load(paths: list[Path]) -> dict[str, Any]:
    return merge([json.loads(Path(p).read_text()) for p in paths])


@dataclass(frozen=True)
class Cell:
    """One table entry: a measured value and its ratio to the baseline, or why there is none."""

    value: float | None
    ratio: float | None = None
    note: str = "not run"
    runs: int = 1  # ok runs behind the medians
    other_call: bool = False  # some run's ratio is against a baseline from another call

    def render(self, unit: str) -> str:
        if self.value is None:
            return self.note
        text = f"{self.value:,.1f} s" if unit == "s" else f"{self.value:,.0f}"
        if self.ratio is None:
            return text
        details = [f"{self.ratio:.2f}x"] + ([f"median of {self.runs}"] if self.runs > 1 else [])
        return f"{text} ({', '.join(details)}){OTHER_CALL_MARK if self.other_call else ''}"


@dataclass(frozen=True)
class Row:
    key: str  # workload name, or "kv:<engine key>" for a capacity row
    title: str
    unit: str  # "s", "tok/s" or "tokens"
    cells: dict[str, Cell]


def _failure_note(runs: list[dict[str, Any]], fmt: str, accept) -> str:
    statuses = [run["status"] for run in runs if run["format"] == fmt and accept(run)]
    return statuses[-1] if statuses else "not run"


def _cells(runs, formats, accept, value_of) -> dict[str, Cell]:
    ok = {fmt: [run for run in runs if run["format"] == fmt and run["status"] == "ok" and accept(run)]
          for fmt in set(formats) | {BASELINE}}
    baseline_by_call: dict[Any, list[float]] = {}
    for run in ok[BASELINE]:
        baseline_by_call.setdefault(run.get("call"), []).append(value_of(run))
    any_baseline = [v for values in baseline_by_call.values() for v in values]
    cells = {}
    for fmt in formats:
        if not ok[fmt]:
            cells[fmt] = Cell(None, note=_failure_note(runs, fmt, accept))
            continue
        ratios, other_call = [], False
        for run in ok[fmt]:
            same_call = baseline_by_call.get(run.get("call"))
            if same_call:
                ratios.append(value_of(run) / statistics.median(same_call))
            elif any_baseline:
                ratios.append(value_of(run) / statistics.median(any_baseline))
                other_call = True
        cells[fmt] = Cell(statistics.median(value_of(run) for run in ok[fmt]),
                          statistics.median(ratios) if ratios else None, runs=len(ok[fmt]), other_call=other_call)
    return cells


def build_table(doc: dict[str, Any], formats: list[str] | None = None) -> list[Row]:
    """Capacity rows (one per engine setting and model seen) then one row per workload, parallel layout and model,
    columns in FORMATS order."""
    runs = doc["runs"]
    present = {run["format"] for run in runs}
    formats = formats or [f for f in FORMATS if f in present or f == BASELINE]
    several_models = len({run.get("model") for run in runs if run.get("model")}) > 1

    def engine_of(run: dict[str, Any]) -> EngineSettings:
        return EngineSettings(**run["engine"])

    def model_key(run: dict[str, Any]) -> str:
        return f":{run.get('model') or '?'}" if several_models else ""

    def model_prefix(run: dict[str, Any]) -> str:
        return f"{run.get('model') or '?'}: " if several_models else ""

    def capacity_key(run: dict[str, Any]) -> str:
        return f"kv:{engine_of(run).key}{model_key(run)}"

    def layout_key(run: dict[str, Any]) -> str:
        engine = engine_of(run)
        return (f"@{engine.parallel_key}" if engine.parallel else "") + model_key(run)

    rows: list[Row] = []
    firsts: dict[str, dict[str, Any]] = {}
    for run in runs:
        firsts.setdefault(capacity_key(run), run)
    for key, first in firsts.items():
        engine = engine_of(first)
        accept = lambda run, key=key: capacity_key(run) == key  # noqa: E731
        title = (f"{model_prefix(first)}KV capacity (tokens{' per engine' if engine.parallel else ''}), "
                 f"{engine.memory_label}, max_num_seqs {engine.max_num_seqs}"
                 + (f", {engine.parallel_label}" if engine.parallel else ""))
        rows.append(Row(key, title, "tokens", _cells(runs, formats, accept, lambda r: r["kv_cache_tokens"])))
    for name, workload in ALL_WORKLOADS.items():
        layouts: dict[str, dict[str, Any]] = {}
        for run in runs:
            if name in run["workloads"]:
                layouts.setdefault(layout_key(run), run)
        unit = "s" if workload.metric == "wall_s" else "tok/s"
        value_of = lambda r, name=name, metric=workload.metric: r["results"][name][metric]  # noqa: E731
        for layout, first in layouts.items():
            def in_row(run: dict[str, Any], name: str = name, layout: str = layout) -> bool:
                return name in run["workloads"] and layout_key(run) == layout

            engine = engine_of(first)
            title = model_prefix(first) + workload.title + (f", {engine.parallel_label}" if engine.parallel else "")
            rows.append(Row(name + layout, title, unit, _cells(runs, formats, in_row, value_of)))
    return rows


def render_markdown(rows: list[Row]) -> str:
    if not rows:
        return "(no results)\n"
    formats = list(rows[0].cells)
    lines = [
        "| workload | " + " | ".join(FORMATS[f].label for f in formats) + " |",
        "|---|" + "---|" * len(formats),
    ]
    for row in rows:
        lines.append(f"| {row.title} | " + " | ".join(row.cells[f].render(row.unit) for f in formats) + " |")
    lines.append("")
    baseline = FORMATS[BASELINE].label
    lines.append(f"(ratio) = value / {baseline} of the same call; higher is better except wall s (lower is better). "
                 "With several runs: the median value and the median of the runs' ratios.")
    if any(cell.other_call for row in rows for cell in row.cells.values()):
        lines.append(f"{OTHER_CALL_MARK.strip()} the call of (some of) these runs had no {baseline} run: ratio against "
                     "the median of the other calls'.")
    return "\n".join(lines) + "\n"


def target_check(rows: list[Row], fmt: str) -> list[str]:
    """The targets above for one of our schemes, row by row: 'ok' or 'MISSED' with the ratio."""
    verdicts = []
    for row in rows:
        cell = row.cells.get(fmt)
        if cell is None or cell.ratio is None:
            continue
        if row.key.startswith("kv:"):
            ok, target = cell.ratio >= CAPACITY_TARGET, f">= {CAPACITY_TARGET}x"
        elif row.unit == "s":
            ok, target = cell.ratio <= WALL_TARGET, f"<= {WALL_TARGET}x"
        else:
            ok, target = cell.ratio >= THROUGHPUT_TARGET, f">= {THROUGHPUT_TARGET}x"
        name = "capacity " + row.key[3:] if row.key.startswith("kv:") else row.key
        # three decimals: 0.999x must not print as a missed 1.00x
        verdicts.append(f"{name} {cell.ratio:.3f}x (target {target}): {'ok' if ok else 'MISSED'}")
    return verdicts
