"""The served endpoint as an operator runs it: `s4kv serve` on the CPU engine with an API key in a file, once per
KV format (int4_kivi, int4_saw, bf16), over loopback only.

For each server: every route the app registers (read from the server's own route table in its log) needs the key,
except GET/HEAD /health, including path and header tricks; the key is in no process's argv or environment and not in
the log; a bounded soak (concurrent clients, streaming and not, clients that hang up mid-stream) gets no 5xx, leaves
no request behind in vLLM's running/waiting gauges, and greedy answers match the bundled model's memorized ones in
every format; finally SIGKILL of the engine core (or of its worker) ends the server with EXIT_ENGINE_DIED, which
the systemd unit restarts. One server start per format (~1-2 min each on 2 cores).
"""

from __future__ import annotations

import configparser
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from s4kv.runtime.cli.demo import CPU_ENGINE_ARGS, stop, wait_until_healthy
from s4kv.runtime.exit_codes import EXIT_BAD_INPUT, EXIT_ENGINE_DIED, EXIT_UNSUPPORTED
from s4kv.runtime.bundled_models import FACTS, QWEN2, bundled_model_dir, chat_text

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")
pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "constructs_lib" / "scripts" / "s4kv.service"
SERVED = "tiny"
HOST = "127.0.0.1"
START_TIMEOUT_S = 900
# Which process each format's run kills at the end: the engine core, or the worker the engine core drives.
KILLED = {"int4_kivi": "engine core", "int4_saw": "worker", "bf16": "engine core"}
ROUTE_LINE = re.compile(r"Route: (\S+), (Methods|Endpoint): (.+)$")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def http_request(port: int, method: str, path: str, headers: dict | None = None, body: bytes | None = None,
            timeout: float = 120) -> tuple[int, bytes]:
    """One raw HTTP request: the path goes on the wire exactly as given (no client-side normalisation)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class Server:
    def __init__(self, scheme: str, process: subprocess.Popen, port: int, key: str, log_path: Path):
        self.scheme, self.process, self.port, self.key, self.log_path = scheme, process, port, key, log_path

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def routes(self) -> list[tuple[str, tuple[str, ...]]]:
        """(path, methods) of every route the running app registered, from the table vLLM logs at start-up."""
        found = []
        for line in self.log().splitlines():
            match = ROUTE_LINE.search(line)
            if match:
                path, kind, rest = match.groups()
                methods = tuple(m.strip() for m in rest.split(",")) if kind == "Methods" else ("GET",)
                found.append((path, methods))
        return found

    def processes(self) -> list:
        parent = psutil.Process(self.process.pid)
        return [parent, *parent.children(recursive=True)]

    def metric(self, name: str) -> float:
        status, body = http_request(self.port, "GET", "/metrics", self.auth)
        assert status == 200
        values = [float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
                  if line.startswith(name + "{") or line.startswith(name + " ")]
        assert values, f"{name} not in /metrics"
        return sum(values)


@pytest.fixture(scope="module", params=sorted(KILLED))
def server(request, tmp_path_factory):
    scheme = request.param
    root = tmp_path_factory.mktemp(f"served-{scheme}")
    key = "s4kv-" + secrets.token_urlsafe(24)
    key_file = root / "api-key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    env = {name: value for name, value in os.environ.items() if name != "VLLM_API_KEY"}
    env["S4KV_API_KEY_FILE"] = str(key_file)
    port = free_port()
    log_path = root / "server.log"
    command = [sys.executable, "-m", "s4kv.runtime.cli", "serve", bundled_model_dir(QWEN2), "--scheme", scheme,
               "--port", str(port), "--host", HOST, "--served-model-name", SERVED, *CPU_ENGINE_ARGS]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    running = Server(scheme, process, port, key, log_path)
    try:
        wait_until_healthy(f"http://{HOST}:{port}", process, START_TIMEOUT_S)
    except (RuntimeError, TimeoutError):
        stop(process)
        pytest.fail("server did not start:\n" + running.log()[-8000:])
    descendants = {p.pid for p in running.processes()}
    yield running
    stop(process)
    for pid in descendants - {process.pid}:  # whatever the engine left behind (an orphaned worker)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------------------------------ the API key
def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def test_every_route_but_health_needs_the_key(server):
    routes = server.routes()
    paths = {path for path, _ in routes}
    # The table is the app's own and complete: vLLM's OpenAI, SageMaker, tokenizer and admin routes are in it.
    assert {"/health", "/v1/chat/completions", "/v1/completions", "/invocations", "/ping", "/tokenize",
            "/metrics", "/load", "/docs", "/openapi.json"} <= paths, sorted(paths)
    wrong = {"Authorization": f"Bearer {server.key}x"}
    not_json = b"{not json"
    for path, methods in routes:
        for method in methods:
            body = not_json if method in ("POST", "PUT", "PATCH") else None
            url = concrete(path)
            no_key = http_request(server.port, method, url, body=body)[0]
            wrong_key = http_request(server.port, method, url, wrong, body=body)[0]
            with_key = http_request(server.port, method, url, server.auth, body=body)[0]
            if path == "/health" and method in ("GET", "HEAD"):
                assert (no_key, wrong_key, with_key) == (200, 200, 200), (method, path)
            else:
                assert (no_key, wrong_key) == (401, 401), (method, path, no_key, wrong_key)
                assert with_key != 401, (method, path)


@pytest.mark.parametrize("method, path, headers, status", [
    ("GET", "//invocations", {}, 401),
    ("POST", "/health/../invocations", {}, 401),
    ("POST", "/health%2F..%2Finvocations", {}, 401),
    ("POST", "/%69nvocations", {}, 401),  # decodes to /invocations
    ("GET", "/./v1/models", {}, 401),
    ("GET", "/v1/../v1/models", {}, 401),
    ("GET", "/v1/models/", {}, 401),
    ("GET", "/health/", {}, 401),
    ("GET", "//health", {}, 401),
    ("GET", "/HEALTH", {}, 401),
    ("POST", "/health", {}, 401),  # only GET and HEAD are open
    ("OPTIONS", "/v1/models", {"Origin": "http://x", "Access-Control-Request-Method": "GET"}, 401),
    ("GET", "/health?probe=1", {}, 200),
    ("GET", "/%68ealth", {}, 200),  # decodes to /health
    ("GET", "/v1/models", {"Authorization": "Basic KEY"}, 401),
    ("GET", "/v1/models", {"Authorization": "Bearer"}, 401),
    ("GET", "/v1/models", {"Authorization": "Bearer  KEY"}, 401),  # two spaces: the token has a leading blank
    ("GET", "/v1/models", {"Authorization": "bearer KEY"}, 200),  # the scheme is case-insensitive (RFC 7235)
    ("GET", "/v1/models", {"Authorization": "Bearer KEY"}, 200),
])
def test_path_and_header_tricks(server, method, path, headers, status):
    headers = {name: value.replace("KEY", server.key) for name, value in headers.items()}
    assert http_request(server.port, method, path, headers)[0] == status


def test_two_authorization_headers_are_refused(server):
    conn = http.client.HTTPConnection(HOST, server.port, timeout=30)
    conn.putrequest("GET", "/v1/models")
    conn.putheader("Authorization", f"Bearer {server.key}")
    conn.putheader("Authorization", "Bearer other")
    conn.endheaders()
    assert conn.getresponse().status == 401
    conn.close()


def test_the_key_is_in_no_argv_environment_or_log(server):
    processes = server.processes()
    assert len(processes) >= 2  # the API server and at least the engine core
    for process in processes:
        pid = process.pid
        for view in ("cmdline", "environ"):
            assert server.key.encode() not in Path(f"/proc/{pid}/{view}").read_bytes(), (pid, view)
    listing = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
    assert server.key not in listing
    assert server.key not in server.log()


def test_the_openai_client_with_the_key(server):
    client = openai.OpenAI(base_url=f"http://{HOST}:{server.port}/v1", api_key=server.key, max_retries=0)
    assert [m.id for m in client.models.list().data] == [SERVED]
    refused = openai.OpenAI(base_url=f"http://{HOST}:{server.port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        refused.models.list()


# ------------------------------------------------------------------------------------------ the soak
CLIENTS = 6
ROUNDS = 4


def hang_up_mid_stream(server: Server, question: str) -> None:
    """A streaming completion whose client goes away after the first chunk."""
    conn = http.client.HTTPConnection(HOST, server.port, timeout=120)
    body = json.dumps({"model": SERVED, "prompt": chat_text(question), "max_tokens": 200, "stream": True,
                       "temperature": 0, "ignore_eos": True}).encode()
    conn.request("POST", "/v1/completions", body, {**server.auth, "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.readline()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def test_soak(server):
    client = openai.OpenAI(base_url=f"http://{HOST}:{server.port}/v1", api_key=server.key, max_retries=0,
                           timeout=300)
    failures_before = server_errors(server)
    answers: dict[str, set[str]] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def record(question: str, text: str) -> None:
        with lock:
            answers.setdefault(question, set()).add(text.strip())

    def one_client(index: int) -> None:
        for round_ in range(ROUNDS):
            question = FACTS[(index + round_) % len(FACTS)][0]
            kind = (index + round_) % 4
            try:
                if kind == 0:
                    reply = client.chat.completions.create(
                        model=SERVED, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=24)
                    record(question, reply.choices[0].message.content)
                elif kind == 1:
                    stream = client.chat.completions.create(
                        model=SERVED, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=24,
                        stream=True)
                    record(question, "".join(c.choices[0].delta.content or "" for c in stream if c.choices))
                elif kind == 2:
                    reply = client.completions.create(model=SERVED, prompt=chat_text(question), temperature=0,
                                                      max_tokens=24)
                    record(question, reply.choices[0].text)
                else:
                    hang_up_mid_stream(server, question)
            except Exception as err:  # every failure is collected, then reported at once
                with lock:
                    errors.append(f"client {index} round {round_} kind {kind}: {err!r}")

    threads = [threading.Thread(target=one_client, args=(i,)) for i in range(CLIENTS)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    assert time.monotonic() - started < 600
    # Greedy answers: one per question however the batch was composed, and the model's memorized one in every
    # format (the tiny model answers with margins int4 KV does not flip).
    expected = dict(FACTS)
    assert answers and all(texts == {expected[q]} for q, texts in answers.items()), answers
    # No request left behind: the hung-up streams are aborted, the gauges return to zero.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        running, waiting = (server.metric("vllm:num_requests_running"), server.metric("vllm:num_requests_waiting"))
        if running == 0 and waiting == 0:
            break
        time.sleep(1)
    assert (running, waiting) == (0, 0)
    assert server_errors(server) == failures_before


def server_errors(server: Server) -> float:
    """5xx responses the server has sent so far (vLLM's HTTP metrics group statuses as 2xx, 4xx, 5xx)."""
    status, body = http_request(server.port, "GET", "/metrics", server.auth)
    assert status == 200
    lines = [line for line in body.decode().splitlines() if line.startswith("http_requests_total{")]
    assert lines, "vLLM's HTTP request metrics are missing"
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if 'status="5xx"' in line)


