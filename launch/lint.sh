#!/usr/bin/env bash
# The habits CI checks before the tests: ruff (lint + format), mypy on the library, import-linter's layer
# contracts (pyproject.toml). Sets up .venv on first use, like test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
ruff check .
ruff format --check .
mypy
PYTHONPATH=. lint-imports
