#!/usr/bin/env python3
"""N consecutive torchrun launches of each example, counting the exits that are not clean. A script, not a test.

  launch/exit_check.py                          20 launches of each example (2 CPU ranks, gloo, a few steps)
  launch/exit_check.py --launches 5 --only hf_trainer,deepspeed_demo

A launch is unclean when torchrun exits non-zero, a rank prints "terminate called" (the abort of issue 27: gloo
threads still running into interpreter teardown), a rank dies by a signal, or it times out. The abort is rare (about
one CI run in three across the whole suite, never reproduced here before the fixes), so each launch also reports
the deterministic cause: a probe (a sitecustomize on PYTHONPATH) counts every rank's gloo threads in its last atexit
handler, when the interpreter is about to tear down. Writes runs/exit_check/<time>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]

# Runs in every rank (and in torchrun's agent) at start-up. Registered first, its atexit handler runs last: what it
# counts is what interpreter teardown will meet. A joined thread can stay listed in /proc for a moment: poll briefly.
PROBE = r"""
import atexit, os, sys, time

def _fp8comm_exit_probe():
    def count():
        try:
            tasks = os.listdir("/proc/self/task")
        except OSError:
            return -1
        n = 0
        for t in tasks:
            try:
                n += open(f"/proc/self/task/{t}/comm").read().startswith(("pt_gloo", "gloo"))
            except OSError:
                pass
        return n
    end = time.monotonic() + 2.0
    while (n := count()) > 0 and time.monotonic() < end:
        time.sleep(0.05)
    if n or "LOCAL_RANK" in os.environ:
        sys.stderr.write(f"[exit_check] rank={os.environ.get('RANK', '-')} gloo_threads_at_exit={n}\n")
        sys.stderr.flush()

atexit.register(_fp8comm_exit_probe)
"""


def _demo_command(steps: int, out: Path) -> tuple[list[str], dict]:
    """The torchrun launch `fp8comm demo` makes (its launch_command), without the progress display."""
    from fp8comm.tools import demo

    p = argparse.ArgumentParser()
    demo.add_args(p)
    args = p.parse_args(["--steps", str(steps), "--device", "cpu", "--ranks", "2", "--out", str(out)])
    out.mkdir(parents=True, exist_ok=True)
    cmd, env = demo.launch_command(args, out)
    return cmd, {k: env[k] for k in ("OMP_NUM_THREADS", "DS_ACCELERATOR") if k in env}


def examples(out: Path) -> dict:
    """name -> (command, extra environment): each example as its test or docstring launches it, a few steps."""
    ex = REPO / "examples"
    return {
        "deepspeed_demo": _demo_command(3, out / "deepspeed_demo"),
        # as tests/integrations/hf/test_hf_trainer.py (the autoload hook on), 3 steps instead of 30
        "hf_trainer": (
            [*TORCHRUN, str(ex / "hf_trainer_deepspeed.py"), "--steps", "3", "--variants", "plain,fp8"]
            + ["--out", str(out / "hf_trainer")],
            {"DS_ACCELERATOR": "cpu", "ACCELERATE_USE_DEEPSPEED": "true"},
        ),
        # as tests/integrations/fsdp2/test_fsdp2.py::test_example_under_torchrun, 2 steps instead of 4
        "fsdp2": (
            [*TORCHRUN, str(ex / "fsdp2_train.py"), "--bench", "--steps", "2", "--n-layer", "2", "--n-embd", "128"]
            + ["--batch-size", "4", "--seq", "32", "--json", str(out / "fsdp2.json")],
            {},
        ),
        # its docstring's --bench launch (the test drives its main() inside the FSDP2 harness), 2 steps
        "torchtitan": (
            [*TORCHRUN, str(ex / "torchtitan_fsdp2.py"), "--bench", "--steps", "2", "--json", str(out / "titan.json")],
            {},
        ),
        # tests/dist/exit_script.py, the 3-rank job of the original abort report (the suite launches it once)
        "three_rank_script": (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
            + [str(REPO / "tests" / "dist" / "exit_script.py")],
            {},
        ),
        # its docstring's CPU launch (the test shims), the distributed optimizer with overlap, 2 iterations
        "megatron_loop": (
            [*TORCHRUN, str(REPO / "tests" / "integrations" / "megatron" / "run_on_cpu.py")]
            + [str(ex / "megatron_simple_loop.py"), "--iters", "2", "--distributed-optimizer", "--overlap"],
            {},
        ),
    }


def verdict(rc: int | None, output: str) -> dict:
    """What one launch's exit code and output say: unclean when any of aborted/signal/failed/timed_out is set."""
    threads = [int(n) for n in re.findall(r"\[exit_check\] rank=\S+ gloo_threads_at_exit=(-?\d+)", output)]
    signal = rc is not None and (rc < 0 or rc >= 128)
    # torchrun reports a worker killed by a signal in its failure summary ("exitcode  : -6", "Signal 6 (SIGABRT)")
    signal = signal or bool(re.search(r"exitcode\s*:\s*-\d+|Signal \d+ \(SIG", output))
    return {
        "rc": rc,
        "timed_out": rc is None,
        "aborted": "terminate called" in output,
        "signal": signal,
        "failed": rc != 0,
        "ranks_probed": len(threads),
        "gloo_threads_at_exit": max(threads, default=None),
    }


