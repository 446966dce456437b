"""``s4kv capacity``: vLLM settings and KV capacity of a model on an EC2 instance type, offline.

From the model's config.json (runtime/sizing/model_shapes.py) and the instance catalog (runtime/sizing/catalog.py):
tensor parallel only when the weights do not fit one GPU, data parallel over the remaining GPUs, the
max model length, the memory utilisation, and how many requests of a given context length fit in the
KV cache in bf16, fp8 and int4. The CDK app renders the same plan into its user data and outputs.

KV bytes per token, per layer and KV head: bf16 4*head_dim, fp8 2*head_dim, int4 head_dim + 8
(both S4 KV schemes and vLLM's int4_per_token_head: 136 at head_dim 128, 72 at 64; kernels/layout.py). vLLM
pages hold 16 tokens for bf16/fp8 and 128 for int4, so a request occupies whole pages. int4_kivi also keeps a
staging pool beside the cache, one int4 page of original keys per ``max_num_seqs`` slot in every layer, taken from
the same memory budget; the plan sets ``max_num_seqs`` so that pool takes at most KIVI_STAGING_SHARE of it. No torch
or vLLM import.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

from s4kv.runtime.schemes import (DEFAULT_SCHEME, KIVI, KV_FORMATS, SCHEME_FORMAT, SUPPORTED_HEAD_DIMS, KvFormat,
                                  ServedScheme)
from s4kv.runtime.sizing import catalog, model_shapes

GPU_MEMORY_UTILIZATION = 0.90
# Per GPU, outside vLLM's KV pool but inside its memory budget: CUDA context, CUDA graphs and the
# activation peak of a profile run at the default 8192 batched tokens. An estimate, on the safe side.
RUNTIME_RESERVE_MIB = 2048
MIN_MODEL_LEN = 4096  # below this a deployment is not useful for chat; the instance does not fit
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)
# int4_kivi's staging pool holds each running sequence's open page of keys in the model's 16-bit dtype: per slot
# 128 x head_dim x 2 bytes a layer and KV head, the room of about 240 int4 tokens at head_dim 128. At vLLM's default
# max_num_seqs it would take 64% of a 24 GB card's KV budget for an 8B model (256 slots) and 14% of an 80 GB one's
# (1,024), so the plan caps max_num_seqs at the slots that fit this share of the budget: int4_kivi then keeps at
# least 7/8 of int4's tokens (3.29x bf16's at head_dim 128).
KIVI_STAGING_SHARE = 1 / 8
STAGED_KEY_BYTES = 2  # bf16 or fp16, the model's dtype
# Up to 512, a multiple of 16 is one of vLLM's default CUDA-graph capture sizes (steps of 8 to 256, then of 16), so
# the largest decode batch replays a full graph without an extra capture size (runtime/plugin/cuda_graphs.py).
MAX_NUM_SEQS_STEP = 16


@dataclass(frozen=True)
class FormatCapacity:
    kv_format: str
    bytes_per_token: int  # all layers and KV heads of one model replica
    tokens_per_replica: int
    concurrent_requests: int  # over all data-parallel replicas, at the plan's context length


@dataclass(frozen=True)
class Plan:
    model: str
    instance: str
    scheme: str
    context: int
    tensor_parallel: int
    data_parallel: int
    max_model_len: int
    gpu_memory_utilization: float
    max_num_seqs: int
    staging_bytes_per_gpu: int  # int4_kivi's staging pool, else 0
    weight_bytes: int
    capacity: tuple[FormatCapacity, ...]

    def vllm_args(self) -> list[str]:
        return [
            "--tensor-parallel-size", str(self.tensor_parallel),
            "--data-parallel-size", str(self.data_parallel),
            "--max-model-len", str(self.max_model_len),
            "--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}",
            "--max-num-seqs", str(self.max_num_seqs),
        ]

    def for_format(self, kv_format: str) -> FormatCapacity:
        return next(row for row in self.capacity if row.kv_format == kv_format)


class DoesNotFit(ValueError):
    """The model cannot be served on this instance type with this scheme."""


def _valid_tensor_parallel(model: model_shapes.ModelShape, gpus: int) -> list[int]:
    # vLLM shards attention heads; KV heads are split or replicated, so one must divide the other.
    return [
        tp for tp in TENSOR_PARALLEL_SIZES
        if tp <= gpus and gpus % tp == 0 and model.num_heads % tp == 0
        and (model.num_kv_heads % tp == 0 or tp % model.num_kv_heads == 0)
    ]


def _kv_pool_bytes(model: model_shapes.ModelShape, gpu_bytes: float, tp: int, gmu: float) -> int:
    """The KV pool of one GPU of ``gpu_bytes`` under vLLM's share ``gmu``: what the share leaves after the runtime
    reserve and the GPU's part of the weights."""
    budget = gpu_bytes * gmu - RUNTIME_RESERVE_MIB * catalog.MIB
    return int(budget - model.weight_bytes / tp)


