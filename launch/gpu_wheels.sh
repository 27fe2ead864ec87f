#!/usr/bin/env bash
# Wheels the GPU device image lacks (it has torch, triton, mpi4py; not DeepSpeed, megatron-core or pydantic), built or
# downloaded HERE into .whl/ (git-ignored) for Python 3.12 x86_64; the device command installs them offline:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
# DeepSpeed ships only a source distribution: its wheel is built here with every native op off (DS_BUILD_OPS=0),
# as the CPU set-up uses it. torch is NOT carried: the device keeps its own CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl \
    "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5" "hjson==3.1.0" \
    "megatron-core==0.19.2"
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==0.19.8"
ls -la .whl
