"""`s4kv eval MODEL`: quality of each KV format against bf16 KV on the same held-out tokens.

For every format (bf16 first: it is the reference), in a short and a long context regime:
teacher-forced top-1 agreement with bf16, perplexity and its delta, mean KL of the next-token distributions
(a top-K lower bound, see quality.py), and free-running greedy exact match with the first divergence.

Engines: ``vllm`` (default; one vLLM process per format, runtime/eval/vllm_engine.py) measures the real kernels;
``torch`` (CPU, runtime/eval/torch_engine.py) runs the Hugging Face model with each format's torch reference and is
what CI uses to check the metrics. Writes ``<out-dir>/<model>-<engine>.json`` and ``.png``; prints the table.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from s4kv.runtime.bench.matrix import BASELINE, FORMATS, STANDARD_FORMATS
from s4kv.runtime.bundled_models import HELDOUT, REFERENCE_MODELS, resolve_model
from s4kv.runtime.packaged_models import PACKAGED_MODELS, resolve_packaged

from .data import Regime, RegimeInputs, build_inputs, describe, load_heldout
from .metrics import Greedy, TeacherForced, compare_teacher_forced, greedy_match
from .vllm_engine import UNSUPPORTED_EXIT

ENGINES = ("vllm", "torch")


def add_arguments(parser) -> None:
    parser.add_argument("model", help="local model folder, hub id (config.json, tokenizer, safetensors), the name "
                                      f"of a bundled model ({', '.join(REFERENCE_MODELS)}) or of a packaged one "
                                      f"({', '.join(PACKAGED_MODELS)}: `s4kv model list`, converted on first use)")
    parser.add_argument("--engine", choices=ENGINES, default="vllm")
    parser.add_argument("--formats", default=",".join(STANDARD_FORMATS),
                        help=f"comma-separated, from {', '.join(FORMATS)}; {BASELINE} is always run first")
    parser.add_argument("--heldout", default=str(HELDOUT), help="held-out documents, JSON lines with 'text'")
    parser.add_argument("--out-dir", default="results/quality")
    parser.add_argument("--top-k", type=int, default=20, help="log-probs per position (KL estimate, top-1)")
    parser.add_argument("--short-windows", type=int, default=64)
    parser.add_argument("--short-len", type=int, default=256)
    parser.add_argument("--short-prompts", type=int, default=64)
    parser.add_argument("--short-prompt-len", type=int, default=32)
    parser.add_argument("--short-generate", type=int, default=64)
    parser.add_argument("--long-windows", type=int, default=16, help="0: no long regime")
    parser.add_argument("--long-len", type=int, default=0, help="default: the model's max_position_embeddings")
    parser.add_argument("--long-prompts", type=int, default=16)
    parser.add_argument("--long-generate", type=int, default=128)
    # vLLM engine
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs (starts faster)")
    parser.add_argument("--prefill-share", type=float, default=0.0, metavar="FRACTION",
                        help="teacher forcing: prefill this share of each window as one prompt (as a served "
                             "request's prompt), then force the rest one decode step at a time and score those "
                             "steps. 0 (default): only the first token is prefilled, every position is a decode step "
                             "that reads its whole context from the KV cache (int4_kivi's blocks then all close over "
                             "several steps); 0.5: half of each window is a prompt whose int4_kivi blocks close per "
                             "channel, as they do for a served prompt")
    parser.add_argument("--allow-unsupported-model", action="store_true",
                        help="the S4 KV formats run a model outside the families the plugin is validated on (its "
                             "start-up check refuses it otherwise), as `s4kv serve --allow-unsupported-model` does")
    # torch engine
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=8)


def regimes_from(args, max_len: int) -> list[Regime]:
    if not 0 <= args.prefill_share < 1:
        raise ValueError(f"--prefill-share must be in [0, 1), got {args.prefill_share}")
    long_len = args.long_len or max_len
    if args.long_windows < 0:
        raise ValueError(f"--long-windows must be 0 (no long regime) or more, got {args.long_windows}")
    if long_len > max_len:
        raise ValueError(f"--long-len {long_len} exceeds the model's max_position_embeddings {max_len}")
    if args.long_generate >= long_len:
        raise ValueError(f"--long-generate {args.long_generate} leaves no prompt in a {long_len}-token context")

    def prefill(window_len: int) -> int:
        return max(1, min(window_len - 2, int(args.prefill_share * window_len)))

    regimes = [
        Regime("short", args.short_windows, args.short_len, args.short_prompts, args.short_prompt_len,
               args.short_generate, prefill(args.short_len)),
    ]
    if args.long_windows:
        # vLLM samples one token after a scored prompt, so a teacher-forced window leaves room for it
        regimes.append(Regime("long", args.long_windows, long_len - 1, args.long_prompts,
                              long_len - args.long_generate, args.long_generate, prefill(long_len - 1)))
    for r in regimes:
        if r.window_len + 1 > max_len or r.prompt_len + r.generate > max_len:
            raise ValueError(f"{r.name} regime: windows of {r.window_len} tokens (+1 sampled) or prompts of "
                             f"{r.prompt_len} + {r.generate} generated tokens exceed the model's context {max_len}")
    return regimes


def parse_formats(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        raise ValueError(f"unknown KV format(s) {unknown}; choose from {', '.join(FORMATS)}")
    return [BASELINE] + [n for n in names if n != BASELINE]


Records = dict[str, tuple[TeacherForced, Greedy]]


class FormatUnsupported(RuntimeError):
    """The engine cannot run this KV format on this machine (not a failure of the format or of the harness)."""


def vllm_records(args, model: str, fmt: str, inputs: list[RegimeInputs], workdir: Path) -> Records:
    """Run one format in its own vLLM process and read its records back."""
    spec = {
        "model": model, "format": fmt, "top_k": args.top_k, "out": str(workdir / f"{fmt}.npz"),
        "engine": {"enforce_eager": args.enforce_eager},  # the rest: vllm_engine.engine_sizing
        "allow_unsupported_model": args.allow_unsupported_model,
        "regimes": [{"name": i.regime.name, "windows": i.windows, "prompts": i.prompts, "generate": i.regime.generate,
                     "prefill": i.regime.prefill} for i in inputs],
    }
    spec_path = workdir / f"{fmt}.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{fmt}.log"
    with log_path.open("w") as log:
        done = subprocess.run([sys.executable, "-m", "s4kv.runtime.eval.vllm_engine", str(spec_path)], stdout=log,
                              stderr=subprocess.STDOUT)
    if done.returncode == UNSUPPORTED_EXIT:
        raise FormatUnsupported(log_path.read_text(errors="replace").strip().splitlines()[-1])
    if done.returncode:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise RuntimeError(f"vLLM run of {fmt} failed (exit {done.returncode}); end of {log_path}:\n{tail}")
    data = np.load(spec["out"])
    return {i.regime.name: (TeacherForced(data[f"{i.regime.name}_top_ids"], data[f"{i.regime.name}_top_logprobs"],
                                          data[f"{i.regime.name}_target_logprobs"],
                                          np.array(i.windows)[:, i.regime.scored]),
                            Greedy(data[f"{i.regime.name}_greedy"])) for i in inputs}


def compare(reference: Records, records: Records) -> dict[str, dict]:
    out = {}
    for regime, (ref_tf, ref_greedy) in reference.items():
        tf, greedy = records[regime]
        out[regime] = {**compare_teacher_forced(ref_tf, tf), **greedy_match(ref_greedy, greedy)}
    return out


def model_name(model: str) -> str:
    """A model's short name for titles and file names: its folder, or the hub id's last part."""
    return Path(model.rstrip("/")).name


def evaluate(args, save=lambda result: None) -> dict:
    """Every format against bf16; ``save(result)`` runs after each format, with ``result["pending"]`` naming the
    formats still to measure, so that a run cut short (a device call's limit) keeps what it measured."""
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer

    formats = parse_formats(args.formats)
    config = AutoConfig.from_pretrained(args.model)
    max_len = config.max_position_embeddings
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    inputs = build_inputs(tokenizer, load_heldout(Path(args.heldout)), regimes_from(args, max_len))
    if args.engine == "torch":
        from .torch_engine import TORCH_FORMATS, load_model, run_format

        model = load_model(args.model, args.device)

        def records_of(fmt: str) -> Records:
            return run_format(model, inputs, TORCH_FORMATS[fmt], args.top_k, args.batch_size)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="s4kv-eval-"))

        def records_of(fmt: str) -> Records:
            return vllm_records(args, args.model, fmt, inputs, workdir)

    result = {
        "model": args.model, "model_name": model_name(args.model), "engine": args.engine,
        "command": "s4kv " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "top_k": args.top_k, "heldout": args.heldout, "regimes": describe(inputs), "formats": {}, "seconds": {},
        "pending": list(formats),
    }
    reference: Records | None = None
    for fmt in tqdm(formats, desc=f"s4kv eval {result['model_name']}", unit="format"):
        started = time.perf_counter()
        try:
            records = records_of(fmt)
        except FormatUnsupported as unsupported:
            if reference is None:
                raise
            result.setdefault("unsupported", {})[fmt] = str(unsupported)
            print(f"s4kv eval: {unsupported}; `--engine torch` measures its torch reference", file=sys.stderr)
        except RuntimeError as error:
            if reference is None:  # without the bf16 reference nothing can be compared
                raise
            # one format failing to start must not cost the others' numbers (a GPU call is scarce)
            result.setdefault("errors", {})[fmt] = str(error)
            print(f"s4kv eval: {fmt} failed, continuing: {str(error).strip().splitlines()[-1]}", file=sys.stderr)
        else:
            reference = reference or records
            result["formats"][fmt] = compare(reference, records)
            result["seconds"][fmt] = round(time.perf_counter() - started, 1)
        result["pending"].remove(fmt)
        save(result)
    del result["pending"]
    return result


def run(args) -> int:
    from .report import markdown_table, plot, render_target_check

    args.model = resolve_packaged(resolve_model(args.model))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # not Path.with_suffix: model names such as Qwen2.5-7B-Instruct contain dots
    name = f"{model_name(args.model)}-{args.engine}"
    json_path, png_path = out_dir / f"{name}.json", out_dir / f"{name}.png"
    result = evaluate(args, save=lambda partial: json_path.write_text(json.dumps(partial, indent=1)))
    json_path.write_text(json.dumps(result, indent=1))
    plot(result, png_path)
    print(markdown_table(result))
    print(render_target_check(result))
    print(f"wrote {json_path} and {png_path}", file=sys.stderr)
    return 1 if result.get("errors") else 0

