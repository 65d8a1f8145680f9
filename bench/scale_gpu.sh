#!/usr/bin/env bash
# scale_gpu.sh: the scale runs of bench/RESULTS.md's "Host memory equals the state" section on a GPU
# machine: for each model, the planner's prediction, then training, with the device memory the
# driver reports (nvidia-smi, sampled every 0.5 s) beside ferry's own device peak and ferry's own
# reading of the driver's count (the JSON's driver_* fields: NVML every 100 ms).
#
# usage: bash bench/scale_gpu.sh [FERRY] [OUT_DIR]
#   FERRY    the ferry binary (default build/release/ferry; the GPU kit's is .gpu/.../bin/ferry)
#   OUT_DIR  where each run's JSON, stderr and memory samples go (default scale-gpu)
# Runs, each under `timeout`:
#   gpt1b_resident   width 2048, 20 blocks, context 256, batch 8, 4 steps, resident
#   gpt1b_stream     the same streamed under --device-budget 8GiB with the updates on the device
#                    (--no-host-optimizer; without it `ferry train` puts them on the host there)
#   gpt1b_stream_host  the same with --host-optimizer (weights in, gradients out: 8.5 GiB over the
#                    link a step instead of 30.7), what `ferry train` takes by itself there (target:
#                    >= 0.9x resident tokens/s, the driver's memory in use <= 8 GiB plus a fixed overhead)
#   gpt7b_stream     width 4096, 32 blocks, 32 heads, --device-budget 24GiB --optimizer adamw8bit,
#                    3 steps, the updates on the device (target: trains; needs >= 100 GB of host memory)
#   gpt7b_stream_host  the same with --host-optimizer (8-bit AdamW on the host's cores: only weights
#                    and gradients cross the link)
# Prints one line per run: tokens/s, host_state_bytes, ferry's device peak, the driver's largest
# sample, the planner's predicted step time with its rates, and the configuration it recommends.
# SCALE_GPU_ONLY=1b runs the three 1B runs alone, 1b-pair the resident and the streamed one as
# `ferry train` chooses its optimizer's place,
# 1b-stream the two streamed ones (SCALE_GPU_HOST_MEMORY adds --host-memory to them,
# SCALE_GPU_STAGING_CHUNK --staging-chunk, SCALE_GPU_SLACK --transfer-slack), 1b-overlap the host-optimizer run without and with
# --overlap-host-updates (with the same two), 1b-accumulate the streamed run as 4 micro-batches of
# 2 per update with the host optimizer (its gradient sums on the host lane) and with the device's
# (with the same two), 7b gpt7b_stream_host alone (with the same two, and
# --overlap-host-updates with SCALE_GPU_OVERLAP=1), each
# bounded by SCALE_GPU_LIMIT_S; SCALE_GPU_ONLY=tiny runs one small streamed GPT instead (a check
# of the script itself, on any device). SCALE_GPU_TRACE=1: each run also writes a trace of its first
# two steps (NAME.trace.json) and prints bench/trace_summary.py's summary of the second.
set -uo pipefail

ferry=${1:-build/release/ferry}
out=${2:-scale-gpu}
mkdir -p "$out"
[[ -x $ferry ]] || {
  echo "scale_gpu.sh: no ferry binary at '$ferry'" >&2
  exit 1
}

gpt1b=(--model gpt --width 2048 --depth 20 --heads 16 --context 256 --batch 8)
gpt7b=(--model gpt --width 4096 --depth 32 --heads 32 --context 256 --batch 8 --optimizer adamw8bit)

