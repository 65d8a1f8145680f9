#!/usr/bin/env bash
# The GPU kernels' inner loops issue little besides their multiply-adds, checked without a GPU: each
# kernel below is compiled to PTX by clang's NVPTX backend (bench/ptx_mix.sh) and the FMAs per
# other instruction of its hottest block must reach a floor. On a GPU every instruction of such a
# loop takes an issue slot an FMA could have had; index arithmetic left in the tiled GEMM's k step
# once cost 415 integer instructions per 1,024 FMAs (1.9 FMAs per other instruction; 7.9 without).
# The floors sit below today's figures (bench/RESULTS.md, twenty-fifth session) and above what
# that index arithmetic gave.
# usage: loop_mix.sh <source root>   (CLANG=path picks the compiler; bench/ptx_mix.sh finds one)
set -uo pipefail
root=${1:?usage: loop_mix.sh <source root>}
cd "$root" || exit 2
failures=0
out=
# mix FILE DEFINES...: bench/ptx_mix.sh's account of every kernel in FILE, into $out (one compile
# serves the checks of all its kernels).
mix() {
  if ! out=$(bench/ptx_mix.sh "$@" 2>&1); then
    echo "FAIL: bench/ptx_mix.sh $*: $out"
    failures=$((failures + 1))
    out=
  fi
}
# check LABEL FLOOR KERNEL_NAME: KERNEL_NAME's hottest block in $out must reach FLOOR.
check() {
  local label=$1 floor=$2 kernel=$3 line ratio
  [ -n "$out" ] || return  # the compile failed, said above
  line=$(grep -A1 "^$kernel " <<<"$out")
  ratio=$(awk '/fma per other instruction:/ {print $NF}' <<<"$line")
  if [ -z "$ratio" ]; then
    echo "FAIL: $label: no block of $kernel in the PTX: $out"
    failures=$((failures + 1))
  elif awk -v r="$ratio" -v f="$floor" 'BEGIN {exit !(r >= f)}'; then
    echo "ok: $label: $ratio FMAs per other instruction (floor $floor)"
  else
    echo "FAIL: $label: $ratio FMAs per other instruction, below the floor of $floor; the block: ${line%%$'\n'*}"
    failures=$((failures + 1))
  fi
}
gemm=(ops/kernels/gemm_tiled.cl -DC_RELU=0 -DC_DACT=0 -DC_GUARD=0 -DTSM=128 -DTSN=128 -DTSK=16 -DWPTM=8 -DWPTN=8)
mix "${gemm[@]}" -DVW=2 -DTRANS_A=0 -DTRANS_B=0
check "tiled GEMM, the H200 row, NN" 6 gemm_tiled
mix "${gemm[@]}" -DVW=4 -DVG=4 -DTRANS_A=1 -DTRANS_B=0
check "tiled GEMM, float4 reads and loads, TN" 12 gemm_tiled
mix ops/kernels/gemm_tiled.cl -DC_RELU=0 -DC_DACT=0 -DC_GUARD=0 -DTSM=64 -DTSN=64 -DTSK=16 -DWPTM=4 -DWPTN=4 -DVW=4 \
  -DTRANS_A=0 -DTRANS_B=1
check "tiled GEMM, the generic GPU row, NT" 6 gemm_tiled
mix ops/kernels/attention_blocked.cl -DHEAD_DIM=64 -DDP=64 -DTQ=64 -DTK=32 -DUNROLL_BLOCKS=1
check "blocked attention, dq" 4 attention_backward_q_blocked
check "blocked attention, dk dv" 4 attention_backward_kv_blocked
[ $failures -eq 0 ] && echo "loop_mix: ok"
exit $((failures > 0))
