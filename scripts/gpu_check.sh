#!/usr/bin/env bash
# One call on a lent GPU machine (a few minutes): Triton kernel parity against the references
# (fp32 and bf16), the tests with CUDA paths, per-op timings, then a short Temper-vs-transformers
# benchmark in bf16. Each step has its own time limit and the whole script a deadline
# (DEADLINE_S, default 520 s), so one hang costs its step, not the call. Logs go to
# /tmp/gpu_check; with $OUT set (the device tool's folder) they come back as one tarball,
# $OUT/gpu_check.tgz. The machine has no network: it uses its own python3 with this checkout
# on PYTHONPATH (TEMPER_PYTHON overrides).
#
#   bash scripts/gpu_check.sh            # everything
#   BENCH=0 bash scripts/gpu_check.sh    # parity and tests only
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${TEMPER_PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# transformers 5.25 kernelizes from the Hub by default; the machine has no network, so the
# transformers side of each benchmark runs its own (sdpa) code.
export USE_HUB_KERNELS=0
LOGS=/tmp/gpu_check
rm -rf "$LOGS" && mkdir -p "$LOGS"
status=0
END=$((SECONDS + ${DEADLINE_S:-520}))
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/gpu_check.tgz" -C "$LOGS" . 2>/dev/null; }
trap pack EXIT

# step NAME LIMIT_S CMD...: (only the steps ONLY names, when set) runs CMD under min(LIMIT_S, time left), logs to $LOGS/NAME.txt,
# and marks the check failed on a non-zero exit (124: out of time).
step() {
  local name=$1 limit=$2 left=$((END - SECONDS))
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "== $name: skipped, out of time" | tee -a "$LOGS/summary.txt"; status=1; return; fi
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$LOGS/summary.txt"
  tail -n 15 "$LOGS/$name.txt"
  [ "$rc" -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOGS/gpu.txt"
"$PY" -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton",
triton.__version__, "transformers", transformers.__version__)' | tee -a "$LOGS/gpu.txt"

# The tests whose fast paths only run on CUDA (the rest run in CI): every Triton op against its
# reference (fp32 and bf16; DeepSeek sparse attention's kernel against its gather, and SparseMLA
# on that kernel against the masked reference: TESTS_K=sparse runs those alone), the flash
# varlen / flex attention backends, gpt-oss's sinks and windows through flex, selective
# checkpointing keeping each backend's output, FLA's gated delta rule when fla is installed,
# the FP8 routed experts (torchao's FP8 grouped GEMM, sm90+) against bf16, and ring
# attention's per-block flash kernel (compat.fused_attention_*, bf16), also run per document
# inside ring attention on packed rows (a one-rank CP group). TESTS_K
# narrows them (a pytest -k expression).
step tests 240 "$PY" -m pytest -v --tb=short -p no:cacheprovider -rs \
  -k "${TESTS_K:-cuda or gpu or triton}" tests/unit/test_kernels_triton.py \
  tests/unit/test_attention.py tests/unit/test_gpt_oss.py tests/unit/test_gated_deltanet.py \
  tests/distributed/test_activation_checkpoint.py tests/unit/test_float8_experts.py \
  tests/unit/test_fused_block_attention.py tests/distributed/test_context_parallel.py

# DeepSeek V4's compressed attention on the sparse-attention Triton kernel
# (kernels.compressed_attention, opt in): the kernel with per-head sinks and a shared KV head
# against the gather and the dense reference (fp32 and bf16, forward and q/k/v/sinks
# gradients), and a 3-layer V4 (sliding, CSA, HCA) on it against the reference (fp32, 1e-5).
step v4_attention 60 "$PY" -m pytest -v --tb=short -p no:cacheprovider \
  -k "sinks or deepseek_v4" tests/unit/test_kernels_triton.py

# Observability (docs/observability.md): a traced step, an allocator snapshot and a MoE load
# map from a short CUDA run, each file checked; then the dry run's peak estimate against the
# allocator's measured peak (world 1, bf16).
OBS="$LOGS/observe"
step observe 90 "$PY" -m temper.train --module temper.recipes.qwen3 --config qwen3_moe_debug \
  --job.dump_folder "$OBS" --training.steps 3 --metrics.no_tensorboard \
  --profiling.trace_steps 2 --profiling.memory_snapshot_steps 3 --profiling.moe_heatmap_freq 1
if [ -d "$OBS" ]; then  # the observe step ran
  for f in "$OBS"/profile/step-2/rank0.*.pt.trace.json "$OBS/memory_snapshot/step-3/rank0.pickle" \
    "$OBS/moe/step-3.png"; do
    if [ -s "$f" ]; then echo "ok: $f"; else echo "MISSING: $f"; status=1; fi
  done > >(tee -a "$LOGS/summary.txt")
  grep -q '"time_forward_ms"' "$OBS/metrics.jsonl" || { echo "no phase times" | tee -a "$LOGS/summary.txt"; status=1; }
fi
rm -rf "$OBS/profile" "$OBS/memory_snapshot"  # large; their presence is what was checked
step plan_memory 60 "$PY" -m bench.plan_memory --device cuda --cases llama3_debug:1,qwen3_moe_debug:1

if [ "${BENCH:-1}" != 0 ]; then
  # Llama 3 8B-shaped layers (4 of 32, full 128K vocabulary) and a Qwen3-30B-A3B-shaped MoE.
  step train_step 120 "$PY" -m bench.train_step --device cuda --dtype bfloat16 --batch 2 \
    --seq-len 4096 --steps 5 --cases llama3-8b-4l,qwen3-moe-30b-a3b-4l
  # Each op's reference, compiled and Triton forms at Llama 3 8B shapes.
  step kernels 60 "$PY" -m bench.kernels --device cuda
  # Rollouts: the eager and compiled decoders against transformers' generate, bf16.
  step rollout 60 "$PY" -m bench.rollout --device cuda --dtype bfloat16 --rounds 3
  # Optimizer step, Muon against AdamW, on Llama 3 8B-shaped layers (4 of 32).
  step optimizer 60 "$PY" -m bench.optimizer_step --device cuda --world 1 --model llama3:8b \
    --layers 4 --steps 5
fi

if [ "${PRECISION:-1}" != 0 ]; then
  # torchao schemes on the GPU (docs/precision.md): FP8 (real float8 matmuls, no emulation)
  # against bf16 tokens/s, the 8-bit AdamW, and LoRA against QLoRA memory, on Llama 3
  # 8B-shaped layers (4 of 32); with 2+ GPUs, FSDP2 CPU offload training and checkpointing.
  step precision_fp8 90 "$PY" -m bench.precision --device cuda --model llama3:8b --layers 4 \
    --batch 2 --seq-len 4096 --schemes base,float8_tensorwise,float8_rowwise,adamw8bit
  step precision_qlora 60 "$PY" -m bench.precision --device cuda --model llama3:8b --layers 4 \
    --batch 2 --seq-len 4096 --schemes lora,qlora
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    step offload 90 env MODULE=temper.recipes.llama3 CONFIG=llama3_debug NGPU=2 ./run_train.sh \
      --training.steps 4 --parallelism.fsdp_cpu_offload --checkpoint.enable \
      --checkpoint.interval 2 --job.dump_folder "$LOGS/offload"
    # QLoRA with the NF4 base sharded by FSDP2 over NCCL, saved and resumed.
    step qlora_fsdp 90 env MODULE=temper.recipes.precision CONFIG=sft_debug_qlora NGPU=2 \
      ./run_train.sh --training.steps 4 --checkpoint.enable --checkpoint.interval 2 \
      --job.dump_folder "$LOGS/qlora_fsdp"
  fi
fi
cat "$LOGS/summary.txt"
exit $status
