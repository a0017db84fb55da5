#!/usr/bin/env bash
# One call on a lent GPU machine (a few minutes): Triton kernel parity against the references
# (fp32 and bf16), the tests with CUDA paths, per-op timings, then a short Temper-vs-transformers
# benchmark in bf16. Logs go to $OUT (the device tool's folder) or /tmp/gpu_check. The machine has no
# network: it uses its own python3 with this checkout on PYTHONPATH (TEMPER_PYTHON overrides).
#
#   bash scripts/gpu_check.sh            # everything
#   BENCH=0 bash scripts/gpu_check.sh    # parity and tests only
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${TEMPER_PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOGS="${OUT:-/tmp/gpu_check}"
mkdir -p "$LOGS"
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOGS/gpu.txt"
"$PY" -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton",
triton.__version__, "transformers", transformers.__version__)' | tee -a "$LOGS/gpu.txt"

# Kernel parity (every Triton op vs its reference, forward and gradients), then the tests
# whose fast paths only run on CUDA (grouped GEMM, flash varlen / flex attention, selective
# checkpointing keeping each backend's output, FLA's gated delta rule when fla is installed,
# the compiled decode step and compiled MoE / Gated DeltaNet blocks).
"$PY" -m pytest -q -p no:cacheprovider tests/unit/test_kernels_triton.py \
  tests/unit/test_grouped_gemm.py tests/unit/test_attention.py tests/unit/test_gpt_oss.py \
  tests/unit/test_gated_deltanet.py tests/distributed/test_activation_checkpoint.py \
  tests/unit/test_fast_decoding.py tests/unit/test_moe_compile.py 2>&1 \
  | tee "$LOGS/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# Observability (docs/observability.md): a traced step, an allocator snapshot and a MoE load
# map from a short CUDA run, each file checked; then the dry run's peak estimate against the
# allocator's measured peak (world 1, bf16).
OBS="$LOGS/observe"
rm -rf "$OBS"
"$PY" -m temper.train --module temper.recipes.qwen3 --config qwen3_moe_debug \
  --job.dump_folder "$OBS" --training.steps 3 --metrics.no_tensorboard \
  --profiling.trace_steps 2 --profiling.memory_snapshot_steps 3 --profiling.moe_heatmap_freq 1 \
  2>&1 | tee "$LOGS/observe.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
for f in "$OBS"/profile/step-2/rank0.*.pt.trace.json "$OBS/memory_snapshot/step-3/rank0.pickle" \
  "$OBS/moe/step-3.png"; do
  if [ -s "$f" ]; then echo "ok: $f"; else echo "MISSING: $f"; status=1; fi
done > >(tee -a "$LOGS/observe.txt")
grep -q '"time_forward_ms"' "$OBS/metrics.jsonl" || { echo "no phase times"; status=1; }
"$PY" -m bench.plan_memory --device cuda --cases llama3_debug:1,qwen3_moe_debug:1 2>&1 \
  | tee "$LOGS/plan_memory.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ "${BENCH:-1}" != 0 ]; then
  # Each op's reference, compiled and Triton forms at Llama 3 8B shapes.
  "$PY" -m bench.kernels --device cuda 2>&1 | tee "$LOGS/kernels.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # Llama 3 8B-shaped layers (4 of 32, full 128K vocabulary) and a Qwen3-30B-A3B-shaped MoE.
  "$PY" -m bench.train_step --device cuda --dtype bfloat16 --batch 2 --seq-len 4096 --steps 5 \
    --cases llama3-8b-4l,qwen3-moe-30b-a3b-4l 2>&1 | tee "$LOGS/bench.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # Rollouts: the eager and compiled decoders against transformers' generate, bf16.
  "$PY" -m bench.rollout --device cuda --dtype bfloat16 --rounds 3 2>&1 | tee "$LOGS/rollout.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # Optimizer step, Muon against AdamW, on Llama 3 8B-shaped layers (4 of 32).
  "$PY" -m bench.optimizer_step --device cuda --world 1 --model llama3:8b --layers 4 --steps 5 \
    2>&1 | tee "$LOGS/optimizer.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ "${PRECISION:-1}" != 0 ]; then
  # torchao schemes on the GPU (docs/precision.md): FP8 (real float8 matmuls, no emulation)
  # against bf16 tokens/s, the 8-bit AdamW, and LoRA against QLoRA memory, on Llama 3
  # 8B-shaped layers (4 of 32); with 2+ GPUs, FSDP2 CPU offload training and checkpointing.
  "$PY" -m bench.precision --device cuda --model llama3:8b --layers 4 --batch 2 --seq-len 4096 \
    --schemes base,float8_tensorwise,float8_rowwise,adamw8bit 2>&1 | tee "$LOGS/precision_fp8.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  "$PY" -m bench.precision --device cuda --model llama3:8b --layers 4 --batch 2 --seq-len 4096 \
    --schemes lora,qlora 2>&1 | tee "$LOGS/precision_qlora.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # FP8 routed experts (torchao's FP8 grouped GEMM, sm90+): output and gradients against bf16.
  "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_float8_experts.py 2>&1 \
    | tee "$LOGS/float8_experts.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    MODULE=temper.recipes.llama3 CONFIG=llama3_debug NGPU=2 ./run_train.sh --training.steps 4 \
      --parallelism.fsdp_cpu_offload --checkpoint.enable --checkpoint.interval 2 \
      --job.dump_folder "$LOGS/offload" 2>&1 | tee "$LOGS/offload.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    # QLoRA with the NF4 base sharded by FSDP2 over NCCL, saved and resumed.
    MODULE=temper.recipes.precision CONFIG=sft_debug_qlora NGPU=2 ./run_train.sh \
      --training.steps 4 --checkpoint.enable --checkpoint.interval 2 \
      --job.dump_folder "$LOGS/qlora_fsdp" 2>&1 | tee "$LOGS/qlora_fsdp.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
fi
exit $status
