#!/usr/bin/env bash
# gpu_session.sh: one device call of a GPU lease, from the project root on the GPU machine with the
# kit (`bash ../shared/gpu/pack.sh`) in .gpu/: the kit's environment, then the named parts in order,
# each bounded by what is left of the call's budget, so a slow part skips the ones after it rather
# than losing the call; timings.txt says what each part took. Everything lands in $OUT/session.tgz
# (one file: the device tool brings back at most eight).
#
# usage: bash bench/gpu_session.sh PART...
#   kit        .gpu/run.sh quick restricted to $GPU_SESSION_KIT_STEPS (tests of the GPU kernels, GEMM
#              beside cuBLAS, the MLP and GPT steps beside PyTorch-CUDA); always run first, since it
#              unpacks the kit and finds the driver (with no steps if not named)
#   cublas     cuBLAS (PyTorch, TF32 off) on the GEMM products bench/kernels_gpu.sh compares
#   gemm       bench/kernels_gpu.sh's GEMM part (the H200 row with and without K split)
#   gemm-wide  the same part on the 128 x 128 tile with 16 x 8 results per work-item (K split, float4
#              loads): the tuner's candidate with the most results per work-item
#   gemm-vw4   the same part on the H200 row read from the tiles as float4s (VW=4, half the local
#              reads of VW=2; K split, and with float4 loads)
#   gemm-small the same part on 64 x 64 tiles (4 x 4 results per work-item, float2 reads), with K split
#              (SK=1) and with the tile halved instead (SK=0): the MLP's linear0 (256 x 1024 x 784) is 16
#              tiles of 128 x 128 on the H200's 132 compute units, split six ways along K by the H200 row
#              (0.60x cuBLAS, 2026-12-04); 64 x 64 tiles make 64 of them
#   attention  bench/kernels_gpu.sh's attention part, beside SDPA on CUDA
#   tune       bench/kernels_gpu.sh's tuner part (KERNELS_GPU_TUNE_S, 60 here)
#   scale1b    bench/scale_gpu.sh's three 1B runs; scale1b-pair: resident and streamed under 8 GiB;
#              scale1b-stream: its two streamed ones; scale7b: its 7B host-optimizer run (its training
#              bounded by GPU_SESSION_7B_S, 600)
#   attention-check  test_attention's cases of the blocked family (default tiles, and tiles wider than
#              the head dimension's float4s), of the gemm family (one chunk and chunks of heads) and
#              of narrow storage, on the GPU
#   attention-tuned  `ferry tune --family attention` (40 s), then `ferry-bench attention` with the
#              tuned kernel beside SDPA
#   host-optimizer  `ferry-bench host-optimizer --peer`: the host optimizer's AdamW and 8-bit AdamW on
#              one and on every core (the 6.4B run's largest term), beside PyTorch's CPU AdamW
#   driver-count  `ferry devices` (each device's memory in use as the driver counts it) and
#              test_driver_memory: whether ferry reads NVML on this driver (its stand-in's cases skip)
#   peak       `ferry-bench peak`: the GPU's fp32 FMA peak, that the GEMM's and the steps' figures read
#              against (in-place fma chains since 2026-12-06; no GPU figure of it is recorded yet)
#   staging    `ferry-bench staging` over 1 GiB: each leg of a pageable <-> device copy and a pipeline
#              through pinned chunks of 4, 16 and 64 MiB
#   trace-staged, trace-pageable, trace-registered  the two 1B streamed runs with --host-memory staged
#              (pageable, registered), each with a trace of two steps and bench/trace_summary.py's
#              account of the second, and the driver's memory in use sampled;
#              trace-chunked: the same with --host-memory staged --staging-chunk 16MiB
#   plan-accuracy  bench/plan_accuracy.sh: `ferry plan`'s predicted step against `ferry train`'s for the
#              MLP, CNN, GPTs and the quick start's deep MLP, with the GEMM rate at the step's own
#              products and with a 1024^3 product's
#   accumulate the 1B GPT streamed under 8 GiB as 4 micro-batches of 2 per update (bench/scale_gpu.sh
#              1b-accumulate): with the host optimizer, whose gradient sums are summed on the host lane
#              (each gradient crosses the link once per micro-batch), and with the device's
#   overlap-chunked  the 1B host-optimizer run with --host-memory staged --staging-chunk 64MiB (the
#              fastest within the budget so far), without and with --overlap-host-updates, traced
#   trace-gpt85m  the 85M GPT (width 768, 12 blocks, context 256, batch 8) trained 4 steps with a trace
#              of 3, with fused attention and with unfused: bench/trace_summary.py's account of the
#              third (the compute lane's busy share and its time per kind of node)
#   compile-cold  the 85M GPT's compile with no program cache (its own empty folder; CUDA_CACHE_DISABLE=1
#              so the driver's cache does not stand in): compile_s with kernels built one at a time
#              (FERRY_BUILD_THREADS=1) and in parallel (the default), one step each
#   predict    does Predict pay where the link binds? The small GPT streamed at its minimum budget
#              (bench/RESULTS.md, "Does Predict pay at scale?", measured on PoCL), 400 steps Full-only
#              and with hybrid phases and int8 Predict weights: val loss every 50 steps and seconds
#   narrow     16-bit storage on the GPU: `ferry-bench gemm --storage f32|f16|bf16` at n = 2048 and the
#              85M GPT's step_ms in fp32, fp16 and bf16, then bf16 with --no-fuse (what the narrowing and
#              the other fusions are worth there)
#   ptx        after parts that built them: the driver's own PTX of the tiled GEMM and blocked attention
#              kernels (NVIDIA's program binaries, in the program cache), each with bench/ptx_mix.sh's
#              account of its hottest block, to set beside clang's (tests/gpu_kernels/loop_mix.sh); the
#              entries come back gzipped in ptx/
# GPU_SESSION_BUDGET_S: seconds for the whole call (540); GPU_SESSION_TEST_BUDGET_S: for the kit's test
# binaries together (100; the GEMM tests alone took more than that on the H200, 2026-12-04).
set -uo pipefail

