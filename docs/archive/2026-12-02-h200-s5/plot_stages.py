"""The pipeline-depth job's committed launches (and what they replaced) as a plot_kernels.py figure.

    python docs/archive/2026-12-02-h200-s5/plot_stages.py      # writes 2_stages.svg beside this file
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "tools" / "device"))
import plot_kernels  # noqa: E402

SHOWN = {"fa3_bf16": "fa3_bf16", "fa3_fp8": "fa3_fp8", "k_128x4x3": "int4_kivi (3 stages)",
         "k_128x4x5": "int4_kivi, 5 stages", "s_64x4x3": "int4_saw before (3 stages, two loads)",
         "s_64x4x5_paired": "int4_saw (5 stages, paired)"}
COPY_GBPS = 4281  # the device-to-device copy measured in the same series' kernel table (3_kernels.md)

rows = json.loads((HERE / "2_stages.json").read_text())
decode = [{"method": SHOWN[r["variant"]], "shape": r["shape"], "batch": r["batch"], "context": r["ctx"],
           "ms": r["us"] / 1e3, "gbps": r["gbps"]} for r in rows if r["variant"] in SHOWN]
results = {"meta": {"copy_gbps": COPY_GBPS}, "decode": decode}
plot_kernels.plot(results, HERE / "2_stages.svg", "Decode attention per layer, NVIDIA H200, 2026-12-02 15:52 UTC")
print(f"wrote {HERE / '2_stages.svg'}")
