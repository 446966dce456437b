"""EC2 GPU instance catalog: every g5, g6, g6e, p4d and p5 size (plus the p4de/p5e/p5en variants).

The figures are the EC2 API's own (``DescribeInstanceTypes``: ``GpuInfo.Gpus[].MemoryInfo.SizeInMiB``,
``VCpuInfo.DefaultVCpus``, ``MemoryInfo.SizeInMiB``), not the marketing numbers: an A10G or an L4
reports 22,888 MiB, not 24 GiB. tests/deploy/test_capacity.py checks every row against the snapshot of
that API that moto ships, so a typo here fails CI.

Pure data and lookups: no torch, no vLLM, no AWS SDK (``s4kv capacity`` and the CDK app both import it).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True)
class InstanceType:
    name: str  # "g6e.12xlarge"
    gpu_model: str  # EC2's GPU name: "A10G", "L4", "L40S", "A100", "H100", "H200"
    gpu_count: int
    gpu_mib: int  # memory of ONE GPU, MiB, as the EC2 API reports it
    vcpus: int
    memory_mib: int  # host RAM

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def gpu_bytes(self) -> int:
        return self.gpu_mib * MIB

    @property
    def total_gpu_mib(self) -> int:
        return self.gpu_mib * self.gpu_count


def _row(name: str, gpu: str, count: int, gpu_mib: int, vcpus: int, memory_mib: int) -> InstanceType:
    return InstanceType(name, gpu, count, gpu_mib, vcpus, memory_mib)


_ROWS = (
    _row("g5.xlarge", "A10G", 1, 22888, 4, 16384),
    _row("g5.2xlarge", "A10G", 1, 22888, 8, 32768),
    _row("g5.4xlarge", "A10G", 1, 22888, 16, 65536),
    _row("g5.8xlarge", "A10G", 1, 22888, 32, 131072),
    _row("g5.12xlarge", "A10G", 4, 22888, 48, 196608),
    _row("g5.16xlarge", "A10G", 1, 22888, 64, 262144),
    _row("g5.24xlarge", "A10G", 4, 22888, 96, 393216),
    _row("g5.48xlarge", "A10G", 8, 22888, 192, 786432),
    _row("g6.xlarge", "L4", 1, 22888, 4, 16384),
    _row("g6.2xlarge", "L4", 1, 22888, 8, 32768),
    _row("g6.4xlarge", "L4", 1, 22888, 16, 65536),
    _row("g6.8xlarge", "L4", 1, 22888, 32, 131072),
    _row("g6.12xlarge", "L4", 4, 22888, 48, 196608),
    _row("g6.16xlarge", "L4", 1, 22888, 64, 262144),
    _row("g6.24xlarge", "L4", 4, 22888, 96, 393216),
    _row("g6.48xlarge", "L4", 8, 22888, 192, 786432),
    _row("g6e.xlarge", "L40S", 1, 45776, 4, 32768),
    _row("g6e.2xlarge", "L40S", 1, 45776, 8, 65536),
    _row("g6e.4xlarge", "L40S", 1, 45776, 16, 131072),
    _row("g6e.8xlarge", "L40S", 1, 45776, 32, 262144),
    _row("g6e.12xlarge", "L40S", 4, 45776, 48, 393216),
    _row("g6e.16xlarge", "L40S", 1, 45776, 64, 524288),
    _row("g6e.24xlarge", "L40S", 4, 45776, 96, 786432),
    _row("g6e.48xlarge", "L40S", 8, 45776, 192, 1572864),
    _row("p4d.24xlarge", "A100", 8, 40960, 96, 1179648),
    _row("p4de.24xlarge", "A100", 8, 81920, 96, 1179648),
    _row("p5.4xlarge", "H100", 1, 81920, 16, 262144),
    _row("p5.48xlarge", "H100", 8, 81920, 192, 2097152),
    _row("p5e.48xlarge", "H200", 8, 144384, 192, 2097152),
    _row("p5en.48xlarge", "H200", 8, 144384, 192, 2097152),
)

CATALOG: dict[str, InstanceType] = {row.name: row for row in _ROWS}
FAMILIES = ("g5", "g6", "g6e", "p4d", "p4de", "p5", "p5e", "p5en")


def instance_type(name: str) -> InstanceType:
    """The catalog row for ``name``; a clear error listing the known sizes otherwise."""
    try:
        return CATALOG[name]
    except KeyError:
        known = ", ".join(CATALOG)
        raise ValueError(f"unknown instance type {name!r}; the catalog has: {known}") from None
