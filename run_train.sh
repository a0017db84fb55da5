#!/usr/bin/env bash
# Train a recipe: MODULE=<python module> CONFIG=<function> NGPU=<procs> ./run_train.sh [--section.field value ...]
# Several nodes: run the same command on each with NNODES=<nodes> MASTER_ADDR=<a node's address>
# [MASTER_PORT=29500]; torchrun's c10d rendezvous there assigns node and global ranks.
# MAX_RESTARTS=<n>: when a rank dies, torchrun restarts the group up to n times, and each
# restart resumes from the newest complete checkpoint (docs/checkpoints.md).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/env.sh"

MODULE="${MODULE:-temper.recipes.llama3}"
CONFIG="${CONFIG:-llama3_debug}"
NGPU="${NGPU:-1}"
NNODES="${NNODES:-1}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
recipe=(-m temper.train --module "$MODULE" --config "$CONFIG")

# Help, the recipe list, a dry run and config errors are answered once, here, before any rank starts.
for arg in "$@"; do
  case "$arg" in
    -h | --help | --help_all | --list) exec "$PYTHON" "${recipe[@]}" "$@" ;;
    --dry_run) WORLD_SIZE="$((NNODES * NGPU))" exec "$PYTHON" "${recipe[@]}" "$@" ;;
  esac
done

# One process needs no launcher (unless it is to be restarted): Ctrl-C then reaches the run
# alone (it stops at a step boundary) instead of also raising in torchrun's agent. It checks
# its inputs itself first (--preflight), so everything is imported and read once.
if [ "$NGPU" -eq 1 ] && [ "$NNODES" -eq 1 ] && [ "$MAX_RESTARTS" -eq 0 ]; then
  exec "$PYTHON" "${recipe[@]}" --preflight "$@"
fi
# Several: a pre-flight process answers config errors and a finished run (exit 3: nothing
# to launch) before any rank starts.
echo "temper: checking the data, tokenizer, chat template, model folder and checkpoints" >&2
status=0
WORLD_SIZE="$((NNODES * NGPU))" "$PYTHON" "${recipe[@]}" --check_only "$@" > /dev/null || status=$?
if [ "$status" -eq 3 ]; then exit 0; fi
if [ "$status" -ne 0 ]; then exit "$status"; fi

# torchrun's own default, set here so that it does not print a banner saying it chose it.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
launch=(--standalone)
if [ "$NNODES" -gt 1 ]; then
  endpoint="${MASTER_ADDR:?NNODES > 1 needs MASTER_ADDR, the address of one of the nodes}"
  launch=(--nnodes="$NNODES" --rdzv_backend=c10d --rdzv_endpoint="$endpoint:${MASTER_PORT:-29500}")
fi
if [ "$MAX_RESTARTS" -gt 0 ]; then
  # A fresh store per restart: the agent's shared one keeps the dead group's keys, and a
  # restarted rank could read a dead rank's gloo/nccl address and fail to connect.
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi
exec "$PYTHON" -m temper.launch "${launch[@]}" --nproc_per_node="$NGPU" \
  --max-restarts="$MAX_RESTARTS" "${recipe[@]}" "$@"
