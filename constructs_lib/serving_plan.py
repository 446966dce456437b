"""The per-instance-type serving plan of one model, as a CloudFormation mapping.

The model is fixed when the template is synthesized; the instance type and the scheme are template
parameters. So every catalog instance type on which the model fits (in both int4 schemes and in bf16) gets a row
with the vLLM settings of each served scheme and its capacity estimate, and the template picks its row
with Fn::FindInMap. The rows come from ``s4kv capacity`` (runtime/sizing/capacity.py): one source of truth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from constructs_lib import regions
from s4kv.runtime.schemes import SCHEME_FORMAT
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


# The mapping column with each served scheme's vLLM settings: their tensor and data parallel sizes may differ, and
# int4_kivi's max_num_seqs is capped by its staging pool (runtime/sizing/capacity.py).
ARGS_KEYS: dict[str, str] = {"int4_kivi": "KiviArgs", "int4_saw": "SawArgs", "bf16": "Bf16Args"}


@dataclass(frozen=True)
class InstancePlan:
    instance: catalog.InstanceType
    plans: dict[str, capacity.Plan]  # by served scheme, every one of ARGS_KEYS
    weight_bytes: int

    def boot_minutes(self) -> int:
        download = self.weight_bytes / DOWNLOAD_BYTES_PER_S / 60
        return 5 * math.ceil(BOOT_SAFETY * (INSTALL_MINUTES + download + LOAD_MINUTES) / 5)

    def boot_timeout(self) -> str:
        return f"PT{self.boot_minutes()}M"

    def concurrent_requests(self, scheme: str) -> int:
        """Requests of the plan's context that fit at once, over all replicas, serving ``scheme``."""
        plan = self.plans[scheme]
        return plan.for_format(SCHEME_FORMAT[scheme]).concurrent_requests

    def mapping_row(self) -> dict[str, str]:
        kivi, bf16 = self.plans["int4_kivi"], self.plans["bf16"]
        gpus = f"{self.instance.gpu_count}x {self.instance.gpu_model} ({self.instance.gpu_mib} MiB each)"
        return {
            "Gpus": gpus,
            **{key: " ".join(self.plans[scheme].vllm_args()) for scheme, key in ARGS_KEYS.items()},
            "BootTimeout": self.boot_timeout(),
            "ZoneKey": regions.zone_key(self.instance.name),  # its column in the ZoneIds mapping
            "Capacity": (
                f"{gpus}, tensor parallel {kivi.tensor_parallel} x data parallel {kivi.data_parallel}: "
                f"at {kivi.context} tokens per request, bf16 KV fits {self.concurrent_requests('bf16')}, "
                f"fp8 {bf16.for_format('fp8').concurrent_requests}, int4_kivi {self.concurrent_requests('int4_kivi')}, "
                f"int4_saw {self.concurrent_requests('int4_saw')} concurrent requests"
            ),
        }


def plans_for(model_id: str, max_model_len: int) -> dict[str, InstancePlan]:
    """Every catalog instance type the model fits on in every served scheme, in catalog order."""
    model = model_shapes.load(model_id)
    context = min(max_model_len, model.max_position_embeddings)
    plans = {}
    for instance in catalog.CATALOG.values():
        try:
            by_scheme = {scheme: capacity.plan(model, instance, scheme, context) for scheme in ARGS_KEYS}
        except capacity.DoesNotFit:
            continue
        plans[instance.name] = InstancePlan(instance, by_scheme, model.weight_bytes)
    if not plans:
        raise ValueError(f"{model_id} fits on no instance type of the catalog (or is not an S4 KV model: head_dim 128)")
    return plans


def mapping(plans: dict[str, InstancePlan]) -> dict[str, dict[str, str]]:
    return {name: plan.mapping_row() for name, plan in plans.items()}
