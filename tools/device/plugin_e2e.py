#!/usr/bin/env python3
"""S4 KV inside the real vLLM 0.26.0 engine and OpenAI server on the GPU, in one bounded run (< 8 minutes).

Run it through tools/device/plugin_e2e.sh (installs the offline vLLM bundle and this package's entry point first).
Phases, each with its own deadline; the summary is printed and written to $OUT/device_plugin_e2e.json even when
a phase fails or runs out of time:

1. capacity (alone on the GPU): "GPU KV cache size: N tokens" for bf16, fp8, vLLM's int4_per_token_head
   (TRITON_ATTN) and both S4 KV schemes, on the Qwen2.5-7B shape (configs/, dummy weights), same memory setting.
2. engine matrix (8 workers side by side): model runner V1 and V2 x CUDA graphs on and --enforce-eager x the tiny
   Qwen2- and Llama-3-shaped models (models/, trained to memorize answers), each with bf16, int4_kivi, int4_saw and
   int4_saw under n-gram speculative decoding: answers vs bf16, a long prompt in chunked prefill, a prefix-cache
   hit, preemption under KV pressure, accepted drafts.
3. servers (side by side with 2): `s4kv serve` (int4_kivi, Qwen2 shape) and a raw `vllm serve ... --attention-backend
   CUSTOM` (int4_saw, Llama-3 shape), exercised with the official openai client.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from s4kv.runtime.bench.report import KV_CACHE_LINE
from s4kv.runtime.schemes import SCHEMES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the engine-matrix runs of S4 KV: both schemes, and int4_saw under n-gram speculative decoding (3 drafts; vLLM
# captures the verification batches, 4 query tokens per request, in full CUDA graphs). int4_kivi refuses drafts.
MATRIX_KINDS = (*SCHEMES, "int4_saw+ngram")
S4KV_ARGS = {"kv_cache_dtype": "int4_per_token_head", "attention_config": {"backend": "CUSTOM"}}
CAPACITY_MODEL_CONFIG = os.path.join(REPO, "configs", "qwen2.5-7b-instruct.json")


# ---------------------------------------------------------------------------------------------------------------
# helpers shared by the phases
# ---------------------------------------------------------------------------------------------------------------
def kv_kwargs(kind: str) -> dict:
    """Engine kwargs for one KV format: bf16, fp8, int4_per_token_head (vLLM's own) or an S4 KV scheme, the
    latter optionally with speculative decoding (``int4_saw+ngram``)."""
    from s4kv.runtime.bundled_models import NGRAM_DRAFTS, SPECULATIVE_SUFFIX

    if kind.endswith(SPECULATIVE_SUFFIX):
        return dict(kv_kwargs(kind.removesuffix(SPECULATIVE_SUFFIX)), speculative_config=NGRAM_DRAFTS)
    if kind == "bf16":
        return {}
    if kind in ("fp8", "int4_per_token_head"):
        return {"kv_cache_dtype": kind}
    return dict(S4KV_ARGS, additional_config={"s4kv": {"scheme": kind}})


def tiny_models() -> dict[str, str]:
    from s4kv.runtime.bundled_models import LLAMA3, QWEN2, bundled_model_dir

    return {"qwen2": bundled_model_dir(QWEN2), "llama3": bundled_model_dir(LLAMA3)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_child(args: list[str], env: dict, timeout: float, log_path: str) -> dict:
    """Run this script in a subprocess (a phase worker). Its 'RESULT {json}' lines, merged, are the result: a
    worker prints one per finished unit of work, so what finished survives a worker that runs out of time."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        try:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    text = open(log_path).read()
    result: dict = {}
    for line in text.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[7:]))
    result.update(exit=code, seconds=round(time.monotonic() - start, 1), log=os.path.basename(log_path))
    if code != 0:
        result["tail"] = text[-3000:]
    return result


# ---------------------------------------------------------------------------------------------------------------
# phase 1: capacity (one process per KV format, one after another, nothing else on the GPU)
# ---------------------------------------------------------------------------------------------------------------
CAPACITY_KINDS = ("bf16", "fp8", "int4_per_token_head", *SCHEMES)


def capacity_worker(kind: str, out: str) -> dict:
    from vllm import LLM

    model_dir = os.path.join(out, "qwen2.5-7b-shape")
    os.makedirs(model_dir, exist_ok=True)
    shutil.copy(CAPACITY_MODEL_CONFIG, os.path.join(model_dir, "config.json"))
    llm = LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              gpu_memory_utilization=0.9, max_model_len=8192, **kv_kwargs(kind))
    cache = llm.llm_engine.engine_core.engine_core.vllm_config.cache_config
    return {"tokens": cache.num_gpu_blocks * cache.block_size, "block_size": cache.block_size}


