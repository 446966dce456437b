"""The two S4 KV int4 schemes and their options, parsed from vLLM's ``additional_config["s4kv"]``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from s4kv.runtime.schemes import KIVI, SAW, SAW_HADAMARD_BLOCKS, SCHEME_OPTIONS, SCHEMES, SchemeName

from .hadamard import block_hadamard



@dataclass(frozen=True)
class Int4Scheme:
    name: SchemeName
    # None: one Hadamard over the whole head (128 or 64 channels); int4_kivi always stages its open block's keys so
    hadamard_block: int | None = None
    rotate_values: bool = False

    def __post_init__(self) -> None:
        if self.name not in SCHEMES:
            raise ValueError(f"unknown s4kv scheme {self.name!r}: choose one of {', '.join(SCHEMES)}")
        if self.name == SAW and self.hadamard_block is not None and self.hadamard_block not in SAW_HADAMARD_BLOCKS:
            raise ValueError(
                f"int4_saw hadamard_block must be one of {SAW_HADAMARD_BLOCKS}, got {self.hadamard_block!r}"
            )
        if self.name == KIVI and (self.hadamard_block is not None or self.rotate_values):
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
        return cls(name=name, hadamard_block=options.get("hadamard_block"), rotate_values=rotate_values)

    @property
    def is_kivi(self) -> bool:
        return self.name == KIVI

    def hadamard_block_for(self, head_dim: int) -> int:
        """The Hadamard block this scheme rotates head_dim-wide keys with (int4_kivi: its open-block staging)."""
        block = head_dim if self.hadamard_block is None else self.hadamard_block
        if head_dim % block:
            raise ValueError(f"int4_saw hadamard_block {block} does not divide head_dim {head_dim}: choose one of "
                             f"{tuple(b for b in SAW_HADAMARD_BLOCKS if head_dim % b == 0)}")
        return block

    def rotation(self, head_dim: int, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [head_dim, head_dim] block-diagonal Hadamard of hadamard_block_for(head_dim)."""
        return block_hadamard(self.hadamard_block_for(head_dim), head_dim, device=device, dtype=dtype)
