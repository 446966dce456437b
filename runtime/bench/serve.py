"""`s4kv bench --serve`: serving latency of each KV format through vLLM's real OpenAI-compatible server.

For every selected configuration (runtime/bench/matrix.py's FORMATS) one server process starts (`s4kv serve`'s,
``s4kv.runtime.plugin.api_server``: vLLM's OpenAI server with the plugin's checks and CUDA-graph sizes, for every
format alike; dummy weights from a config.json, no tokenizer: prompts are token ids), a few warm-up requests run,
then two sweeps drive it through the official ``openai`` client, streaming, from ``--client-processes`` processes
(each its own event loop, so that parsing the chunks keeps up with the server):

* request rate: Poisson arrivals at each rate of ``--rates`` (requests per second);
* fixed concurrency: each count of ``--concurrency`` requests kept in flight.

Each point sends ``--requests`` requests of ``--input-len`` distinct random token ids and ``--output-len`` output
tokens (``ignore_eos``). Per point: time to first token, inter-token latency (the gaps between streamed chunks,
per token) and end-to-end latency at p50 and p99, output tokens/s over the point, the number of requests the
server runs and queues (its ``/metrics`` gauges, sampled twice a second), and the engine's own inter-token latency
(vLLM's histogram over the point, timed where the engine core emits each token: a p99 far under the client's says the
gaps arise between the engine and the client, not in the steps). The server's own "GPU KV cache size" line
gives the KV capacity. Output: ``serve.json`` (every point of every configuration, saved after each one),
``serve.md`` (tables) and ``serve.svg`` (p99 ITL and p99 TTFT against the request rate, output tokens/s against
concurrency).

This process imports neither torch nor vLLM, nor ``openai``: only the client processes do. Each point also reports
how late the clients' event loops woke (their p99): a timed gap includes that delay.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import multiprocessing
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

from s4kv.runtime.cli.demo import wait_until_healthy
from s4kv.runtime.schemes import (DEFAULT_PREFILL_TOKENS_PER_STEP, choose_model_runner,
                                  prefill_capped_scheduler_settings)
from s4kv.runtime.sizing import model_shapes
from s4kv.runtime.vllm_metrics import bucket_percentile, histogram_buckets

from . import report as bench_report
from .matrix import FORMATS, KVFormat, parse_names

SERVED_NAME = "bench"
SERVER_MODULE = "s4kv.runtime.plugin.api_server"  # `s4kv serve`'s server, for every format
SERVE_FORMATS = ("bf16_fa3", "fp8_fa3", "s4kv_kivi", "s4kv_saw")
WARMUP_REQUESTS = 4
METRICS_PERIOD_S = 0.5
LOOP_LAG_PERIOD_S = 0.005
CLIENT_START_S = 60  # a client process's start: spawn, import openai
GAUGE_LINE = re.compile(r"^vllm:num_requests_(running|waiting)\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)
# the engine's own inter-token latency histogram: gaps between the engine core's output timestamps of a request, so
# free of the HTTP stream's and the clients' delays (vLLM's buckets: 10, 25, 50, 75, 100, 150, 200, 300 ms, ...)
ENGINE_ITL_FAMILY = "vllm:inter_token_latency_seconds"
TTFT_TARGET_S = 2.0  # a rate is sustained while p99 TTFT stays under this
MIN_CONFIG_S = 150  # a 7B server's start on the H200 plus one sweep point: less left, the configuration is skipped
# a server's GPU memory beyond its weights and its fixed KV cache: the CUDA context, CUDA graphs (0.4-0.6 GiB for an
# 8B model in vLLM's log), activations and workspaces
SERVER_OVERHEAD_BYTES = 3 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving sweep's own options (`s4kv bench --serve ...`); --configs, --model, --out and --budget-s are
    `s4kv bench`'s."""
    group = parser.add_argument_group("serving benchmark (--serve)")
    group.add_argument("--serve", action="store_true",
                       help="measure serving latency through the OpenAI server instead of offline throughput; "
                            f"--configs all means {', '.join(SERVE_FORMATS)}")
    group.add_argument("--rates", default="2,4,8,16", help="request-rate sweep, requests/s (comma list)")
    group.add_argument("--concurrency", default="16,64", help="fixed-concurrency sweep (comma list)")
    group.add_argument("--requests", type=int, default=64, help="requests per sweep point")
    group.add_argument("--input-len", type=int, default=2048, help="prompt tokens per request")
    group.add_argument("--output-len", type=int, default=256, help="output tokens per request")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.16,
                       help="the server's gpu_memory_utilization (default 0.16: on an H200 a 24 GB card's "
                            "budget, where KV memory binds; on an 80 GB GPU it leaves less than an 8B model's "
                            "weights, so give --kv-cache-memory-bytes there)")
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None, metavar="BYTES",
                       help="the same KV-cache memory for every configuration instead of gmu's profiling; the "
                            "servers then start side by side, in as few waves as the GPU's free memory allows, "
                            "and are measured one at a time")
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-model-len", type=int, default=4096)
    group.add_argument("--prefill-tokens-per-step", type=int, default=DEFAULT_PREFILL_TOKENS_PER_STEP,
                       metavar="TOKENS",
                       help="every server with the plugin's prefill-capped scheduler, as `s4kv serve` runs it: while "
                            "requests decode, a step takes at most TOKENS prompt tokens (runtime/plugin/scheduler.py; "
                            f"default {DEFAULT_PREFILL_TOKENS_PER_STEP}); 0 runs vLLM's own scheduler")
    group.add_argument("--client-processes", type=int, default=min(4, os.cpu_count() or 1), metavar="N",
                       help="client processes the streams are spread over, each with its own event loop and "
                            "openai client (default: 4, at most the CPU count): one process parsing every streamed "
                            "chunk falls behind at a few thousand tokens/s, which its loop lag column shows")
    group.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                       help="one more argument for the server (repeat; e.g. the CPU engine's settings)")


