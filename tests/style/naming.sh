#!/usr/bin/env bash
# The naming rules of .clang-tidy (STYLE.md: types CamelCase; functions, namespaces and enum
# values lower_case; private members with a trailing _) and its length rule, checked over every
# header of the library, public (include/ferry) and internal (the layer folders): one translation
# unit that includes them all, so the check takes seconds. The .cpp files' own names (functions
# in anonymous namespaces) are checked by tests/style/tidy.sh, on demand: it parses every file.
# usage: naming.sh <clang-tidy> <source root>
set -uo pipefail
tidy=${1:?usage: naming.sh <clang-tidy> <source root>}
root=$(cd "${2:?usage: naming.sh <clang-tidy> <source root>}" && pwd) || exit 2
cd "$root" || exit 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unit=$work/every_header.cpp
{
  find include/ferry -name '*.hpp' | sort | sed -E 's|^include/(.*)$|#include "\1"|'
  find cl ops offload graph runtime -name '*.hpp' -not -path 'runtime/cli/*' | sort | sed -E 's|^(.*)$|#include "\1"|'
} >"$unit"
headers=$(wc -l <"$unit")
out=$("$tidy" --quiet --config-file="$root/.clang-tidy" "$unit" -- -std=c++20 -DCL_TARGET_OPENCL_VERSION=120 \
  -DCL_USE_DEPRECATED_OPENCL_1_2_APIS -I"$root/include" -I"$root" 2>&1)
status=$?
findings=$(grep -E "(error|warning): " <<<"$out" | grep -v "warnings generated")
if [ $status -ne 0 ] || [ -n "$findings" ]; then
  echo "$out" | grep -vE "^[0-9]+ warnings? generated"
  echo "naming: clang-tidy found problems in the $headers headers (exit $status)"
  exit 1
fi
echo "naming: nothing found in $headers headers"
