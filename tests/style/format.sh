#!/usr/bin/env bash
# Every C++ file of the tree is as clang-format (.clang-format) writes it. Fails naming the files
# that are not, with the command that fixes them.
# usage: format.sh <clang-format> <source root>
set -uo pipefail
clang_format=${1:?usage: format.sh <clang-format> <source root>}
cd "${2:?usage: format.sh <clang-format> <source root>}" || exit 2
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.h')
else
  mapfile -t files < <(find . -path ./build -prune -o -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.h' \) -print)
fi
((${#files[@]} > 0)) || { echo "no C++ files found"; exit 1; }
out=$("$clang_format" --dry-run -Werror "${files[@]}" 2>&1)
status=$?
if ((status != 0)); then
  mapfile -t unformatted < <(grep -oE '^[^:]+\.(cpp|hpp|h):[0-9]+:[0-9]+: error' <<<"$out" | cut -d: -f1 | sort -u)
  echo "${#unformatted[@]} of ${#files[@]} files are not formatted: ${unformatted[*]}"
  echo "fix: $clang_format -i ${unformatted[*]}"
  exit 1
fi
echo "${#files[@]} files formatted"
