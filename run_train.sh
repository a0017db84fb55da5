#!/usr/bin/env bash
# Train a recipe: MODULE=<python module> CONFIG=<function> NGPU=<procs> ./run_train.sh [--section.field value ...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/env.sh"

MODULE="${MODULE:-temper.recipes.llama3}"
CONFIG="${CONFIG:-llama3_debug}"
NGPU="${NGPU:-1}"
recipe=(-m temper.train --module "$MODULE" --config "$CONFIG")

# Help and config errors are answered once, here, before any rank starts.
for arg in "$@"; do
  case "$arg" in -h | --help) exec "$PYTHON" "${recipe[@]}" "$@" ;; esac
done
WORLD_SIZE="$NGPU" "$PYTHON" "${recipe[@]}" --check_only "$@" > /dev/null

exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" "${recipe[@]}" "$@"
