#!/usr/bin/env bash
# Run the whole suite (lint, then pytest); extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/env.sh"
cd "$TEMPER_ROOT"
# Inductor's compiled kernels beside the vLLM and torch-floor virtualenvs: a machine that
# keeps ~/.cache/temper between runs compiles them once, even where /tmp is wiped
# (tests/unit/test_moe_compile.py takes 233 s cold against 85 s warm on a 2-core CPU).
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/temper/inductor}"

"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .
exec "$PYTHON" -m pytest "$@"
