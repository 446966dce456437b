"""The two S4 KV int4 schemes and their options, parsed from vLLM's ``additional_config["s4kv"]``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from s4kv.runtime.schemes import (DEFAULT_HADAMARD_BLOCK, KIVI, SAW, SAW_HADAMARD_BLOCKS, SCHEME_OPTIONS, SCHEMES,
                                  SchemeName)

from .hadamard import block_hadamard
from .layout import HEAD_DIM

# An open KIVI block stages its keys per token after the full-head rotation (see docs/format.md).
KIVI_STAGING_BLOCK = 128


@dataclass(frozen=True)
class Int4Scheme:
    name: SchemeName
    hadamard_block: int = DEFAULT_HADAMARD_BLOCK
    rotate_values: bool = False

    def __post_init__(self) -> None:
        if self.name not in SCHEMES:
            raise ValueError(f"unknown s4kv scheme {self.name!r}: choose one of {', '.join(SCHEMES)}")
        if self.name == SAW and self.hadamard_block not in SAW_HADAMARD_BLOCKS:
            raise ValueError(
                f"int4_saw hadamard_block must be one of {SAW_HADAMARD_BLOCKS}, got {self.hadamard_block!r}"
            )
        if self.name == KIVI and (self.hadamard_block != KIVI_STAGING_BLOCK or self.rotate_values):
            raise ValueError("int4_kivi takes no rotation options (hadamard_block, rotate_values are int4_saw options)")

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> "Int4Scheme":
        """Build from the user's ``{"scheme": ..., ...}`` dict; unknown keys are errors, not ignored."""
        if not isinstance(options, Mapping) or "scheme" not in options:
            raise ValueError(f's4kv options need a "scheme" ({" or ".join(SCHEMES)}), got {options!r}')
        name = options["scheme"]
        if name not in SCHEMES:
            raise ValueError(f"unknown s4kv scheme {name!r}: choose one of {', '.join(SCHEMES)}")
        unknown = set(options) - SCHEME_OPTIONS[name]
        if unknown:
            raise ValueError(
                f"unknown option(s) {sorted(unknown)} for {name}; allowed: {sorted(SCHEME_OPTIONS[name])}"
            )
        rotate_values = options.get("rotate_values", False)
        if not isinstance(rotate_values, bool):
            raise ValueError(f"rotate_values must be true or false, got {rotate_values!r}")
        return cls(name=name, hadamard_block=options.get("hadamard_block", DEFAULT_HADAMARD_BLOCK),
                   rotate_values=rotate_values)

    @property
    def is_kivi(self) -> bool:
        return self.name == KIVI

    def rotation(self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [128, 128] block-diagonal Hadamard this scheme rotates keys with (KIVI: its open-block staging)."""
        return block_hadamard(self.hadamard_block, HEAD_DIM, device=device, dtype=dtype)
