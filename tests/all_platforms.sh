#!/usr/bin/env bash
# Runs the test suite once per OpenCL platform present, each time on that platform's first device
# (FERRY_DEVICE=<its index in `ferry devices`), and prints a summary: one line per platform with
# its device, the result and the time taken. The Oclgrind label is left out of these runs (it
# always runs on Oclgrind); a simulator platform registered in /etc/OpenCL/vendors is skipped
# unless FERRY_ALL_PLATFORMS_SIMULATORS=1, since the whole suite on a simulator takes hours.
#
#   tests/all_platforms.sh [ctest options]        # e.g. tests/all_platforms.sh -R gemm
#
# Environment: FERRY_BUILD_DIR (default build/release; built beforehand), CTEST_PARALLEL_LEVEL.
# Exit status: 0 if every platform passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
build=${FERRY_BUILD_DIR:-build/release}
ferry=$build/ferry
[[ -x $ferry ]] || {
  echo "all_platforms: $ferry not found: build first (cmake --preset release && cmake --build --preset release)" >&2
  exit 2
}

# `ferry devices` lines: "[INDEX] PLATFORM / DEVICE  (TYPE, ...)". Keep the first device of each platform.
declare -a indices=() platforms=() devices=()
declare -A seen=()
while IFS= read -r line; do
  [[ $line =~ ^\[([0-9]+)\]\ (.*)\ /\ (.*)$ ]] || continue
  index=${BASH_REMATCH[1]} platform=${BASH_REMATCH[2]} device=${BASH_REMATCH[3]}
  [[ -n ${seen[$platform]:-} ]] && continue
  seen[$platform]=1
  if [[ ${platform,,} == *oclgrind* && ${FERRY_ALL_PLATFORMS_SIMULATORS:-0} != 1 ]]; then
    echo "all_platforms: skipping the simulator platform '$platform' (ctest -L oclgrind runs the op tests there)"
    continue
  fi
  indices+=("$index") platforms+=("$platform") devices+=("${device%%  (*}")
done < <("$ferry" devices 2>&1)
((${#indices[@]})) || {
  echo "all_platforms: no OpenCL platform to test (ferry devices lists none)" >&2
  "$ferry" devices >&2
  exit 2
}

declare -a results=()
failed=0
for i in "${!indices[@]}"; do
  echo "all_platforms: === ${platforms[i]}: ${devices[i]} (FERRY_DEVICE=${indices[i]}) ==="
  start=$SECONDS
  if FERRY_DEVICE=${indices[i]} ctest --test-dir "$build" -j"${CTEST_PARALLEL_LEVEL:-2}" --output-on-failure \
    -LE oclgrind "$@"; then
    result=passed
  else
    result=FAILED
    failed=1
  fi
  results+=("$(printf '%-8s %5d s  [%s] %s / %s' "$result" $((SECONDS - start)) "${indices[i]}" "${platforms[i]}" "${devices[i]}")")
done
echo "all_platforms: summary"
printf '  %s\n' "${results[@]}"
exit "$failed"
