"""What `s4kv bench` measures: the KV formats (one engine configuration each), the standard workloads, the lighter
workloads for several GPUs, and how long an engine may take.

Pure data, no torch or vLLM import, so the table and plot code and its tests run anywhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from s4kv.runtime.schemes import ATTENTION_BACKEND, CONFIG_KEY, KIVI, KV_CACHE_DTYPE, SAW, find_options
from s4kv.runtime.sizing import capacity, model_shapes

MAX_MODEL_LEN = 20480  # the baseline's: long prompts are 16384 + 256 tokens
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

    @property
    def scheme(self) -> str | None:
        """The S4 KV scheme of this configuration, None for vLLM's own formats."""
        return (find_options(self.additional_config) or {}).get("scheme")

    def deployed_max_num_seqs(self, model: str, setting: int, gpu_bytes: float | None, share: float,
                              tp: int = 1) -> int:
        """The max_num_seqs this configuration runs at under a ``setting``: the setting's, for int4_kivi capped as its
        deployment caps it (`s4kv capacity`, `s4kv serve`), so that its staging pool takes at most an eighth of the
        KV budget that ``share`` leaves on GPUs of ``gpu_bytes`` for ``model`` (a config.json or its folder). No GPU
        (``gpu_bytes`` None): the setting's, as `s4kv serve` leaves it off CUDA."""
        if self.scheme != KIVI or gpu_bytes is None:
            return setting
        return capacity.kivi_max_num_seqs(model_shapes.load(model), gpu_bytes, share, tp, default=setting)

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
        # Our schemes reuse int4_per_token_head's page budget through the CUSTOM backend slot.
        KVFormat("s4kv_kivi", f"s4kv {KIVI}", KV_CACHE_DTYPE, ATTENTION_BACKEND, {CONFIG_KEY: {"scheme": KIVI}}),
        KVFormat("s4kv_saw", f"s4kv {SAW}", KV_CACHE_DTYPE, ATTENTION_BACKEND, {CONFIG_KEY: {"scheme": SAW}}),
        # an option of int4_saw measured beside the defaults: values rotated like keys, as vLLM's int4 does
        KVFormat("s4kv_saw_rotv", f"s4kv {SAW}, rotated values", KV_CACHE_DTYPE, ATTENTION_BACKEND,
                 {CONFIG_KEY: {"scheme": SAW, "rotate_values": True}}),
    )
}
# The standard formats: what `s4kv bench --configs all` and `s4kv eval` run unless told otherwise
STANDARD_FORMATS = ("bf16_fa3", "fp8_fa3", "vllm_int4", "s4kv_kivi", "s4kv_saw")


