"""The token sequences `s4kv eval` feeds every KV format: held-out text cut into fixed windows and prompts.

Every format sees exactly the same token ids (engines get ids, never text), so differences come from the
KV cache alone. Held-out documents are tokenized one by one and concatenated; windows are spread evenly
over that stream and each starts with what the tokenizer puts before any text (BOS, or our models'
document separator), as a real request would.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Regime:
    """One context regime (short or long): teacher-forced windows and greedy prompts.

    A window's first ``prefill`` tokens are sent as one prompt, as a served request's prompt is; every later token
    is forced one decode step at a time, and the positions predicted by decode steps (tokens prefill + 1 onward)
    are scored. The first forced token is predicted by the prefill itself and is not scored."""

    name: str
    windows: int  # teacher-forced sequences
    window_len: int  # tokens per sequence
    prompts: int  # greedy prompts
    prompt_len: int
    generate: int  # tokens generated greedily per prompt
    prefill: int = 1  # tokens of each window prefilled before its forced decode steps

    def __post_init__(self) -> None:
        for field in ("windows", "window_len", "prompts", "prompt_len", "generate", "prefill"):
            if getattr(self, field) < 1:
                raise ValueError(f"{self.name} regime: {field} must be positive, got {getattr(self, field)}")
        if self.prefill > self.window_len - 2:
            raise ValueError(f"{self.name} regime: a {self.window_len}-token window with {self.prefill} prefilled "
                             f"tokens leaves no decode step to score (prefill must be at most window_len - 2)")

    @property
    def scored(self) -> slice:
        """The window tokens whose log-probabilities are scored: those predicted by decode steps."""
        return slice(self.prefill + 1, self.window_len)


@dataclass
class RegimeInputs:
    regime: Regime
    windows: list[list[int]]
    prompts: list[list[int]]


def load_heldout(path: Path) -> list[str]:
    if not path.exists():
        raise FileNotFoundError(f"held-out text {path} not found (pass --heldout FILE.jsonl)")
    texts = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise ValueError(f"{path} holds no documents")
    return texts


def token_stream(tokenizer, texts: list[str]) -> tuple[list[int], list[int]]:
    """(start ids the tokenizer puts before any text, all documents' tokens without those start ids)."""
    start = tokenizer("", add_special_tokens=True)["input_ids"]
    stream: list[int] = []
    for text in texts:
        # verbose=False: documents are longer than the context on purpose, windows are cut afterwards
        ids = tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"]
        stream.extend(ids[len(start):] if ids[: len(start)] == start else ids)
    return start, stream


def spread_windows(start: list[int], stream: list[int], count: int, length: int,
                   staggered: bool = False) -> list[list[int]]:
    """``count`` windows of ``length`` tokens (start ids included) at evenly spaced offsets of the stream.

    ``staggered`` shifts the offsets by half a spacing, so greedy prompts do not begin where windows do.
    """
    body = length - len(start)
    if body < 1 or body > len(stream):
        raise ValueError(f"a window of {length} tokens needs {body} held-out tokens; the held-out text has "
                         f"{len(stream)}")
    last = len(stream) - body
    if staggered:
        offsets = [round((i + 0.5) * last / count) for i in range(count)]
    else:
        offsets = [round(i * last / max(count - 1, 1)) for i in range(count)]
    return [start + stream[o:o + body] for o in offsets]


def build_inputs(tokenizer, texts: list[str], regimes: list[Regime]) -> list[RegimeInputs]:
    start, stream = token_stream(tokenizer, texts)
    inputs = []
    for regime in regimes:
        windows = spread_windows(start, stream, regime.windows, regime.window_len)
        prompts = spread_windows(start, stream, regime.prompts, regime.prompt_len, staggered=True)
        inputs.append(RegimeInputs(regime, windows, prompts))
    return inputs


def describe(inputs: list[RegimeInputs]) -> dict:
    return {i.regime.name: asdict(i.regime) for i in inputs}
