#!/usr/bin/env bash
# kernels_gpu.sh: the GPU kernel comparisons no CPU session can make, in one call of a GPU machine:
#   gemm       the tuned tiled GEMM in each of KERNELS_GPU_GEMM_VARIANTS (comma-separated options added
#              to the row; default: K split where its work-groups leave the last wave short (SK=1), that
#              with float4 loads (VG=4), and that with registers capped at 128 (RR=128, NVIDIA)), on the
#              tuner's scored products (squares, the MLP's linear0, the 85M GPT's up and down
#              projections and weight gradient), as gflops_best (the fastest round: the statistic
#              bench/peers/torch_gemm.py reports for cuBLAS) and gflops (the median round); each
#              variant's first build report (FERRY_BUILD_REPORT:
#              registers and spills from ptxas on NVIDIA, private memory elsewhere) is printed
#   tune       `ferry tune --mode full`: the GEMM's search (each tiled finalist scored with its twins:
#              SK=1, SK=1 VG=4, and on NVIDIA SK=1 VG=4 RR=128) and the fused attention's (tiled
#              against blocked, their tiles)
#   attention  `ferry-bench attention` with each of KERNELS_GPU_ATTENTION (comma-separated kernels;
#              default the blocked family at TQ=64 with TK=32, the gemm family (whose contexts past
#              2048 run blocked), the blocked one capped at 168 registers (RR, NVIDIA only), and TK=64,
#              fitted per kernel), the first
#              beside PyTorch's SDPA on CUDA when KERNELS_GPU_PYTHON names a Python with torch, with
#              each kernel's build report
#
# usage: bash bench/kernels_gpu.sh [BIN_DIR] [OUT_DIR]
#   BIN_DIR  where ferry and ferry-bench are (default build/release; the GPU kit's binaries work,
#            run in the kit's environment: FERRY_DEVICE and the packed libraries' path set)
#   OUT_DIR  each command's JSON and stderr (default kernels-gpu)
# KERNELS_GPU_ROW: the tiled row to compare (default the H200 row of ops/tuning/gemm.tsv);
# KERNELS_GPU_TINY=1: small sizes, a check of the script itself on any device (PoCL included);
# KERNELS_GPU_ONLY: the parts to run, comma-separated (default gemm,tune,attention); KERNELS_GPU_TUNE_S:
# the search budget of `ferry tune` (120).
# Prints one line per result; every figure is also in OUT_DIR.
set -uo pipefail

bin=${1:-build/release}
out=${2:-kernels-gpu}
mkdir -p "$out"
for b in ferry ferry-bench; do
  [[ -x $bin/$b ]] || {
    echo "kernels_gpu.sh: no $b in '$bin'" >&2
    exit 1
  }
done
row=${KERNELS_GPU_ROW:-tiled TSM=128 TSN=128 TSK=16 WPTM=8 WPTN=8 VW=2}
tiny=${KERNELS_GPU_TINY:-0}
variants=${KERNELS_GPU_GEMM_VARIANTS:-SK=1,SK=1 VG=4,SK=1 VG=4 RR=128}
if [[ $tiny == 1 ]]; then
  shapes=("96,32,300" "32,96,256 --trans-a")
  contexts=64
  budget=5
  row="tiled TSM=32 TSN=32 TSK=8 WPTM=2 WPTN=2"
  variants=${KERNELS_GPU_GEMM_VARIANTS:-SK=1,SK=1 VG=4}
else
  shapes=("1024,1024,1024" "2048,2048,2048" "256,1024,784 --trans-b" "2048,3072,768 --trans-b" "2048,768,3072"
    "768,3072,2048 --trans-a")
  contexts=256,1024,4096
  budget=${KERNELS_GPU_TUNE_S:-120}
fi
status=0
only=${KERNELS_GPU_ONLY:-gemm,tune,attention}
part() { [[ ,$only, == *,$1,* ]]; }

# field FILE KEY...: the values of KEY in each JSON line of FILE, as "key=value" pairs.
field() {
  python3 -c '
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        j = json.loads(line)
        print(" ".join(f"{k}={j.get(k)}" for k in sys.argv[2:]))' "$@"
}