# ------------------------------------------------------------------------------------------ engine death
def engine_cores(server_pid: int) -> list:
    """The server's engine-core processes (multiprocessing spawns them). A child that exits while it is listed (a
    short-lived helper, or a zombie not yet reaped) has no command line to read and is no engine core."""
    cores = []
    for child in psutil.Process(server_pid).children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                cores.append(child)
        except psutil.NoSuchProcess:  # ZombieProcess is one
            continue
    return cores


def test_engine_death_ends_the_server_with_a_failure_the_unit_restarts(server):
    """Runs last for each server: it kills the server's engine."""
    cores = engine_cores(server.process.pid)
    assert len(cores) == 1, cores
    target = cores[0]
    if KILLED[server.scheme] == "worker":
        (target,) = target.children()
    target.send_signal(signal.SIGKILL)
    try:
        status = server.process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server kept running after its {KILLED[server.scheme]} was killed")
    assert status == EXIT_ENGINE_DIED, server.log()[-4000:]
    assert "the engine died; exiting with status 4" in server.log()
    assert restarts_after(status) and not restarts_after(EXIT_BAD_INPUT) and not restarts_after(EXIT_UNSUPPORTED)


def unit_service_section() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(UNIT)
    return parser["Service"]


def restarts_after(status: int) -> bool:
    """Whether systemd restarts s4kv.service after the main process exits with this status (not a stop request):
    Restart=always restarts after every exit except the statuses in RestartPreventExitStatus."""
    service = unit_service_section()
    assert service["Restart"] == "always"
    prevented = {int(code) for code in service.get("RestartPreventExitStatus", "").split()}
    return status not in prevented


