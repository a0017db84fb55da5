#!/usr/bin/env bash
# Run the whole suite (lint, then pytest); extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/env.sh"
cd "$TEMPER_ROOT"

"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .
exec "$PYTHON" -m pytest "$@"