def capacity_phase(out: str, env: dict, deadline: float) -> dict:
    results = {}
    for kind in CAPACITY_KINDS:
        log_path = os.path.join(out, f"capacity_{kind}.log")
        results[kind] = run_child(["capacity", "--kind", kind, "--out", out], env,
                                  max(20, min(60, deadline - time.monotonic())), log_path)
        printed = KV_CACHE_LINE.findall(open(log_path).read())
        results[kind]["vllm_line"] = f"GPU KV cache size: {printed[-1]} tokens" if printed else None
        print(f"[capacity] {kind}: {results[kind].get('vllm_line') or results[kind].get('tail', '')[-300:]}",
              flush=True)
    return results


# ---------------------------------------------------------------------------------------------------------------
# phase 2: engine matrix (one worker per model runner x graph mode)
# ---------------------------------------------------------------------------------------------------------------
def long_context(turns: int) -> str:
    from s4kv.runtime.bundled_models import FACTS, chat_text

    return "".join(chat_text(*FACTS[i % len(FACTS)]) for i in range(turns))


def attention_impls(model) -> list[str]:
    return sorted({type(module.impl).__name__ for module in model.modules() if hasattr(module, "impl")})


def engine_checks(model: str, kind: str, eager: bool) -> dict:
    from vllm import LLM, SamplingParams

    from s4kv.runtime.bundled_models import FACTS, chat_text

    with open(os.path.join(model, "config.json")) as handle:
        config = json.load(handle)
    bytes_per_token = config["num_hidden_layers"] * config["num_key_value_heads"] * (512 if kind == "bf16" else 136)
    # (n-gram drafts need no draft model and no KV of their own: the budget stays 48 pages)
    llm = LLM(model, dtype="bfloat16", enforce_eager=eager, max_model_len=1024, max_num_seqs=32,
              max_num_batched_tokens=256, enable_chunked_prefill=True, enable_prefix_caching=True,
              gpu_memory_utilization=0.08, kv_cache_memory_bytes=48 * 128 * bytes_per_token,  # 48 pages of 128
              disable_log_stats=False, seed=0,
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}, **kv_kwargs(kind))
    greedy = SamplingParams(temperature=0, max_tokens=24)
    prompts = [chat_text(q) for q, _ in FACTS]
    medium = long_context(7) + chat_text(FACTS[9][0])  # ~160 tokens: a page closes in prefill
    long = long_context(40) + chat_text(FACTS[3][0])  # ~900 tokens: chunked prefill over 7 pages
    outs = llm.generate(prompts + [medium, long], greedy, use_tqdm=False)
    repeat = llm.generate([long], greedy, use_tqdm=False)[0]
    # KV pressure: 24 copies of the medium prompt generating 300 tokens need 1 shared + 24 x 3 pages of the 48:
    # vLLM must preempt (and recompute) some of them.
    pressure = llm.generate([medium] * 24, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
                            use_tqdm=False)
    single = list(outs[-2].outputs[0].token_ids)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    result = {
        "answers": [o.outputs[0].text.strip() for o in outs[: len(FACTS)]],
        "correct": sum(o.outputs[0].text.strip() == a for o, (_, a) in zip(outs[: len(FACTS)], FACTS, strict=True)),
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "long_prompt_tokens": len(outs[-1].prompt_token_ids),
        "prefix_cached_tokens": repeat.num_cached_tokens,
        "prefix_repeat_same": list(repeat.outputs[0].token_ids) == list(outs[-1].outputs[0].token_ids),
        "pressure_all_same": len({tuple(o.outputs[0].token_ids) for o in pressure}) == 1,
        "pressure_matches_single": list(pressure[0].outputs[0].token_ids[: len(single)]) == single,
        "preemptions": metrics.get("vllm:num_preemptions"),
        "accepted_draft_tokens": metrics.get("vllm:spec_decode_num_accepted_tokens"),
        "impls": llm.apply_model(attention_impls)[0],
    }
    del llm
    return result


def matrix_worker(name: str, eager: bool) -> None:
    """bf16 then the S4 KV runs on one tiny model, one engine after another; a RESULT line after each."""
    from vllm.distributed import cleanup_dist_env_and_memory

    for kind in ("bf16", *MATRIX_KINDS):
        start = time.monotonic()
        try:
            result = engine_checks(tiny_models()[name], kind, eager)
        except Exception as err:
            result = {"error": f"{type(err).__name__}: {err}"[:800]}
        gc.collect()
        cleanup_dist_env_and_memory()
        result["seconds"] = round(time.monotonic() - start, 1)
        print(f"[matrix] {name}/{kind}: {json.dumps(result)[:400]}", flush=True)
        print("RESULT " + json.dumps({f"{name}/{kind}": result}), flush=True)