# run NAME SECONDS STEPS ARGS...: plan, then train with the driver's memory sampled.
run() {
  local name=$1 limit=$2 steps=$3
  shift 3
  timeout 120 "$ferry" plan "$@" --json >"$out/$name.plan.json" 2>"$out/$name.plan.err"
  local sampler=
  if command -v nvidia-smi >/dev/null; then
    (while :; do
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n 1
      sleep 0.5
    done) >"$out/$name.smi" &
    sampler=$!
  fi
  local trace=()
  [[ ${SCALE_GPU_TRACE:-0} == 1 ]] && trace=(--trace "$out/$name.trace.json" --trace-steps 2 --force)
  # 16 validation windows: the pass after the steps streams the whole model per batch of windows.
  timeout "$limit" "$ferry" train "$@" --steps "$steps" --eval-every "$steps" --val-windows 16 --json "${trace[@]}" \
    >"$out/$name.json" 2>"$out/$name.err"
  local rc=$?
  [[ -n $sampler ]] && kill "$sampler" 2>/dev/null
  if [[ -s $out/$name.trace.json ]]; then
    python3 "$(dirname "${BASH_SOURCE[0]}")/trace_summary.py" "$out/$name.trace.json" --step 1 \
      >"$out/$name.trace_summary.json" && cat "$out/$name.trace_summary.json"
  fi
  python3 - "$name" "$rc" "$out" <<'EOF'
import json, sys
name, rc, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def last_json(path):
    try:
        lines = [l for l in open(path) if l.startswith("{")]
        return json.loads(lines[-1]) if lines else {}
    except OSError:
        return {}
train, plan = last_json(f"{out}/{name}.json"), last_json(f"{out}/{name}.plan.json")
try:
    smi = max(int(x) for x in open(f"{out}/{name}.smi").read().split() if x.isdigit())
except (OSError, ValueError):
    smi = None
rec = plan.get("recommended") or {}
print(json.dumps({"run": name, "rc": rc, "tokens_per_s": train.get("tokens_per_s"),
                  "step_ms": train.get("step_ms"),
                  "host_state_bytes": train.get("host_state_bytes"),
                  "host_memory": train.get("host_memory"),
                  "staging_chunk_bytes": train.get("staging_chunk_bytes"),
                  "pinned_staging_bytes": train.get("pinned_staging_bytes"),
                  "compile_s": train.get("compile_s"), "eval_s": train.get("eval_seconds"),
                  "training_state_bytes": train.get("training_state_bytes"),
                  "device_peak_bytes": train.get("device_peak_bytes"),
                  "driver_memory_used_mib_max": smi,
                  "ferry_driver_count": {k: train.get(k) for k in ("driver_memory_source", "driver_memory_unavailable",
                                                                   "driver_device_used_before_bytes",
                                                                   "driver_device_used_after_context_bytes",
                                                                   "driver_device_used_peak_bytes",
                                                                   "driver_device_bytes_beyond_plan")},
                  "predicted_step_ms": plan.get("predicted_step_ms"),
                  "predicted_terms_ms": {k: plan.get(k) for k in ("compute_ms", "forward_ms", "transfer_ms", "to_device_ms", "to_host_ms",
                                                                  "host_update_ms", "codec_ms", "scheduled_step_ms",
                                                                  "scheduled_compute_idle_ms")},
                  "scheduled_longest_wait_before": plan.get("scheduled_longest_wait_before"),
                  "plan_rates": {k: plan.get(k) for k in ("link_gbps", "link_d2h_gbps", "link_both_gbps", "gemm_gflops", "device_gbps", "device_8bit_gbps", "launch_us", "host_gbps", "host_8bit_gbps", "codec_gbps")},
                  "recommended": rec.get("flags"),
                  "recommended_predicted_step_ms": rec.get("predicted_step_ms")}))
EOF
}

# The host memory flags of the streamed runs that take them (1b-stream, 1b-overlap, 7b), and the
# tag their names carry.
memory=()
[[ -n ${SCALE_GPU_HOST_MEMORY:-} ]] && memory=(--host-memory "$SCALE_GPU_HOST_MEMORY")
[[ -n ${SCALE_GPU_STAGING_CHUNK:-} ]] && memory+=(--staging-chunk "$SCALE_GPU_STAGING_CHUNK")
[[ -n ${SCALE_GPU_SLACK:-} ]] && memory+=(--transfer-slack "$SCALE_GPU_SLACK")
tag=${SCALE_GPU_HOST_MEMORY:+_$SCALE_GPU_HOST_MEMORY}${SCALE_GPU_STAGING_CHUNK:+_chunked}${SCALE_GPU_SLACK:+_slack$SCALE_GPU_SLACK}

