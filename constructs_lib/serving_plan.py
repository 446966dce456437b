"""The per-instance-type serving plan of one model, as a CloudFormation mapping.

The model is fixed when the template is synthesized; the instance type and the scheme are template
parameters. So every catalog instance type on which the model fits (in int4 and in bf16) gets a row
with its vLLM settings for each KV format and its capacity estimate, and the template picks its row
with Fn::FindInMap. The rows come from ``s4kv capacity`` (runtime/sizing/capacity.py): one source of truth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from constructs_lib import regions
from s4kv.runtime.sizing import capacity, catalog, model_shapes

MAPPING_NAME = "ServingPlans"
# The boot's time budget (the CreationPolicy timeout), reasoned, not yet measured on AWS: installing the locked
# runtime (about 4 GB of wheels, mostly torch and the CUDA libraries) ~8 min, downloading the weights at a
# conservative 100 MB/s from Hugging Face, loading them plus torch.compile and CUDA graph capture ~7 min;
# then 1.5x that for a slow mirror or a cold EBS volume, rounded up to 5 minutes.
INSTALL_MINUTES = 8
LOAD_MINUTES = 7
DOWNLOAD_BYTES_PER_S = 100e6
BOOT_SAFETY = 1.5


@dataclass(frozen=True)
class InstancePlan:
    instance: catalog.InstanceType
    int4: capacity.Plan
    bf16: capacity.Plan
    weight_bytes: int

    def boot_minutes(self) -> int:
        download = self.weight_bytes / DOWNLOAD_BYTES_PER_S / 60
        return 5 * math.ceil(BOOT_SAFETY * (INSTALL_MINUTES + download + LOAD_MINUTES) / 5)

    def boot_timeout(self) -> str:
        return f"PT{self.boot_minutes()}M"

    def mapping_row(self) -> dict[str, str]:
        rows = {row.kv_format: row for row in self.int4.capacity}
        gpus = f"{self.instance.gpu_count}x {self.instance.gpu_model} ({self.instance.gpu_mib} MiB each)"
        return {
            "Gpus": gpus,
            "Int4Args": " ".join(self.int4.vllm_args()),
            "Bf16Args": " ".join(self.bf16.vllm_args()),
            "BootTimeout": self.boot_timeout(),
            "ZoneKey": regions.zone_key(self.instance.name),  # its column in the ZoneIds mapping
            "Capacity": (
                f"{gpus}, tensor parallel {self.int4.tensor_parallel} x data parallel {self.int4.data_parallel}: "
                f"at {self.int4.context} tokens per request, bf16 KV fits {rows['bf16'].concurrent_requests}, "
                f"fp8 {rows['fp8'].concurrent_requests}, int4 {rows['int4'].concurrent_requests} concurrent requests"
            ),
        }


def plans_for(model_id: str, max_model_len: int) -> dict[str, InstancePlan]:
    """Every catalog instance type the model fits on, in catalog order."""
    model = model_shapes.load(model_id)
    context = min(max_model_len, model.max_position_embeddings)
    plans = {}
    for instance in catalog.CATALOG.values():
        try:
            int4 = capacity.plan(model, instance, "int4_kivi", context)
            bf16 = capacity.plan(model, instance, "bf16", context)
        except capacity.DoesNotFit:
            continue
        plans[instance.name] = InstancePlan(instance, int4, bf16, model.weight_bytes)
    if not plans:
        raise ValueError(f"{model_id} fits on no instance type of the catalog (or is not an S4 KV model: head_dim 128)")
    return plans


def mapping(plans: dict[str, InstancePlan]) -> dict[str, dict[str, str]]:
    return {name: plan.mapping_row() for name, plan in plans.items()}
