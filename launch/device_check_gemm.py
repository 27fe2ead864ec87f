#!/usr/bin/env python3
"""GPU checks of fp8comm's FP8 GEMMs: `gemm_section()` (called by launch/device_check.py) or standalone:

    PYTHONPATH=. python3 launch/device_check_gemm.py [--quick] [--train]

1. agreement: every GEMM backend available on the device (torch._scaled_mm, the Triton block-scaled GEMM, the
   emulation) against a float64 product of the dequantized operands, per scale layout, aligned and odd shapes;
2. Fp8Linear forward + both gradients per recipe against float64 (the unit tests' check, on the GPU paths);
3. timing (medians, CUDA events): FP8 GEMM vs BF16 matmul at 4096^3 and 8192^3 (target: >= 1.6x at 8192^3), and
   Fp8Linear fwd+bwd vs nn.Linear bf16 at 16384 tokens x 8192 -> 8192 (target: >= 1.3x), weight re-quantized
   every iteration as after each optimizer step.
Every case catches its own errors and reports them as a row; nothing aborts the section.
--train also runs examples/train_gpt.py on the GPU (bf16, fp8_amax, tensorwise, blockwise; 3 seeds, paired).
On CUDA the full-size timings and the training table go into docs/results/gpu.json (launch/gpu_results.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp8comm.gemm import RECIPES, Fp8Linear, backends, telemetry
from fp8comm.quant import dequantize
from fp8comm.tools.bench.gemm import LAYOUTS, bench, operands


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def agreement_rows(device, quick: bool, layouts=None) -> list[dict]:
    rows = []
    shapes = [(256, 384, 512), (200, 136, 328)] if quick else [(1024, 768, 2048), (1000, 776, 1288)]
    for layout in LAYOUTS if layouts is None else layouts:
        for m, n, k in shapes:
            try:
                a, b = operands(m, n, k, layout, device)
                ref = backends.emulate_f64(a, b)
                emu = backends.emulate(a, b, torch.float32)
            except Exception as e:
                rows.append(dict(check="agreement", case=f"{layout} {m}x{n}x{k}", status="FAIL", detail=_err(e)))
                continue
            for be in ("emulation", "scaled_mm", "triton"):
                for out_dtype in (torch.bfloat16, torch.float32):
                    case = f"{layout} {m}x{n}x{k} {be} -> {str(out_dtype)[6:]}"
                    try:
                        out = backends.gemm(a, b, out_dtype, backend=be)
                        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                        err_emu = ((out.float() - emu).abs().max() / emu.abs().max()).item()
                        # fp32 out: the emulation is exact to fp32 rounding (1e-5); Hopper's FP8 tensor cores
                        # accumulate with fewer bits inside a K block (measured 1.5e-4 .. 2e-4 on an H200, for
                        # cuBLAS and Triton alike: why DeepSeek-V3 promotes to fp32 every 128), hence 1e-3 there
                        tol = 2**-7 if out_dtype == torch.bfloat16 else (1e-5 if be == "emulation" else 1e-3)
                        rows.append(
                            dict(
                                check="agreement",
                                case=case,
                                status="ok" if err < tol else "FAIL",
                                detail=f"rel err vs f64 {err:.2e}, vs emulation {err_emu:.2e}",
                            )
                        )
                    except NotImplementedError as e:
                        rows.append(dict(check="agreement", case=case, status="n/a", detail=_err(e)))
                    except Exception as e:
                        rows.append(dict(check="agreement", case=case, status="FAIL", detail=_err(e)))
    # which block-scaled layout the probe trusted per operand pair (fp8comm/gemm/block_scaled_mm.py, docs/gemm.md)
    for pair in ("block128x128", "block1x128"):
        lay = backends.blockwise_layout(device, pair) if device.type == "cuda" else None
        detail = lay.name if lay is not None else "no layout agreed with the emulation (WARNING lines say why)"
        rows.append(
            dict(check="blockwise_layout", case=f"1x128 x {pair[5:]}", status="ok" if lay else "n/a", detail=detail)
        )
    return rows


def linear_rows(device, quick: bool) -> list[dict]:
    """Fp8Linear on the GPU backends vs float64 on its own dequantized operands (exactness) and vs unquantized."""
    rows = []
    m, k, n = (300, 1024, 768) if not quick else (100, 256, 136)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, k)).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device)
    dy = (torch.randn(m, n, generator=g) * 1e-3).to(device, torch.bfloat16)
    for name in RECIPES:
        try:
            layer = Fp8Linear(k, n, bias=False, device=device, recipe=name)
            with torch.no_grad():
                layer.weight.copy_(w)
            seen = {}
            orig = layer._quantize

            def spy(t, role, primary=True, with_transpose=False, _o=orig, _s=seen):
                q = _o(t, role, primary, with_transpose)
                _s[(role, primary)] = q[0] if with_transpose else q
                return q

            layer._quantize = spy
            telemetry.reset_counters()
            xr = x.clone().requires_grad_()
            y = layer(xr)
            y.backward(dy)
            d = lambda q: dequantize(q, torch.float64)
            y64 = d(seen[("input", True)]) @ d(seen[("weight", True)]).t()
            e_fwd = ((y.double() - y64).norm() / y64.norm()).item()
            x64, w64, dy64 = x.double(), w.double(), dy.double()
            a_fwd = ((y.double() - x64 @ w64.t()).norm() / (x64 @ w64.t()).norm()).item()
            a_dx = ((xr.grad.double() - dy64 @ w64).norm() / (dy64 @ w64).norm()).item()
            a_dw = ((layer.weight.grad.double() - dy64.t() @ x64).norm() / (dy64.t() @ x64).norm()).item()
            ok = e_fwd < 2**-7 and max(a_fwd, a_dx, a_dw) < (0.3 if name in ("fp8_noscale", "cscale") else 0.1)
            routes = ",".join(f"{k_[5:]}:{v}" for k_, v in telemetry.counters("gemm.").items())
            rows.append(
                dict(
                    check="fp8linear",
                    case=name,
                    status="ok" if ok else "FAIL",
                    detail=f"fwd exact {e_fwd:.1e}; vs unquantized fwd {a_fwd:.3f} dgrad {a_dx:.3f} "
                    f"wgrad {a_dw:.3f}; routes {routes}",
                )
            )
        except Exception as e:
            rows.append(dict(check="fp8linear", case=name, status="FAIL", detail=_err(e)))
    return rows


def timing_rows(device, quick: bool, cases=None, sizes=None, recipes=None) -> list[dict]:
    """cases: (layout, backend) pairs to time (None: all); sizes: square GEMM sizes; recipes: Fp8Linear recipes
    for the fwd+bwd timing (None: tensorwise, fp8_amax, rowwise, blockwise; empty: no layer timing at all)."""
    rows = []
    reps = 5 if quick else 20
    for s in ((1024,) if quick else (4096, 8192)) if sizes is None else sizes:
        flop = 2.0 * s**3
        try:
            a16 = torch.randn(s, s, device=device, dtype=torch.bfloat16)
            b16 = torch.randn(s, s, device=device, dtype=torch.bfloat16)
            t16 = bench(lambda a16=a16, b16=b16: a16 @ b16.t(), reps, 3, device)
            del a16, b16
            rows.append(
                dict(
                    check="timing",
                    case=f"bf16 matmul {s}^3",
                    status="ok",
                    detail=f"{t16 * 1e3:.3f} ms, {flop / t16 / 1e12:.0f} TFLOP/s",
                )
            )
        except Exception as e:
            rows.append(dict(check="timing", case=f"bf16 matmul {s}^3", status="FAIL", detail=_err(e)))
            continue
        todo = (
            cases
            if cases is not None
            else [
                ("tensorwise", "scaled_mm"),
                ("rowwise", "scaled_mm"),
                ("blockwise", "scaled_mm"),
                ("blockwise", "triton"),
                ("tensorwise", "triton"),
                ("mxfp8", "triton"),
            ]
        )
        for layout, be in todo:
            case = f"fp8 {layout} {be} {s}^3"
            try:
                a, b = operands(s, s, s, layout, device)
                t = bench(lambda a=a, b=b, be=be: backends.gemm(a, b, torch.bfloat16, backend=be), reps, 3, device)
                target = layout == "tensorwise" and be == "scaled_mm" and s == 8192
                sp = t16 / t
                rows.append(
                    dict(
                        check="timing",
                        case=case,
                        status=("ok" if sp >= 1.6 else "BELOW TARGET") if target else "ok",
                        detail=f"{t * 1e3:.3f} ms, {flop / t / 1e12:.0f} TFLOP/s, {sp:.2f}x bf16"
                        + (" (target >= 1.6x)" if target else ""),
                        speedup=sp,
                    )
                )
                if layout == "tensorwise" and be == "scaled_mm":  # for reference: cuBLAS fast accumulation
                    ad, bd = a.data, b.data
                    sa, sb = a.scale.reshape(1, 1), b.scale.reshape(1, 1)
                    tf = bench(
                        lambda: torch._scaled_mm(ad, bd.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True),
                        reps,
                        3,
                        device,
                    )
                    rows.append(
                        dict(
                            check="timing",
                            case=f"fp8 tensorwise _scaled_mm fast_accum {s}^3",
                            status="info",
                            detail=f"{tf * 1e3:.3f} ms, {t16 / tf:.2f}x bf16 (not used: "
                            "fast accumulation is not fp32 accumulation)",
                            speedup=t16 / tf,
                        )
                    )
                del a, b
            except NotImplementedError as e:
                rows.append(dict(check="timing", case=case, status="n/a", detail=_err(e)))
            except Exception as e:
                rows.append(dict(check="timing", case=case, status="FAIL", detail=_err(e)))
    if recipes is not None and not recipes:
        return rows
    tokens, n_in, n_out = (2048, 1024, 1024) if quick else (16384, 8192, 8192)
    flop = 6.0 * tokens * n_in * n_out
    try:
        x = torch.randn(tokens, n_in, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(tokens, n_out, device=device, dtype=torch.bfloat16)
        ref = torch.nn.Linear(n_in, n_out, bias=False, device=device, dtype=torch.bfloat16)

        def step(layer, requant):
            if requant:
                layer.invalidate_weight_cache()  # as after an optimizer step
            layer(x).backward(dy)
            x.grad = None
            layer.weight.grad = None

        t16 = bench(lambda: step(ref, False), reps, 3, device)
        rows.append(
            dict(
                check="timing",
                case=f"nn.Linear bf16 fwd+bwd {tokens}x{n_in}->{n_out}",
                status="ok",
                detail=f"{t16 * 1e3:.3f} ms, {flop / t16 / 1e12:.0f} TFLOP/s",
            )
        )
    except Exception as e:
        rows.append(dict(check="timing", case="nn.Linear bf16 fwd+bwd", status="FAIL", detail=_err(e)))
        return rows
    for name in ("tensorwise", "fp8_amax", "rowwise", "blockwise") if recipes is None else recipes:
        case = f"Fp8Linear {name} fwd+bwd {tokens}x{n_in}->{n_out}"
        try:
            lin = Fp8Linear(n_in, n_out, bias=False, device=device, recipe=name)
            telemetry.reset_counters()
            t = bench(lambda lin=lin: step(lin, True), reps, 3, device)
            sp = t16 / t
            routes = ",".join(f"{k[5:]}:{v}" for k, v in telemetry.counters("gemm.").items())
            target = name == "tensorwise"
            rows.append(
                dict(
                    check="timing",
                    case=case,
                    status=("ok" if sp >= 1.3 else "BELOW TARGET") if target else "ok",
                    speedup=sp,
                    detail=f"{t * 1e3:.3f} ms, {sp:.2f}x nn.Linear bf16"
                    + (" (target >= 1.3x)" if target else "")
                    + f"; routes {routes}",
                )
            )
            del lin
        except Exception as e:
            rows.append(dict(check="timing", case=case, status="FAIL", detail=_err(e)))
    return rows


def gemm_section(quick: bool = False, device: torch.device | str | None = None, blockwise: bool = False) -> list[dict]:
    """Run agreement, Fp8Linear and timing checks (blockwise=True: blockwise_rows only); print and return the rows
    (check, case, status, detail)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    if device.type == "cuda":
        rows.append(
            dict(
                check="env",
                case=torch.cuda.get_device_name(device),
                status="info",
                detail=f"torch {torch.__version__}, capability {torch.cuda.get_device_capability(device)}",
            )
        )
    for fn in (blockwise_rows,) if blockwise else (agreement_rows, linear_rows, timing_rows):
        t0 = time.time()
        try:
            rows += fn(device, quick)
        except Exception:
            rows.append(
                dict(check=fn.__name__, case="(section)", status="FAIL", detail=traceback.format_exc().splitlines()[-1])
            )
        print(f"[gemm] {fn.__name__} done in {time.time() - t0:.1f} s", flush=True)
    print("| check | case | status | detail |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['check']} | {r['case']} | {r['status']} | {r['detail']} |")
    fails = sum(r["status"] == "FAIL" for r in rows)
    print(f"[gemm] {len(rows)} rows, {fails} FAIL", flush=True)
    return rows


