#!/usr/bin/env bash
# The first thing to run on a GPU: install, then bench/gpu_check.py's one table (<= 10 minutes): bf16 parity
# with transformers, the SDPA kernel of each attention call, decode tokens/s and the memory bandwidth it
# reaches, the update's peak memory against bench/memory_plan.py, and 20 GRPO steps of the SmolLM2 recipe in
# bf16 with config_24GB.yaml's optimizer. ALL=1 then runs the speed benchmarks too (<= 8 min more).
# Reports (tables + JSON) go to $OUT if set, else bench/results-gpu/.
#
#   SMOLLM2_DIR=DIR bash bench/gpu.sh      # DIR from ../shared/tools/make_smollm2.sh DIR . (or the Hub's copy)
#   MODEL=path/to/Qwen2.5-3B-Instruct bash bench/gpu.sh   # checks 1-5 on that model (default: random 0.5B shape)
#   DRY_RUN=1 bash bench/gpu.sh            # the same commands on the CPU at toy sizes: checks the wiring
#
# Speed benchmarks' time budget (timeouts, 8 min in all): profile 90 s, rollout 165 s, update 45 s, update host
# reads 30 s, step vs TRL 2 x 75 s. A benchmark that fails or times out is reported and the next one still runs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results-gpu}"
MODEL="${MODEL:-qwen2.5-0.5b}"
if [[ "${DRY_RUN:-0}" != 1 ]] && ! nvidia-smi -L >/dev/null 2>&1; then  # before anything is created
  echo "bench/gpu.sh needs an NVIDIA GPU and nvidia-smi finds none here; DRY_RUN=1 bash bench/gpu.sh runs the same" \
    "commands on the CPU at toy sizes" >&2
  exit 2
fi
mkdir -p "$OUT"
# Install first, outside every benchmark's timeout: on a fresh machine the CUDA wheels take minutes to fetch.
uv sync --locked --group bench

# Timeouts in seconds (a dry run on a busy CPU gets ten times as long).
SCALE=1
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  SCALE=10
  MODEL=tiny
  DEVICE=(--device cpu)
  ROLLOUT=(--questions 2 --answers 4 --prompt-len 12 --min-gen-len 4 --max-gen-len 16)
  PROFILE=("${ROLLOUT[@]}")
  UPDATE=(--model tiny --seq-len 64 --prompt-len 16 --chunk-sizes 32)
  HOST_READS=(--model tiny --seq-len 64 --prompt-len 16 --batch-size 8 --episodes 32)
  STEP=(--questions 2 --answers 4 --max-gen-len 8 --micro-batch-size 4 --rounds 1)
  echo "dry run on the CPU at toy sizes" | tee "$OUT/gpu.txt"
else
  DEVICE=(--device cuda --dtype bfloat16)
  # GRPO-like: 16 questions x 8 answers, ~120-token prompts, planted lengths 32-384.
  ROLLOUT=(--questions 16 --answers 8 --min-gen-len 32 --max-gen-len 384)
  PROFILE=(--questions 16 --answers 8 --min-gen-len 32 --max-gen-len 256)  # shorter: the profiler's events cost time
  UPDATE=(--model qwen2.5-0.5b --chunk-sizes 512 256)  # the training micro-batch, 2 x 1280 tokens
  HOST_READS=(--model qwen2.5-0.5b --seq-len 512 --prompt-len 128 --batch-size 8 --episodes 64)  # 8 micro-batches
  STEP=(--questions 16 --answers 8 --max-gen-len 128 --micro-batch-size 64 --rounds 3)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi
DEVICE_ONLY=("${DEVICE[@]:0:2}")  # step_vs_trl.py picks its dtype itself: bf16 on CUDA, fp32 on the CPU
failed() { echo "!! $1 failed or timed out (exit $2); going on" | tee -a "$OUT/failures.txt"; }

CHECK=(--out "$OUT")
[[ "${DRY_RUN:-0}" == 1 ]] && CHECK+=(--dry-run)
[[ "$MODEL" != qwen2.5-0.5b && "$MODEL" != tiny ]] && CHECK+=(--model "$MODEL")
[[ -n "${SMOLLM2_DIR:-}" ]] && CHECK+=(--smollm2 "$SMOLLM2_DIR")
timeout $((600 * SCALE)) uv run python -m bench.gpu_check "${CHECK[@]}" 2>&1 | tee "$OUT/gpu_check.txt" \
  || failed gpu_check $?
[[ "${ALL:-0}" == 1 ]] || exit 0

# Where a rollout's time goes (eager decode: a captured graph hides its parts).
timeout $((90 * SCALE)) uv run python -m bench.rollout --model "$MODEL" "${DEVICE[@]}" "${PROFILE[@]}" --profile \
  --json-out "$OUT/profile.json" 2>&1 | tee "$OUT/profile.txt" || failed profile $?

# Our engine (eager and compiled decode) vs the GRPO:Zero-style engine vs transformers, 3 interleaved rounds.
timeout $((165 * SCALE)) uv run python -m bench.rollout --model "$MODEL" "${DEVICE[@]}" "${ROLLOUT[@]}" --compile \
  --json-out "$OUT/rollout.json" 2>&1 | tee "$OUT/rollout.txt" || failed rollout $?

# One update step: chunked log-probs vs full logits.
timeout $((45 * SCALE)) uv run python -m bench.update "${DEVICE[@]}" "${UPDATE[@]}" \
  --json-out "$OUT/update.json" 2>&1 | tee "$OUT/update.txt" || failed update $?

# grpo.update_policy with its sums read once per step (now) vs once per micro-batch (before).
timeout $((30 * SCALE)) uv run python -m bench.update --host-reads "${DEVICE[@]}" "${HOST_READS[@]}" \
  --json-out "$OUT/update_host_reads.json" 2>&1 | tee "$OUT/update_host_reads.txt" || failed update_host_reads $?

# A whole GRPO step vs TRL's GRPOTrainer, our decode eager and compiled.
for compile in "" --compile; do
  name="step_vs_trl${compile:+_compiled}"
  timeout $((75 * SCALE)) uv run --group bench python -m bench.step_vs_trl "${DEVICE_ONLY[@]}" "${STEP[@]}" $compile \
    --json-out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.txt" || failed "$name" $?
done
