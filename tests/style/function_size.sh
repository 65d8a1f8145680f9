#!/usr/bin/env bash
# No function of the library or the CLI longer than LIMIT lines (default 120), signature to closing
# brace: a longer one is split into named steps. (.clang-tidy's readability-function-size says the
# same with a compiler's parse; tests/style/tidy.sh runs it, too slow for every CI run.)
# A function here is a definition at namespace scope, as clang-format lays it out: its first line
# starts in column 0, its body ends at the next line that is "}" alone. Functions defined inside a
# class body are not measured.
# usage: function_size.sh <source root> [LIMIT]
set -uo pipefail
root=${1:?usage: function_size.sh <source root> [LIMIT]}
limit=${2:-120}
cd "$root" || exit 2
mapfile -t files < <(find cl graph ops offload runtime include -name '*.cpp' -o -name '*.hpp' | sort)
[ "${#files[@]}" -gt 0 ] || { echo "no sources under $root"; exit 2; }
long=$(awk -v limit="$limit" '
  FNR == 1 { start = 0 }
  # A definition starts at column 0 with a name or a type, not with a keyword that opens a scope.
  start == 0 && /^[A-Za-z_~]/ && !/^(namespace|struct|class|enum|union|template|using|typedef|extern|static_assert)([[:space:]<:({]|$)/ && !/;[[:space:]]*(\/\/.*)?$/ {
    start = FNR; head = $0; opened = ($0 ~ /\{[[:space:]]*$/)
    if ($0 ~ /\}[[:space:]]*$/ && opened == 0) start = 0  # a one-line definition
    next
  }
  start != 0 && opened == 0 {
    if ($0 ~ /;[[:space:]]*$/ && $0 !~ /\{/) { start = 0; next }  # a declaration over several lines
    if ($0 ~ /\{[[:space:]]*$/) opened = 1
    next
  }
  start != 0 && /^\};?[[:space:]]*$/ {
    n = FNR - start + 1
    if (n > limit) printf "%s:%d: %d lines: %s\n", FILENAME, start, n, head
    start = 0
  }
' "${files[@]}")
checked=${#files[@]}
if [ -n "$long" ]; then
  echo "functions longer than $limit lines (split them into named steps):"
  echo "$long"
  exit 1
fi
echo "no function longer than $limit lines in $checked files"
