#!/usr/bin/env bash
# Create (or reuse) .venv with torch, the package and the extras the README commands need. Idempotent and quick
# when nothing changed: a stamp of pyproject.toml, setup.py, fp4_cpu.c and this script skips the reinstall.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FP8COMM_VENV:-$root/.venv}"
extras="${FP8COMM_EXTRAS:-dev,triton,tools,hf,titan}"
py="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
stamp="$venv/.fp8comm-stamp"
# setup.py and fp4_cpu.c too: the 4-bit CPU kernels are built at install (an edit rebuilds them on the next run)
want="$(cat "$root/pyproject.toml" "$root/setup.py" "$root/fp8comm/quant/fp4_cpu.c" "$root/launch/setup_env.sh" \
    | sha256sum | cut -c1-16)-$extras"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
    # Package metadata, not `import torch`: torch warns "Failed to initialize NumPy" when imported before numpy
    # (an extra) is installed.
    has_torch() { "$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null; }
    if ! has_torch >/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            "${pip[@]}" torch            # a CUDA machine: the default CUDA build
        else
            "${pip[@]}" "torch==2.13.0"  # CPU: the pinned CPU wheel (unpinned torch would pull a multi-GB CUDA build)
        fi
    fi
    # torch stays pinned in every command below so no extra (transformers, torchtitan, ...) can swap the CPU build
    # for a CUDA one.
    torch_pin="torch==$(has_torch | cut -d+ -f1)"
    "${pip[@]}" -e "$root[$extras]" "$torch_pin"
    if [ "${FP8COMM_FRAMEWORKS:-1}" = 1 ]; then
        # The engines the demo and the integration tests run on. megatron-core 0.19.x declares Python >= 3.12 but
        # runs on 3.11 (every module compiles), hence --ignore-requires-python.
        "${pip[@]}" --ignore-requires-python "megatron-core==0.19.2" "deepspeed==0.19.8" "$torch_pin"
    fi
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