def judge_matrix(results: dict) -> list[str]:
    """Failures of one worker's results, as lines."""
    from s4kv.runtime.bundled_models import SPECULATIVE_SUFFIX

    failures = []
    for name in tiny_models():
        bf16 = results.get(f"{name}/bf16", {})
        for kind in MATRIX_KINDS:
            run = results.get(f"{name}/{kind}", {})
            key = f"{name}/{kind}"
            if "error" in run or not run:
                failures.append(f"{key}: {run.get('error', 'did not run')}")
                continue
            checks = {
                "S4 KV backend ran": run["impls"] == ["S4KVAttentionImpl"],
                "all answers right": run["correct"] == len(run["answers"]),
                "short + medium prompts match bf16": run["token_ids"][:-1] == bf16.get("token_ids", [None])[:-1],
                "prefix cache hit": run["prefix_cached_tokens"] >= 128 and run["prefix_repeat_same"],
                "preempted": bool(run["preemptions"]),
                "preemption kept outputs": run["pressure_all_same"] and run["pressure_matches_single"],
            }
            if kind.endswith(SPECULATIVE_SUFFIX):
                checks["drafts accepted"] = bool(run["accepted_draft_tokens"])
            failures += [f"{key}: {check} FAILED" for check, ok in checks.items() if not ok]
    return failures


