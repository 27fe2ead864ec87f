#!/usr/bin/env bash
# Install what tests/cluster and launch/cluster.py need on a fresh Debian/Ubuntu machine (CI runs as root):
#   system: iproute2 (ip netns, tc), util-linux (nsenter), slurm-wlm (slurmctld, slurmd, sbatch/srun), munge
#   venv:   mpi4py + mpich wheels (mpirun); torch is never touched
# Idempotent; skips what is already there. Without root the system part is skipped with a message (the cluster
# tests then skip with their reason; the MPI test still runs). FP8COMM_SYSTEM_DEPS=0 skips the system part on
# purpose (a workstation where apt-installing Slurm/munge and stopping their services would surprise the owner).
#   launch/install_cluster_deps.sh [VENV]        VENV default: $FP8COMM_VENV or <repo>/.venv
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-${FP8COMM_VENV:-$root/.venv}}"
need=()
command -v ip >/dev/null && command -v tc >/dev/null || need+=(iproute2)
command -v nsenter >/dev/null || need+=(util-linux)
command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null || need+=(slurm-wlm)
command -v munged >/dev/null || need+=(munge)
if [ ${#need[@]} -gt 0 ]; then
    if [ "${FP8COMM_SYSTEM_DEPS:-1}" = 0 ]; then
        echo "install_cluster_deps.sh: FP8COMM_SYSTEM_DEPS=0: skipped system packages: ${need[*]}" >&2
    elif [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        # --no-install-recommends: slurm-wlm otherwise pulls in mail and X11 pieces we never use.
        apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
        # The packages start system munge/slurm services where an init system runs; the simulated cluster uses
        # its own private daemons, so stop those to keep ports 6817/6818 and the default munge socket free.
        for svc in slurmctld slurmd munge; do
            (command -v systemctl >/dev/null && systemctl stop "$svc" 2>/dev/null) || true
        done
    else
        echo "install_cluster_deps.sh: not root or no apt-get; skipped system packages: ${need[*]}" >&2
    fi
fi
py="$venv/bin/python"
if [ -x "$py" ] && ! "$py" -c "import mpi4py" 2>/dev/null; then
    "$py" -m pip install -q --disable-pip-version-check mpi4py mpich
fi
if [ -x "$py" ]; then
    "$py" -c "import torch, mpi4py; print('cluster deps ok: torch', torch.__version__, 'mpi4py', mpi4py.__version__)"
fi