part gemm && echo "== gemm: $row as a tuning row, with each of: $variants"
# As a row of the tuning data (FERRY_GEMM_TUNING, tuning off), so the shape fit applies as in training.
# The build report on stderr: with ferry's program cache and NVIDIA's kernel cache off, ptxas runs and says
# what it used.
IFS=, read -r -a variant_list <<<"$variants"
v=0
part gemm && for variant in "${variant_list[@]}"; do
  printf '*\t*\t*\tferry\t%s\t%s\n' "${row%% *}" "${row#* } $variant" >"$out/row_$v.tsv"
  echo " $variant"
  i=0
  for shape in "${shapes[@]}"; do
    f="$out/gemm_${i}_v$v.jsonl"
    # shellcheck disable=SC2086  # the shape's transpose flag is a separate word
    if FERRY_TUNE=off FERRY_GEMM_TUNING="$out/row_$v.tsv" FERRY_BUILD_REPORT=1 FERRY_PROGRAM_CACHE=0 CUDA_CACHE_DISABLE=1 timeout 120 \
      "$bin/ferry-bench" --repeat 9 gemm --impls ferry --shape $shape >"$f" 2>"$f.err"; then
      # gflops_best (the fastest of the --repeat rounds) is what to set beside torch_gemm.py's cuBLAS
      # figure, the best of its rounds; gflops is the median round.
      echo "  $shape: $(field "$f" gflops_best gflops kernel)"
    else
      echo "  $shape: failed (see $f.err)"
      status=1
    fi
    ((i == 0)) && grep -E "registers|spill|kernel gemm_tiled:" "$f.err" | sort -u | head -n 6 | sed "s/^/    /"
    i=$((i + 1))
  done
  v=$((v + 1))
done

part tune && echo "== tune: ferry tune --mode full"
if ! part tune; then
  :
elif timeout 600 "$bin/ferry" tune --mode full --budget-seconds "$budget" --json >"$out/tune.jsonl" 2>"$out/tune.err"; then
  field "$out/tune.jsonl" family best seconds
else
  echo "  failed (see $out/tune.err)"
  status=1
fi

attention_kernels=${KERNELS_GPU_ATTENTION:-blocked TQ=64 TK=32,gemm,blocked TQ=64 TK=32 RR=168,blocked TQ=64 TK=64}
part attention && echo "== attention: $attention_kernels"
peer=()
[[ -n ${KERNELS_GPU_PYTHON:-} ]] && peer=(--peer --peer-device cuda --python "$KERNELS_GPU_PYTHON")
IFS=, read -r -a attention_list <<<"$attention_kernels"
# A register cap is NVIDIA's compiler option: on other devices the capped kernels are left out, not
# failed (ferry's device list names the vendor's platform).
if ! "$bin/ferry" devices 2>/dev/null | grep -qi nvidia; then
  kept=()
  for kernel in "${attention_list[@]}"; do [[ $kernel == *RR=* ]] || kept+=("$kernel"); done
  attention_list=("${kept[@]}")
fi
a=0
part attention && for kernel in "${attention_list[@]}"; do
  f="$out/attention_$a.jsonl"
  # The build report as for the GEMM: each kernel's registers and spills (tiles are fitted per kernel).
  if FERRY_TUNE=off FERRY_BUILD_REPORT=1 FERRY_PROGRAM_CACHE=0 CUDA_CACHE_DISABLE=1 timeout 300 "$bin/ferry-bench" attention \
    --contexts "$contexts" --kernel "$kernel" "${peer[@]}" >"$f" 2>"$f.err"; then
    field "$f" context fused_kernel fused_ms fused_kernels_ms unfused_ms speedup_vs_unfused peer_ms speedup_vs_peer | sed "s/^/  /"
  else
    echo "  $kernel: failed (see $f.err)"
    status=1
  fi
  grep -E "registers|spill|kernel attention_" "$f.err" | sort -u | head -n 9 | sed "s/^/    /"
  a=$((a + 1))
  peer=()  # the peer's figures do not depend on ferry's kernel: once
done
exit $status
