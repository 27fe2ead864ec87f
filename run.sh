#!/usr/bin/env bash
# The main job: sets up .venv on first use, then runs `fp8comm demo` (extra arguments are passed through).
set -euo pipefail
cd "$(dirname "$0")"
source launch/setup_env.sh
exec fp8comm demo "$@"