def result_rows(rows: list[dict], device_name: str) -> list[dict]:
    """The full-size timings as docs/results/gpu.json rows (the names the GPU-speed work defines)."""
    from gpu_results import result_row

    def speedup(case: str):
        return next((r["speedup"] for r in rows if r["case"] == case and "speedup" in r), None)

    out = []
    blk = [v for v in (speedup(f"fp8 blockwise {be} 8192^3") for be in ("scaled_mm", "triton")) if v is not None]
    if blk:
        unit = "x bf16 matmul (best of scaled_mm, triton)"
        out.append(result_row("gemm_blockwise_vs_bf16_8192", round(max(blk), 3), 1.5, unit, device_name))
    for name in ("blockwise", "rowwise", "tensorwise"):
        v = speedup(f"Fp8Linear {name} fwd+bwd 16384x8192->8192")
        if v is not None:
            unit = "x nn.Linear bf16 fwd+bwd, weight re-quantized every iteration"
            out.append(result_row(f"linear_{name}_vs_bf16", round(v, 3), 1.3, unit, device_name))
    return out


def train_rows(results: list[dict], device_name: str, baseline: str = "bf16") -> list[dict]:
    """examples/train_gpt.py results as gpu.json rows per FP8 recipe: the mean final validation loss relative to
    bf16's (signed fraction, target |x| <= 0.01) and the training speed relative to bf16's (same tokens per run).
    Paired by seed: only seeds that both the recipe and bf16 completed count (a run cut short leaves some out)."""
    from statistics import mean

    from gpu_results import result_row

    by: dict[str, dict[int, dict]] = {}
    for r in results:
        by.setdefault(r["recipe"], {})[r.get("seed", 0)] = r
    if baseline not in by:
        return []
    base = by[baseline]
    out = []
    for recipe, runs in by.items():
        seeds = sorted(set(runs) & set(base))
        if recipe == baseline or not seeds:
            continue
        base_loss = mean(base[s]["val_loss"] for s in seeds)
        rel = (mean(runs[s]["val_loss"] for s in seeds) - base_loss) / base_loss
        label = f"{len(seeds)} paired seed{'s' if len(seeds) != 1 else ''}"
        out.append(
            result_row(f"train_{recipe}_val_loss_rel", round(rel, 5), 0.01, f"fraction of bf16 ({label})", device_name)
        )
        speed = mean(base[s]["seconds"] for s in seeds) / mean(runs[s]["seconds"] for s in seeds)
        unit = f"x bf16 tokens/s ({label}, evaluation included)"
        out.append(result_row(f"train_{recipe}_tokens_per_s_vs_bf16", round(speed, 3), None, unit, device_name))
    return out


