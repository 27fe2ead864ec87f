#!/usr/bin/env bash
# The whole test suite: sets up .venv on first use (plus the simulated-cluster tools: iproute2, Slurm, munge,
# mpi4py/mpich), then runs pytest; extra arguments are passed through.
# pytest exits non-zero on any failure and with 5 when no test was collected, so both fail this script.
set -euo pipefail
cd "$(dirname "$0")"
source launch/setup_env.sh
bash launch/install_cluster_deps.sh
exec python -m pytest -q "$@"
