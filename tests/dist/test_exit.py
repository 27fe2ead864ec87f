"""Clean process exit: after dist.destroy_process_group() no gloo thread of a group fp8comm touched is left running.

A gloo group's worker and socket threads stop only when the group object is freed; a reference that outlives
destroy_process_group() keeps them running into interpreter teardown, where one rank of a 3-rank job was seen
aborting ("terminate called without an active exception"). Each test runs a fresh interpreter (what matters is
what is imported after init_process_group) and counts the gloo threads left after destroy_process_group().
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import json, os, torch, torch.distributed as dist

def gloo_threads():
    # torch names them pt_gloo_runloop (workers) and gloo_tcp_loop (sockets)
    names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
    return sum(n.startswith(("pt_gloo", "gloo")) for n in names)

def gloo_threads_left(wait=5.0):
    # A joined thread can stay listed in /proc for a moment while the kernel reaps it (seen once in CI on a busy
    # 2-core VM: 1 of 3 left); a leaked one stays for good. Poll briefly before counting.
    import time
    end = time.monotonic() + wait
    while (n := gloo_threads()) and time.monotonic() < end:
        time.sleep(0.05)
    return n

def gloo_threads_started(wait=5.0):
    # A thread takes its name itself once it runs: right after init, on a loaded machine, it may not have yet
    # (seen once in a CI rehearsal: 0 counted). Poll briefly before counting.
    import time
    end = time.monotonic() + wait
    while not (n := gloo_threads()) and time.monotonic() < end:
        time.sleep(0.05)
    return n

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
running = gloo_threads_started()
"""