if [[ ${SCALE_GPU_ONLY:-} == 1b ]]; then
  run gpt1b_resident "${SCALE_GPU_LIMIT_S:-900}" 4 "${gpt1b[@]}" --residency resident
  run gpt1b_stream "${SCALE_GPU_LIMIT_S:-900}" 4 "${gpt1b[@]}" --residency stream --device-budget 8GiB \
    --no-host-optimizer
  run gpt1b_stream_host "${SCALE_GPU_LIMIT_S:-900}" 4 "${gpt1b[@]}" --residency stream --device-budget 8GiB \
    --host-optimizer
  exit
fi
if [[ ${SCALE_GPU_ONLY:-} == 1b-pair ]]; then
  run gpt1b_resident "${SCALE_GPU_LIMIT_S:-900}" 4 "${gpt1b[@]}" --residency resident
  run gpt1b_stream "${SCALE_GPU_LIMIT_S:-900}" 4 "${gpt1b[@]}" --residency stream --device-budget 8GiB
  exit
fi
if [[ ${SCALE_GPU_ONLY:-} == 1b-stream ]]; then
  run "gpt1b_stream$tag" "${SCALE_GPU_LIMIT_S:-900}" 4 "${gpt1b[@]}" --residency stream --device-budget 8GiB \
    --no-host-optimizer "${memory[@]}"
  run "gpt1b_stream_host$tag" "${SCALE_GPU_LIMIT_S:-900}" 4 "${gpt1b[@]}" --residency stream --device-budget 8GiB \
    --host-optimizer "${memory[@]}"
  exit
fi
if [[ ${SCALE_GPU_ONLY:-} == 1b-overlap ]]; then
  # The host optimizer's updates after the backward, then deferred into the next step's forward.
  run "gpt1b_stream_host$tag" "${SCALE_GPU_LIMIT_S:-900}" 4 "${gpt1b[@]}" --residency stream --device-budget 8GiB \
    --host-optimizer "${memory[@]}"
  run "gpt1b_stream_host_overlap$tag" "${SCALE_GPU_LIMIT_S:-900}" 4 "${gpt1b[@]}" --residency stream \
    --device-budget 8GiB --host-optimizer --overlap-host-updates "${memory[@]}"
  exit
fi
if [[ ${SCALE_GPU_ONLY:-} == 1b-accumulate ]]; then
  # The same 8 windows per update as 4 micro-batches of 2 (8 steps: 2 updates), the gradient sums
  # summed on the host lane with the host optimizer, streamed through the device with the device's.
  accumulated=(--model gpt --width 2048 --depth 20 --heads 16 --context 256 --batch 2 --accumulate 4)
  run "gpt1b_accumulate_host$tag" "${SCALE_GPU_LIMIT_S:-900}" 8 "${accumulated[@]}" --residency stream \
    --device-budget 8GiB --host-optimizer "${memory[@]}"
  run "gpt1b_accumulate_device$tag" "${SCALE_GPU_LIMIT_S:-900}" 8 "${accumulated[@]}" --residency stream \
    --device-budget 8GiB --no-host-optimizer "${memory[@]}"
  exit
fi
if [[ ${SCALE_GPU_ONLY:-} == 7b ]]; then
  [[ ${SCALE_GPU_OVERLAP:-0} == 1 ]] && memory+=(--overlap-host-updates) && tag+=_overlap
  run "gpt7b_stream_host$tag" "${SCALE_GPU_LIMIT_S:-1800}" 3 "${gpt7b[@]}" --residency stream --device-budget 24GiB \
    --host-optimizer "${memory[@]}"
  exit
fi
[[ ${SCALE_GPU_ONLY:-} == tiny ]] && { run tiny_stream 300 3 --model gpt --width 64 --depth 2 --heads 4 --context 32 --batch 8 --residency stream; exit; }
run gpt1b_resident 900 4 "${gpt1b[@]}" --residency resident
run gpt1b_stream 900 4 "${gpt1b[@]}" --residency stream --device-budget 8GiB --no-host-optimizer
run gpt1b_stream_host 900 4 "${gpt1b[@]}" --residency stream --device-budget 8GiB --host-optimizer
run gpt7b_stream 1800 3 "${gpt7b[@]}" --residency stream --device-budget 24GiB --no-host-optimizer
run gpt7b_stream_host 1800 3 "${gpt7b[@]}" --residency stream --device-budget 24GiB --host-optimizer