# ---------------------------------------------------------------------------------------------------------------
# phase 3: OpenAI servers
# ---------------------------------------------------------------------------------------------------------------
def server_worker(model: str, scheme: str, raw_vllm: bool, out: str, timeout_s: float, extra: list[str]) -> dict:
    from openai import BadRequestError, OpenAI

    from s4kv.runtime.cli.demo import stop, wait_until_healthy
    from s4kv.runtime.bundled_models import FACTS, chat_text

    port, served = free_port(), "tiny"
    # CUDA graphs on (the default), captured for batch sizes up to 32 only: a shorter start on a shared GPU
    common = ["--port", str(port), "--host", "127.0.0.1", "--served-model-name", served, "--max-model-len", "1024",
              "--gpu-memory-utilization", "0.08", "--kv-cache-memory-bytes", str(256 * 2**20), "--max-num-seqs", "32",
              "--compilation-config", json.dumps({"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}), *extra]
    if raw_vllm:
        command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--kv-cache-dtype",
                   "int4_per_token_head", "--attention-backend", "CUSTOM", "--additional-config",
                   json.dumps({"s4kv": {"scheme": scheme}}), *common]
    else:
        command = [sys.executable, "-m", "s4kv.runtime.cli", "serve", model, "--scheme", scheme, *common]
    log_path = os.path.join(out, f"server_{scheme}.log")
    checks: dict[str, object] = {}
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        start = time.monotonic()
        wait_until_healthy(f"http://127.0.0.1:{port}", server, timeout_s=timeout_s)
        checks["startup_s"] = round(time.monotonic() - start, 1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)

        def chat(question, **kw):
            settings = {"temperature": 0, "max_tokens": 24, **kw}
            return client.chat.completions.create(model=served, messages=[{"role": "user", "content": question}],
                                                  **settings)

        checks["chat"] = chat(FACTS[0][0]).choices[0].message.content.strip() == FACTS[0][1]
        completion = client.completions.create(model=served, prompt=chat_text(FACTS[1][0]), temperature=0,
                                               max_tokens=24)
        checks["completion"] = completion.choices[0].text.strip() == FACTS[1][1]
        stream = chat(FACTS[4][0], stream=True)
        checks["stream"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip() == FACTS[4][1]
        several = client.chat.completions.create(model=served, messages=[{"role": "user", "content": FACTS[2][0]}],
                                                 n=3, temperature=1.0, seed=1, max_tokens=16)
        checks["n=3"] = len(several.choices) == 3
        checks["stop"] = chat(FACTS[0][0], stop=[" is"]).choices[0].message.content.strip() == "The capital of France"
        short = chat(FACTS[0][0], max_tokens=3)
        checks["max_tokens"] = short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
        try:
            client.completions.create(model=served, prompt=" ".join(["week"] * 1100), max_tokens=4)
            checks["too_long_400"] = False
        except BadRequestError as err:
            checks["too_long_400"] = err.status_code == 400
        answers: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, chat(FACTS[i][0]).choices[0]
                                                                            .message.content.strip()))
                   for i in range(len(FACTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        checks["concurrent"] = answers == {i: a for i, (_, a) in enumerate(FACTS)}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as response:
            checks["health"] = response.status == 200
    except Exception as err:
        checks["error"] = f"{type(err).__name__}: {err}"[:500]
    finally:
        stop(server)
    log_text = open(log_path).read()
    checks["kv_line"] = (KV_CACHE_LINE.findall(log_text) or [None])[-1]
    return checks


# ---------------------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------------------
def drive(out: str, budget_s: float, with_capacity: bool) -> int:
    deadline = time.monotonic() + budget_s
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    summary: dict[str, object] = {}

    summary["capacity"] = {}
    if with_capacity:
        print("[e2e] phase 1: KV capacity (alone on the GPU)", flush=True)
        summary["capacity"] = capacity_phase(out, env, deadline - 300)

    print("[e2e] phase 2+3: engine matrix (8 workers) and 2 OpenAI servers, side by side", flush=True)
    remaining = max(30, deadline - time.monotonic() - 10)
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=10) as pool:
        for runner in ("0", "1"):
            for eager in (False, True):
                key = f"runner_v{'2' if runner == '1' else '1'}_{'eager' if eager else 'graphs'}"
                worker_env = dict(env, VLLM_USE_V2_MODEL_RUNNER=runner)
                for name in tiny_models():
                    jobs[(key, name)] = pool.submit(
                        run_child, ["matrix", "--out", out, "--model", name] + (["--eager"] if eager else []),
                        worker_env, remaining, os.path.join(out, f"{key}_{name}.log"))
        models = tiny_models()
        for scheme, model, raw in (("int4_kivi", models["qwen2"], False), ("int4_saw", models["llama3"], True)):
            key = f"server_{scheme}_{'vllm_serve' if raw else 's4kv_serve'}"
            jobs[(key, None)] = pool.submit(
                run_child, ["server", "--out", out, "--scheme", scheme, "--model", model, "--timeout-s",
                            str(remaining - 60)] + (["--raw"] if raw else []),
                dict(os.environ), remaining, os.path.join(out, f"{key}.log"))
        for (key, name), job in jobs.items():
            result = job.result()
            if name is None:
                summary[key] = result
            else:  # the engines' results, and the worker's exit/seconds/log under its model's name
                worker = {field: result.pop(field) for field in ("exit", "seconds", "log", "tail") if field in result}
                summary.setdefault(key, {}).update(result, **{f"worker_{name}": worker})

    failures = [f"capacity {kind}: not measured (exit {entry.get('exit')})"
                for kind, entry in summary["capacity"].items() if not entry.get("vllm_line")]
    for key, value in summary.items():
        if key.startswith("runner_"):
            failures += [f"{key} {line}" for line in judge_matrix(value)]
        elif key.startswith("server_"):
            failures += [f"{key} {check}: {value.get(check)}" for check in
                         ("chat", "completion", "stream", "n=3", "stop", "max_tokens", "too_long_400", "concurrent",
                          "health") if value.get(check) is not True]
    summary["failures"] = failures
    with open(os.path.join(out, "device_plugin_e2e.json"), "w") as handle:
        json.dump(summary, handle, indent=1)

    print("\n===== S4 KV plugin on the GPU: summary =====")
    for kind, entry in summary["capacity"].items():
        print(f"KV capacity {kind:>20}: {entry.get('vllm_line') or 'not measured (see ' + entry['log'] + ')'}")
    for key, value in summary.items():
        if key.startswith(("runner_", "server_")):
            workers = [value] if key.startswith("server_") else [v for k, v in value.items() if k.startswith("worker_")]
            print(f"{key}: " + ", ".join(f"exit {w.get('exit')} in {w.get('seconds')} s" for w in workers))
    print(f"{len(failures)} failure(s)" + "".join(f"\n  {line}" for line in failures))
    return 0 if not failures else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", nargs="?", default="all", choices=("all", "capacity", "matrix", "server"))
    parser.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="s4kv_e2e_"))
    parser.add_argument("--budget-s", type=float, default=420, help="wall-clock budget of the whole run")
    parser.add_argument("--no-capacity", action="store_true", help="skip phase 1 (the KV capacity of 5 formats)")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--kind", choices=CAPACITY_KINDS)
    parser.add_argument("--scheme", choices=SCHEMES)
    parser.add_argument("--model", help="matrix: a tiny model's name; server: its folder")
    parser.add_argument("--timeout-s", type=float, default=240, help="server: how long it may take to start")
    parser.add_argument("--raw", action="store_true", help="server: plain `vllm serve` flags instead of `s4kv serve`")
    parser.add_argument("--vllm-args", default="", metavar="'FLAGS'",
                        help="server: more `vllm serve` flags, one string "
                             "(e.g. --vllm-args='--tensor-parallel-size 2')")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.phase == "all":
        return drive(args.out, args.budget_s, not args.no_capacity)
    if args.phase == "capacity":
        result = capacity_worker(args.kind, args.out)
    elif args.phase == "matrix":
        matrix_worker(args.model, args.eager)
        return 0
    else:
        result = server_worker(args.model, args.scheme, args.raw, args.out, args.timeout_s, shlex.split(args.vllm_args))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
