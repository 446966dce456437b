"""int4_saw's tile loop at other launch shapes: the split sweep for int4_saw only, DECODE_LAUNCH replaced."""
import dataclasses
import sys

from s4kv.kernels import attention
from tools.device import sweep_splits as ss

variant, out = sys.argv[1], sys.argv[2]
tile, warps, stages = map(int, variant.split("x"))
attention.DECODE_LAUNCH["int4_saw"] = dataclasses.replace(attention.DECODE_LAUNCH["int4_saw"], tile=tile,
                                                          num_warps=warps, num_stages=stages)
attention.WARP_SPLIT_LAUNCH.clear()
ss.SCHEMES = ("int4_saw",)
sys.argv = ["sweep_splits", "--out", out, "--batches", sys.argv[3], "--contexts", "1024,4096,16384,32768",
            "--budget-s", sys.argv[4]]
ss.main()
