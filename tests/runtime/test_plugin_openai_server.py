"""vLLM's OpenAI-compatible server started by `s4kv serve` (int4 KV on the CPU engine), exercised with the official
`openai` client (one server start, ~1-2 min). The README's `s4kv demo` runs from the installed wheel in
test_installed_wheel.py."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest

from s4kv.runtime.cli.demo import CPU_ENGINE_ARGS, stop, wait_until_healthy
from s4kv.runtime.bundled_models import FACTS, QWEN2, bundled_model_dir, chat_text

openai = pytest.importorskip("openai")
pytest.importorskip("vllm")
SERVED = "tiny"
MAX_MODEL_LEN = 512


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    command = [sys.executable, "-m", "s4kv.runtime.cli", "serve", bundled_model_dir(QWEN2), "--scheme", "int4_saw",
               "--port", str(port), "--host", "127.0.0.1", "--served-model-name", SERVED, *CPU_ENGINE_ARGS]
    assert CPU_ENGINE_ARGS[:2] == ["--max-model-len", str(MAX_MODEL_LEN)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base_url, process, timeout_s=900)
    except (RuntimeError, TimeoutError):
        stop(process)
        pytest.fail("server did not start:\n" + log_path.read_text()[-8000:])
    yield base_url, log_path, process
    stop(process)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, question: str, **kwargs):
    settings = {"temperature": 0, "max_tokens": 24, **kwargs}
    return client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": question}], **settings)


def test_health_models_and_backend(server, client):
    with urllib.request.urlopen(f"{server[0]}/health") as response:
        assert response.status == 200
    assert [m.id for m in client.models.list().data] == [SERVED]
    log = server[1].read_text()
    assert "S4 KV int4_saw runs on the CPU platform in place of CPU_ATTN" in log


def test_chat_and_completion(client):
    question, answer = FACTS[1]
    assert chat(client, question).choices[0].message.content.strip() == answer
    completion = client.completions.create(model=SERVED, prompt=chat_text(question), temperature=0, max_tokens=24)
    assert completion.choices[0].text.strip() == answer
    assert completion.choices[0].finish_reason == "stop"


def test_streaming(client):
    question, answer = FACTS[4]
    stream = chat(client, question, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.strip() == answer


def test_n_stop_and_max_tokens(client):
    question, answer = FACTS[0]
    several = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": question}],
                                             n=3, temperature=1.0, seed=1, max_tokens=24)
    assert len(several.choices) == 3 and all(c.message.content for c in several.choices)
    stopped = chat(client, question, stop=[" is"])
    assert stopped.choices[0].message.content.strip() == answer.split(" is")[0]
    short = chat(client, question, max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_request_longer_than_the_context_is_a_clean_400(client):
    too_long = " ".join(["week"] * (MAX_MODEL_LEN + 50))
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=SERVED, prompt=too_long, max_tokens=4)
    assert err.value.status_code == 400


def test_concurrent_requests(client):
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        answers[i] = chat(client, FACTS[i][0]).choices[0].message.content.strip()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(FACTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert answers == {i: FACTS[i][1] for i in range(len(FACTS))}


def test_sigterm_stops_the_server_with_status_0(server):
    """What `systemctl stop` sends: a clean exit, not mistaken for an engine death (runs last: it stops the server)."""
    process = server[2]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0, server[1].read_text()[-4000:]
    assert "the engine died" not in server[1].read_text()
