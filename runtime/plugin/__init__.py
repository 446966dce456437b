"""vLLM plugin entry point (``vllm.general_plugins``: ``s4kv = s4kv.runtime.plugin:register``).

vLLM calls ``register()`` once in every process (front end, engine core, workers) before any model exists, so no
vLLM config is visible here. The plugin therefore only writes class paths into vLLM's attention-backend registry;
which class runs is decided when vLLM resolves a path inside a worker, where the config is current:

* ``CUSTOM`` -> ``s4kv.runtime.plugin.backend.S4KVAttentionBackend`` (the CUDA path, Triton kernels). vLLM's CUDA
  selector calls its ``validate_configuration``, which runs our checks (``config.check_vllm_config``).
* The backends vLLM would pick on its own (CPU_ATTN on the CPU; FLASH_ATTN, FLASHINFER, TRITON_ATTN, FLEX_ATTENTION on
  CUDA) are routed through this module: with no ``additional_config["s4kv"]`` the route hands back vLLM's own class,
  unchanged. With our options it either fails start-up with one sentence (for example ``--attention-backend CUSTOM``
  is missing, so vLLM would silently run its own int4 format) or, on the CPU platform, which ignores
  ``--attention-backend`` and always asks for CPU_ATTN, returns our CPU backend (torch reference kernels).

Registration patches no vLLM function (int4_kivi's layers wrap one runner method when built: staging.py). Importing
this module is cheap: vLLM is imported only inside the functions.
"""

from __future__ import annotations

import logging
from typing import Any

from s4kv.runtime.plugin.config import S4KVConfigError, check_vllm_config, find_options
from s4kv.runtime.plugin.version import vllm_version_mismatch

# A child of the "vllm" logger, so vLLM's own log configuration prints our lines in every process.
logger = logging.getLogger("vllm.s4kv")

GPU_BACKEND = "s4kv.runtime.plugin.backend.S4KVAttentionBackend"
CPU_BACKEND = "s4kv.runtime.plugin.cpu_backend.S4KVCpuAttentionBackend"
# The enum members vLLM selects by itself for a dense decoder, per platform; each is routed through ROUTE_PREFIX.
ROUTED_CUDA_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
ROUTED_CPU_BACKENDS = ("CPU_ATTN",)
ROUTE_PREFIX = "route_"
INCOMPATIBLE_BACKEND = "IncompatibleVllm"

# Set by register() when the installed vLLM cannot host S4 KV; start-up fails with it only if S4 KV is asked for.
_incompatibility: str | None = None


def register() -> None:
    """Put S4 KV into vLLM's attention-backend registry (idempotent)."""
    global _incompatibility
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum, register_backend

    custom_holder = _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM)
    if custom_holder not in (None, GPU_BACKEND, f"{__name__}.{INCOMPATIBLE_BACKEND}"):
        raise RuntimeError(
            f"S4 KV cannot register the CUSTOM attention backend: another plugin already holds it ({custom_holder}); "
            "allow only one with VLLM_PLUGINS."
        )
    _incompatibility = incompatibility()
    if _incompatibility is not None:
        logger.error("S4 KV is disabled: %s", _incompatibility)
        register_backend(AttentionBackendEnum.CUSTOM, f"{__name__}.{INCOMPATIBLE_BACKEND}")
    else:
        register_backend(AttentionBackendEnum.CUSTOM, GPU_BACKEND)
    routed = ROUTED_CPU_BACKENDS if current_platform.is_cpu() else ROUTED_CUDA_BACKENDS
    for name in routed:
        if name not in AttentionBackendEnum.__members__:  # an older or newer vLLM without this backend
            continue
        register_backend(AttentionBackendEnum[name], f"{__name__}.{ROUTE_PREFIX}{name}")
    logger.debug("S4 KV plugin registered (CUSTOM backend; routes for %s)", ", ".join(routed))


def incompatibility() -> str | None:
    """Why this vLLM cannot run S4 KV (one sentence), or None. Probes the facts our page layout relies on."""
    import inspect
    from typing import get_args

    import torch
    import vllm

    from s4kv.kernels.layout import PageLayout
    from s4kv.runtime.schemes import KV_CACHE_DTYPE, SUPPORTED_HEAD_DIMS

    from .config import BLOCK_SIZE

    version_problem = vllm_version_mismatch(vllm.__version__)
    if version_problem is not None:
        return version_problem
    try:
        from vllm.config.cache import CacheDType
        from vllm.v1.attention.backend import AttentionBackend
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode
    except ImportError as err:
        return f"this vLLM lacks an interface S4 KV builds on ({err})."
    if KV_CACHE_DTYPE not in get_args(CacheDType):
        return f"this vLLM has no --kv-cache-dtype {KV_CACHE_DTYPE}, whose page budget S4 KV reuses."
    shape_params = list(inspect.signature(AttentionBackend.get_kv_cache_shape).parameters)
    if shape_params != ["num_blocks", "block_size", "num_kv_heads", "head_size", "cache_dtype_str"]:
        return f"this vLLM's AttentionBackend.get_kv_cache_shape takes {shape_params}, not the 0.26.0 arguments."
    for head_dim in SUPPORTED_HEAD_DIMS:
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=head_dim, dtype=torch.uint8,
            kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD,
        )
        ours = PageLayout(BLOCK_SIZE, head_dim).page_bytes
        if spec.page_size_bytes != ours:
            return (
                f"this vLLM sizes an {KV_CACHE_DTYPE} page at head_dim {head_dim} at {spec.page_size_bytes} bytes per "
                f"KV head, not the {ours} S4 KV's layout fills."
            )
    return None


def resolve_route(name: str) -> type:
    """The class behind a routed registry entry, for the vLLM config current in this process."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or find_options(vllm_config.additional_config) is None:
        return resolve_obj_by_qualname(AttentionBackendEnum[name].value)
    if _incompatibility is not None:
        raise S4KVConfigError(_incompatibility)
    config = check_vllm_config(vllm_config)  # raises, with every cause, unless S4 KV can run as configured
    if name in ROUTED_CPU_BACKENDS:
        logger.info("S4 KV %s runs on the CPU platform in place of %s (torch reference kernels)",
                    config.scheme.name, name)
        return resolve_obj_by_qualname(CPU_BACKEND)
    # The CUDA selector only resolves these when CUSTOM was not chosen, which check_vllm_config already rejects.
    raise S4KVConfigError(f"vLLM asked for its {name} backend while S4 KV ({config.scheme.name}) is configured.")


def __getattr__(attribute: str) -> Any:
    # vLLM resolves a registry path "module.Name" with getattr(module, "Name"): the routes are decided here, lazily.
    if attribute.startswith(ROUTE_PREFIX):
        return resolve_route(attribute[len(ROUTE_PREFIX):])
    if attribute == INCOMPATIBLE_BACKEND:
        raise S4KVConfigError(_incompatibility or "S4 KV is disabled in this process.")
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")
