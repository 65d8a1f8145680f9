#!/usr/bin/env bash
# clang-tidy with the tree's .clang-tidy (function size, the names STYLE.md gives) over the library
# and the CLI, from a build folder's compile_commands.json. Not part of `.ci/quickstart test`: it
# parses every file again (about 5 minutes on 2 cores); style_function_size checks the length
# rule there cheaply. Run it before a change that adds types or functions:
#   bash tests/style/tidy.sh build/release
# usage: tidy.sh <build folder> [jobs]
set -uo pipefail
build=${1:?usage: tidy.sh <build folder> [jobs]}
jobs=${2:-$(nproc)}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tidy=$(command -v clang-tidy || command -v clang-tidy-14) || {
  echo "no clang-tidy: apt-get install clang-tidy"
  exit 2
}
[ -f "$build/compile_commands.json" ] || { echo "no $build/compile_commands.json: configure the build first"; exit 2; }
cd "$root" || exit 2
mapfile -t files < <(find cl graph ops offload runtime -name '*.cpp' | sort)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
printf '%s\n' "${files[@]}" | xargs -P "$jobs" -n 4 "$tidy" -p "$build" --quiet >"$log" 2>&1
errors=$(grep -E "(error|warning): .*\[(readability|bugprone|performance)" "$log" | sort -u)
if [ -n "$errors" ]; then
  echo "$errors"
  echo "clang-tidy: $(wc -l <<<"$errors") findings in ${#files[@]} files"
  exit 1
fi
echo "clang-tidy: nothing found in ${#files[@]} files"
