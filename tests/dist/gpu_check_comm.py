"""One-shot device check for fp8comm.comm (not collected by pytest): run as `python tests/dist/gpu_check_comm.py OUT`.

1. CUDA + NCCL (world 1, the GPU machine has one GPU): every collective on CUDA tensors through the quant core's
   Triton kernels, bit-compared with the torch reference on CPU; timing of FP8 all_gather/reduce_scatter against
   plain NCCL bf16 on one device (pack + copy + unpack: kernel cost, not link bandwidth).
2. The gloo multi-process checks (world 2, 3, 4) on this machine's torch/Python.
3. `fp8comm bench comm` loopback (gloo, CPU) with more cores than the dev VM.
Its one H200 run (2026-11-30 ~15:03 UTC, code committed as 14a5d1a) measured the metadata check on every call; the
first-calls-only policy (24936a2) superseded those timings (docs/benchmarks.md); launch/gpu_ready_check.py's
host_time section is the current measurement.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def cuda_part(out: Path, device: str = "cuda") -> dict:
    import torch
    import torch.distributed as dist

    import fp8comm.comm as fc
    from fp8comm.quant import Scaling, quantize

    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    if device == "cuda":  # device="cpu" dry-runs this script's logic on gloo
        res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
        dev = torch.device("cuda", 0)
    else:
        res = {"torch": torch.__version__, "device": "cpu"}
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        dev = torch.device("cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def qdq(x2, dtype=torch.float32, enc="fp32"):
        return quantize(x2.cpu(), "e4m3", scaling=Scaling(1, 128, enc), backend="reference").dequantize(dtype)

    g = torch.Generator().manual_seed(0)
    checks = {}

    def run(name, fn):
        # One failing check must not hide the others: record the error and go on.
        try:
            checks[name] = bool(fn())
        except Exception as e:
            import traceback

            checks[name] = f"{type(e).__name__}: {e} | {traceback.format_exc()[-1500:]}"

    for enc in ("fp32", "e8m0"):
        x = torch.randn(37, 301, generator=g).to(torch.bfloat16)
        run(
            f"all_gather_{enc}",
            lambda: torch.equal(
                fc.all_gather(x.to(dev), scaling=enc).cpu().view(1, -1), qdq(x.view(1, -1), torch.bfloat16, enc)
            ),
        )
        run(
            f"reduce_scatter_{enc}",
            lambda: torch.equal(
                fc.reduce_scatter(x.float().to(dev), scaling=enc).cpu(),
                qdq(x.float().view(1, -1), enc=enc).view(37, 301),
            ),
        )
        exp = qdq(qdq(x.float().view(1, -1), enc=enc), enc=enc).view(37, 301)
        run(
            f"all_reduce_async_{enc}",
            lambda: torch.equal(fc.all_reduce(x.float().to(dev), scaling=enc, async_op=True).wait().cpu(), exp),
        )

        def a2a():
            t = x[:, :256].contiguous().to(dev).requires_grad_(True)
            y = fc.all_to_all(t, [37], [37], scaling=enc)
            ok = torch.equal(y.detach().cpu(), qdq(x[:, :256], torch.bfloat16, enc))
            y.float().sum().backward()
            return ok and bool(torch.all(t.grad == 1).item())

        run(f"all_to_all_fwd_bwd_{enc}", a2a)

    def nonfinite():
        xi = torch.randn(1000, generator=g).to(dev)
        xi[17] = float("inf")
        return torch.equal((~torch.isfinite(fc.reduce_scatter(xi))).nonzero().cpu(), torch.tensor([[17]]))

    run("nonfinite_exact", nonfinite)

    def float8():
        try:
            fc.all_gather(torch.randn(4, device=dev).to(torch.float8_e4m3fn))
        except fc.Fp8CommError:
            return True
        return False

    run("float8_rejected", float8)
    res["checks"] = checks
    timing = []
    if not all(v is True for v in checks.values()):
        print(json.dumps(checks, indent=1), flush=True)
    for n in (1 << 20, 16 << 20, 64 << 20) if dev.type == "cuda" else (1 << 16,):
        x = torch.randn(n, device=dev).to(torch.bfloat16)
        outp = torch.empty(n, dtype=torch.bfloat16, device=dev)
        row = {"elements": n}
        for name, fn in (
            ("nccl_bf16_all_gather", lambda: dist.all_gather_into_tensor(outp, x)),
            ("fp8_all_gather", lambda: fc.all_gather(x)),
            ("fp8_all_gather_nocheck", lambda: fc.all_gather(x, check=False)),
            ("fp8_reduce_scatter", lambda: fc.reduce_scatter(x)),
            ("fp8_all_to_all", lambda: fc.all_to_all(x.view(-1, 4096), None, None, check=False)),
        ):
            try:
                fn()
                sync()
                t0 = time.perf_counter()
                for _ in range(10):
                    fn()
                sync()
                row[name + "_us"] = round((time.perf_counter() - t0) / 10 * 1e6, 1)
            except Exception as e:
                row[name + "_us"] = f"{type(e).__name__}: {str(e)[:300]}"
        timing.append(row)
    res["timing_world1"] = timing
    res["stats"] = fc.comm_stats()
    dist.destroy_process_group()
    (out / "cuda.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1), flush=True)
    return res


def dist_part(out: Path) -> None:
    sys.path.insert(0, str(HERE))
    import dist_harness

    for w in (2, 3, 4):
        t0 = time.perf_counter()
        run = dist_harness.launch(w, out / f"dist{w}", env={"LOCAL_WORLD_SIZE": "2"} if w == 4 else {}, timeout=150)
        fails = dist_harness.failures(run)
        print(f"gloo world {w}: {'PASS' if not fails else 'FAIL'} in {time.perf_counter() - t0:.1f} s", flush=True)
        for f in fails[:6]:
            print("   ", f[:2000], flush=True)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)
    parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["cuda", "dist", "bench"]
    print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M} cpus={os.cpu_count()}", flush=True)

    if "cuda" in parts or "cpu" in parts:
        try:
            cuda_part(out, "cuda" if "cuda" in parts else "cpu")
        except Exception as e:
            import traceback

            print("CUDA PART FAILED:", e, traceback.format_exc(), flush=True)
    if "dist" in parts:
        dist_part(out)
    if "bench" in parts:
        cmd = [
            sys.executable,
            "-m",
            "fp8comm.tools.cli",
            "bench",
            "comm",
            "--nproc",
            os.environ.get("BENCH_NPROC", "4"),
            "--max-size",
            os.environ.get("BENCH_MAX", "256M"),
            "--json",
            str(out / "bench.jsonl"),
            "--timeout",
            os.environ.get("BENCH_TIMEOUT", "240"),
            "--target-s",
            "0.5",
            "--iters",
            "10",
        ]
        with open(out / "bench.txt", "w") as f:
            subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=float(os.environ.get("BENCH_TIMEOUT", "240")) + 30
            )
        print((out / "bench.txt").read_text(), flush=True)


if __name__ == "__main__":
    main()
