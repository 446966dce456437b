"""What `s4kv bench` measures: the KV formats (one engine configuration each) and the issue-4 workloads.

Pure data, no torch or vLLM import, so the table and plot code and its tests run anywhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MAX_MODEL_LEN = 20480  # the issue-4 baseline: long prompts are 16384 + 256 tokens
# Engine start (torch.compile + CUDA graphs for a 7B shape, 45-70 s on the H200) plus the warm-up.
ENGINE_START_S = 80


@dataclass(frozen=True)
class KVFormat:
    """One KV-cache configuration of vLLM 0.26.0: the engine arguments that select it."""

    name: str
    label: str
    kv_cache_dtype: str
    attention_backend: str
    additional_config: dict[str, Any] | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "kv_cache_dtype": self.kv_cache_dtype,
            "attention_backend": self.attention_backend,
        }
        if self.additional_config is not None:
            kwargs["additional_config"] = self.additional_config
        return kwargs


BASELINE = "bf16_fa3"
FORMATS: dict[str, KVFormat] = {
    fmt.name: fmt
    for fmt in (
        KVFormat("bf16_fa3", "bf16 + FA3", "auto", "FLASH_ATTN"),
        KVFormat("fp8_fa3", "fp8 + FA3", "fp8", "FLASH_ATTN"),
        KVFormat("vllm_int4", "vLLM int4_per_token_head", "int4_per_token_head", "TRITON_ATTN"),
        # Our schemes reuse int4_per_token_head's page budget through the CUSTOM backend slot (issue 3).
        KVFormat("s4kv_kivi", "s4kv int4_kivi", "int4_per_token_head", "CUSTOM",
                 {"s4kv": {"scheme": "int4_kivi"}}),
        KVFormat("s4kv_saw", "s4kv int4_saw", "int4_per_token_head", "CUSTOM",
                 {"s4kv": {"scheme": "int4_saw"}}),
    )
}


@dataclass(frozen=True)
class EngineSettings:
    """Engine arguments that differ between workloads; workloads with equal settings share one engine."""

    gpu_memory_utilization: float
    max_num_seqs: int
    max_model_len: int = MAX_MODEL_LEN

    @property
    def key(self) -> str:
        return f"gmu{self.gpu_memory_utilization:.2f}-seqs{self.max_num_seqs}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Workload:
    """A batch of token-id prompts sent at once; greedy, ignore_eos, so every request makes output_len tokens."""

    name: str
    title: str
    num_requests: int
    input_len: int
    output_len: int
    engine: EngineSettings
    # "output_tok_s" (higher is better) or "wall_s" (lower is better): what the issue-4 table reports.
    metric: str = "output_tok_s"
    seed: int = field(default=0, compare=False)

    @property
    def higher_is_better(self) -> bool:
        return self.metric != "wall_s"

    def to_spec(self) -> dict[str, Any]:
        """JSON-ready form for the engine process's spec file (the engine runs exactly what it is sent)."""
        return asdict(self)

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> "Workload":
        return cls(**{**spec, "engine": EngineSettings(**spec["engine"])})


FULL_CARD = EngineSettings(gpu_memory_utilization=0.90, max_num_seqs=256)
WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("short", "short: 256 x 1024 in / 256 out (output tok/s)", 256, 1024, 256, FULL_CARD,
                 seed=1),
        Workload("long", "long: 32 x 16384 in / 256 out (wall s)", 32, 16384, 256, FULL_CARD, "wall_s",
                 seed=2),
        Workload("many", "many: 1024 x 2048 in / 512 out, max_num_seqs 1024 (output tok/s)", 1024, 2048, 512,
                 EngineSettings(gpu_memory_utilization=0.90, max_num_seqs=1024), seed=3),
        Workload("24gb", "24 GB card: gmu 0.16, 256 x 2048 in / 512 out (output tok/s)", 256, 2048, 512,
                 EngineSettings(gpu_memory_utilization=0.16, max_num_seqs=256), seed=4),
    )
}


def parse_names(text: str, known: dict[str, Any], what: str) -> list[str]:
    """Split a comma list ("all" = every known name, in table order) and reject unknown names."""
    if text.strip() == "all":
        return list(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown {what} {unknown or text!r}: choose from {', '.join(known)} or 'all'")
    return [n for n in known if n in names]  # table order, duplicates dropped


# Wall seconds of each workload as issue 4 measured them on the H200 (vLLM 0.26.0); a time budget must
# leave this much for a workload, and for a format not measured there, the slowest format's time.
MEASURED_WALL_S = {
    "short": {"bf16_fa3": 8.9, "fp8_fa3": 8.6, "vllm_int4": 14.5},
    "long": {"bf16_fa3": 16.2, "fp8_fa3": 15.3, "vllm_int4": 87.9},
    "many": {"bf16_fa3": 87.2, "vllm_int4": 148.0},
    "24gb": {"bf16_fa3": 33.4, "vllm_int4": 45.7},
}


def expected_engine_s(fmt: str, workload_names: list[str]) -> float:
    """Time one engine may need: its start plus each workload at this format's measured (or the slowest) speed."""
    walls = [MEASURED_WALL_S[name].get(fmt, max(MEASURED_WALL_S[name].values())) for name in workload_names]
    return ENGINE_START_S + sum(walls)


def engine_groups(workload_names: list[str]) -> list[tuple[EngineSettings, list[str]]]:
    """Group the selected workloads by engine settings, in table order: one engine process per group."""
    groups: dict[EngineSettings, list[str]] = {}
    for name in workload_names:
        groups.setdefault(WORKLOADS[name].engine, []).append(name)
    return list(groups.items())