def run(body: str, timeout: float = 120) -> dict:
    """Run PRELUDE + body in a fresh interpreter (one gloo rank); returns the JSON it prints last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "terminate called" not in p.stderr, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
def test_destroy_stops_gloo_after_importing_fp8comm_late():
    """fp8comm imported after init_process_group (the usual order: `import fp8comm` is lazy) imports torch._dynamo,
    which imports torch.distributed.nn.functional, whose `group=group.WORLD` defaults then hold the live group."""
    got = run(
        """
        import fp8comm
        fp8comm.all_gather(torch.randn(256))  # first use imports fp8comm.comm (and torch._dynamo) now
        dist.destroy_process_group()
        print(json.dumps({"running": running, "left": gloo_threads_left(), "file": fp8comm.__file__}))
        """
    )
    assert got["file"].startswith(str(ROOT)), got
    assert got["running"] > 0, f"no gloo threads to count while the group was up: {got}"
    assert got["left"] == 0, f"{got['left']} gloo threads still running after destroy_process_group(): {got}"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
def test_shutdown_releases_what_fp8comm_holds():
    """fp8comm.shutdown() before destroy_process_group(): the node groups hierarchical mode cached, and group
    defaults bound by a module imported after init (here torch.distributed.nn.functional imported directly)."""
    got = run(
        """
        import fp8comm.comm as fc
        import importlib, sys
        sys.modules.pop("torch.distributed.nn.functional", None)
        importlib.import_module("torch.distributed.nn.functional")  # binds the live group as its defaults
        hg = fc.node_groups(local_size=1)
        x = torch.randn(512)
        y = fc.all_reduce(x, hierarchical=hg)
        del hg
        fc.shutdown()
        fc.shutdown()  # idempotent
        dist.destroy_process_group()
        left = gloo_threads_left()
        fc.shutdown()  # and harmless once torch.distributed is gone
        print(json.dumps({"running": running, "left": left}))
        """
    )
    assert got["left"] == 0, f"{got['left']} gloo threads still running after shutdown() + destroy: {got}"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
def test_shutdown_releases_the_group_fsdp2_pins():
    """FSDP2 fills torch's DTensor caches (sharding propagation in C++ and Python, redistribute plans, transform
    infos, mesh topology), whose entries hold the DeviceMesh and through it the process group, and its state sits in
    reference cycles: without fp8comm.shutdown() clearing them and collecting, destroy_process_group() leaves the
    gloo threads running into teardown (seen in CI: both ranks of examples/fsdp2_train.py aborted at exit)."""
    got = run(
        """
        import gc
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        import fp8comm

        def train():
            mesh = init_device_mesh("cpu", (1,))
            model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model(torch.randn(2, 16)).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DTensor redistribution: its plan caches
            model[0].weight.full_tensor()
            cycle = {"mesh": mesh}
            cycle["self"] = cycle  # garbage only a collection frees (as FSDP2's own state cycles are)

        train()
        fp8comm.shutdown()
        dist.destroy_process_group()
        print(json.dumps({"running": running, "left": gloo_threads_left()}))
        """
    )
    assert got["left"] == 0, f"{got['left']} gloo threads still running after fully_shard, shutdown() + destroy: {got}"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed not installed")
def test_deepspeed_shutdown_releases_the_groups_deepspeed_keeps():
    """A ZeRO-3 engine with the fp8_comm section, destroyed and dropped: DeepSpeed still holds its groups in module
    globals (deepspeed.utils.groups._WORLD_GROUP), in barrier defaults bound at import (imported after init here), in
    ZeRO-3's module stack and release cache (both keep the engine's state). fp8comm.integrations.deepspeed.shutdown()
    drops each (without any one of them: 3 or 6 threads left; with uninstall() + fp8comm.shutdown() only: 6)."""
    got = run(
        """
        os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        from fp8comm.integrations.deepspeed import cpu
        cpu.prepare()  # imports deepspeed now, after init_process_group (a Trainer imports it late too)
        import deepspeed
        import fp8comm.integrations.deepspeed as fd

        def train():
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            config = {
                "train_micro_batch_size_per_gpu": 2,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # no parameter persists
                "fp8_comm": {"enabled": True},
            }
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
            for _ in range(2):  # the second step runs on the recorded trace: parameter releases, and their cache
                engine.backward(engine(torch.randn(2, 64, dtype=torch.bfloat16)).float().sum())
                engine.step()
            assert fd.engine_state(engine) is not None  # the fp8comm hooks were on
            engine.destroy()  # DeepSpeed's own teardown: its gradient hooks would keep the engine alive

        train()
        fd.shutdown()
        dist.destroy_process_group()
        print(json.dumps({"running": running, "left": gloo_threads_left()}))
        """
    )
    assert got["left"] == 0, f"{got['left']} gloo threads still running after a DeepSpeed job + shutdown(): {got}"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="Megatron-Core not installed")
def test_megatron_shutdown_releases_the_groups_megatron_keeps():
    """A 2-layer MoE GPT with rotary embeddings, Megatron's DDP (distributed optimizer, overlap) and fp8comm installed,
    2 steps, the model dropped: Megatron-Core still holds groups in parallel_state globals that destroy_model_parallel()
    leaves, and the model, hence every group, through RotaryEmbedding.forward's lru_cache (keys: the embedding, whose
    config holds DDP's no_sync_func) and the dispatcher's last routing probabilities (an autograd graph reaching DDP's
    gradient hooks). fp8comm.integrations.megatron.shutdown() drops each (with uninstall() + destroy_model_parallel()
    + fp8comm.shutdown() instead: 60 threads left; leaving the cache, the dispatcher or the globals be: 60, 60, 6)."""
    got = run(
        """
        import sys, warnings
        sys.path.insert(0, "tests/integrations/megatron")
        os.environ.setdefault("NO_VCS_VERSION", "1")  # megatron.core's __version__ would otherwise run git
        warnings.filterwarnings("ignore")
        import mcore_cpu
        mcore_cpu.install()  # the test-only CUDA stand-ins Megatron-Core needs on CPU
        import mcore_train as mt
        from megatron.core.distributed import DistributedDataParallelConfig
        import fp8comm.integrations.megatron as fm

        def train():
            mt.init_parallel()
            kw = mt.ddp_kwargs(overlap_grad_reduce=True, overlap_param_gather=True)
            ddp_config = DistributedDataParallelConfig(**kw)
            fm.install(ddp_config=ddp_config, grad_reduce=True, param_gather=True, moe_dispatch=True)
            model, opt, config = mt.build(kw, moe=True)  # rotary embeddings, the alltoall dispatcher
            mt.train(model, opt, config, iters=2)
            # one rank: the hooks pass Megatron's collectives through, but they ran
            return sum(n for s in fm.hook_stats().values() for k, n in s.items() if k.endswith("_calls"))

        calls = train()
        fm.shutdown()
        dist.destroy_process_group()
        print(json.dumps({"running": running, "hook_calls": calls, "left": gloo_threads_left()}))
        """
    )
    assert got["hook_calls"] > 0, f"fp8comm's hooks never ran: {got}"
    assert got["left"] == 0, f"{got['left']} gloo threads still running after a Megatron job + shutdown(): {got}"


@pytest.mark.slow
def test_three_rank_script_exits_clean(tmp_path):
    """The job of the report, launched once: every rank exits 0 and none prints "terminate called". A smoke test, not
    proof (the abort never reproduced here); the deterministic guards are the thread counts above, and repeated
    launches of this script and of every example are `launch/exit_check.py`'s job (docs/benchmarks.md, "Clean
    exits"), not the suite's."""
    script = Path(__file__).with_name("exit_script.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "terminate called" not in out, f"exit {p.returncode}\n{out[-3000:]}"
