#!/usr/bin/env bash
# The instruction mix of a GPU kernel's hottest loop, read from PTX that clang's NVPTX backend
# makes of ferry's OpenCL C: a check, without a GPU, of what a kernel's loops issue besides their
# multiply-adds. Integer instructions share a GPU's issue slots with the FMAs, so index arithmetic
# left in a loop costs speed one to one; this shows it before a GPU session measures it.
#
#   bench/ptx_mix.sh KERNEL_FILE [-DNAME=VALUE ...]
#   bench/ptx_mix.sh --ptx FILE     the same account of PTX a driver made (NVIDIA's program binaries
#                                   are PTX: ferry's program cache entries, read through their header)
#   bench/ptx_mix.sh ops/kernels/gemm_tiled.cl -DTSM=128 -DTSN=128 -DTSK=16 -DWPTM=8 -DWPTN=8 -DVW=2 \
#       -DTRANS_A=0 -DTRANS_B=0 -DC_RELU=0 -DC_DACT=0 -DC_GUARD=0
#
# Prints, for each kernel in the file, the basic block with the most fma.rn.f32 (the unrolled inner
# loop) and the count of each PTX opcode in it, then its FMAs per other instruction (mov and
# branch excluded: moves vanish in register allocation). NVIDIA's OpenCL compiler is another
# front end (NVVM) and ptxas optimises further, so the figures are a proxy for what the driver
# builds, not a measurement; a GPU session's FERRY_BUILD_REPORT (registers, spills) and timings
# decide. Needs clang 14 or newer with the NVPTX target (Debian 12 has clang-14 and clang-15).
set -euo pipefail
(($# >= 1)) || {
  sed -n '2,16p' "$0" >&2
  exit 2
}
if [[ $1 == --ptx ]]; then
  ptx_file=${2:?usage: ptx_mix.sh --ptx FILE}
else
  ptx_file=
  kernel_file=$(realpath "$1")
fi
shift
clang=${CLANG:-$(command -v clang-15 || command -v clang || true)}
[[ -n $clang || -n $ptx_file ]] || {
  echo "ptx_mix: no clang (apt-get install clang)" >&2
  exit 2
}
work=$(mktemp -d "${TMPDIR:-/tmp}/ferry-ptx.XXXXXX")
# PTX_MIX_KEEP=file: also keep the PTX there, to read the loops themselves.
trap '[[ -n ${PTX_MIX_KEEP:-} && -f $work/kernel.ptx ]] && cp "$work/kernel.ptx" "$PTX_MIX_KEEP"; rm -rf "$work"' EXIT

# compile_ptx: KERNEL_FILE with the defines in "$@" to $work/kernel.ptx. The OpenCL builtins ferry's
# GPU kernels call are defined as NVVM intrinsics (clang declares them for OpenCL but has no library
# for NVPTX); exp and log as the hardware's approximations, which NVIDIA's compiler builds them around.
compile_ptx() {
  cat >"$work/builtins.cl" <<'EOF'
typedef unsigned long size_t;
#define OVL __attribute__((overloadable, always_inline))
size_t OVL get_local_id(uint d) {
  return d == 0 ? __nvvm_read_ptx_sreg_tid_x() : d == 1 ? __nvvm_read_ptx_sreg_tid_y() : __nvvm_read_ptx_sreg_tid_z();
}
size_t OVL get_group_id(uint d) {
  return d == 0 ? __nvvm_read_ptx_sreg_ctaid_x() : d == 1 ? __nvvm_read_ptx_sreg_ctaid_y() : __nvvm_read_ptx_sreg_ctaid_z();
}
size_t OVL get_local_size(uint d) {
  return d == 0 ? __nvvm_read_ptx_sreg_ntid_x() : d == 1 ? __nvvm_read_ptx_sreg_ntid_y() : __nvvm_read_ptx_sreg_ntid_z();
}
size_t OVL get_global_id(uint d) { return get_group_id(d) * get_local_size(d) + get_local_id(d); }
void OVL barrier(uint flags) { __nvvm_bar_sync(0); }
float OVL fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
uint OVL min(uint a, uint b) { return a < b ? a : b; }
uint OVL mul_hi(uint a, uint b) { return __nvvm_mulhi_ui(a, b); }
float OVL exp(float x) { return __nvvm_ex2_approx_f(x * 1.4426950408889634f); }
float OVL log(float x) { return __nvvm_lg2_approx_f(x) * 0.6931471805599453f; }
float OVL fmax(float a, float b) { return __builtin_fmaxf(a, b); }
EOF
  "$clang" -target nvptx64-nvidia-nvcl -cl-std=CL1.2 -O2 -c -emit-llvm -o "$work/builtins.bc" "$work/builtins.cl"
  echo "#include \"$(basename "$kernel_file")\"" >"$work/kernel.cl"
  "$clang" -target nvptx64-nvidia-nvcl -Xclang -finclude-default-header -Xclang -mlink-builtin-bitcode \
    -Xclang "$work/builtins.bc" -cl-std=CL1.2 -O3 -march=sm_80 -S -I"$(dirname "$kernel_file")" "$@" \
    -Wno-everything -o "$work/kernel.ptx" "$work/kernel.cl"
  if grep -q "call.uni" "$work/kernel.ptx"; then
    echo "ptx_mix: calls left in the PTX (a builtin without a definition above):" >&2
    grep -A3 "call.uni" "$work/kernel.ptx" | grep -o "_Z[A-Za-z0-9_]*" | sort -u >&2
  fi
}
if [[ -n $ptx_file ]]; then
  cp "$ptx_file" "$work/kernel.ptx"  # a cache entry's binary header holds no tab-indented line: not counted
else
  compile_ptx "$@"
fi

awk '
  /^\.(visible )?\.?entry/ { fn = $NF; sub(/\(.*/, "", fn) }
  /^(\$L__BB|LBB|BB)[0-9_]+:/ { bb = $1; sub(/:$/, "", bb) }  # $L__BB0_1 (clang 15, NVVM), LBB0_1, BB0_1
  /^\t[a-z@]/ {
    op = ($1 ~ /^@/) ? $2 : $1
    n = split(op, part, ".")
    kind = part[1]
    if (kind == "ld" || kind == "st") kind = kind "." part[2]  # ld.shared, ld.global, ...
    if (op ~ /^fma\.rn\.f32/) kind = "fma.f32"
    count[fn SUBSEP bb SUBSEP kind]++
    if (kind == "fma.f32") fmas[fn SUBSEP bb]++
  }
  END {
    for (key in fmas) {
      split(key, k, SUBSEP)
      if (fmas[key] > best[k[1]]) { best[k[1]] = fmas[key]; where[k[1]] = k[2] }
    }
    for (f in best) {
      line = ""; other = 0
      for (key in count) {
        split(key, k, SUBSEP)
        if (k[1] != f || k[2] != where[f]) continue
        line = line sprintf(" %s=%d", k[3], count[key])
        if (k[3] != "fma.f32" && k[3] != "mov" && k[3] != "bra") other += count[key]
      }
      printf "%s %s:%s\n  fma per other instruction: %.1f\n", f, where[f], line, other ? best[f] / other : best[f]
    }
  }' "$work/kernel.ptx"
