"""The per-instance-type serving plan of one model, as a CloudFormation mapping.

The model is fixed when the template is synthesized; the instance type and the scheme are template
parameters. So every catalog instance type on which the model fits (in int4 and in bf16) gets a row
with its vLLM settings for each KV format and its capacity estimate, and the template picks its row
with Fn::FindInMap. The rows come from ``s4kv capacity`` (runtime/sizing/capacity.py): one source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass

from s4kv.runtime.sizing import capacity, catalog, model_shapes

MAPPING_NAME = "ServingPlans"


@dataclass(frozen=True)
class InstancePlan:
    instance: catalog.InstanceType
    int4: capacity.Plan
    bf16: capacity.Plan

    def mapping_row(self) -> dict[str, str]:
        rows = {row.kv_format: row for row in self.int4.capacity}
        gpus = f"{self.instance.gpu_count}x {self.instance.gpu_model} ({self.instance.gpu_mib} MiB each)"
        return {
            "Gpus": gpus,
            "Int4Args": " ".join(self.int4.vllm_args()),
            "Bf16Args": " ".join(self.bf16.vllm_args()),
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
        plans[instance.name] = InstancePlan(instance, int4, bf16)
    if not plans:
        raise ValueError(f"{model_id} fits on no instance type of the catalog (or is not an S4 KV model: head_dim 128)")
    return plans


def mapping(plans: dict[str, InstancePlan]) -> dict[str, dict[str, str]]:
    return {name: plan.mapping_row() for name, plan in plans.items()}
