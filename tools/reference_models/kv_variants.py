"""Teacher-forced quality of S4 KV scheme options against vLLM's int4 and fp8, with every context token read back
from the stored format (the decode condition), through the torch references on the CPU.

    python tools/reference_models/kv_variants.py models/s4kv-ref-qwen2    # ~5 minutes on 2 cores: 16 x 256 tokens

`s4kv eval` measures the formats as served. Through vLLM, S4 KV's prefill attends to its own chunk's tokens in
bf16, so its teacher-forced numbers there mix bf16 and int4 context. This tool isolates the stored format and
compares the options a deployment can set (`hadamard_block`, `rotate_values`; docs/plugin.md) before they are
timed on a GPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoTokenizer

from s4kv.kernels.scheme import Int4Scheme
from s4kv.runtime.eval.data import Regime, build_inputs, load_heldout
from s4kv.runtime.eval.torch_engine import TORCH_FORMATS, PagedInt4Cache, load_model, teacher_forced
from s4kv.runtime.eval.metrics import compare_teacher_forced

REPO = Path(__file__).resolve().parents[2]


def whole_window(scheme: Int4Scheme):
    """A factory whose cache stores each window in one write (every block closes as a prefill closes it), whatever
    the teacher-forcing prefill: this tool reads every position's context back from the stored format."""
    return lambda prefill_tokens=None: PagedInt4Cache(scheme)


# label -> transform factory; the first is the reference
VARIANTS = {
    "bf16": TORCH_FORMATS["bf16_fa3"],
    "fp8 e4m3": TORCH_FORMATS["fp8_fa3"],
    "vLLM int4_per_token_head (emulated)": TORCH_FORMATS["vllm_int4"],
    "int4_kivi": whole_window(Int4Scheme("int4_kivi")),
    "int4_kivi, written one token per step (every block closed by decode steps through the staging pool)":
        lambda prefill_tokens=None: PagedInt4Cache(Int4Scheme("int4_kivi"), prefill_tokens=1),
    "int4_saw (default: hadamard_block 128)": whole_window(Int4Scheme("int4_saw")),
    "int4_saw rotate_values": whole_window(Int4Scheme("int4_saw", 128, rotate_values=True)),
    "int4_saw hadamard_block 64, rotate_values": whole_window(Int4Scheme("int4_saw", 64, True)),
    "int4_saw hadamard_block 32": whole_window(Int4Scheme("int4_saw", 32)),
}


def sweep(model_path: str, windows: int, window_len: int, heldout: Path) -> list[tuple[str, dict]]:
    model = load_model(model_path, "cpu")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    regime = Regime("variants", windows, window_len, prompts=1, prompt_len=8, generate=1)
    inputs = build_inputs(tokenizer, load_heldout(heldout), [regime])[0]
    rows, reference = [], None
    for label, make in VARIANTS.items():
        records = teacher_forced(model, inputs.windows, make, top_k=20)[0]
        reference = reference or records
        rows.append((label, compare_teacher_forced(reference, records)))
        print(f"  {label}: mean KL {rows[-1][1]['mean_kl']:.3e}", flush=True)
    return rows


def markdown(rows: list[tuple[str, dict]]) -> str:
    lines = ["| stored format | top-1 agree | ppl delta | mean KL |", "|---|---|---|---|"]
    lines += [f"| {label} | {m['top1_agreement']:.2%} | {m['perplexity_delta_pct']:+.2f}% | {m['mean_kl']:.2e} |"
              for label, m in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--window-len", type=int, default=256)
    parser.add_argument("--heldout", type=Path, default=REPO / "data/eval/heldout.jsonl")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(markdown(sweep(args.model, args.windows, args.window_len, args.heldout)))


if __name__ == "__main__":
    main()