@dataclass(frozen=True)
class SweepPoint:
    """One load level: ``kind`` "rate" (Poisson arrivals, requests/s; inf sends all at once) or "concurrency"."""

    kind: str
    value: float
    num_requests: int

    @property
    def label(self) -> str:
        if self.kind == "rate":
            return "rate inf" if math.isinf(self.value) else f"rate {self.value:g}/s"
        return f"concurrency {self.value:g}"


@dataclass
class RequestRecord:
    """What one streamed request measured, in seconds from its send."""

    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)  # per token: a chunk's gap divided by its token count
    error: str | None = None


def parse_numbers(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma list of numbers, got {text!r}") from None
    if any(not v > 0 for v in values):
        raise ValueError(f"{what} must be positive, got {text!r}")
    return values


def sweep_points(rates: list[float], concurrency: list[float], num_requests: int) -> list[SweepPoint]:
    return ([SweepPoint("rate", r, num_requests) for r in rates]
            + [SweepPoint("concurrency", c, num_requests) for c in concurrency])


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default) of a non-empty list, else None."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_point(point: SweepPoint, records: list[RequestRecord], wall_s: float,
                    gauges: list[tuple[float, float]], engine_itl: dict[float, float] | None = None,
                    loop_lags: list[float] | None = None) -> dict:
    """The numbers a point reports from its requests, the gauge samples (running, waiting), the engine's
    inter-token latency histogram over the point (cumulative counts per bucket bound) and the client processes'
    event-loop lags."""
    ok = [r for r in records if r.error is None]
    output_tokens = sum(r.output_tokens for r in ok)
    itl = [gap for r in ok for gap in r.itl_s]
    stats = {}
    for name, values in (("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]),
                         ("itl", itl), ("e2e", [r.e2e_s for r in ok if r.e2e_s is not None])):
        stats[f"{name}_p50_s"] = percentile(values, 50)
        stats[f"{name}_p99_s"] = percentile(values, 99)
    running = [g[0] for g in gauges]
    waiting = [g[1] for g in gauges]
    errors = [r.error for r in records if r.error is not None]
    return {"kind": point.kind, "value": point.value, "label": point.label, "requests": len(records),
            "failed": len(errors), "first_error": errors[0] if errors else None, "wall_s": wall_s,
            "output_tokens": output_tokens, "output_tok_s": output_tokens / wall_s if wall_s > 0 else None,
            "request_s": len(ok) / wall_s if wall_s > 0 else None, **stats,
            "engine_itl_count": max((engine_itl or {}).values(), default=None),
            "engine_itl_p50_le_s": bucket_percentile(engine_itl or {}, 50),
            "engine_itl_p99_le_s": bucket_percentile(engine_itl or {}, 99),
            "client_lag_p99_s": percentile(loop_lags or [], 99),
            "running_mean": sum(running) / len(running) if running else None,
            "running_max": max(running) if running else None,
            "waiting_max": max(waiting) if waiting else None}


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Distinct random token ids per request (no shared prefix, so prefix caching skips nothing)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num)]