deadline=$((SECONDS + ${GPU_SESSION_BUDGET_S:-540}))
root=$PWD
OUT=${OUT:-$root/gpu-session}
res=$OUT/session
mkdir -p "$res"
kit=$root/.gpu
[[ -f $kit/run.sh ]] || {
  echo "gpu_session.sh: no kit in .gpu/ (bash ../shared/gpu/pack.sh here first)" >&2
  exit 2
}

left() { echo $((deadline - SECONDS)); }
# part NAME MAX_SECONDS CMD...: CMD under the smaller of MAX_SECONDS and what is left.
part() {
  local name=$1 max=$2 l t
  shift 2
  l=$(($(left) - 15))
  t=$((max < l ? max : l))
  if ((t < 20)); then
    echo "== $name: skipped, ${l}s left"
    return
  fi
  echo "== $name (limit ${t}s, at ${SECONDS}s)"
  local start=$SECONDS rc
  timeout -k 5 "$t" "$@" >"$res/$name.out" 2>"$res/$name.err"
  rc=$?
  echo "   rc=$rc after $((SECONDS))s"
  echo "$name rc=$rc seconds=$((SECONDS - start)) limit=$t" >>"$res/timings.txt"
  tail -n 40 "$res/$name.out"
}

steps=${GPU_SESSION_KIT_STEPS:-none}
# The kit first: it unpacks bin/ and lib/ and writes the ICD file the other parts use.
FERRY_GPU_KEEP=1 FERRY_GPU_ONLY=$steps FERRY_GPU_BUDGET_S=$(($(left) - 20)) FERRY_GPU_TEST_BUDGET_S=${GPU_SESSION_TEST_BUDGET_S:-100} \
  OUT=$res/kit timeout -k 5 $(($(left) - 10)) bash "$kit/run.sh" quick >"$res/kit.out" 2>&1
