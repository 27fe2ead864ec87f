#!/usr/bin/env python3
"""GPU checks of scratch-memory lifetime across CUDA streams, and of E8M0 decoding on the hardware path.

check_stream_reuse(device): ten async all-gathers are issued on stream A (where their scratch blocks are
allocated) and waited on stream B behind a GPU sleep, so every decode is still queued when the host releases the
blocks. The pool then drops blocks (eviction of more than 8 free ones; clear()) and stream A allocates and fills
memory of the same sizes at once. Outputs must equal a synchronous reference. A control pool that skips the
record_stream of the releasing stream runs the same scenario and must show corrupted outputs, or the scenario
proves nothing. check_e8m0_decode(device): every E8M0 scale byte (0 -> 2**-127, an fp32 subnormal; 255 -> NaN)
through the Triton wire decoders on the GPU against the CPU reference.

Both return rows {"name": str, "ok": bool, "detail": str}; launch/gpu_ready_check.py runs them as sections.
Standalone: `PYTHONPATH=. python3 launch/gpu_check_streams.py` prints the rows as JSON (exit 1 if any fails).
Importable without CUDA (nothing runs at import).
"""

from __future__ import annotations

import gc
import json
import sys

import torch

CALLS = 10  # async calls per round: more scratch blocks than the pool keeps free (8), so some are evicted
SLEEP_CYCLES = 1_000_000_000  # torch.cuda._sleep ahead of the decodes on stream B (~0.5 s at ~2 GHz)


def _row(name: str, ok: bool, detail: str) -> dict:
    return {"name": name, "ok": bool(ok), "detail": detail}


def _init_group(device: torch.device) -> None:
    """A one-rank NCCL default group on `device`, unless a group exists (gpu_ready_check makes the same one)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)


def _pools():
    """(recording pool class, control pool class that never record_streams a block)."""
    from fp8comm.comm import buffers

    class Tracked(buffers.ScratchPool):
        def __init__(self) -> None:
            super().__init__()
            self.block_bytes: set[int] = set()

        def take(self, numel, dtype, device):
            view, block = super().take(numel, dtype, device)
            self.block_bytes.add(block.base.numel() * block.base.element_size())
            return view, block

    class Unrecorded(Tracked):
        def _used_on(self, block, stream) -> None:
            pass  # the bug: the allocator only knows the allocation stream

    return Tracked, Unrecorded


def _round(device: torch.device, pool, xs: list, wants: list, clear: bool, sleep_cycles: int) -> dict:
    import fp8comm.comm as fc

    buf = fc.Buffer(check=False)
    buf.pool = pool
    sa, sb = torch.cuda.Stream(device), torch.cuda.Stream(device)
    outs = [torch.empty_like(w) for w in wants]
    torch.cuda.synchronize(device)
    handles: list = []
    with torch.cuda.stream(sa):
        for x, o in zip(xs, outs):
            handles.append(buf.all_gather_into(o, x, async_op=True))
    with torch.cuda.stream(sb):
        torch.cuda._sleep(sleep_cycles)  # every decode below is queued behind this
        for h in handles:
            h.wait()  # releases the call's blocks to the pool, on stream B
    handles.clear()  # the handles' views of the scratch go: the pool holds the blocks' last references
    gc.collect()
    evictions = pool.evictions
    recorded = sum(sb in blk.streams for fl in pool._free.values() for blk in fl)
    if clear:
        pool.clear()
    with torch.cuda.stream(sa):  # the allocation stream: it may get the dropped blocks' memory right away
        junk = [
            torch.empty(n, dtype=torch.uint8, device=device).fill_(0xFF) for n in sorted(pool.block_bytes) for _ in "ab"
        ]
    torch.cuda.synchronize(device)
    bad = sum(not torch.equal(o, w) for o, w in zip(outs, wants))
    del junk
    return {"bad": bad, "evictions": evictions, "recorded_on_b": recorded, "blocks": pool.allocations}


def check_stream_reuse(device: torch.device | str = "cuda", sleep_cycles: int = SLEEP_CYCLES) -> list[dict]:
    """Rows stream_reuse.{evict,clear} (ok: every output equals the synchronous reference) and
    stream_reuse.control_{evict,clear} (ok: the control pool without record_stream DID corrupt outputs)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return [_row("stream_reuse", False, f"needs a CUDA device, got {device}")]
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    import fp8comm.comm as fc

    _init_group(device)
    g = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn((i + 1) << 18, device=device, generator=g) * (i + 1) for i in range(CALLS)]
    wants = [fc.all_gather(x, check=False) for x in xs]  # synchronous reference (also compiles the kernels)
    torch.cuda.synchronize(device)
    ms = sleep_cycles / 2e6
    Tracked, Unrecorded = _pools()
    rows = []
    for clear in (False, True):
        what = "clear" if clear else "evict"
        for control, cls in ((False, Tracked), (True, Unrecorded)):
            name = f"stream_reuse.{'control_' if control else ''}{what}"
            try:
                r = _round(device, cls(), xs, wants, clear, sleep_cycles)
            except Exception as e:  # one failed round must not hide the others
                rows.append(_row(name, False, f"{type(e).__name__}: {e}"))
                continue
            detail = (
                f"{CALLS} async all_gathers on stream A, waited on B behind a ~{ms:.0f} ms GPU sleep; "
                f"{r['blocks']} blocks, {r['evictions']} evicted{', then clear()' if clear else ''}; "
                f"free blocks recorded on B: {r['recorded_on_b']}; outputs differing from the sync reference: "
                f"{r['bad']} of {CALLS}"
            )
            if control:
                ok = r["bad"] > 0
                detail = "control pool without record_stream (must corrupt): " + detail
            else:
                ok = r["bad"] == 0 and (clear or r["evictions"] > 0)
            rows.append(_row(name, ok, detail))
    return rows


