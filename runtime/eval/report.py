"""`s4kv eval` results as a Markdown table and a PNG plot (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from s4kv.runtime.bench.matrix import FORMATS
from s4kv.runtime.bench.plot import COLORS

from .metrics import perplexity_ratio_interval, ratio_interval

# (key in a regime's metrics, column title, format string)
COLUMNS = [
    ("top1_agreement", "top-1 agree", "{:.2%}"),
    ("perplexity", "ppl", "{:.3f}"),
    ("perplexity_delta_pct", "ppl delta", "{:+.2f}%"),
    ("mean_kl", "mean KL", "{:.2e}"),
    ("exact_match", "greedy exact", "{:.0%}"),
    ("mean_first_divergence", "first diverge (mean)", "{:.1f}"),
]
# The torch engine runs torch references (and one emulation), not vLLM's backends: say so in its labels.
TORCH_LABELS = {"bf16_fa3": "bf16 KV", "fp8_fa3": "fp8 e4m3 KV", "vllm_int4": "int4 per-token + RHT (emulated)",
                "s4kv_kivi": "s4kv int4_kivi (torch ref)", "s4kv_saw": "s4kv int4_saw (torch ref)",
                "s4kv_saw_rotv": "s4kv int4_saw, rotated values (torch ref)"}
PLOTTED = [("top1_agreement", "top-1 agreement with bf16"), ("perplexity_delta_pct", "perplexity delta (%)"),
           ("mean_kl", "mean KL (nats)"), ("exact_match", "greedy exact match")]


def label(name: str, engine: str) -> str:
    if engine == "torch" and name in TORCH_LABELS:
        return TORCH_LABELS[name]
    return FORMATS[name].label if name in FORMATS else name


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def markdown_table(result: dict) -> str:
    """One row per (regime, format); formats in the order they ran, the reference first."""
    lines = []
    for regime, settings in result["regimes"].items():
        # results saved before windows had a prefill scored every token after the first
        prefill = settings.get("prefill")
        forced = (f"{settings['windows']} windows of {settings['window_len']} tokens: {prefill} prefilled, "
                  f"{settings['window_len'] - prefill - 1} scored by forced decode steps" if prefill else
                  f"{settings['windows']} x {settings['window_len']} teacher-forced tokens")
        lines.append(f"**{result['model_name']}, {regime} context** ({forced}; {settings['prompts']} prompts of "
                     f"{settings['prompt_len']} tokens, {settings['generate']} greedy tokens each)\n")
        lines.append("| KV format | " + " | ".join(title for _, title, _ in COLUMNS) + " |")
        lines.append("|---" * (len(COLUMNS) + 1) + "|")
        for name, per_regime in result["formats"].items():
            metrics = per_regime[regime]
            cells = [_cell(metrics.get(key), fmt) for key, _, fmt in COLUMNS]
            lines.append(f"| {label(name, result['engine'])} | " + " | ".join(cells) + " |")
        lines.append("")
    for name, reason in result.get("unsupported", {}).items():
        lines.append(f"{label(name, result['engine'])}: not run ({reason})")
    for name, error in result.get("errors", {}).items():
        lines.append(f"{label(name, result['engine'])}: failed ({error.strip().splitlines()[-1]})")
    if result.get("pending"):  # a run cut short: evaluate() saves after every format
        lines.append(f"not measured: {', '.join(result['pending'])} (the run stopped before them)")
    return "\n".join(lines)


# The quality target: each S4 KV scheme at least as good as vLLM's int4 on every metric (True: higher is better),
# and int4_kivi better than int4_saw
TARGET_METRICS = [("top1_agreement", "top-1", "{:.2%}", True), ("perplexity_delta_pct", "ppl delta", "{:+.2f}%", False),
                  ("mean_kl", "KL", "{:.2e}", False), ("exact_match", "greedy exact", "{:.0%}", True)]
TARGET_SCHEMES = ("s4kv_kivi", "s4kv_saw", "s4kv_saw_rotv")
TARGET_REFERENCE = "vllm_int4"
TARGET_PAIRS = [(scheme, TARGET_REFERENCE) for scheme in TARGET_SCHEMES] + [("s4kv_kivi", "s4kv_saw")]


def paired_ratios(ours: dict, theirs: dict) -> dict[str, tuple[float, float, float]]:
    """Our mean KL and perplexity over theirs on the same windows, each as (ratio, 95% low, 95% high) from a paired
    bootstrap over the windows; only the metrics whose per-window values the run kept (result files written before
    per-window values were kept have none)."""
    ratios = {}
    if len(ours.get("window_kl", [])) > 1 and len(ours["window_kl"]) == len(theirs.get("window_kl", [])) \
            and theirs["mean_kl"]:
        ratios["mean_kl"] = (ours["mean_kl"] / theirs["mean_kl"], *ratio_interval(ours["window_kl"],
                                                                                  theirs["window_kl"]))
    if len(ours.get("window_nll", [])) > 1 and len(ours["window_nll"]) == len(theirs.get("window_nll", [])):
        ratios["perplexity_delta_pct"] = (ours["perplexity"] / theirs["perplexity"],
                                          *perplexity_ratio_interval(ours["window_nll"], theirs["window_nll"]))
    return ratios


def _ratio_text(key: str, ratio: tuple[float, ...]) -> str:
    """" (0.97x, 95% CI 0.93-1.01)" for KL, " (ppl 0.985x, 95% CI 0.975-0.996)" for perplexity; the ratio alone
    where the run kept no per-window values."""
    if len(ratio) == 1:
        return f" ({ratio[0]:.2f}x)"
    if key == "mean_kl":
        return f" ({ratio[0]:.2f}x, 95% CI {ratio[1]:.2f}-{ratio[2]:.2f})"
    return f" (ppl {ratio[0]:.3f}x, 95% CI {ratio[1]:.3f}-{ratio[2]:.3f})"


def target_check(result: dict) -> list[str]:
    """One line per (pair, regime): each metric of the first format against the second in the same run, 'ok' or
    'MISSED' by the measured values, with the paired intervals of the KL and perplexity ratios."""
    formats = result["formats"]
    lines = []
    for scheme, reference in ((a, b) for a, b in TARGET_PAIRS if a in formats and b in formats):
        for regime in result["regimes"]:
            ours, theirs = formats[scheme][regime], formats[reference][regime]
            ratios = paired_ratios(ours, theirs)
            if "mean_kl" not in ratios and theirs.get("mean_kl"):  # runs that kept no per-window KL
                ratios["mean_kl"] = (ours["mean_kl"] / theirs["mean_kl"],)
            verdicts = []
            for key, title, fmt, higher_is_better in TARGET_METRICS:
                if ours.get(key) is None or theirs.get(key) is None:
                    continue
                ok = ours[key] >= theirs[key] if higher_is_better else ours[key] <= theirs[key]
                extra = _ratio_text(key, ratios[key]) if key in ratios else ""
                verdicts.append(f"{title} {fmt.format(ours[key])} vs {fmt.format(theirs[key])}{extra}: "
                                f"{'ok' if ok else 'MISSED'}")
            lines.append(f"{scheme} {regime} vs {label(reference, result['engine'])}: " + "; ".join(verdicts))
    return lines


def render_target_check(result: dict) -> str:
    """target_check as a Markdown list (it goes under the tables in docs/results/quality.md)."""
    return "\n".join(f"- {line}" for line in target_check(result))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = list(result["regimes"])
    formats = list(result["formats"])
    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(4.2 * len(PLOTTED), 3.6))
    width = 0.8 / len(formats)
    for ax, (key, title) in zip(axes, PLOTTED):
        for i, name in enumerate(formats):
            values = [result["formats"][name][r].get(key) or 0.0 for r in regimes]
            ax.bar([x + i * width for x in range(len(regimes))], values, width,
                   label=label(name, result["engine"]), color=COLORS.get(name))
        ax.set_xticks([x + width * (len(formats) - 1) / 2 for x in range(len(regimes))], regimes)
        ax.set_title(title, fontsize=10)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"{result['model_name']}: KV formats against bf16 KV ({result['engine']} engine)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    """``python -m s4kv.runtime.eval.report RESULT.json...``: the tables for docs/results/quality.md, with their
    commands."""
    import json

    for path in argv:
        result = json.loads(Path(path).read_text())
        print(f"Command: `{result['command']}` ({result['engine']} engine, top-{result['top_k']} log-probs)\n")
        print(markdown_table(result))
        print(render_target_check(result) + "\n")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