kit_rc=$?
echo "== kit: rc=$kit_rc after ${SECONDS}s"
echo "kit rc=$kit_rc seconds=$SECONDS" >>"$res/timings.txt"
grep -v '^\[' "$res/kit.out" | tail -n 60
grep '^\[' "$res/kit.out" | tail -n 40

icd=$(cat "$kit/icd/ferry-gpu.icd" 2>/dev/null) || {
  echo "gpu_session.sh: the kit found no OpenCL driver" >&2
  tar czf "$OUT/session.tgz" -C "$res" .
  exit 3
}
export OCL_ICD_VENDORS=$kit/icd LD_LIBRARY_PATH=$kit/lib:$(dirname "$icd") FERRY_DEVICE=${GPU_SESSION_DEVICE:-nvidia}
export FERRY_DATA_DIR=$kit/data FERRY_TEXT_DIR=$kit/text FERRY_CACHE_DIR=$kit/work/program-cache
python_peer=$kit/work/python-peer
free -g | head -n 2

for p in "$@"; do
  case $p in
    kit) ;;
    cublas)
      part cublas 90 "$python_peer" bench/peers/torch_gemm.py --device cuda --shapes 1024,1024,1024 2048,2048,2048 \
        256,1024,784,nt 2048,3072,768,nt 2048,768,3072 768,3072,2048,tn ;;
    gemm) part gemm 150 env KERNELS_GPU_ONLY=gemm bash bench/kernels_gpu.sh "$kit/bin" "$res/kernels" ;;
    gemm-wide)
      part gemm-wide 90 env KERNELS_GPU_ONLY=gemm KERNELS_GPU_ROW="tiled TSM=128 TSN=128 TSK=16 WPTM=16 WPTN=8 VW=4" \
        KERNELS_GPU_GEMM_VARIANTS="SK=1 VG=4" bash bench/kernels_gpu.sh "$kit/bin" "$res/kernels-wide" ;;
    gemm-vw4)
      part gemm-vw4 90 env KERNELS_GPU_ONLY=gemm KERNELS_GPU_ROW="tiled TSM=128 TSN=128 TSK=16 WPTM=8 WPTN=8 VW=4" \
        KERNELS_GPU_GEMM_VARIANTS="SK=1,SK=1 VG=4" bash bench/kernels_gpu.sh "$kit/bin" "$res/kernels-vw4" ;;
    gemm-small)
      part gemm-small 90 env KERNELS_GPU_ONLY=gemm KERNELS_GPU_ROW="tiled TSM=64 TSN=64 TSK=16 WPTM=4 WPTN=4 VW=2" \
        KERNELS_GPU_GEMM_VARIANTS="SK=1,SK=0" bash bench/kernels_gpu.sh "$kit/bin" "$res/kernels-small" ;;
    attention)
      part attention 210 env KERNELS_GPU_ONLY=attention KERNELS_GPU_PYTHON="$python_peer" \
        bash bench/kernels_gpu.sh "$kit/bin" "$res/kernels" ;;
    tune)
      part tune 150 env KERNELS_GPU_ONLY=tune KERNELS_GPU_TUNE_S=60 bash bench/kernels_gpu.sh "$kit/bin" "$res/kernels" ;;
    scale1b) part scale1b 330 env SCALE_GPU_ONLY=1b SCALE_GPU_LIMIT_S=110 bash bench/scale_gpu.sh "$kit/bin/ferry" "$res/scale" ;;
    scale1b-pair)
      part scale1b-pair 240 env SCALE_GPU_ONLY=1b-pair SCALE_GPU_LIMIT_S=110 bash bench/scale_gpu.sh "$kit/bin/ferry" "$res/scale" ;;
    scale1b-stream)
      part scale1b-stream 240 env SCALE_GPU_ONLY=1b-stream SCALE_GPU_LIMIT_S=110 bash bench/scale_gpu.sh "$kit/bin/ferry" \
        "$res/scale" ;;
    attention-check)  # the blocked and gemm families' kernels against the CPU reference on this GPU
      part attention-check 120 env FERRY_TUNE=off "$kit/bin/test_attention" \
        --gtest_filter='*_blocked_p*:*blocked_TQ_64_TK_4_*:*blocked_TQ_4_TK_64_*:*_gemm_p*:AttentionGemm.*:*Narrow*' ;;
    attention-tuned)
      part attention-tune 90 "$kit/bin/ferry" tune --family attention --mode full --budget-seconds 40 --json
      part attention-tuned 90 "$kit/bin/ferry-bench" attention --contexts 1024,4096 --peer --peer-device cuda \
        --python "$python_peer" ;;
    host-optimizer)  # the host's AdamW and 8-bit AdamW on 1 and all cores, beside PyTorch's CPU AdamW
      part host-optimizer 90 "$kit/bin/ferry-bench" --repeat 5 host-optimizer --threads 1 "$(nproc)" --peer \
        --python "$python_peer" ;;
    driver-count)  # ferry's own reading of the driver's count (NVML): ferry devices, then its test binary
      part "$p" 60 bash -c "'$kit/bin/ferry' devices && FERRY_TUNE=off '$kit/bin/test_driver_memory'" ;;
    peak)
      part peak 60 "$kit/bin/ferry-bench" --repeat 3 peak --widths 1 2 4 --accumulators 4 8 16 ;;
    staging)
      part staging 120 "$kit/bin/ferry-bench" --repeat 3 staging --bytes 1GiB --chunks 4MiB,16MiB,64MiB ;;
    plan-accuracy)  # ferry plan's predicted step beside the measured one, the GEMM rate at the step's products
      part "$p" 240 bash bench/plan_accuracy.sh "$kit/bin/ferry" "$kit/bin/ferry-bench" ;;
    overlap-chunked)  # the in-budget 1B configuration's host updates after the backward, then overlapped
      part "$p" 300 env SCALE_GPU_ONLY=1b-overlap SCALE_GPU_HOST_MEMORY=staged SCALE_GPU_STAGING_CHUNK=64MiB \
        SCALE_GPU_TRACE=1 SCALE_GPU_LIMIT_S=130 bash bench/scale_gpu.sh "$kit/bin/ferry" "$res/scale" ;;
    accumulate)  # 4 micro-batches of 2 per update: the host optimizer's sums on the host lane, the device's streamed
      part accumulate 300 env SCALE_GPU_ONLY=1b-accumulate SCALE_GPU_LIMIT_S=140 bash bench/scale_gpu.sh "$kit/bin/ferry" \
        "$res/scale" ;;
    trace-staged | trace-pageable | trace-registered | trace-chunked)
      memory=${p#trace-} chunk=
      [[ $memory == chunked ]] && memory=staged chunk=16MiB
      part "$p" 300 env SCALE_GPU_ONLY=1b-stream SCALE_GPU_HOST_MEMORY="$memory" SCALE_GPU_STAGING_CHUNK="$chunk" \
        SCALE_GPU_TRACE=1 SCALE_GPU_LIMIT_S=130 bash bench/scale_gpu.sh "$kit/bin/ferry" "$res/scale" ;;
    trace-gpt85m)  # where the 85M GPT's step goes on the GPU, fused attention and unfused: per kind of node
      for attention in fused unfused; do
        trace=$res/gpt85m_$attention.trace.json
        part "trace-gpt85m-$attention" 100 "$kit/bin/ferry" train --model gpt --width 768 --depth 12 --heads 12 \
          --context 256 --batch 8 --attention "$attention" --steps 4 --eval-every 4 --val-windows 16 --trace "$trace" \
          --trace-steps 3 --force --json
        python3 bench/trace_summary.py "$trace" --step 2 >"$res/gpt85m_$attention.trace_summary.json" &&
          python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); c = d["lanes"]["compute"]
