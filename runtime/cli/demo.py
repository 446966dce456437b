"""`s4kv demo`: the offline quick start. Serves the bundled tiny model with int4 KV through vLLM's OpenAI server
(the CPU engine on a machine without a GPU, the GPU otherwise), asks it a question with the official `openai`
client, prints the answer and shuts the server down. Needs no network and no GPU.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from s4kv.runtime.bundled_models import FACTS, QWEN2, bundled_model_dir
from s4kv.runtime.schemes import DEFAULT_SCHEME, SCHEMES

SERVED_NAME = "s4kv-demo"
# Small settings so the CPU engine starts quickly and holds little memory; a GPU gets vLLM's defaults.
CPU_ENGINE_ARGS = ["--max-model-len", "512", "--max-num-seqs", "4", "--enforce-eager",
                   "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(64 * 2**20)]
STARTUP_TIMEOUT_S = 600


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheme", choices=SCHEMES, default=DEFAULT_SCHEME)
    parser.add_argument("--model", default=None, help=f"model folder (default: the bundled models/{QWEN2})")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--question", default=FACTS[0][0])


def server_command(model: str, scheme: str, port: int, on_gpu: bool) -> list[str]:
    return [sys.executable, "-m", "s4kv.runtime.cli", "serve", model, "--scheme", scheme, "--port", str(port),
            "--host", "127.0.0.1", "--served-model-name", SERVED_NAME,
            *([] if on_gpu else CPU_ENGINE_ARGS)]


def wait_until_healthy(url: str, server: subprocess.Popen, timeout_s: float, poll_s: float = 2.0) -> None:
    """Until GET {url}/health answers 200; an error if the server exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"the server did not answer {url}/health within {timeout_s:.0f} s")


def ask(base_url: str, question: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="not-needed")
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": question}], max_tokens=32, temperature=0
    )
    return reply.choices[0].message.content.strip()


def stop(server: subprocess.Popen) -> None:
    """Ctrl-C first (vLLM's server shuts its engine down cleanly on SIGINT), then harder."""
    for send in (lambda: server.send_signal(signal.SIGINT), server.terminate, server.kill):
        if server.poll() is not None:
            return
        send()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            continue


def run(args: argparse.Namespace) -> int:
    import torch

    model = args.model or bundled_model_dir(QWEN2)
    if not os.path.isfile(os.path.join(model, "config.json")):
        print(f"s4kv demo: no model at {model}: --model takes a folder holding a config.json", file=sys.stderr)
        return 2
    on_gpu = torch.cuda.is_available()
    base_url = f"http://127.0.0.1:{args.port}"
    log_path = os.path.join(tempfile.mkdtemp(prefix="s4kv-demo-"), "server.log")
    print(f"[demo] serving {model} with {args.scheme} KV on the {'GPU' if on_gpu else 'CPU'} at {base_url} "
          f"(vLLM's log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen(server_command(model, args.scheme, args.port, on_gpu), stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(base_url, server, STARTUP_TIMEOUT_S)
        print(f"[demo] the OpenAI-compatible server is up: {base_url}/v1", flush=True)
        print(f"[demo] Q: {args.question}", flush=True)
        print(f"[demo] A: {ask(base_url, args.question)}", flush=True)
    except (RuntimeError, TimeoutError) as err:
        with open(log_path) as log:
            print(log.read()[-4000:], file=sys.stderr)
        print(f"s4kv demo: {err}", file=sys.stderr)
        return 1
    finally:
        stop(server)
    print("[demo] server stopped", flush=True)
    return 0
