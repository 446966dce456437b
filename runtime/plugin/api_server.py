"""vLLM's OpenAI-compatible server as `s4kv serve` runs it: vLLM's own parser, app and engine, plus three things
the stock entry point (``python -m vllm.entrypoints.openai.api_server``) lacks:

* every setting is judged before vLLM builds the engine: vLLM's config is created from the parsed arguments (no
  weights, no engine process) and our checks run on it, the very checks the engine runs later; a refusal is one
  sentence and a distinct exit status (EXIT_BAD_INPUT, EXIT_UNSUPPORTED), not a traceback 40 s in;
* the exit status says when the engine died: vLLM's watchdog stops the HTTP server after an engine death and the
  process then exits 0, which a supervisor reads as a deliberate stop. Here vLLM's watchdog is switched off
  (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH) and our own stops the server instead, remembering why, so the process exits
  EXIT_ENGINE_DIED. A shutdown by signal is told apart by uvicorn's ``should_exit``, which its signal handler sets
  before vLLM stops the engine;
* int4_kivi's max_num_seqs, where the user chose none, is capped so that its staging pool takes at most an eighth of
  the KV memory, as `s4kv capacity` plans it (staging_cap.py); and a batch of max_num_seqs decodes replays a full
  CUDA graph where vLLM's default capture sizes would leave it out (cuda_graphs.py): both go into the arguments the
  engine is built from.

The sequence below is vLLM 0.26.0's ``run_server`` / ``run_server_worker`` / ``build_and_serve``, with the app kept
in hand for the watchdog.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from argparse import Namespace
from typing import Any

from s4kv.runtime.exit_codes import EXIT_BAD_INPUT, EXIT_ENGINE_DIED, EXIT_OK, EXIT_UNSUPPORTED
from s4kv.runtime.plugin.config import S4KVConfig, S4KVConfigError, as_sentence, check_vllm_config
from s4kv.runtime.plugin.cuda_graphs import cover_largest_decode_batch
from s4kv.runtime.plugin.scheduler import check_config as check_scheduler_config
from s4kv.runtime.plugin.staging_cap import cap_kivi_max_num_seqs
from s4kv.runtime.plugin.version import vllm_version_mismatch
from s4kv.runtime.schemes import PREFILL_CAPPED_SCHEDULER, choose_model_runner

WATCHDOG_INTERVAL_S = 0.5


class Refusal(Exception):
    """A setting the server will not start with: the exit status and one sentence."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def main(argv: list[str]) -> int:
    """Parse `vllm serve` arguments, refuse bad settings, then serve until a signal or the engine's death."""
    os.environ["VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"] = "1"  # before vLLM reads its environment; see the module doc
    args = _checked_arguments(argv)
    if isinstance(args, int):
        return args
    import uvloop

    return uvloop.run(serve(args))


def check_only(argv: list[str]) -> int:
    """`s4kv serve --dry-run`: the same checks, no server."""
    args = _checked_arguments(argv)
    if isinstance(args, int):
        return args
    print("s4kv serve: every check passed (dry run, nothing started).")
    return EXIT_OK


def _checked_arguments(argv: list[str]) -> Namespace | int:
    """The parsed arguments once every check passed, or the exit status after printing the refusal."""
    try:
        import vllm

        if (mismatch := vllm_version_mismatch(vllm.__version__)) is not None:  # before any vLLM internal
            raise Refusal(EXIT_UNSUPPORTED, mismatch)
        args = parse(argv)
        choose_model_runner(args.additional_config)
        precheck(args)
    except Refusal as refusal:
        print(f"s4kv serve: {refusal}", file=sys.stderr)
        return refusal.status
    return args


