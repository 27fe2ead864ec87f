#!/usr/bin/env bash
# The whole test suite: sets up .venv on first use (plus the simulated-cluster tools: iproute2, Slurm, munge,
# mpi4py/mpich), then runs pytest; extra arguments are passed through.
# pytest exits non-zero on any failure and with 5 when no test was collected, so both fail this script.
set -euo pipefail
cd "$(dirname "$0")"
source launch/setup_env.sh
bash launch/install_cluster_deps.sh
# Test files run on parallel workers (pytest-xdist; each file stays on one worker, tests/conftest.py): one per core,
# at most 4 (the multi-rank launches start 2-4 processes each). FP8COMM_TEST_WORKERS=0 runs in this process.
cores="$(nproc 2>/dev/null || echo 1)"
workers="${FP8COMM_TEST_WORKERS:-$((cores < 4 ? cores : 4))}"
exec python -m pytest -q -n "$workers" --dist loadfile "$@"
