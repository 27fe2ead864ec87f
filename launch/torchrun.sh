#!/usr/bin/env bash
# torchrun wrapper for fp8comm jobs: one node (default) or many (NNODES > 1, or under `srun` in an allocation).
#
#   launch/torchrun.sh PROGRAM [ARGS...]           PROGRAM: path/to/script.py, or -m package.module
#
# Environment (all optional on one node):
#   NPROC_PER_NODE  ranks per node (default: number of GPUs, else 2)
#   NNODES          nodes in the job (default: SLURM_NNODES, else 1)
#   NODE_RANK       this node's index (default: SLURM_NODEID, else 0); node 0 hosts the rendezvous
#   MASTER_ADDR     address of node 0, reachable from every node (required for several nodes)
#   MASTER_PORT     rendezvous port on node 0 (default 29400)
#   LOCAL_ADDR      the address this node advertises (default under Slurm: its NodeAddr; else torchrun's guess)
#   MAX_RESTARTS    torchrun elastic restarts after a worker failure (default 0); the program resumes from its
#                   own checkpoint (see launch/train_demo.py)
#   FP8COMM_TIMEOUT kill the whole launch after this many seconds (default: no limit; Slurm's --time still holds)
#   RDZV_ID         rendezvous id shared by all nodes (default: SLURM_JOB_ID, else "fp8comm")
#   PYTHON          interpreter (default: the repo's .venv if present, else python3)
# Ranks talk gloo on CPU / NCCL on GPU; set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the inter-node interface
# when a host has several. fp8comm.distributed.init_distributed() picks the torchrun environment up.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ $# -eq 0 ]; then sed -n '2,20p' "$0"; exit 2; fi
py="${PYTHON:-}"
[ -n "$py" ] || { [ -x "$root/.venv/bin/python" ] && py="$root/.venv/bin/python" || py=python3; }
if [ -z "${NPROC_PER_NODE:-}" ]; then
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
    NPROC_PER_NODE=$([ "${gpus:-0}" -gt 0 ] && echo "$gpus" || echo 2)
fi
nnodes="${NNODES:-${SLURM_NNODES:-1}}"
node_rank="${NODE_RANK:-${SLURM_NODEID:-0}}"
# The failed workers' store is otherwise handed to the restarted ones without a per-round prefix, and they read
# the dead ranks' addresses (torch 2.13; see docs/launch.md "Elastic restart").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

args=(-m torch.distributed.run --nproc-per-node "$NPROC_PER_NODE" --max-restarts "${MAX_RESTARTS:-0}")
if [ "$nnodes" -le 1 ]; then
    args+=(--standalone)
else
    if [ -z "${MASTER_ADDR:-}" ]; then
        echo "torchrun.sh: NNODES=$nnodes needs MASTER_ADDR (node 0's address reachable from every node)" >&2
        exit 2
    fi
    local_addr="${LOCAL_ADDR:-}"
    if [ -z "$local_addr" ] && [ -n "${SLURMD_NODENAME:-}" ] && command -v scontrol >/dev/null; then
        local_addr=$(scontrol show node -o "$SLURMD_NODENAME" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
    fi
    # is_host says explicitly which node hosts the rendezvous store (hostnames can all map to one address).
    args+=(--nnodes "$nnodes" --node-rank "$node_rank" --rdzv-backend c10d
           --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29400}" --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-fp8comm}}"
           --rdzv-conf "is_host=$([ "$node_rank" -eq 0 ] && echo 1 || echo 0),join_timeout=${JOIN_TIMEOUT:-300}")
    [ -z "$local_addr" ] || args+=(--local-addr "$local_addr")
fi
cmd=("$py" "${args[@]}" "$@")
if [ -n "${FP8COMM_TIMEOUT:-}" ]; then
    # TERM first (torchrun forwards it to the workers), KILL 30 s later.
    exec timeout --kill-after=30 "$FP8COMM_TIMEOUT" "${cmd[@]}"
fi
exec "${cmd[@]}"