@dataclass(frozen=True)
class EngineSettings:
    """Engine arguments that differ between workloads; workloads with equal settings share one engine.

    ``tensor_parallel_size`` goes to vLLM as is. ``data_parallel_size`` replicas are independent engines, one per
    group of ``tensor_parallel_size`` GPUs, each serving its share of the requests: what vLLM 0.26.0 itself does
    for a dense model under ``--data-parallel-size`` (v1/engine/core.py: "Non-MoE DP ranks are completely
    independent"), while its offline ``LLM`` refuses ``data_parallel_size > 1`` (entrypoints/llm.py).

    Memory is one of two: ``gpu_memory_utilization``, each GPU's share as vLLM takes it, or ``gpu_memory_gb``, a
    smaller card's memory on whatever GPU runs the engine, turned into that GPU's share when the engine starts
    (24 GB is 0.16 of an H200's 150.8 GB, 0.28 of an H100's 85.5 GB, the totals NVML reports), so a card-sized
    workload measures the same budget on either.
    """

    gpu_memory_utilization: float | None
    max_num_seqs: int
    max_model_len: int = MAX_MODEL_LEN
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_gb: float | None = None

    def __post_init__(self) -> None:
        if (self.gpu_memory_utilization is None) == (self.gpu_memory_gb is None):
            raise ValueError("an engine setting takes one of gpu_memory_utilization and gpu_memory_gb")

    def memory_share(self, gpu_total_bytes: int | None) -> float:
        """The gpu_memory_utilization vLLM gets on a GPU of ``gpu_total_bytes`` (needed only for a card size)."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        if gpu_total_bytes is None:
            raise ValueError(f"a {self.gpu_memory_gb:g} GB card's budget needs the GPU's total memory")
        share = self.gpu_memory_gb * 1e9 / gpu_total_bytes
        if share > 1:
            raise ValueError(f"a {self.gpu_memory_gb:g} GB card's budget does not fit a GPU of "
                             f"{gpu_total_bytes / 1e9:.1f} GB")
        return share

    @property
    def memory_label(self) -> str:
        """"gmu 0.90", or "24 GB" for a card size."""
        if self.gpu_memory_gb is not None:
            return f"{self.gpu_memory_gb:g} GB"
        return f"gmu {self.gpu_memory_utilization:.2f}"

    @property
    def parallel(self) -> bool:
        return self.tensor_parallel_size > 1 or self.data_parallel_size > 1

    @property
    def parallel_key(self) -> str:
        """"" on one GPU, else "tp2", "dp2" or "tp2-dp2"."""
        parts = [f"tp{self.tensor_parallel_size}"] if self.tensor_parallel_size > 1 else []
        parts += [f"dp{self.data_parallel_size}"] if self.data_parallel_size > 1 else []
        return "-".join(parts)

    @property
    def parallel_label(self) -> str:
        """"" on one GPU, else e.g. "TP 2", "DP 2 (2 engines, requests split, throughput summed)"."""
        parts = [f"TP {self.tensor_parallel_size}"] if self.tensor_parallel_size > 1 else []
        if self.data_parallel_size > 1:
            parts.append(f"DP {self.data_parallel_size} ({self.data_parallel_size} engines, requests split, "
                         "throughput summed)")
        return " x ".join(parts)

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def key(self) -> str:
        memory = self.memory_label.replace(" ", "").lower()  # "gmu0.90", "24gb"
        base = f"{memory}-seqs{self.max_num_seqs}"
        return f"{base}-{self.parallel_key}" if self.parallel else base

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
    # "output_tok_s" (higher is better) or "wall_s" (lower is better): what the results table reports.
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
        Workload("24gb", "24 GB card: 24 GB of the GPU, 256 x 2048 in / 512 out (output tok/s)", 256, 2048, 512,
                 EngineSettings(gpu_memory_utilization=None, max_num_seqs=256, gpu_memory_gb=24.0), seed=4),
    )
}


# Not part of 'all' (the standard matrix): lighter workloads for several GPUs, where a 70B engine's start leaves
# little of a 10-minute GPU job for the workload.
EXTRA_WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("short128", "short128: 128 x 1024 in / 128 out, max_num_seqs 128 (output tok/s)", 128, 1024, 128,
                 EngineSettings(gpu_memory_utilization=0.90, max_num_seqs=128), seed=5),
    )
}
ALL_WORKLOADS: dict[str, Workload] = {**WORKLOADS, **EXTRA_WORKLOADS}


def parse_names(text: str, known: dict[str, Any], what: str, all_names: list[str] | None = None,
                keep_order: bool = False) -> list[str]:
    """Split a comma list ("all" = ``all_names``, by default every known name, in table order) and reject unknown
    names. The result is in table order, or with ``keep_order`` in the order given; duplicates are dropped."""
    if text.strip() == "all":
        return list(all_names if all_names is not None else known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown {what} {unknown or text!r}: choose from {', '.join(known)} or 'all'")
    if keep_order:
        return list(dict.fromkeys(names))
    return [n for n in known if n in names]


# Wall seconds of each workload as measured on the H200 (vLLM 0.26.0); a time budget must
# leave this much for a workload, and for a format not measured there, the slowest format's time.
MEASURED_WALL_S = {
    "short": {"bf16_fa3": 8.9, "fp8_fa3": 8.6, "vllm_int4": 14.5, "s4kv_kivi": 8.8, "s4kv_saw": 8.5},
    "long": {"bf16_fa3": 16.2, "fp8_fa3": 15.3, "vllm_int4": 87.9, "s4kv_kivi": 16.3, "s4kv_saw": 15.8},
    "many": {"bf16_fa3": 87.2, "fp8_fa3": 75.3, "vllm_int4": 148.0, "s4kv_kivi": 78.8, "s4kv_saw": 77.6},
    "24gb": {"bf16_fa3": 33.4, "fp8_fa3": 24.3, "vllm_int4": 45.7, "s4kv_kivi": 21.4, "s4kv_saw": 23.4},
}


# Not measured: estimated from "short" on the same card (half the requests and half the output tokens, so about
# half of its prefill and decode time).
ESTIMATED_WALL_S = {
    "short128": {"bf16_fa3": 4.5, "fp8_fa3": 4.3, "vllm_int4": 7.3},
}

# Scaling the 7B single-GPU numbers above to another model and layout. All estimates, to be replaced by
# measurements: within one `s4kv bench` call, the measured start of an earlier engine replaces START estimates, and
# each workload's measured pace (its wall over the estimate, another GPU's or model's) scales the later estimates.
REFERENCE_PARAMS = 7.62e9  # the Qwen2.5-7B shape the wall times above were measured on (model_shapes count)
REFERENCE_LAYERS = 28
START_S_PER_EXTRA_LAYER = 1.25  # torch.compile tracing and CUDA-graph capture grow with depth
TP_START_S = 20  # worker processes, NCCL and custom all-reduce set-up
TP_SLOWDOWN = 1.3  # an all-reduce after attention and after the MLP of every layer
DP_START_S = 10  # replicas compile side by side on shared CPU cores
MEASURED_MARGIN = 1.15  # on an earlier engine's measured start (start + warm-up) and pace in the same call


@dataclass(frozen=True)
class ModelScale:
    """What the time estimates need of a model: its parameter count and depth (runtime/sizing/model_shapes.py)."""

    params: float = REFERENCE_PARAMS
    layers: int = REFERENCE_LAYERS


def expected_start_s(scale: ModelScale = ModelScale(), engine: EngineSettings | None = None) -> float:
    """Engine start plus warm-up, estimated: ENGINE_START_S for the 7B shape on one GPU, more for a deeper model, a
    tensor-parallel engine or replicas starting side by side."""
    start = ENGINE_START_S + START_S_PER_EXTRA_LAYER * max(0, scale.layers - REFERENCE_LAYERS)
    if engine is not None and engine.tensor_parallel_size > 1:
        start += TP_START_S
    if engine is not None and engine.data_parallel_size > 1:
        start += DP_START_S
    return start


def wall_factor(scale: ModelScale = ModelScale(), engine: EngineSettings | None = None) -> float:
    """Wall time of a workload relative to the 7B shape on one GPU: weights per GPU (never less than the 7B's), a
    tensor-parallel slowdown, and each data-parallel replica serving 1/dp of the requests."""
    tp = engine.tensor_parallel_size if engine is not None else 1
    dp = engine.data_parallel_size if engine is not None else 1
    factor = max(1.0, scale.params / tp / REFERENCE_PARAMS)
    if tp > 1:
        factor *= TP_SLOWDOWN
    return factor / dp


def workload_wall_s(fmt: str, name: str) -> float:
    """A workload's wall time on the 7B shape and one H200: measured for this format, else the slowest format's."""
    walls = MEASURED_WALL_S.get(name) or ESTIMATED_WALL_S[name]
    return walls.get(fmt, max(walls.values()))


def expected_workload_s(fmt: str, name: str, scale: ModelScale | None = None,
                        engine: EngineSettings | None = None) -> float:
    """A workload's wall time estimated from the table: this format's measured (or the slowest) speed, scaled to the
    model and layout."""
    return wall_factor(scale or ModelScale(), engine) * workload_wall_s(fmt, name)


def expected_engine_s(fmt: str, workload_names: list[str], scale: ModelScale | None = None,
                      engine: EngineSettings | None = None, start_s: float | None = None,
                      pace: dict[str, float] | None = None) -> float:
    """Time one engine may need: its start plus each workload's estimated wall; ``start_s`` (a measured start)
    replaces the estimated start, ``pace`` (per workload, measured wall over estimate) multiplies a workload's."""
    start = expected_start_s(scale or ModelScale(), engine) if start_s is None else start_s
    pace = pace or {}
    return start + sum(expected_workload_s(fmt, name, scale, engine) * pace.get(name, 1.0) for name in workload_names)


def engine_groups(workload_names: list[str]) -> list[tuple[EngineSettings, list[str]]]:
    """Group the selected workloads by engine settings, in table order: one engine process per group."""
    groups: dict[EngineSettings, list[str]] = {}
    for name in workload_names:
        groups.setdefault(ALL_WORKLOADS[name].engine, []).append(name)
    return list(groups.items())