print("  step", round(d["span_ms"], 2), "ms, compute busy", round(c["busy_share"], 3), "over", c["nodes"], "nodes")
for k in c["by_kind"]: print("   ", k["kind"], k["nodes"], round(k["ms"], 2), "ms")' "$res/gpt85m_$attention.trace_summary.json"
        rm -f "$trace"  # the summary is what comes back (the trace is megabytes)
      done ;;
    predict)  # hybrid phases against Full-only on a link-bound streamed GPT (issue: "Does Predict pay at scale?")
      for phases in full hybrid; do
        int8=()
        [[ $phases == hybrid ]] && int8=(--predict-int8)
        part "predict-$phases" 120 "$kit/bin/ferry" train --model gpt --width 256 --depth 4 --heads 4 --context 64 \
          --batch 8 --steps 400 --eval-every 50 --phases "$phases" "${int8[@]}" --residency stream \
          --no-host-optimizer --device-budget 39MiB --json
      done ;;
    compile-cold)  # parallel kernel builds: does NVIDIA's compiler run them at once?
      for threads in 1 default; do
        cold=$kit/work/cold-cache-$threads
        rm -rf "$cold"
        part "compile-cold-$threads" 120 env FERRY_CACHE_DIR="$cold" CUDA_CACHE_DISABLE=1 \
          FERRY_BUILD_THREADS="$([[ $threads == 1 ]] && echo 1)" "$kit/bin/ferry" train --model gpt --width 768 \
          --depth 12 --heads 12 --context 256 --batch 8 --steps 1 --eval-every 1 --val-windows 4 --json --quiet
        grep -o '"compile_s":[0-9.]*' "$res/compile-cold-$threads.out"
        rm -rf "$cold"
      done ;;
    narrow)  # f16's branch-free conversions and the fusions, measured where the GPU's memory binds
      for storage in f32 f16 bf16; do
        part "narrow-gemm-$storage" 40 "$kit/bin/ferry-bench" --repeat 5 gemm --impls ferry --storage "$storage" \
          --sizes 2048
      done
      for run in fp32 fp16 bf16 bf16-no-fuse; do
        precision=${run%-no-fuse} fuse=()
        [[ $run == *-no-fuse ]] && fuse=(--no-fuse)
        part "narrow-gpt85m-$run" 60 "$kit/bin/ferry" train --model gpt --width 768 --depth 12 --heads 12 --context 256 \
          --batch 8 --precision "$precision" "${fuse[@]}" --steps 6 --eval-every 6 --val-windows 4 --json --quiet
        grep -o '"step_ms":[0-9.]*' "$res/narrow-gpt85m-$run.out"
      done ;;
    ptx)
      mkdir -p "$res/ptx"
      for f in "$FERRY_CACHE_DIR"/gemm_tiled-*.bin "$FERRY_CACHE_DIR"/attention_blocked-*.bin; do
        [[ -f $f ]] && grep -aq '\.entry' "$f" || continue
        echo "== $(basename "$f")" >>"$res/ptx.out"
        bash bench/ptx_mix.sh --ptx "$f" >>"$res/ptx.out" 2>&1
        gzip -c "$f" >"$res/ptx/$(basename "$f").gz"
      done
      tail -n 40 "$res/ptx.out" 2>/dev/null ;;
    scale7b)
      limit7b=$(($(left) - 40))
      ((limit7b > ${GPU_SESSION_7B_S:-600})) && limit7b=${GPU_SESSION_7B_S:-600}
      part scale7b 600 env SCALE_GPU_ONLY=7b SCALE_GPU_LIMIT_S=$limit7b bash bench/scale_gpu.sh "$kit/bin/ferry" "$res/scale" ;;
    *) echo "gpu_session.sh: unknown part '$p'" >&2 ;;
  esac
done
tar czf "$OUT/session.tgz" -C "$res" .
echo "== done at ${SECONDS}s"