def launch(cmd: list[str], extra: dict, probe_dir: Path, timeout: float) -> tuple[dict, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(probe_dir), str(REPO), env.get("PYTHONPATH", "")) if p)
    t0 = time.monotonic()
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, start_new_session=True
    )
    try:
        output, rc = p.communicate(timeout=timeout)[0], p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)  # torchrun and its workers: the session started above
        output, rc = p.communicate()[0], None
    v = verdict(rc, output or "")
    v["seconds"] = round(time.monotonic() - t0, 1)
    return v, output or ""


def unclean(v: dict) -> bool:
    return v["timed_out"] or v["aborted"] or v["signal"] or v["failed"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=20, help="consecutive launches per example (default 20)")
    ap.add_argument("--only", default="", help="comma list of examples (default: all)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per launch before it is killed")
    ap.add_argument("--out", default=str(REPO / "runs" / "exit_check"))
    a = ap.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = Path(a.out) / stamp
    work = Path(tempfile.mkdtemp(prefix="exit_check-"))
    (work / "probe").mkdir()
    (work / "probe" / "sitecustomize.py").write_text(PROBE)
    table = examples(work / "out")
    names = [n for n in a.only.split(",") if n] or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown example(s) {unknown}; known: {', '.join(table)}")
    folder.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=REPO)
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else ""),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "launches": a.launches,
        "examples": {},
    }
    path = folder / "exit_check.json"
    try:
        for name in names:
            cmd, extra = table[name]
            runs = result["examples"].setdefault(name, {"command": cmd, "runs": []})["runs"]
            for i in range(a.launches):
                v, output = launch(cmd, extra, work / "probe", a.timeout)
                runs.append(v)
                if unclean(v) or v["gloo_threads_at_exit"]:
                    (folder / f"{name}-{i + 1}.log").write_text(output)  # the evidence, whole
                print(f"{name} {i + 1}/{a.launches}: {json.dumps(v)}", flush=True)
                path.write_text(json.dumps(result, indent=1))  # partial results survive an interrupted run
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\n{'example':<16}{'launches':>9}{'unclean':>9}{'aborts':>8}{'signal':>8}{'rc!=0':>7}{'timeout':>9}"
        f"{'threads>0':>11}{'median s':>10}"
    )
    for name, r in result["examples"].items():
        runs = r["runs"]
        secs = sorted(x["seconds"] for x in runs)
        print(
            f"{name:<16}{len(runs):>9}{sum(map(unclean, runs)):>9}{sum(x['aborted'] for x in runs):>8}"
            f"{sum(x['signal'] for x in runs):>8}{sum(x['failed'] for x in runs):>7}"
            f"{sum(x['timed_out'] for x in runs):>9}{sum(bool(x['gloo_threads_at_exit']) for x in runs):>11}"
            f"{secs[len(secs) // 2]:>10.1f}"
        )
    print(f"results: {path}")
    bad = any(unclean(x) or x["gloo_threads_at_exit"] for r in result["examples"].values() for x in r["runs"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