def parse(argv: list[str]) -> Namespace:
    """vLLM's own `vllm serve` parser (argparse prints a one-line error and exits EXIT_BAD_INPUT)."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="s4kv serve", description="vLLM's OpenAI server"))
    return parser.parse_args(argv)


def precheck(args: Namespace) -> None:
    """Everything knowable before the engine starts: vLLM's own argument and config validation, then ours; then
    int4_kivi's max_num_seqs capped by its staging pool where the user chose none (staging_cap.py), and the largest
    decode batch added to the CUDA-graph capture sizes where it would miss its full graph (cuda_graphs.py)."""
    if args.api_key:  # from a --config file: vLLM would log it with its non-default arguments
        raise Refusal(EXIT_BAD_INPUT, "s4kv serve takes no api-key setting, not even in a --config file: put the "
                                      "key in a file named by S4KV_API_KEY_FILE, or in VLLM_API_KEY.")
    other_servers = [flag for flag, given in (("--api-server-count", (args.api_server_count or 1) > 1),
                                              ("--headless", args.headless), ("--grpc", args.grpc)) if given]
    if other_servers:
        raise Refusal(EXIT_BAD_INPUT, f"s4kv serve runs one HTTP API server process; remove "
                                      f"{' and '.join(other_servers)}.")
    model = args.model
    if _looks_like_path(model) and not os.path.isdir(model):
        raise Refusal(EXIT_BAD_INPUT, f"no model folder at {model}: give a local model folder or a Hugging Face id.")
    vllm_config, config = _checked_engine_config(args)
    if cap_kivi_max_num_seqs(args, vllm_config, config) is not None:
        vllm_config, _ = _checked_engine_config(args)  # the capture sizes and the scheduler follow max_num_seqs
    cover_largest_decode_batch(args, vllm_config)


def _checked_engine_config(args: Namespace) -> tuple[Any, S4KVConfig | None]:
    """vLLM's config as the engine will build it from ``args``, after vLLM's checks and ours, and our config from it
    (None for vLLM's own KV formats)."""
    from pydantic import ValidationError
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import validate_parsed_serve_args
    from vllm.usage.usage_lib import UsageContext

    try:
        validate_parsed_serve_args(args)
        vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config(UsageContext.OPENAI_API_SERVER)
        if vllm_config.scheduler_config.scheduler_cls == PREFILL_CAPPED_SCHEDULER:
            check_scheduler_config(vllm_config)
    except ValidationError as err:
        message = _validation_message(err)
        if "max_model_len" in message:
            message = message.rstrip(".") + "; lower --max-model-len."
        raise Refusal(EXIT_BAD_INPUT, message) from None
    except S4KVConfigError as err:  # our checks, should vLLM resolve our backend while it builds the config
        raise Refusal(EXIT_UNSUPPORTED, as_sentence(err)) from None
    except (ValueError, TypeError) as err:
        raise Refusal(EXIT_BAD_INPUT, as_sentence(err).removeprefix("Error: ")) from None
    try:
        return vllm_config, check_vllm_config(vllm_config)
    except S4KVConfigError as err:
        raise Refusal(EXIT_UNSUPPORTED, str(err)) from None


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../")) or os.path.exists(model)


def _validation_message(err) -> str:
    """vLLM's config validation error (pydantic: several lines) as its first sentence."""
    first = err.errors()[0]
    message = " ".join(str(first.get("msg", err)).split()).removeprefix("Value error, ")
    return message.split(". ", 1)[0].rstrip(".") + "."


async def serve(args: Namespace) -> int:
    """vLLM's single-API-server sequence; returns EXIT_ENGINE_DIED when the engine died under a running server."""
    from vllm.entrypoints.launcher import serve_http
    from vllm.entrypoints.openai.api_server import build_app, build_async_engine_client, init_app_state, setup_server
    from vllm.entrypoints.serve.utils.server_utils import get_uvicorn_log_config
    from vllm.utils.system_utils import decorate_logs
    import vllm.envs as envs

    decorate_logs("APIServer", skip_if_decorated=True)

    def interrupt_start_up(*_) -> None:  # as vLLM does: SIGTERM before uvicorn runs stops the start-up
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, interrupt_start_up)
    listen_address, sock = setup_server(args, reuse_port=False)
    uvicorn_kwargs = {}
    if (log_config := get_uvicorn_log_config(args)) is not None:
        uvicorn_kwargs["log_config"] = log_config
    try:
        async with build_async_engine_client(args) as engine_client:
            supported_tasks = await engine_client.get_supported_tasks()
            app = build_app(args, supported_tasks, engine_client.model_config)
            await init_app_state(engine_client, app.state, args, supported_tasks)
            watchdog = EngineWatchdog(app, engine_client)
            watch = asyncio.get_running_loop().create_task(watchdog.run())
            shutdown = await serve_http(
                app, sock=sock, enable_ssl_refresh=args.enable_ssl_refresh, host=args.host, port=args.port,
                log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
                timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE, ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                ssl_ciphers=args.ssl_ciphers, h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                h11_max_header_count=args.h11_max_header_count, **uvicorn_kwargs,
            )
            watch.cancel()
        await shutdown  # after the engine client is closed, as vLLM does
    finally:
        sock.close()
    if watchdog.engine_died:
        print("s4kv serve: the engine died; exiting with status "
              f"{EXIT_ENGINE_DIED} so that the supervisor restarts the server.", file=sys.stderr, flush=True)
        return EXIT_ENGINE_DIED
    return 0


class EngineWatchdog:
    """Stops the HTTP server when the engine dies while the server is meant to run, and remembers that it did."""

    def __init__(self, app, engine_client) -> None:
        self.app = app
        self.engine_client = engine_client
        self.engine_died = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            server = getattr(self.app.state, "server", None)  # set by serve_http once uvicorn exists
            if server is None or server.should_exit:
                continue  # not serving yet, or a shutdown was asked for: the engine stopping then is expected
            if self.engine_client.errored:
                self.engine_died = True
                server.should_exit = True
                return


if __name__ == "__main__":  # `s4kv bench --serve` runs every server this way, as `s4kv serve` runs it
    sys.exit(main(sys.argv[1:]))
