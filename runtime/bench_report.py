"""Results of `s4kv bench`: parse engine logs, merge runs from several calls, build the table with ratios.

A results document is ``{"meta": {...}, "runs": [run, ...]}``; a run is one engine process (or the replicas of a
data-parallel run): ``{"format", "model", "engine": EngineSettings.as_dict(), "workloads": [names],
"status": "ok" | "failed" | "skipped", "kv_cache_tokens", "startup_s", "results": {workload: {"wall_s",
"output_tok_s", ...}}, "error"}``. Runs from several device calls are concatenated; for each (format, workload,
parallel layout, model) the last ok run counts. Rows of one GPU keep their plain keys ("short",
"kv:gmu0.90-seqs256"); a parallel layout adds "@tp2" / "-tp2", and a document with several models adds ":model".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .bench_engine import RESULT_PREFIX
from .bench_matrix import ALL_WORKLOADS, BASELINE, FORMATS, EngineSettings

KV_CACHE_LINE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
# issue 4's targets for our schemes, as ratios to bf16 + FA3
THROUGHPUT_TARGET = 1.0
WALL_TARGET = 1.0
CAPACITY_TARGET = 3.7


def parse_kv_cache_tokens(log: str) -> int | None:
    """vLLM's "GPU KV cache size: 2,043,840 tokens" (the last one, if the log holds several)."""
    matches = KV_CACHE_LINE.findall(log)
    return int(matches[-1].replace(",", "")) if matches else None


def parse_engine_result(log: str) -> dict[str, Any] | None:
    """The JSON payload bench_engine prints on its last result line, or None if it never got there."""
    for line in reversed(log.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return None


def merge(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """One document from several calls: runs in call order, meta from the first that has a GPU name."""
    meta: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    for doc in documents:
        if "runs" not in doc:
            raise ValueError("not an s4kv bench results document (no 'runs')")
        if not meta.get("gpu") and doc.get("meta", {}).get("gpu"):
            meta = dict(doc["meta"])
        runs.extend(doc["runs"])
    return {"meta": meta, "runs": runs}


def load(paths: list[Path]) -> dict[str, Any]:
    return merge([json.loads(Path(p).read_text()) for p in paths])


@dataclass(frozen=True)
class Cell:
    """One table entry: a measured value and its ratio to the baseline, or why there is none."""

    value: float | None
    ratio: float | None = None
    note: str = "not run"

    def render(self, unit: str) -> str:
        if self.value is None:
            return self.note
        text = f"{self.value:,.1f} s" if unit == "s" else f"{self.value:,.0f}"
        return text if self.ratio is None else f"{text} ({self.ratio:.2f}x)"


@dataclass(frozen=True)
class Row:
    key: str  # workload name, or "kv:<engine key>" for a capacity row
    title: str
    unit: str  # "s", "tok/s" or "tokens"
    cells: dict[str, Cell]


def _latest_ok(runs: list[dict[str, Any]], fmt: str, accept) -> dict[str, Any] | None:
    found = None
    for run in runs:
        if run["format"] == fmt and run["status"] == "ok" and accept(run):
            found = run
    return found


def _failure_note(runs: list[dict[str, Any]], fmt: str, accept) -> str:
    statuses = [run["status"] for run in runs if run["format"] == fmt and accept(run)]
    return statuses[-1] if statuses else "not run"


def _cells(runs, formats, accept, value_of) -> dict[str, Cell]:
    values = {}
    for fmt in formats:
        run = _latest_ok(runs, fmt, accept)
        values[fmt] = value_of(run) if run else None
    base = values.get(BASELINE)
    cells = {}
    for fmt in formats:
        value = values[fmt]
        if value is None:
            cells[fmt] = Cell(None, note=_failure_note(runs, fmt, accept))
        else:
            cells[fmt] = Cell(value, value / base if base else None)
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
                 f"gmu {engine.gpu_memory_utilization:.2f}, max_num_seqs {engine.max_num_seqs}"
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
    lines.append(f"(ratio) = value / {FORMATS[BASELINE].label}; higher is better except wall s (lower is better).")
    return "\n".join(lines) + "\n"


def target_check(rows: list[Row], fmt: str) -> list[str]:
    """issue 4's done criterion for one of our schemes, row by row: 'ok' or 'MISSED' with the ratio."""
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
