#!/usr/bin/env bash
# Rollout and update benchmarks on CUDA in bf16, eager and compiled decode, in one command (< 8 min on
# an A100/H100-class GPU). Reports (tables + JSON) go to $OUT if set, else bench/results-gpu/.
#
#   bash bench/gpu.sh                 # random weights of the real Qwen2.5-0.5B shape
#   MODEL=path/to/Qwen2.5-3B-Instruct bash bench/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results-gpu}"
MODEL="${MODEL:-qwen2.5-0.5b}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

# GRPO-like rollout: 32 questions x 8 answers, ~120-token prompts, planted lengths 32-512.
timeout 330 uv run bench/rollout.py --model "$MODEL" --device cuda --dtype bfloat16 --compile --warmup \
  --questions 32 --answers 8 --min-gen-len 32 --max-gen-len 512 --json-out "$OUT/rollout.json" \
  2>&1 | tee "$OUT/rollout.txt"

# One update step at the training micro-batch (2 x 1280 tokens) with the 0.5B-shaped model.
timeout 120 uv run bench/update.py --model qwen2.5-0.5b --device cuda --dtype bfloat16 --chunk-sizes 512 256 \
  --json-out "$OUT/update.json" 2>&1 | tee "$OUT/update.txt"
