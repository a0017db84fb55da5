#!/usr/bin/env bash
# Train a recipe: MODULE=<python module> CONFIG=<function> NGPU=<procs> ./run_train.sh [--section.field value ...]
# Several nodes: run the same command on each with NNODES=<nodes> MASTER_ADDR=<a node's address>
# [MASTER_PORT=29500]; torchrun's c10d rendezvous there assigns node and global ranks.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/env.sh"

MODULE="${MODULE:-temper.recipes.llama3}"
CONFIG="${CONFIG:-llama3_debug}"
NGPU="${NGPU:-1}"
NNODES="${NNODES:-1}"
recipe=(-m temper.train --module "$MODULE" --config "$CONFIG")

# Help, the recipe list, a dry run and config errors are answered once, here, before any rank starts.
for arg in "$@"; do
  case "$arg" in
    -h | --help | --list) exec "$PYTHON" "${recipe[@]}" "$@" ;;
    --dry_run) WORLD_SIZE="$((NNODES * NGPU))" exec "$PYTHON" "${recipe[@]}" "$@" ;;
  esac
done
WORLD_SIZE="$((NNODES * NGPU))" "$PYTHON" "${recipe[@]}" --check_only "$@" > /dev/null

# One process needs no launcher: Ctrl-C then reaches the run alone (it stops at a step
# boundary) instead of also raising in torchrun's agent.
if [ "$NGPU" -eq 1 ] && [ "$NNODES" -eq 1 ]; then
  exec "$PYTHON" "${recipe[@]}" "$@"
fi

launch=(--standalone)
if [ "$NNODES" -gt 1 ]; then
  endpoint="${MASTER_ADDR:?NNODES > 1 needs MASTER_ADDR, the address of one of the nodes}"
  launch=(--nnodes="$NNODES" --rdzv_backend=c10d --rdzv_endpoint="$endpoint:${MASTER_PORT:-29500}")
fi
exec "$PYTHON" -m torch.distributed.run "${launch[@]}" --nproc_per_node="$NGPU" "${recipe[@]}" "$@"
