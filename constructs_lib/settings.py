"""What a deployment is: read once from the CDK context (cdk.json and ``-c key=value``), validated.

Context keys: modelId, instanceType, scheme (int4_kivi | int4_saw | bf16), allowedCidr (optional:
becomes the AllowedCidr parameter's default; the exported templates never have one), regions
(comma separated: one stack per region), flavour (dlami | marketplace), maxModelLen, s4kvPipSpec,
modelConfig (a config.json path to size a model that is neither built in nor in the local HF cache).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from s4kv.runtime.schemes import DEFAULT_SCHEME, SCHEME_FORMAT, ServedScheme
from s4kv.runtime.sizing import catalog

FLAVOURS = ("dlami", "marketplace")
DEFAULT_MODEL = "Qwen/Qwen2.5-7B-Instruct"
DEFAULT_INSTANCE = "g6.xlarge"
DEFAULT_MAX_MODEL_LEN = 32768
# pip requirement for this project's plugin. Until s4kv is on PyPI, deploy with a pinned git URL or a
# wheel URL instead (docs/deploy.md): -c s4kvPipSpec=git+https://HOST/ORG/s4kv@COMMIT
DEFAULT_S4KV_PIP_SPEC = "s4kv==0.1.0"
VLLM_PIP_SPEC = "vllm==0.26.0"
MODEL_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)?$")  # a Hugging Face id, as vllm serve takes it


@dataclass(frozen=True)
class DeploySettings:
    model_id: str = DEFAULT_MODEL
    instance_type: str = DEFAULT_INSTANCE
    scheme: ServedScheme = DEFAULT_SCHEME
    allowed_cidr: str | None = None
    regions: tuple[str, ...] = ()
    flavour: str = "dlami"
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    s4kv_pip_spec: str = DEFAULT_S4KV_PIP_SPEC
    model_config: str | None = None

    @property
    def model_source(self) -> str:
        """What sizes the model (runtime/sizing/model_shapes.py): its config.json if given, else its id."""
        return self.model_config or self.model_id

    def __post_init__(self) -> None:
        if not MODEL_ID_PATTERN.match(self.model_id) or self.model_id.endswith(".json"):
            raise ValueError(f"modelId must be a Hugging Face model id such as Qwen/Qwen2.5-7B-Instruct, got "
                             f"{self.model_id!r} (size a local config.json with -c modelConfig=PATH)")
        catalog.instance_type(self.instance_type)  # raises with the list of known types
        if self.scheme not in SCHEME_FORMAT:
            raise ValueError(f"scheme must be one of {', '.join(SCHEME_FORMAT)}, got {self.scheme!r}")
        if self.flavour not in FLAVOURS:
            raise ValueError(f"flavour must be one of {', '.join(FLAVOURS)}, got {self.flavour!r}")
        if self.allowed_cidr is not None:
            if "/" not in self.allowed_cidr:
                raise ValueError(f"allowedCidr must be a CIDR such as 203.0.113.7/32, got {self.allowed_cidr!r}")
            network = ipaddress.ip_network(self.allowed_cidr, strict=True)  # ValueError names the problem
            if network.version != 4:
                raise ValueError(f"allowedCidr must be an IPv4 CIDR, got {self.allowed_cidr!r}")
        if self.max_model_len < 1:
            raise ValueError(f"maxModelLen must be positive, got {self.max_model_len}")

    @classmethod
    def from_context(cls, node) -> "DeploySettings":
        def get(key: str, default=None):
            value = node.try_get_context(key)
            return default if value in (None, "") else value

        regions = get("regions", "")
        if isinstance(regions, str):
            regions = (r.strip() for r in regions.split(",") if r.strip())
        regions = tuple(regions)
        return cls(
            model_id=get("modelId", DEFAULT_MODEL),
            instance_type=get("instanceType", DEFAULT_INSTANCE),
            scheme=get("scheme", DEFAULT_SCHEME),
            allowed_cidr=get("allowedCidr"),
            regions=regions,
            flavour=get("flavour", "dlami"),
            max_model_len=int(get("maxModelLen", DEFAULT_MAX_MODEL_LEN)),
            s4kv_pip_spec=get("s4kvPipSpec", DEFAULT_S4KV_PIP_SPEC),
            model_config=get("modelConfig"),
        )
