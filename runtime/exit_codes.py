"""Exit statuses of `s4kv serve` and `s4kv check`, chosen so that a supervisor can tell them apart.

Python itself exits 1 on an uncaught exception, and signals give 128+N, so our own refusals use other numbers: the
systemd unit restarts the server after a crash or an engine death, never after a refusal that would only repeat.
"""

EXIT_OK = 0
EXIT_BAD_INPUT = 2  # a malformed or contradictory setting or file (argparse uses 2 as well)
EXIT_UNSUPPORTED = 3  # valid input that S4 KV cannot serve: the model or a vLLM feature
EXIT_ENGINE_DIED = 4  # the engine process died while the server was running
