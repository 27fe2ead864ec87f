#!/usr/bin/env bash
# Start an fp8comm program with MPI: every process calls fp8comm.distributed.init_distributed(), which reads
# PMI_RANK/PMI_SIZE (MPICH) or OMPI_COMM_WORLD_* (Open MPI); rank 0 opens the torch.distributed store on a free
# port and broadcasts it with mpi4py.
#
#   launch/mpirun.sh [-n NP] PROGRAM [ARGS...]      PROGRAM: script.py, or -m package.module (default NP 2)
#
# Environment: HOSTS (comma-separated host list for several hosts; MASTER_ADDR or GLOO_SOCKET_IFNAME then says
# which address rank 0 offers), MPIRUN (default: the repo's .venv/bin/mpirun, else mpirun on PATH), PYTHON,
# FP8COMM_TIMEOUT (seconds; default 3600 so a hung job cannot live forever; 0 = no limit).
# Needs: pip install mpi4py mpich (launch/install_cluster_deps.sh) or a system MPI plus mpi4py built for it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
np=2
if [ "${1:-}" = "-n" ] || [ "${1:-}" = "-np" ]; then np="$2"; shift 2; fi
if [ $# -eq 0 ]; then sed -n '2,13p' "$0"; exit 2; fi
py="${PYTHON:-}"
[ -n "$py" ] || { [ -x "$root/.venv/bin/python" ] && py="$root/.venv/bin/python" || py=python3; }
mpirun="${MPIRUN:-}"
[ -n "$mpirun" ] || { [ -x "$root/.venv/bin/mpirun" ] && mpirun="$root/.venv/bin/mpirun" || mpirun=$(command -v mpirun || true); }
if [ -z "$mpirun" ]; then
    echo "mpirun.sh: no mpirun found (pip install mpi4py mpich, or set MPIRUN)" >&2
    exit 2
fi
if ! "$py" -c "import mpi4py" 2>/dev/null; then
    echo "mpirun.sh: $py cannot import mpi4py (pip install mpi4py mpich)" >&2
    exit 2
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
extra=()
if "$mpirun" --version 2>&1 | grep -q "Open MPI"; then
    # Open MPI refuses root and more ranks than cores unless told.
    [ "$(id -u)" -ne 0 ] || extra+=(--allow-run-as-root)
    extra+=(--oversubscribe -x PYTHONPATH)
    [ -z "${HOSTS:-}" ] || extra+=(--host "$HOSTS")
else
    [ -z "${HOSTS:-}" ] || extra+=(-hosts "$HOSTS")
fi
cmd=("$mpirun" -n "$np" "${extra[@]}" "$py" "$@")
t="${FP8COMM_TIMEOUT:-3600}"
if [ "$t" != "0" ]; then exec timeout --kill-after=30 "$t" "${cmd[@]}"; fi
exec "${cmd[@]}"