def blockwise_rows(device, quick: bool = False) -> list[dict]:
    """The cuBLASLt block-scaled GEMM only: the layout the probe trusted per operand pair, agreement at aligned
    and odd shapes, 8192^3 timing next to Triton and bf16, Fp8Linear blockwise fwd+bwd (launch/gpu_ready_check.py's
    blockwise_gemm section)."""
    rows = agreement_rows(device, quick, layouts=("blockwise",))  # ends with the probe's blockwise_layout rows
    rows += timing_rows(
        device,
        quick,
        cases=[("blockwise", "scaled_mm"), ("blockwise", "triton")],
        sizes=(1024,) if quick else (8192,),
        recipes=("blockwise",),
    )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes (also runs on CPU)")
    p.add_argument("--device", default=None)
    p.add_argument("--blockwise", action="store_true", help="only the cuBLASLt block-scaled GEMM (layout, timings)")
    p.add_argument("--train", action="store_true", help="also run the tiny-GPT training table on the device")
    p.add_argument("--train-args", default="", help="extra arguments for examples/train_gpt.py")
    p.add_argument("--no-write", action="store_true", help="do not merge rows into docs/results/gpu.json")
    a = p.parse_args()
    rows = gemm_section(a.quick, a.device, a.blockwise)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_results import merge

    if device.type == "cuda" and not a.quick and not a.no_write:  # full sizes only: the rows name them
        merge(result_rows(rows, torch.cuda.get_device_name(device)))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "device_check_gemm.json"), "w") as f:
            json.dump(rows, f, indent=1)
    if a.train:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
        import train_gpt

        dev = a.device or "cuda"
        folder = os.path.join(out or "runs", "train_gpt_gpu")
        args = ["--device", dev, "--out", folder, "--recipes", "bf16,fp8_amax,tensorwise,blockwise"]
        try:
            train_gpt.main(args + a.train_args.split())  # later flags win: --train-args may override the recipes
            if torch.device(dev).type == "cuda" and not a.no_write:
                with open(os.path.join(folder, "results.json")) as f:
                    merge(train_rows(json.load(f), torch.cuda.get_device_name(torch.device(dev))))
        except Exception:
            traceback.print_exc()
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
