"""Quality metrics of one KV format against the bf16 reference, from what any engine can return.

An engine (vLLM or the torch path) gives, per KV format:

* ``TeacherForced``: for every scored position of every held-out sequence, the log-probabilities of the
  top-K next tokens (sorted, best first) and of the token that actually follows;
* ``Greedy``: the tokens each fixed prompt generates greedily.

Top-1 agreement, perplexity and greedy matches are exact. The KL divergence is computed from the top-K
lists (vLLM returns no full distributions): ``KL(p_ref || p_fmt)`` over a partition of the vocabulary into
one part per token in both top-K lists, one for the token that actually follows (its log-probability is
returned in both), each with both probabilities known, and one part for every other token (its mass is one
minus the known ones, in both distributions). The KL divergence of a coarser partition can only be smaller
(data-processing inequality), so this is a lower bound of the true mean KL, exact when the top-K lists hold
nearly all the mass; tests/quality compare it with the exact value on the torch path. The target's own part
keeps the bound from vanishing when a broken format moves all its mass away from the reference's top-K
(disjoint lists would otherwise leave one part, equal in both).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLOOR = 1e-12  # keeps logs finite where a bucket is empty


@dataclass
class TeacherForced:
    top_ids: np.ndarray  # [S, N, K] int, best first
    top_logprobs: np.ndarray  # [S, N, K] float
    target_logprobs: np.ndarray  # [S, N] float: log p(actual next token)
    target_ids: np.ndarray  # [S, N] int: the actual next token

    def __post_init__(self) -> None:
        if (self.top_ids.shape != self.top_logprobs.shape or self.top_ids.shape[:2] != self.target_logprobs.shape
                or self.target_ids.shape != self.target_logprobs.shape):
            raise ValueError(f"inconsistent shapes: top_ids {self.top_ids.shape}, top_logprobs "
                             f"{self.top_logprobs.shape}, target_logprobs {self.target_logprobs.shape}, "
                             f"target_ids {self.target_ids.shape}")


@dataclass
class Greedy:
    tokens: np.ndarray  # [P, G] int: G generated tokens for each of P prompts


def _same_shape(ref, fmt, what: str) -> None:
    for name in ref.__dataclass_fields__:
        a, b = getattr(ref, name), getattr(fmt, name)
        if a.shape[:2] != b.shape[:2]:
            raise ValueError(f"{what}: {name} of the format has shape {b.shape}, reference {a.shape}")


def top1_agreement(ref: TeacherForced, fmt: TeacherForced) -> float:
    _same_shape(ref, fmt, "top1_agreement")
    return float((ref.top_ids[..., 0] == fmt.top_ids[..., 0]).mean())


def perplexity(record: TeacherForced) -> float:
    return float(np.exp(-record.target_logprobs.mean()))


def _kl_terms(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """p * log(p / q) per part of a partition, finite where a part is empty."""
    return p * (np.log(np.maximum(p, FLOOR)) - np.log(np.maximum(q, FLOOR)))


def topk_kl(ref: TeacherForced, fmt: TeacherForced) -> np.ndarray:
    """Per-position KL(ref || fmt) lower bound [S, N] from top-K lists (see the module docstring)."""
    _same_shape(ref, fmt, "topk_kl")
    if np.any(ref.target_ids != fmt.target_ids):
        raise ValueError("topk_kl: the two records score different target tokens")
    p = np.exp(ref.top_logprobs.astype(np.float64))  # [S, N, K]
    match = ref.top_ids[..., :, None] == fmt.top_ids[..., None, :]  # [S, N, K_ref, K_fmt]
    found = match.any(-1)
    q = (match * np.exp(fmt.top_logprobs.astype(np.float64))[..., None, :]).sum(-1)
    p_known, q_known = np.where(found, p, 0.0), np.where(found, q, 0.0)
    # the target's own part, unless it is already one of the shared tokens
    target_shared = ((ref.top_ids == ref.target_ids[..., None]) & found).any(-1)
    p_target = np.where(target_shared, 0.0, np.exp(ref.target_logprobs.astype(np.float64)))
    q_target = np.where(target_shared, 0.0, np.exp(fmt.target_logprobs.astype(np.float64)))
    p_rest = np.clip(1.0 - p_known.sum(-1) - p_target, 0.0, 1.0)
    q_rest = np.clip(1.0 - q_known.sum(-1) - q_target, 0.0, 1.0)
    kl = _kl_terms(p_known, q_known).sum(-1) + _kl_terms(p_target, q_target) + _kl_terms(p_rest, q_rest)
    return np.maximum(kl, 0.0)


def exact_kl(ref_logprobs: np.ndarray, fmt_logprobs: np.ndarray) -> np.ndarray:
    """KL(ref || fmt) from full log-probability tensors [..., V] (the torch path can afford them)."""
    p = np.exp(ref_logprobs.astype(np.float64))
    return (p * (ref_logprobs.astype(np.float64) - fmt_logprobs.astype(np.float64))).sum(-1)


def first_divergence(ref: np.ndarray, fmt: np.ndarray) -> int | None:
    """Index of the first generated token that differs, None if the two generations are identical."""
    differ = np.nonzero(ref != fmt)[0]
    return int(differ[0]) if differ.size else None


def greedy_match(ref: Greedy, fmt: Greedy) -> dict:
    _same_shape(ref, fmt, "greedy_match")
    divergence = [first_divergence(r, f) for r, f in zip(ref.tokens, fmt.tokens)]
    length = ref.tokens.shape[1]
    diverged = [d for d in divergence if d is not None]
    return {
        "exact_match": sum(d is None for d in divergence) / len(divergence),
        "first_divergence": divergence,
        "mean_first_divergence": float(np.mean(diverged)) if diverged else None,
        "mean_matched_prefix": float(np.mean([length if d is None else d for d in divergence])) / length,
    }


def compare_teacher_forced(ref: TeacherForced, fmt: TeacherForced) -> dict:
    ref_ppl, fmt_ppl = perplexity(ref), perplexity(fmt)
    kl = topk_kl(ref, fmt)
    return {
        "top1_agreement": top1_agreement(ref, fmt),
        "perplexity": fmt_ppl,
        "perplexity_delta": fmt_ppl - ref_ppl,
        "perplexity_delta_pct": 100.0 * (fmt_ppl - ref_ppl) / ref_ppl,
        "mean_kl": float(kl.mean()),
        # every window scores the same number of positions, so their mean is mean_kl: what the bootstrap resamples
        "window_kl": [float(f"{v:.4e}") for v in kl.mean(axis=1)],
        # per window, the mean negative log-likelihood of the text: perplexity is exp of their mean
        "window_nll": [float(f"{v:.6e}") for v in -fmt.target_logprobs.astype(np.float64).mean(axis=1)],
        "positions": int(ref.target_logprobs.size),
    }


def _paired_resamples(size: int, resamples: int, seed: int) -> np.ndarray:
    """[resamples, size] window indices: one resample of the windows serves both formats of a pair."""
    return np.random.default_rng(seed).integers(0, size, size=(resamples, size))


def _paired(numerator: list[float], denominator: list[float], what: str) -> tuple[np.ndarray, np.ndarray]:
    num, den = np.asarray(numerator, np.float64), np.asarray(denominator, np.float64)
    if num.shape != den.shape or num.ndim != 1 or num.size < 2:
        raise ValueError(f"{what}: needs two equal lists of at least 2 windows, got {num.shape}, {den.shape}")
    return num, den


def _quantiles(values: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1.0 - confidence) / 2
    return float(np.quantile(values, tail)), float(np.quantile(values, 1.0 - tail))


def ratio_interval(numerator: list[float], denominator: list[float], resamples: int = 2000,
                   confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap over windows of mean(numerator) / mean(denominator): both formats were scored on the same
    windows, so one resample of window indices serves both, and the window-to-window spread that they share (some
    text is harder for every int4 format) cancels out of the ratio."""
    num, den = _paired(numerator, denominator, "ratio_interval")
    picks = _paired_resamples(num.size, resamples, seed)
    return _quantiles(num[picks].mean(1) / np.maximum(den[picks].mean(1), FLOOR), confidence)


def perplexity_ratio_interval(window_nll: list[float], reference_window_nll: list[float], resamples: int = 2000,
                              confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap over windows of one format's perplexity over another's on the same text,
    exp(mean nll - mean reference nll) (every window scores the same number of positions)."""
    nll, ref_nll = _paired(window_nll, reference_window_nll, "perplexity_ratio_interval")
    picks = _paired_resamples(nll.size, resamples, seed)
    return _quantiles(np.exp(nll[picks].mean(1) - ref_nll[picks].mean(1)), confidence)
