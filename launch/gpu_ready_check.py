#!/usr/bin/env python3
"""GPU-readiness checks as one prepared script (H100/H200): `PYTHONPATH=. python3 launch/gpu_ready_check.py`.

Sections (each timed; an exception fails that section only): env; sync_free (every collective, sync and async,
and Fp8Linear fwd+bwd per recipe under torch.cuda.set_sync_debug_mode("error") after warm-up, 1-rank NCCL);
host_ahead (torch.cuda._sleep queued ahead of N calls: the host must return from all of them first); host_time
(host time per steady-state call at 16 Mi elements next to NCCL's own call; CUDA-graph capture and replay);
streams (two streams share one scratch pool, the first call's decode delayed: outputs equal the reference, and an
unordered pool shows the corruption the event prevents); offsets (unpack_sum of a > 2 GiB packed buffer of 3
chunks; a GEMM whose row offsets pass 2^31); multi_rank (tests/dist on CUDA tensors, 2 and 4 ranks on this GPU,
staged backend); examples (the demo, the Megatron example and examples/train_gpt.py on the GPU, when DeepSpeed /
megatron-core are importable: carry them as wheels, launch/gpu_wheels.sh). Rows go to docs/results/gpu.json
(merged by name) and $OUT/gpu_ready.json when OUT is set. `--only a,b` runs some sections; `--budget S` skips
sections once S seconds have passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "launch"))
from gpu_results import commit, merge, result_row  # noqa: E402

ROWS: list[dict] = []
SECTIONS: list = []


def section(fn):
    SECTIONS.append(fn)
    return fn


def row(name: str, value, target=None, unit: str = "") -> None:
    """One machine-readable result (launch/gpu_results.py: the docs/results/gpu.json schema)."""
    ROWS.append(result_row(name, value, target, unit, DEVICE))
    print(f"  {name} = {value} {unit}" + (f" (target {target})" if target is not None else ""), flush=True)


def init_nccl_1rank() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))


def collective_calls(n: int = 1 << 20) -> dict:
    """name -> thunk of every collective form a steady-state engine makes (tensors allocated once)."""
    import fp8comm.comm as fc

    dev = torch.device("cuda")
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    o = torch.empty(n, device=dev, dtype=torch.bfloat16)
    tok = torch.randn(n // 4096, 4096, device=dev, dtype=torch.bfloat16)
    tok_out = torch.empty_like(tok)
    t = tok.shape[0]
    splits = [t]
    ef = fc.ErrorFeedback()
    guard = fc.Guard(fc.GuardPolicy())
    return {
        "reduce_scatter.guard": lambda: fc.reduce_scatter(x, guard=guard.bucket("b", dev)),
        "guard.step": guard.step,
        "all_gather": lambda: fc.all_gather(x),
        "all_gather_into": lambda: fc.all_gather_into(o, x),
        "all_gather_into.async": lambda: fc.all_gather_into(o, x, async_op=True).wait(),
        "all_gather.fp8_out": lambda: fc.all_gather(x.view(-1, 4096), fp8_out=True),
        "reduce_scatter": lambda: fc.reduce_scatter(x),
        "reduce_scatter_into": lambda: fc.reduce_scatter_into(o, x),
        "reduce_scatter_into.async": lambda: fc.reduce_scatter_into(o, x, async_op=True).wait(),
        "reduce_scatter.error_feedback": lambda: fc.reduce_scatter(x, error_feedback=ef),
        "reduce_scatter.stochastic": lambda: fc.reduce_scatter(x, rounding="stochastic"),
        "all_reduce": lambda: fc.all_reduce(x),
        "all_reduce_into.async": lambda: fc.all_reduce_into(o, x, async_op=True).wait(),
        "all_to_all": lambda: fc.all_to_all(tok, out=tok_out),
        "all_to_all.splits": lambda: fc.all_to_all(tok, splits, splits, out=tok_out),
        "all_to_all.autograd": lambda: fc.all_to_all(tok.clone().requires_grad_(), splits, splits).sum().backward(),
        "all_to_all.fp8_out": lambda: fc.all_to_all(tok, fp8_out=True),
        "all_to_all.async": lambda: fc.all_to_all(tok, out=tok_out, async_op=True).wait(),
    }


# ----------------------------------------------------------------------------------------------------- sections
@section
def env(a) -> dict:
    import triton

    p = torch.cuda.get_device_properties(0)
    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "gpu": p.name,
        "capability": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 1),
    }


@section
def sync_free(a) -> dict:
    """After warm-up no collective and no Fp8Linear step may sync the host with the device (torch's detector)."""
    from fp8comm.gemm import RECIPES, Fp8Linear

    init_nccl_1rank()
    calls = collective_calls()
    failures, ok = {}, []
    for name, fn in calls.items():
        for _ in range(6):  # past the metadata check's first calls, layouts and kernels cached
            fn()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            ok.append(name)
        except RuntimeError as e:
            failures[name] = str(e).splitlines()[0][:300]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for recipe in RECIPES:
        if recipe == "fp8_noscale":
            continue
        for cache in ("step", "gathered"):
            name = f"Fp8Linear.{recipe}.{cache}"
            lin = Fp8Linear(1024, 1024, recipe=recipe, weight_cache=cache, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3):
                lin(x).sum().backward()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                lin(x).sum().backward()
                ok.append(name)
            except RuntimeError as e:
                failures[name] = str(e).splitlines()[0][:300]
            finally:
                torch.cuda.set_sync_debug_mode("default")
    row("sync_free_calls", len(ok), len(ok) + len(failures), "calls")
    return {"status": "fail" if failures else "ok", "sync_free": ok, "syncing": failures}


@section
def host_ahead(a) -> dict:
    """torch's detector sees only syncs made through torch: queue a long GPU sleep, then N calls of each
    collective; the host must return from all of them before the sleep has ended (no hidden sync anywhere)."""
    init_nccl_1rank()
    calls = collective_calls()
    res, bad = {}, []
    for name, fn in calls.items():
        if name.endswith(".autograd"):
            continue  # autograd's backward engine may synchronize its own streams; covered by sync_free
        for _ in range(6):
            fn()
        torch.cuda.synchronize()
        done = torch.cuda.Event()
        torch.cuda._sleep(int(2e9))  # ~1 s of GPU clock cycles queued ahead
        done.record()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        host = time.perf_counter() - t0
        ahead = not done.query()
        torch.cuda.synchronize()
        res[name] = {"host_ms_per_call": round(host / 10 * 1e3, 3), "host_ran_ahead": ahead}
        if not ahead:
            bad.append(name)
    row("host_ahead_calls", len(res) - len(bad), len(res), "collective forms")
    return {"status": "fail" if bad else "ok", "calls": res, "blocked": bad}


@section
def host_time(a) -> dict:
    """Host time per steady-state call at 16 Mi elements, next to NCCL's own call of the same op (host time: the
    GPU is kept busy by a queued sleep, so only the host's own work is timed); and the GPU part by CUDA-graph
    replay where the call can be captured (nearest rounding, fixed buffers, check off after warm-up)."""
    import torch.distributed as dist

    import fp8comm.comm as fc

    init_nccl_1rank()
    n = 16 << 20
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(x)
    tok = x.view(-1, 4096)
    tok_out = torch.empty_like(tok)
    pairs = {
        "all_gather_into": (lambda: fc.all_gather_into(o, x), lambda: dist.all_gather_into_tensor(o, x)),
        "reduce_scatter_into": (lambda: fc.reduce_scatter_into(o, x), lambda: dist.reduce_scatter_tensor(o, x)),
        "all_to_all": (lambda: fc.all_to_all(tok, out=tok_out), lambda: dist.all_to_all_single(tok_out, tok)),
    }
    out = {}
    for name, (ours, nccl) in pairs.items():
        r = {}
        for who, fn in (("fp8comm", ours), ("nccl", nccl)):
            for _ in range(6):
                fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(int(4e9))
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            r[who] = (time.perf_counter() - t0) / 50 * 1e3
            torch.cuda.synchronize()
        row(f"host_ms_{name}_16Mi", round(r["fp8comm"], 4), 0.1, "ms")
        row(f"host_ms_{name}_16Mi_nccl", round(r["nccl"], 4), None, "ms")
        try:  # CUDA-graph capture of the same steady-state call
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    ours()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                ours()
            want = o.clone() if name != "all_to_all" else tok_out.clone()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(20):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            got = o if name != "all_to_all" else tok_out
            r["graph_gpu_ms"] = e0.elapsed_time(e1) / 20
            r["graph_equal"] = bool(torch.equal(got, want))
            row(f"graph_gpu_ms_{name}_16Mi", round(r["graph_gpu_ms"], 4), None, "ms")
        except Exception as e:
            r["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out[name] = r
    over = [k for k, v in out.items() if v["fp8comm"] > 0.1]
    return {"status": "fail" if over else "ok", "calls": out, "over_budget": over}


@section
def streams(a) -> dict:
    """Two CUDA streams lease from one scratch pool (DeepSpeed ZeRO-3's gather and reduce streams): the first
    call's decode is delayed by a GPU sleep, the second call on the other stream reuses its buffers. With the
    pool's events both outputs equal the reference; an unordered pool (no event wait) is run too and must differ,
    or the scenario proves nothing."""
    import fp8comm.comm as fc
    from fp8comm.comm import buffers

    init_nccl_1rank()

    class Unordered(buffers.ScratchPool):
        def give(self, block, event=None, stream=None):
            super().give(block, None, None)  # forget the event: the next lease does not wait

    n = 1 << 22
    x1 = torch.randn(n, device="cuda")
    x2 = torch.randn(n, device="cuda") * 100
    want1, want2 = fc.all_gather(x1, check=False), fc.all_gather(x2, check=False)
    res = {}
    for label, pool in (("ordered", buffers.ScratchPool()), ("unordered", Unordered())):
        buf = fc.Buffer(check=False)
        buf.pool = pool
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        o1, o2 = torch.empty_like(want1), torch.empty_like(want2)
        torch.cuda.synchronize()
        with torch.cuda.stream(s1):
            h = buf.all_gather_into(o1, x1, async_op=True)
            torch.cuda._sleep(int(1e9))  # the decode (in wait) is queued behind this on s1
            h.wait()
        with torch.cuda.stream(s2):
            buf.all_gather_into(o2, x2)  # leases the buffers just returned by the first call
        torch.cuda.synchronize()
        res[label] = {
            "first_equal": bool(torch.equal(o1, want1)),
            "second_equal": bool(torch.equal(o2, want2)),
            "cross_stream_waits": getattr(pool, "cross_stream_waits", None),
        }
    ok = res["ordered"]["first_equal"] and res["ordered"]["second_equal"]
    shows = not (res["unordered"]["first_equal"] and res["unordered"]["second_equal"])
    row("streams_ordered_outputs_equal", int(ok), 1, "bool")
    row("streams_unordered_pool_corrupts", int(shows), 1, "bool")
    return {"status": "ok" if ok else "fail", "runs": res, "scenario_can_fail": shows}


@section
def offsets(a) -> dict:
    """Past 2^31: unpack_sum over 3 chunks of 2^30 elements (a 3 GiB packed buffer), and a 140000 x 16384 x 256
    GEMM; both against the reference on sampled windows / rows."""
    from fp8comm.gemm.backends import emulate
    from fp8comm.gemm.triton_gemm import triton_gemm
    from fp8comm.quant import Scaling, quantize
    from fp8comm.quant.formats import E4M3
    from fp8comm.quant.wire import layout_of, pack_chunks, unpack_sum

    out = {}
    k = 1 << 30
    sc = Scaling(1, 128)
    x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
    lay = layout_of((1, 1, 1), k, sc)
    buf = pack_chunks(x, lay, E4M3, backend="triton")
    acc = unpack_sum(buf, lay, E4M3, backend="triton")
    bad = 0
    for a0 in (0, k // 2, k - 4096):
        w = x[:, a0 : a0 + 4096]
        wl = layout_of((1, 1, 1), 4096, sc)
        ref = unpack_sum(pack_chunks(w, wl, E4M3, backend="reference"), wl, E4M3, backend="reference")
        bad += int(not torch.equal(acc[:, a0 : a0 + 4096], ref))
    out["unpack_sum_packed_gib"] = round(lay.total_bytes / 2**30, 2)
    out["unpack_sum_windows_bad"] = bad
    row("offsets_unpack_sum_3GiB_windows_equal", 3 - bad, 3, "windows")
    del x, buf, acc
    m, kk, n = 140000, 16384, 256
    xa = torch.randn(m, kk, device="cuda", dtype=torch.bfloat16)
    qa = quantize(xa, "e4m3", scaling=Scaling(1, 128))
    qb = quantize(torch.randn(n, kk, device="cuda"), "e4m3", scaling=Scaling(128, 128))
    got = triton_gemm(qa, qb, torch.float32)
    rows = torch.tensor([0, 70000, 131071, 131072, 133000, m - 1], device="cuda")
    from fp8comm.quant import Fp8Tensor

    sub = Fp8Tensor(qa.data[rows], qa.scale[rows], qa.fmt, qa.scaling, qa.dtype)
    want = emulate(sub, qb, torch.float32)
    err = float(((got[rows] - want).abs() / want.abs().clamp_min(1e-3)).max())
    out["gemm_rel_err_sampled_rows"] = err
    row("offsets_gemm_140000x16384_rel_err", err, 1e-3, "relative")
    return {"status": "ok" if bad == 0 and err < 1e-3 else "fail", **out}


@section
def multi_rank(a) -> dict:
    """tests/dist's checks with CUDA tensors on 2 and 4 ranks sharing this GPU (staged backend: gloo on host copies;
    NCCL refuses two ranks per GPU). Bit-exact against the CPU reference like the CPU suite."""
    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    import dist_harness

    out, bad = {}, []
    for world in (2, 4):
        env = {"FP8COMM_TEST_BACKEND": "staged", "FP8COMM_TEST_DEVICE": "cuda"}
        if world == 4:
            env["LOCAL_WORLD_SIZE"] = "2"
        run = dist_harness.launch(world, Path("/tmp/fp8comm_gpu_dist") / str(world), env=env, timeout=420)
        fails = dist_harness.failures(run)
        done = [x["check"] for x in run["results"].get(0, []) if x.get("state") == "done" and x.get("ok")]
        out[world] = {"passed": done, "failures": [f[:400] for f in fails], "seconds": run["seconds"]}
        row(f"multi_rank_cuda_world{world}_checks_passed", len(done), None, "checks")
        bad += fails
    return {"status": "fail" if bad else "ok", "worlds": out}


@section
def examples(a) -> dict:
    """The main job and the examples on the GPU with every fp8comm flag on (world 1: the hooks' CUDA paths, the
    FP8 GEMMs, the loss). Needs DeepSpeed and megatron-core (wheels: launch/gpu_wheels.sh)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:  # fp8comm.integrations maps to integrations/ through pyproject: an (offline) editable install
        __import__("fp8comm.integrations.megatron")
    except ImportError:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "-e",
                str(ROOT),
            ],
            check=False,
            timeout=300,
        )
    runs = {
        "demo": [
            sys.executable,
            "-m",
            "fp8comm.tools.cli",
            "demo",
            "--device",
            "cuda",
            "--ranks",
            "1",
            "--steps",
            "60",
            "--out",
            "/tmp/fp8comm_gpu_demo",
        ],
        "train_gpt": [
            sys.executable,
            "examples/train_gpt.py",
            "--device",
            "cuda",
            "--recipes",
            "bf16,fp8_amax,tensorwise,blockwise",
            "--seeds",
            "0",
            "--steps",
            "200",
            "--out",
            "/tmp/fp8comm_gpu_train",
        ],
        "megatron": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            "-m",
            "fp8comm.integrations.megatron.pretrain_gpt",
            "--num-layers",
            "2",
            "--hidden-size",
            "256",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "128",
            "--max-position-embeddings",
            "128",
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "4",
            "--train-iters",
            "20",
            "--lr",
            "3e-4",
            "--bf16",
            "--use-distributed-optimizer",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "1024",
            "--transformer-impl",
            "local",
            "--log-interval",
            "5",
            "--fp8comm-grad-reduce",
            "--fp8comm-param-gather",
        ],
    }
    out, bad = {}, []
    for name, cmd in runs.items():
        need = {"demo": "deepspeed", "megatron": "megatron.core"}.get(name)
        if need:
            try:
                __import__(need)
            except ImportError as e:
                out[name] = {"status": "skipped", "reason": f"{need} not importable ({e}); carry wheels"}
                continue
        t0 = time.time()
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.example_timeout)
        out[name] = {"rc": p.returncode, "seconds": round(time.time() - t0, 1), "tail": (p.stdout + p.stderr)[-3000:]}
        print(out[name]["tail"][-1500:], flush=True)
        if p.returncode:
            bad.append(name)
    return {"status": "fail" if bad else "ok", "runs": out}


# ------------------------------------------------------------------------------------------------------- driver
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated sections: " + ", ".join(f.__name__ for f in SECTIONS))
    p.add_argument("--budget", type=float, default=540, help="seconds; later sections are skipped past it")
    p.add_argument("--example-timeout", type=float, default=240)
    p.add_argument("--no-write", action="store_true", help="do not merge rows into docs/results/gpu.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_ready_check: no CUDA device; nothing to run (every section needs a GPU)")
        return 2
    global DEVICE
    DEVICE = torch.cuda.get_device_name(0)
    only = {s for s in a.only.split(",") if s}
    t_start, results = time.time(), {}
    for fn in SECTIONS:
        if only and fn.__name__ not in only:
            continue
        if time.time() - t_start > a.budget:
            results[fn.__name__] = {"status": "skipped", "reason": f"past --budget {a.budget} s"}
            continue
        print(f"== {fn.__name__}", flush=True)
        t0 = time.time()
        try:
            res = fn(a) or {}
        except Exception as e:
            traceback.print_exc()
            res = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        res.setdefault("status", "ok")
        res["seconds"] = round(time.time() - t0, 1)
        results[fn.__name__] = res
        print(f"== {fn.__name__}: {res['status']} ({res['seconds']} s)", flush=True)
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "commit": COMMIT,
        "device": DEVICE,
        "sections": results,
        "rows": ROWS,
    }
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_ready.json").write_text(json.dumps(doc, indent=1, default=str))
    if not a.no_write:
        merge(ROWS)
    bad = [k for k, v in results.items() if v["status"] in ("fail", "error")]
    print(f"== overall: {'FAIL: ' + ', '.join(bad) if bad else 'ok'}")
    return 1 if bad else 0


COMMIT = commit()
DEVICE = "unknown"

if __name__ == "__main__":
    sys.exit(main())
