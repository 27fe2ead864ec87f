"""Exhaustive check that the compiled CPU quantizer's single fp32 -> FP8 cast gives the reference's bits.

backend_compiled.encode_nearest clamps to +-max and casts; the reference rounds onto the FP8 grid itself
(reference.round_to_grid) and then casts exactly. This walks every fp32 bit pattern of magnitude below 1.5 x max,
both signs, both formats (about 2.3e9 values each), in 16 Mi-value slices: ~2 min per format on one core.
Usage: python launch/check_cast.py [e4m3 e5m2]; exits 1 on any mismatch.
"""

from __future__ import annotations

import sys
import time

import torch

from fp8comm.quant import reference as ref
from fp8comm.quant.backend_compiled import encode_nearest
from fp8comm.quant.formats import get_format
from fp8comm.quant.scaling import BlockScaling

STEP = 1 << 24


def check(name: str) -> int:
    fmt = get_format(name)
    one = torch.ones(STEP // 128, 1)
    cast = torch.compile(lambda y: encode_nearest(y, one[: y.shape[0]], BlockScaling(128), fmt).view(torch.uint8))
    hi = int(torch.tensor([fmt.max * 1.5]).view(torch.int32))
    bad, t0 = 0, time.time()
    for a in range(0, hi, STEP):
        b = torch.arange(a, min(a + STEP, hi), dtype=torch.int32)
        b = torch.cat([b, b.new_zeros(-b.numel() % 128)])
        for sign in (0, -(2**31)):
            y = (b | sign).view(torch.float32).view(-1, 128)
            want = ref.round_to_grid(torch.clamp(y, -fmt.max, fmt.max), fmt).to(fmt.dtype).view(torch.uint8)
            ne = int((cast(y) != want).sum())
            if ne:
                print(f"{name}: {ne} mismatches in [{a:#x}, {a + STEP:#x}) sign {sign != 0}", flush=True)
            bad += ne
    print(
        f"{name}: every fp32 below {fmt.max * 1.5:g} in magnitude, both signs: {bad} mismatches "
        f"({time.time() - t0:.0f} s, torch {torch.__version__})",
        flush=True,
    )
    return bad


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(1 if sum(check(n) for n in (sys.argv[1:] or ["e4m3", "e5m2"])) else 0)
