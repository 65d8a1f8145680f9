#!/usr/bin/env bash
# The build's layering, checked from the outside: each layer compiles against an include root
# (<build>/layers/<layer>, CMakeLists.txt) that holds its own headers and those below it, so a
# header of a layer above, public ("ferry/<layer>/...") or private ("<layer>/..."), is not found.
# Each layer must see a header of its own and of the layer below, and must not find one of each
# layer above.
# usage: layer_roots.sh <c++ compiler> <build folder>
set -uo pipefail
cxx=${1:?usage: layer_roots.sh <c++ compiler> <build folder>}
build=${2:?usage: layer_roots.sh <c++ compiler> <build folder>}
layers=(cl ops offload graph runtime)
# A public and a private header of each layer.
declare -A public=([cl]=ferry/cl/error.hpp [ops]=ferry/ops/types.hpp [offload]=ferry/offload/home.hpp
  [graph]=ferry/graph/ir.hpp [runtime]=ferry/runtime/units.hpp)
declare -A private=([cl]=cl/fnv1a.hpp [ops]=ops/table/rows.hpp [offload]=offload/homes/stores.hpp
  [graph]=graph/compiled_step_impl.hpp [runtime]=runtime/output_file.hpp)
bad=0
checks=0
compiles() {  # <layer> <header>: whether a file including the header compiles in the layer's root
  local root=$build/layers/$1
  [ -d "$root/include" ] || { echo "no include root $root: configure the build first"; exit 2; }
  printf '#include "%s"\n' "$2" |
    "$cxx" -std=c++20 -fsyntax-only -x c++ -DCL_TARGET_OPENCL_VERSION=120 -I"$root/include" -I"$root/src" - 2>"$work/err"
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in "${!layers[@]}"; do
  layer=${layers[$i]}
  for j in "${!layers[@]}"; do
    other=${layers[$j]}
    for header in "${public[$other]}" "${private[$other]}"; do
      checks=$((checks + 1))
      if ((j <= i)); then
        # Own and lower layers' headers are found; the one-layer-down case is enough beside its own.
        ((j >= i - 1)) || continue
        compiles "$layer" "$header" || {
          echo "layer $layer cannot include $header of $other: $(head -3 "$work/err")"
          bad=$((bad + 1))
        }
      elif compiles "$layer" "$header"; then
        echo "upward include compiles: layer $layer includes $header of $other"
        bad=$((bad + 1))
      elif ! grep -q "No such file" "$work/err"; then
        echo "layer $layer including $header of $other failed for another reason: $(head -3 "$work/err")"
        bad=$((bad + 1))
      fi
    done
  done
done
echo "$checks includes across ${#layers[@]} layer roots checked, $bad wrong"
((bad == 0))