async def _stream_one(client, prompt: list[int], output_len: int) -> RequestRecord:
    record = RequestRecord()
    start = time.perf_counter()
    last = start
    try:
        # the token ids travel in extra_body, which the client sends as is: as `prompt=` the client's parameter
        # transform walks every id (about 15 ms of CPU for 2,048 ids), stalling the event loop that every open
        # stream's timing shares, once per request sent
        stream = await client.completions.create(
            model=SERVED_NAME, prompt=[], max_tokens=output_len, temperature=0.0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"prompt": prompt, "ignore_eos": True, "min_tokens": output_len, "return_token_ids": True})
        async for chunk in stream:
            now = time.perf_counter()
            tokens = sum(len(choice.token_ids or []) for choice in chunk.choices) if chunk.choices else 0
            if tokens == 0:
                continue
            if record.ttft_s is None:
                record.ttft_s = now - start
            else:
                record.itl_s.extend([(now - last) / tokens] * tokens)
            record.output_tokens += tokens
            last = now
        record.e2e_s = time.perf_counter() - start
        if record.output_tokens != output_len:
            record.error = f"{record.output_tokens} output tokens streamed, {output_len} asked for"
    except Exception as exc:  # one failed request is counted, not fatal to the point
        record.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return record


async def _sample_gauges(metrics_url: str, samples: list[tuple[float, float]], started: threading.Event,
                         stop: asyncio.Event) -> None:
    """(running, waiting) every METRICS_PERIOD_S from the clients' start (not their spawn) until stopped."""
    loop = asyncio.get_running_loop()
    while not started.is_set() and not stop.is_set():
        await asyncio.sleep(0.01)
    while not stop.is_set():
        try:
            text = await loop.run_in_executor(None, _read_url, metrics_url)
            values = {"running": 0.0, "waiting": 0.0}
            for name, value in GAUGE_LINE.findall(text):
                values[name] += float(value)
            samples.append((values["running"], values["waiting"]))
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), METRICS_PERIOD_S)
        except asyncio.TimeoutError:
            pass


async def _sample_loop_lag(lags: list[float], stop: asyncio.Event) -> None:
    """How late a client process's event loop wakes from a LOOP_LAG_PERIOD_S sleep: a stream's chunk waits as long
    to be timed, so a lag near the ITL says the client, not the server, made the gap."""
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(LOOP_LAG_PERIOD_S)
        lags.append(max(0.0, time.perf_counter() - start - LOOP_LAG_PERIOD_S))