@pytest.mark.parametrize("unit", ["s4kv.service", "s4kv-metrics.service", "s4kv-metrics.timer"])
def test_the_unit_files_are_valid_for_systemd(tmp_path, unit):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify needs the ExecStart binary and the user to exist here: only those two lines change.
    for name in ("s4kv.service", "s4kv-metrics.service", "s4kv-metrics.timer"):  # the timer names its service
        text = (UNIT.parent / name).read_text()
        text = re.sub(r"^ExecStart=.*$", f"ExecStart={shutil.which('true')}", text, flags=re.M)
        text = re.sub(r"^User=.*$", "User=root", text, flags=re.M)
        (tmp_path / name).write_text(text)
    done = subprocess.run([analyze, "verify", str(tmp_path / unit)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr


def test_engine_death_while_loading_is_a_failure_the_unit_restarts(tmp_path):
    """SIGKILL of the engine core while it loads the model (its worker exists, the server is not up yet)."""
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-m", "s4kv.runtime.cli", "serve", bundled_model_dir(QWEN2), "--scheme", "int4_kivi",
               "--port", str(free_port()), "--host", HOST, *CPU_ENGINE_ARGS]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    left_behind: set[int] = set()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        engine_core = None
        while engine_core is None and time.monotonic() < deadline and process.poll() is None:
            cores = engine_cores(process.pid)
            if cores and cores[0].children():  # the worker is up: the engine is loading the model
                engine_core = cores[0]
            time.sleep(0.2)
        assert engine_core is not None, log_path.read_text()[-4000:]
        left_behind = {p.pid for p in psutil.Process(process.pid).children(recursive=True)}
        engine_core.send_signal(signal.SIGKILL)
        status = process.wait(timeout=300)
    finally:
        stop(process)
        for pid in left_behind:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert status not in (0, EXIT_BAD_INPUT, EXIT_UNSUPPORTED), log_path.read_text()[-4000:]
    assert restarts_after(status)