def check_e8m0_decode(device: torch.device | str = "cuda") -> list[dict]:
    """Row e8m0_decode (ok: unpack_chunks and unpack_sum of every E8M0 scale byte with every FP8 code, Triton on
    `device`, equal the CPU reference bit for bit outside NaN payloads: byte 0 is 2**-127, not flushed; 255 NaN)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return [_row("e8m0_decode", False, f"needs a CUDA device, got {device}")]
    from fp8comm.quant import ChunkLayout, Scaling, get_format, unpack_chunks, unpack_sum

    def canon(t: torch.Tensor) -> torch.Tensor:
        t = t.float().cpu()
        return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int32)

    layout = ChunkLayout((128, 128), 256, Scaling(1, 256, "e8m0"))
    j = torch.arange(256, dtype=torch.int32)
    codes = ((j[None, :] + j[:, None]) % 256).to(torch.uint8)  # row r: every code, rotated; its scale byte is r
    buf = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for c in range(2):
        o, pb = layout.offsets[c], layout.payload_bytes(c)
        buf[o : o + 128 * 256] = codes[128 * c : 128 * (c + 1)].reshape(-1)
        buf[o + pb : o + pb + 128] = j[128 * c : 128 * (c + 1)].to(torch.uint8)
    gbuf = buf.to(device)
    bad = {}
    for fmt in ("e4m3", "e5m2"):
        f = get_format(fmt)
        for dt in (torch.float32, torch.bfloat16):
            want = unpack_chunks(buf, layout, f, dt, backend="reference")
            got = unpack_chunks(gbuf, layout, f, dt, backend="triton")
            bad[f"{fmt}.unpack.{str(dt)[6:]}"] = int((canon(got) != canon(want)).sum())
        want = unpack_sum(buf, layout, f, backend="reference")
        got = unpack_sum(gbuf, layout, f, backend="triton")
        bad[f"{fmt}.unpack_sum"] = int((canon(got) != canon(want)).sum())
    ok = not any(bad.values())
    return [_row("e8m0_decode", ok, f"elements differing from the CPU reference (of 65536 / 32768): {bad}")]


def main() -> int:
    rows = check_stream_reuse() + check_e8m0_decode()
    print(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