def _read_url(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


@dataclass(frozen=True)
class ClientShare:
    """One client process's part of a point: which requests (indices into the point's prompts), when each is sent
    (seconds after the common start; None: as soon as an in-flight slot frees) and how many it keeps in flight
    (None: no limit)."""

    indices: tuple[int, ...]
    offsets: tuple[float, ...] | None
    in_flight: int | None


def client_shares(point: SweepPoint, processes: int, seed: int) -> list[ClientShare]:
    """Split a point's requests over client processes, round robin. A rate point keeps one Poisson schedule for
    all of them (the first request at 0), each request sent by its process at its time; a concurrency point gives
    each process an even share of the in-flight count (at most one process per slot)."""
    n = point.num_requests
    if point.kind == "rate":
        rng = random.Random(seed)
        offsets, t = [], 0.0
        for _ in range(n):
            offsets.append(t)
            t += 0.0 if math.isinf(point.value) else rng.expovariate(point.value)
        return [ClientShare(tuple(range(w, n, processes)), tuple(offsets[w::processes]), None)
                for w in range(min(processes, n))]
    slots = int(point.value)
    used = min(processes, slots, n)
    return [ClientShare(tuple(range(w, n, used)), None, slots // used + (1 if w < slots % used else 0))
            for w in range(used)]


def _client_process(conn, base_url: str, prompts: list[list[int]], share: ClientShare, output_len: int) -> None:
    """A client process: its own event loop and openai client; reports ready, waits for the common start time
    (time.monotonic(), shared by the processes of one machine), streams its share (``prompts``: the share's own, in
    its order) and sends back its records, its event-loop lags and when it finished."""
    from openai import AsyncOpenAI

    async def main() -> None:
        client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="not-needed", max_retries=0, timeout=1800)
        client.completions  # noqa: B018  # its lazy import (about 0.5 s) before the start, not inside the point
        conn.send("ready")
        start = conn.recv()
        lags: list[float] = []
        stop = asyncio.Event()
        lag_sampler = asyncio.create_task(_sample_loop_lag(lags, stop))
        limit = asyncio.Semaphore(share.in_flight) if share.in_flight else None

        async def send(offset: float | None, prompt: list[int]) -> RequestRecord:
            if offset is not None:
                await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            if limit is None:
                return await _stream_one(client, prompt, output_len)
            async with limit:
                return await _stream_one(client, prompt, output_len)

        offsets = share.offsets or (None,) * len(share.indices)
        records = await asyncio.gather(*(send(o, prompt) for o, prompt in zip(offsets, prompts)))
        finished = time.monotonic()
        stop.set()
        await lag_sampler
        await client.close()
        conn.send(([asdict(r) for r in records], lags, finished))

    asyncio.run(main())


def _receive(link, worker):
    """The client process's next message, or a RuntimeError naming its exit code if it died (its traceback went to
    this process's stderr)."""
    try:
        return link.recv()
    except EOFError:
        worker.join(timeout=10)
        raise RuntimeError(f"a client process exited with code {worker.exitcode} before reporting") from None


def drive_clients(base_url: str, point: SweepPoint, prompts: list[list[int]], output_len: int, seed: int,
                  processes: int, started: threading.Event | None = None
                  ) -> tuple[list[RequestRecord], list[float], float, float]:
    """Run one point from ``processes`` client processes (spawned, so no state of this one is inherited; ``started``
    is set when they are sent the start); returns every request's record, every process's event-loop lags, and when
    the point started and ended (time.monotonic())."""
    ctx = multiprocessing.get_context("spawn")
    shares = client_shares(point, processes, seed)
    links, workers = [], []
    try:
        for share in shares:
            parent, child = ctx.Pipe()
            own_prompts = [prompts[i] for i in share.indices]
            worker = ctx.Process(target=_client_process, args=(child, base_url, own_prompts, share, output_len),
                                 daemon=True)
            worker.start()
            child.close()
            links.append(parent)
            workers.append(worker)
        for link, worker in zip(links, workers):
            if not link.poll(CLIENT_START_S):
                raise RuntimeError(f"a client process did not start within {CLIENT_START_S} s")
            _receive(link, worker)  # "ready"
        start = time.monotonic() + 0.05  # a moment for every process to receive it
        for link in links:
            link.send(start)
        if started is not None:
            started.set()
        results = [_receive(link, worker) for link, worker in zip(links, workers)]
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    records = [RequestRecord(**r) for done, _, _ in results for r in done]
    lags = [lag for _, process_lags, _ in results for lag in process_lags]
    return records, lags, start, max(finished for _, _, finished in results)


async def run_point(base_url: str, point: SweepPoint, prompts: list[list[int]], output_len: int, seed: int,
                    client_processes: int) -> dict:
    """Drive the server at one load level from ``client_processes`` processes; returns summarize_point's
    numbers."""
    loop = asyncio.get_running_loop()
    itl_before = histogram_buckets(await loop.run_in_executor(None, _read_url, f"{base_url}/metrics"),
                                   ENGINE_ITL_FAMILY)
    gauges: list[tuple[float, float]] = []
    started, stop = threading.Event(), asyncio.Event()
    sampler = asyncio.create_task(_sample_gauges(f"{base_url}/metrics", gauges, started, stop))
    try:
        records, lags, start, end = await loop.run_in_executor(
            None, drive_clients, base_url, point, prompts, output_len, seed, client_processes, started)
    finally:
        stop.set()
        await sampler
    itl_after = histogram_buckets(await loop.run_in_executor(None, _read_url, f"{base_url}/metrics"),
                                  ENGINE_ITL_FAMILY)
    engine_itl = {bound: count - itl_before.get(bound, 0.0) for bound, count in itl_after.items()}
    return summarize_point(point, records, end - start, gauges, engine_itl, lags)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_max_num_seqs(fmt: KVFormat, model_dir: Path, args: argparse.Namespace) -> int:
    """--max-num-seqs, for int4_kivi capped by its staging pool as its deployment caps it where the KV memory comes
    from the share (``KVFormat.deployed_max_num_seqs``); --kv-cache-memory-bytes sizes the cache apart from the
    pool, and then every configuration runs at --max-num-seqs."""
    if args.kv_cache_memory_bytes is not None:
        return args.max_num_seqs
    return fmt.deployed_max_num_seqs(str(model_dir), args.max_num_seqs, gpu_total_bytes(), args.gpu_memory_utilization)


def server_command(fmt: KVFormat, model_dir: Path, port: int, args: argparse.Namespace,
                   max_num_seqs: int) -> list[str]:
    """argv of `s4kv serve`'s server (vLLM's OpenAI server with the plugin's checks and its CUDA-graph sizes) for one
    configuration, with dummy weights and no tokenizer (token-id prompts), prefix caching on as vLLM's default."""
    command = [sys.executable, "-m", SERVER_MODULE, "--model", str(model_dir), "--served-model-name", SERVED_NAME,
               "--host", "127.0.0.1", "--port", str(port), "--load-format", args.load_format,
               "--skip-tokenizer-init", "--seed", "0",
               "--kv-cache-dtype", fmt.kv_cache_dtype, "--attention-backend", fmt.attention_backend,
               "--gpu-memory-utilization", str(args.gpu_memory_utilization),
               "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(args.max_model_len)]
    if args.kv_cache_memory_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    additional_config = dict(fmt.additional_config or {})
    scheduler_flags, scheduler_config = prefill_capped_scheduler_settings(args.prefill_tokens_per_step)
    command += scheduler_flags
    additional_config.update(scheduler_config)
    if additional_config:
        command += ["--additional-config", json.dumps(additional_config)]
    return command + list(args.server_arg)


def gpu_free_bytes() -> int | None:
    """Free memory of the first visible GPU, read with nvidia-smi (this process holds no CUDA context); None where
    there is no NVIDIA GPU or it cannot be read."""
    return _gpu_memory_bytes("free")


def gpu_total_bytes() -> int | None:
    """Total memory of the first visible GPU, as gpu_free_bytes reads it."""
    return _gpu_memory_bytes("total")


def _gpu_memory_bytes(field: str) -> int | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    command = ["nvidia-smi", f"--query-gpu=memory.{field}", "--format=csv,noheader,nounits"]
    if visible.isdigit():
        command += ["-i", visible]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout.split()
        return int(float(out[0]) * 2**20)  # MiB
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None


def server_waves(formats: list[str], server_bytes: int, free_bytes: int | None) -> list[list[str]]:
    """The configurations in waves of servers that fit the GPU side by side (each ``server_bytes``), in the order
    given and as even as the count allows; one wave where the free memory is unknown. A server that alone does not
    fit is a wave of its own (its start then says why)."""
    per_wave = len(formats) if free_bytes is None else max(1, free_bytes // server_bytes)
    count = math.ceil(len(formats) / per_wave)
    size = math.ceil(len(formats) / count)
    return [formats[i:i + size] for i in range(0, len(formats), size)]


def stop_server(server: subprocess.Popen) -> None:
    """SIGINT first (vLLM shuts its engine down cleanly), then the whole process group."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        if server.poll() is not None:
            break
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            continue
    try:  # the engine core and workers of the group, if the server left them behind
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class Server:
    """One configuration's server process and its record (filled as it runs)."""

    fmt_name: str
    process: subprocess.Popen
    base_url: str
    log_path: Path
    started: float
    record: dict


def start_server(fmt_name: str, model_dir: Path, args: argparse.Namespace, logs: Path) -> Server:
    fmt = FORMATS[fmt_name]
    port = free_port()
    log_path = logs / f"serve-{fmt_name}.log"
    env = dict(os.environ)
    choose_model_runner(fmt.additional_config, env)  # as `s4kv serve` does: int4_kivi on vLLM's V1 runner
    max_num_seqs = server_max_num_seqs(fmt, model_dir, args)
    with open(log_path, "w") as log:
        process = subprocess.Popen(server_command(fmt, model_dir, port, args, max_num_seqs), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True, env=env)
    record = {"format": fmt_name, "label": fmt.label, "log": str(log_path), "max_num_seqs": max_num_seqs,
              "points": []}
    return Server(fmt_name, process, f"http://127.0.0.1:{port}", log_path, time.monotonic(), record)


def await_ready(server: Server, deadline: float | None) -> bool:
    """Wait for /health; on failure the record says why. True when the server is ready."""
    try:
        limit = (deadline - time.monotonic()) if deadline else 1800
        wait_until_healthy(server.base_url, server.process, max(1.0, limit), poll_s=1.0)
    except (RuntimeError, TimeoutError) as exc:
        server.record.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        return False
    server.record["startup_s"] = time.monotonic() - server.started
    return True


def sweep(servers: list[Server], vocab_size: int, args: argparse.Namespace, deadline: float | None) -> None:
    """Warm-up requests on each server, then the sweep point by point, each point on every server in turn: a
    deadline then cuts the heaviest points of every configuration, not whole configurations. A point that would
    start past the deadline is skipped; a server that breaks keeps what it measured."""
    live = []
    for server in servers:
        try:
            warm = SweepPoint("concurrency", WARMUP_REQUESTS, WARMUP_REQUESTS)
            warm_prompts = random_prompts(WARMUP_REQUESTS, args.input_len, vocab_size, seed=999)
            server.record["warmup"] = asyncio.run(run_point(server.base_url, warm, warm_prompts, args.output_len,
                                                            0, args.client_processes))
            live.append(server)
        except Exception as exc:
            server.record.update(status="failed", error=f"warm-up: {type(exc).__name__}: {exc}")
    for i, point in enumerate(sweep_points(args.rate_values, args.concurrency_values, args.requests)):
        prompts = random_prompts(point.num_requests, args.input_len, vocab_size, seed=1000 + i)
        for server in list(live):
            if deadline is not None and time.monotonic() > deadline:
                server.record["points"].append({**asdict(point), "label": point.label, "skipped": "time budget"})
                continue
            try:
                result = asyncio.run(run_point(server.base_url, point, prompts, args.output_len, seed=i,
                                               client_processes=args.client_processes))
            except Exception as exc:
                server.record.update(status="failed", error=f"{point.label}: {type(exc).__name__}: {exc}")
                live.remove(server)
                continue
            server.record["points"].append(result)
            print(f"[serve] {server.fmt_name:10s} {describe_point(result)}", flush=True)
    for server in live:
        server.record["status"] = "ok"


def finish(server: Server) -> dict:
    """Stop the server; the record with its KV capacity and, on failure, its log's tail."""
    stop_server(server.process)
    text = server.log_path.read_text(errors="replace")
    record = server.record
    record["kv_cache_tokens"] = bench_report.parse_kv_cache_tokens(text)
    record["jit_compiled"] = bench_report.parse_jit_compiled(text)
    if record.get("status") == "failed":
        record["error"] += "\nlog tail:\n" + "\n".join(text.splitlines()[-15:])
    return record


def describe_point(p: dict) -> str:
    if p.get("skipped"):
        return f"{p['label']}: skipped ({p['skipped']})"
    ms = lambda v: "-" if v is None else f"{v * 1e3:,.0f} ms"  # noqa: E731
    return (f"{p['label']:16s} {p['output_tok_s'] or 0:8,.0f} tok/s  TTFT p50 {ms(p['ttft_p50_s'])} p99 "
            f"{ms(p['ttft_p99_s'])}  ITL p50 {ms(p['itl_p50_s'])} p99 {ms(p['itl_p99_s'])} (engine <= "
            f"{ms(p.get('engine_itl_p99_le_s'))}, client lag {ms(p.get('client_lag_p99_s'))})  E2E p99 "
            f"{ms(p['e2e_p99_s'])}  running mean {p['running_mean'] or 0:.0f} max {p['running_max'] or 0:.0f}"
            + (f"  FAILED {p['failed']}: {p['first_error']}" if p["failed"] else ""))


def render_markdown(doc: dict) -> str:
    """One table per sweep: a row per (point, configuration)."""
    meta = doc["meta"]
    lines = [f"Serving, {meta.get('model', '')}, {meta.get('input_len')} in / {meta.get('output_len')} out tokens, "
             f"{meta.get('requests')} requests per point, {kv_budget(meta)}, "
             f"max_num_seqs {meta.get('max_num_seqs')}{scheduler_note(meta)}; {meta.get('date', '')}", ""]
    lines.append("| configuration | KV capacity (tokens) | max_num_seqs | server start | Triton kernels compiled "
                 "after start-up (warm-up requests included) |")
    lines.append("|---|---|---|---|---|")
    for run in doc["runs"]:
        kv = f"{run['kv_cache_tokens']:,}" if run.get("kv_cache_tokens") else "-"
        seqs = run.get("max_num_seqs") or meta.get("max_num_seqs")  # runs saved before it was recorded have none
        start = f"{run['startup_s']:.0f} s" if run.get("startup_s") else run.get("status", "-")
        compiled = run.get("jit_compiled")  # runs saved before it was recorded have none
        jit = "-" if compiled is None else ", ".join(f"`{name}`" for name in compiled) or "none"
        lines.append(f"| {run['label']} | {kv} | {seqs} | {start} | {jit} |")
    ms = lambda v: "-" if v is None else f"{v * 1e3:,.0f}"  # noqa: E731
    bucket = lambda v: "-" if v is None else "> 80 s" if math.isinf(v) else f"<= {v * 1e3:,.0f}"  # noqa: E731
    for kind, title in (("rate", "request rate (Poisson arrivals)"), ("concurrency", "fixed concurrency")):
        lines += ["", f"{title}: TTFT / ITL / E2E in ms (engine ITL p99: the bucket of vLLM's own histogram, timed "
                  "where the engine emits each token, that holds the p99; client lag p99: how late the clients' "
                  "event loops woke, a delay any gap they timed may include)", "",
                  "| load | configuration | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | engine ITL p99 | "
                  "client lag p99 | E2E p50 | E2E p99 | running mean / max | waiting max | failed |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        values = sorted({p["value"] for run in doc["runs"] for p in run.get("points", []) if p["kind"] == kind})
        for value in values:
            for run in doc["runs"]:
                p = next((p for p in run.get("points", []) if p["kind"] == kind and p["value"] == value), None)
                if p is None:
                    continue
                if p.get("skipped"):
                    lines.append(f"| {p['label']} | {run['label']} | skipped: {p['skipped']} |" + " |" * 11)
                    continue
                lines.append(
                    f"| {p['label']} | {run['label']} | {p['output_tok_s'] or 0:,.0f} | {ms(p['ttft_p50_s'])} | "
                    f"{ms(p['ttft_p99_s'])} | {ms(p['itl_p50_s'])} | {ms(p['itl_p99_s'])} | "
                    f"{bucket(p.get('engine_itl_p99_le_s'))} | {ms(p.get('client_lag_p99_s'))} | "
                    f"{ms(p['e2e_p50_s'])} | "
                    f"{ms(p['e2e_p99_s'])} | {p['running_mean'] or 0:.0f} / {p['running_max'] or 0:.0f} | "
                    f"{p['waiting_max'] or 0:.0f} | {p['failed']} |")
    sustained = sustained_rates(doc)
    if sustained:
        lines += ["", f"highest request rate with p99 TTFT under {TTFT_TARGET_S:g} s: " + "; ".join(
            f"{FORMATS[f].label} {'none' if r is None else f'{r:g}/s'}" for f, r in sustained.items())]
    return "\n".join(lines) + "\n"


def kv_budget(meta: dict) -> str:
    if meta.get("kv_cache_memory_bytes"):
        return f"KV cache {meta['kv_cache_memory_bytes'] / 2**30:.2f} GiB for every configuration"
    return f"gmu {meta.get('gpu_memory_utilization')}"


def scheduler_note(meta: dict) -> str:
    cap = meta.get("prefill_tokens_per_step")
    return (f", the prefill-capped scheduler ({cap} prompt tokens a step that decodes)" if cap
            else ", vLLM's scheduler")


def sustained_rates(doc: dict) -> dict[str, float | None]:
    """Per configuration, the highest swept rate (every lower one too) whose p99 TTFT stays under the target."""
    out = {}
    for run in doc["runs"]:
        rates = sorted((p for p in run.get("points", []) if p["kind"] == "rate" and not p.get("skipped")),
                       key=lambda p: p["value"])
        if not rates:
            continue
        best = None
        for p in rates:
            if p["failed"] or p["ttft_p99_s"] is None or p["ttft_p99_s"] >= TTFT_TARGET_S:
                break
            best = p["value"]
        out[run["format"]] = best
    return out


def render_svg(doc: dict) -> str:
    """Three line panels: p99 ITL and p99 TTFT against the request rate, output tok/s against concurrency."""
    from .plot import COLORS

    panels = [("rate", "itl_p99_s", "p99 inter-token latency (ms) vs request rate", 1e3),
              ("rate", "ttft_p99_s", "p99 time to first token (ms) vs request rate", 1e3),
              ("concurrency", "output_tok_s", "output tokens/s vs concurrency", 1.0)]
    w, h, margin = 360, 260, 50
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * len(panels)}" height="{h + 40}" '
             'font-family="sans-serif">']
    for i, (kind, key, title, unit) in enumerate(panels):
        x0 = i * w
        series = {}
        for run in doc["runs"]:
            pts = sorted((p["value"], p[key] * unit) for p in run.get("points", [])
                         if p["kind"] == kind and not p.get("skipped") and p.get(key) is not None
                         and not math.isinf(p["value"]))
            if pts:
                series[run["format"]] = pts
        parts.append(f'<text x="{x0 + w / 2}" y="16" font-size="12" text-anchor="middle">{escape(title)}</text>')
        if not series:
            continue
        xs = [x for pts in series.values() for x, _ in pts]
        ys = [y for pts in series.values() for _, y in pts]
        x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        y_hi = max(ys) * 1.1 or 1.0
        sx = lambda x: x0 + margin + (x - x_lo) / (x_hi - x_lo) * (w - 1.5 * margin)  # noqa: E731
        sy = lambda y: 30 + (h - margin) * (1 - y / y_hi)  # noqa: E731
        parts.append(f'<line x1="{x0 + margin}" y1="{sy(0):.1f}" x2="{x0 + w - margin / 2}" y2="{sy(0):.1f}" '
                     'stroke="black"/>')
        parts.append(f'<text x="{x0 + margin - 4}" y="{sy(y_hi / 1.1):.1f}" font-size="10" '
                     f'text-anchor="end">{y_hi / 1.1:,.0f}</text>')
        for x in sorted(set(xs)):
            parts.append(f'<text x="{sx(x):.1f}" y="{sy(0) + 14:.1f}" font-size="10" '
                         f'text-anchor="middle">{x:g}</text>')
        for fmt, pts in series.items():
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
            parts.append(f'<polyline class="series" data-format="{fmt}" data-panel="{key}" points="{path}" '
                         f'fill="none" stroke="{COLORS.get(fmt, "#777777")}" stroke-width="2"/>')
    for j, run in enumerate(doc["runs"]):
        color = COLORS.get(run["format"], "#777777")
        parts.append(f'<rect x="{10 + j * 180}" y="{h + 22}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{24 + j * 180}" y="{h + 31}" font-size="11">{escape(run["label"])}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_outputs(doc: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(doc, indent=1))
    table = render_markdown(doc)
    (out / "serve.md").write_text(table)
    (out / "serve.svg").write_text(render_svg(doc))
    print("\n" + table)


def run(args: argparse.Namespace) -> int:
    """`s4kv bench --serve`: one server per configuration, in the order given; results after each one."""
    from .runner import prepare_model

    if args.merge:
        runs, meta = [], {}
        for path in args.merge:
            part = json.loads(Path(path).read_text())
            meta = meta or part["meta"]
            runs += part["runs"]
        write_outputs({"meta": meta, "runs": runs}, args.out)
        return 0
    try:
        formats = parse_names(args.configs, FORMATS, "configs", all_names=list(SERVE_FORMATS), keep_order=True)
        args.rate_values = parse_numbers(args.rates, "--rates")
        args.concurrency_values = parse_numbers(args.concurrency, "--concurrency")
        if args.requests < 1 or args.input_len < 1 or args.output_len < 1:
            raise ValueError("--requests, --input-len and --output-len must be at least 1")
        if args.client_processes < 1:
            raise ValueError("--client-processes must be at least 1")
        prefill_capped_scheduler_settings(args.prefill_tokens_per_step)  # refuses a negative cap before any start
        if args.input_len + args.output_len > args.max_model_len:
            raise ValueError(f"--input-len + --output-len ({args.input_len + args.output_len}) exceeds "
                             f"--max-model-len {args.max_model_len}")
    except ValueError as err:
        print(f"s4kv bench --serve: {err}", file=sys.stderr)
        return 2
    points = sweep_points(args.rate_values, args.concurrency_values, args.requests)
    print(f"[serve] {len(formats)} servers ({', '.join(formats)}), each: " + ", ".join(p.label for p in points))
    if args.dry_run:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    model_dir = prepare_model(args.model, args.out / "model")
    model_config = json.loads((model_dir / "config.json").read_text())
    vocab_size = model_config["vocab_size"]
    doc = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "command": " ".join(["s4kv", *sys.argv[1:]]), "model": str(args.model),
                    "input_len": args.input_len, "output_len": args.output_len, "requests": args.requests,
                    "gpu_memory_utilization": args.gpu_memory_utilization, "max_num_seqs": args.max_num_seqs,
                    "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
                    "max_model_len": args.max_model_len, "prefill_tokens_per_step": args.prefill_tokens_per_step,
                    "client_processes": args.client_processes},
           "runs": []}
    deadline = time.monotonic() + args.budget_s if args.budget_s is not None else None

    def save(record: dict) -> None:
        if record.get("status") != "ok":
            print(f"[serve] {record['format']}: {record.get('status')}: {record.get('error', '').splitlines()[0]}",
                  flush=True)
        doc["runs"].append(record)
        (args.out / "serve.json").write_text(json.dumps(doc, indent=1))

    if args.kv_cache_memory_bytes is not None:
        # The KV budget is fixed, so no server's memory profiling can see another's allocations: start the servers
        # of a wave at once (one start's wait instead of one per configuration), then load one server at a time
        # while the others idle. A wave holds as many servers as fit the GPU's free memory side by side.
        server_bytes = (model_shapes.from_config(model_config).weight_bytes + args.kv_cache_memory_bytes
                        + SERVER_OVERHEAD_BYTES)
        free = gpu_free_bytes()
        waves = server_waves(formats, server_bytes, free)
        if len(waves) > 1:
            print(f"[serve] {len(waves)} waves of servers ({', '.join(' + '.join(w) for w in waves)}): about "
                  f"{server_bytes / 2**30:.0f} GiB a server, {free / 2**30:.0f} GiB free", flush=True)
    else:
        waves = [[fmt] for fmt in formats]  # one at a time: each server's memory profiling sees a free GPU
    for number, wave in enumerate(waves):
        if deadline is not None and deadline - time.monotonic() < MIN_CONFIG_S:
            for fmt in wave:
                save({"format": fmt, "label": FORMATS[fmt].label, "status": "skipped", "error": "time budget",
                      "points": []})
            continue
        # each wave an even share of the time left, so a late wave is not starved by an early one's sweep
        wave_deadline = None if deadline is None else (
            time.monotonic() + (deadline - time.monotonic()) / (len(waves) - number))
        servers = [start_server(fmt, model_dir, args, logs) for fmt in wave]
        try:
            ready = [server for server in servers if await_ready(server, wave_deadline)]
            sweep(ready, vocab_size, args, wave_deadline)
        finally:
            for server in servers:
                save(finish(server))
    write_outputs(doc, args.out)
    return 1 if any(r["status"] == "failed" for r in doc["runs"]) else 0
