#!/usr/bin/env bash
# Train a recipe: MODULE=<python module> CONFIG=<function> NGPU=<procs> ./run_train.sh [--section.field value ...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/env.sh"

MODULE="${MODULE:-temper.recipes.llama3}"
CONFIG="${CONFIG:-llama3_debug}"
NGPU="${NGPU:-1}"

exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
  -m temper.train --module "$MODULE" --config "$CONFIG" "$@"