def vllm_default_max_num_seqs(instance: catalog.InstanceType) -> int:
    """vLLM 0.26's max_num_seqs for its OpenAI server on the instance's GPU (``EngineArgs.get_batch_defaults``):
    1,024 on GPUs of at least 70 GiB other than the A100, else 256."""
    large = instance.gpu_mib * catalog.MIB >= 70 * 2**30 and "a100" not in instance.gpu_model.lower()
    return 1024 if large else 256


def _kv_heads_per_gpu(model: model_shapes.ModelShape, tp: int) -> int:
    # vLLM splits the KV heads over the tensor-parallel ranks, or replicates one per rank when there are fewer
    return math.ceil(model.num_kv_heads / tp)


def staging_bytes_per_slot(model: model_shapes.ModelShape, tp: int) -> int:
    """One slot of int4_kivi's staging pool on one GPU: an int4 page of 16-bit keys in every layer and KV head
    (runtime/plugin/backend.py allocates ``max_num_seqs`` of them)."""
    return (KV_FORMATS["int4"].block_size * model.num_layers * _kv_heads_per_gpu(model, tp) * model.head_dim
            * STAGED_KEY_BYTES)


def kivi_max_num_seqs(model: model_shapes.ModelShape, gpu_bytes: float, gmu: float, tp: int, default: int) -> int:
    """int4_kivi's max_num_seqs on GPUs of ``gpu_bytes`` under vLLM's share ``gmu``: the most slots (a multiple of
    MAX_NUM_SEQS_STEP, at least one step) whose staging pool fits KIVI_STAGING_SHARE of the KV pool, or ``default``
    if that is fewer. `s4kv capacity`, `s4kv serve` (runtime/plugin/staging_cap.py) and `s4kv bench` apply it."""
    room = int(_kv_pool_bytes(model, gpu_bytes, tp, gmu) * KIVI_STAGING_SHARE) // staging_bytes_per_slot(model, tp)
    return min(default, max(MAX_NUM_SEQS_STEP, room // MAX_NUM_SEQS_STEP * MAX_NUM_SEQS_STEP))


def _max_num_seqs(model, instance, tp: int, gmu: float, scheme: ServedScheme) -> int:
    """vLLM's default, or for int4_kivi the cap of its staging pool (``kivi_max_num_seqs``)."""
    default = vllm_default_max_num_seqs(instance)
    if scheme != KIVI:
        return default
    return kivi_max_num_seqs(model, instance.gpu_bytes, gmu, tp, default)


def _staging_bytes_per_gpu(model, instance, tp: int, gmu: float, scheme: ServedScheme) -> int:
    if scheme != KIVI:
        return 0
    return _max_num_seqs(model, instance, tp, gmu, scheme) * staging_bytes_per_slot(model, tp)


def _blocks_per_gpu(model, instance, tp: int, gmu: float, fmt: KvFormat, staging_bytes: int = 0) -> int:
    block_bytes = (fmt.block_size * model.num_layers * _kv_heads_per_gpu(model, tp)
                   * fmt.bytes_per_head_token(model.head_dim))
    return max(0, (_kv_pool_bytes(model, instance.gpu_bytes, tp, gmu) - staging_bytes) // block_bytes)


def _format_capacity(model, instance, tp: int, dp: int, gmu: float, fmt: KvFormat, context: int,
                     staging_bytes: int) -> FormatCapacity:
    blocks = _blocks_per_gpu(model, instance, tp, gmu, fmt, staging_bytes)
    per_request = math.ceil(context / fmt.block_size)
    return FormatCapacity(
        kv_format=fmt.name,
        bytes_per_token=model.num_layers * model.num_kv_heads * fmt.bytes_per_head_token(model.head_dim),
        tokens_per_replica=blocks * fmt.block_size,
        concurrent_requests=(blocks // per_request) * dp,
    )


def plan(
    model: model_shapes.ModelShape,
    instance: catalog.InstanceType,
    scheme: ServedScheme = DEFAULT_SCHEME,
    context: int | None = None,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
) -> Plan:
    """Tensor parallel 1 with one data-parallel replica per GPU when one GPU's KV pool holds a request of
    ``context`` tokens in the scheme's format; else, of the tensor parallel sizes that hold one, the layout
    with the most concurrent requests (the other GPUs become data-parallel replicas). ``context`` defaults to the
    model's max_position_embeddings; if even the largest tensor parallel size cannot hold it, the max
    model length shrinks to what fits (at least MIN_MODEL_LEN), else DoesNotFit."""
    if scheme not in SCHEME_FORMAT:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEME_FORMAT)}")
    if SCHEME_FORMAT[scheme] == "int4" and model.head_dim not in SUPPORTED_HEAD_DIMS:
        raise DoesNotFit(f"{model.name}: S4 KV schemes need head_dim {' or '.join(map(str, SUPPORTED_HEAD_DIMS))}, "
                         f"the model has {model.head_dim}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if context is not None and not 0 < context <= model.max_position_embeddings:
        raise ValueError(f"context must be in 1..{model.max_position_embeddings} "
                         f"(max_position_embeddings of {model.name}), got {context}")
    target = context or model.max_position_embeddings
    fmt = KV_FORMATS[SCHEME_FORMAT[scheme]]
    sizes = _valid_tensor_parallel(model, instance.gpu_count)
    if not sizes:
        raise DoesNotFit(
            f"{model.name}: {model.num_heads} attention heads cannot be split over {instance.gpu_count} GPUs")

    def staging(tp: int) -> int:
        return _staging_bytes_per_gpu(model, instance, tp, gpu_memory_utilization, scheme)

    def tokens(tp: int) -> int:
        return _blocks_per_gpu(model, instance, tp, gpu_memory_utilization, fmt, staging(tp)) * fmt.block_size

    fitting = [size for size in sizes if tokens(size) >= target]
    if not fitting:
        tp = sizes[-1]
    elif fitting[0] == 1:
        tp = 1  # the model fits one GPU: one replica per GPU, no tensor-parallel traffic
    else:
        # The model needs several GPUs: of the layouts that hold a request, the one with the most concurrent
        # requests (larger tensor parallel sizes split the weights further, leaving more room for KV).
        def concurrent(size: int) -> int:
            blocks = _blocks_per_gpu(model, instance, size, gpu_memory_utilization, fmt, staging(size))
            return blocks // math.ceil(target / fmt.block_size) * (instance.gpu_count // size)

        tp = max(fitting, key=lambda size: (concurrent(size), -size))
    max_model_len = min(target, tokens(tp) // 1024 * 1024)
    if max_model_len < min(MIN_MODEL_LEN, target):
        raise DoesNotFit(
            f"{model.name} (~{model.weight_bytes / 1e9:.1f} GB of weights) leaves too little KV cache on "
            f"{instance.name} ({instance.gpu_count}x {instance.gpu_model}, {instance.gpu_mib} MiB each)"
        )
    dp = instance.gpu_count // tp
    rows = tuple(
        _format_capacity(model, instance, tp, dp, gpu_memory_utilization, KV_FORMATS[name], max_model_len,
                         staging(tp) if name == SCHEME_FORMAT[scheme] else 0)
        for name in KV_FORMATS
    )
    return Plan(model.name, instance.name, scheme, max_model_len, tp, dp, max_model_len, gpu_memory_utilization,
                _max_num_seqs(model, instance, tp, gpu_memory_utilization, scheme), staging(tp), model.weight_bytes,
                rows)


# --- command line ---------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="config.json path, model folder, or model id (local HF cache or built-in)")
    parser.add_argument("--instance", required=True,
                        help="EC2 instance type, e.g. g6.xlarge (see runtime/sizing/catalog.py)")
    parser.add_argument("--context", type=int, default=None, help="tokens per request (default: the model's maximum)")
    parser.add_argument("--scheme", default=DEFAULT_SCHEME, choices=sorted(SCHEME_FORMAT),
                        help="KV scheme the settings are for")
    parser.add_argument("--gpu-memory-utilization", type=float, default=GPU_MEMORY_UTILIZATION)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _report(plan_: Plan, model: model_shapes.ModelShape, instance: catalog.InstanceType) -> str:
    bf16 = plan_.for_format("bf16").concurrent_requests
    lines = [
        f"{model.name} on {instance.name}: {instance.gpu_count}x {instance.gpu_model} "
        f"({instance.gpu_mib} MiB each), {instance.vcpus} vCPU, {instance.memory_mib // 1024} GiB RAM",
        f"weights ~{plan_.weight_bytes / 1e9:.1f} GB ({model.num_params / 1e9:.2f}B params x "
        f"{model.weight_bytes_per_param:g} B); "
        f"tensor parallel {plan_.tensor_parallel}, data parallel {plan_.data_parallel}",
        f"{'KV format':<10}{'bytes/token':>12}{'tokens/replica':>16}{f'requests @{plan_.context}':>20}{'vs bf16':>9}",
    ]
    for row in plan_.capacity:
        ratio = f"{row.concurrent_requests / bf16:.2f}x" if bf16 else "-"
        lines.append(f"{row.kv_format:<10}{row.bytes_per_token:>12}{row.tokens_per_replica:>16}"
                     f"{row.concurrent_requests:>20}{ratio:>9}")
    if plan_.staging_bytes_per_gpu:
        lines.append(f"int4 row: after int4_kivi's staging pool of {plan_.max_num_seqs} slots (max_num_seqs), "
                     f"{plan_.staging_bytes_per_gpu / 2**30:.2f} GiB per GPU")
    lines.append(f"vLLM settings for {plan_.scheme}: {' '.join(plan_.vllm_args())}")
    served = "MODEL" if model.name.endswith(".json") else model.name  # a bare config.json is not servable
    command = f"s4kv serve {served} --scheme {plan_.scheme}"  # bf16 too: the same server, key and exit statuses
    lines.append(f"serve with: {command} {' '.join(plan_.vllm_args())}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        model = model_shapes.load(args.model)
        instance = catalog.instance_type(args.instance)
        plan_ = plan(model, instance, args.scheme, args.context, args.gpu_memory_utilization)
    except ValueError as error:  # DoesNotFit included
        print(f"s4kv capacity: {error}")
        return 2
    if args.json:
        print(json.dumps({**asdict(plan_), "vllm_args": plan_.vllm_args()}, indent=2))
    else:
        print(_report(plan_, model, instance))
    return 0
