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
#
# PTX_MIX_SASS=sm_90 (or another architecture): also assemble the PTX with ptxas (the CUDA
# toolkit's; Debian: nvidia-cuda-toolkit) and print each kernel's registers, spills and local
# memory, the work-groups of PTX_MIX_GROUP work-items one compute unit then holds (sm_80 and newer:
# 64K registers, 2048 work-items, 227 KiB of local memory), and, where nvdisasm is found (NVDISASM=
# its path, else PATH), the machine code's mix in the block with the most FFMA. ptxas's register
# allocation and scheduling are what NVIDIA's driver runs after its own front end: registers and
# spills are close to a GPU's, the mix closer than the PTX's.
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
size_t OVL get_num_groups(uint d) {
  return d == 0 ? __nvvm_read_ptx_sreg_nctaid_x() : d == 1 ? __nvvm_read_ptx_sreg_nctaid_y() : __nvvm_read_ptx_sreg_nctaid_z();
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

# hottest FMA SKIP TITLE: reads "kernel block opcode" lines and prints, per kernel, the block with
# the most FMA (the unrolled inner loop), the count of each opcode in it and its FMAs per other
# instruction, SKIP's opcodes not counted (moves vanish in register allocation, branches close the
# loop). TITLE says whose code it was (e.g. "SASS ").
hottest() {
  awk -v fma="$1" -v skip=" $2 " -v title="$3" '
    { count[$1 SUBSEP $2 SUBSEP $3]++; if ($3 == fma) fmas[$1 SUBSEP $2]++ }
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
          if (k[3] != fma && index(skip, " " k[3] " ") == 0) other += count[key]
        }
        printf "%s %s%s:%s\n  %s per other instruction: %.1f\n", f, title, where[f], line,
               fma == "fma.f32" ? "fma" : fma, other ? best[f] / other : best[f]
      }
    }'
}

awk '
  /^\.(visible )?\.?entry/ { fn = $NF; sub(/\(.*/, "", fn) }
  /^(\$L__BB|LBB|BB)[0-9_]+:/ { bb = $1; sub(/:$/, "", bb) }  # $L__BB0_1 (clang 15, NVVM), LBB0_1, BB0_1
  /^\t[a-z@]/ {
    op = ($1 ~ /^@/) ? $2 : $1
    n = split(op, part, ".")
    kind = part[1]
    if (kind == "ld" || kind == "st") kind = kind "." part[2]  # ld.shared, ld.global, ...
    if (op ~ /^fma\.rn\.f32/) kind = "fma.f32"
    print fn, bb, kind
  }' "$work/kernel.ptx" | hottest fma.f32 "mov bra" ""

[[ -n ${PTX_MIX_SASS:-} ]] || exit 0
ptxas=${PTXAS:-$(command -v ptxas || true)}
[[ -n $ptxas ]] || {
  echo "ptx_mix: PTX_MIX_SASS asks for ptxas, which is not on PATH (the CUDA toolkit's bin folder; or PTXAS=path)" >&2
  exit 2
}
# NVIDIA's OpenCL PTX and clang's say .target sm_NN, texmode_independent: ptxas assembles it for
# the architecture asked for, which may be newer.
if ! "$ptxas" -arch="$PTX_MIX_SASS" -v -o "$work/kernel.cubin" "$work/kernel.ptx" 2>"$work/ptxas.log"; then
  grep -i error "$work/ptxas.log" >&2
  exit 1
fi
awk -v group="${PTX_MIX_GROUP:-0}" -v arch="$PTX_MIX_SASS" '
  /Compiling entry function/ { fn = $0; sub(/.*function .?/, "", fn); sub(/.? for .*/, "", fn) }
  /spill stores/ { spill = $5 + $9 }
  /Used [0-9]+ registers/ {
    regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
    smem = 0; if ($0 ~ /bytes smem/) { smem = $0; sub(/ bytes smem.*/, "", smem); sub(/.*, /, "", smem) }
    line = sprintf("%s %s: %d registers, %d bytes spilled, %d bytes local", fn, arch, regs, spill, smem)
    if (group > 0) {
      per = 256 * int((regs + 7) / 8) * 8 * group / 256  # registers go out in blocks of 8 a work-item
      n = int(65536 / per); why = "registers"
      if (int(2048 / group) < n) { n = int(2048 / group); why = "work-items" }
      if (smem > 0 && int(232448 / (smem + 1024)) < n) { n = int(232448 / (smem + 1024)); why = "local memory" }
      line = line sprintf("; %d work-groups of %d a compute unit (%s), %d warps", n, group, why, n * group / 32)
    }
    print line
  }' "$work/ptxas.log"
nvdisasm=${NVDISASM:-$(command -v nvdisasm || true)}
[[ -n $nvdisasm ]] || exit 0
"$nvdisasm" -c "$work/kernel.cubin" | awk '
  /^[ \t]*\.text\./ { fn = $1; sub(/.*\.text\./, "", fn); sub(/:$/, "", fn) }
  /^\.L_x_[0-9]+:/ { bb = $1; sub(/:$/, "", bb) }
  /^[ \t]*\/\*[0-9a-f]+\*\// {
    op = ""
    for (i = 2; i <= NF; ++i) if ($i !~ /^@/) { op = $i; break }
    sub(/;$/, "", op)
    n = split(op, part, "."); kind = part[1]
    if (kind == "LDS" || kind == "LDG" || kind == "STS" || kind == "STG") kind = kind (op ~ /\.128/ ? ".128" : op ~ /\.64/ ? ".64" : "")
    print fn, bb, kind
  }' | hottest FFMA "MOV NOP" "SASS "
