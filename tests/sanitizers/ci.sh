#!/usr/bin/env bash
# CI's sanitizer stage: the library (-O1) and the GoogleTest binaries (-O0) built with clang,
# AddressSanitizer (with LeakSanitizer) and UBSan (the `asan-ci` preset), then run one by one;
# any report fails the stage. CI (.ci/quickstart test) runs every test binary with
# FERRY_TEST_SMALL=1 (the op tests' small shapes: their CPU references in double are most of a
# sanitized run's time) and the release stage's program cache. Left to the `asan` preset's
# longer run (docs/testing.md): the `oclgrind` label, the command-line tests, the package test.
#
#   tests/sanitizers/ci.sh [test ...]      # default: every tests/test_*.cpp
#
# Honoured: FERRY_TEST_SMALL, FERRY_CACHE_DIR, FERRY_DATA_DIR, FERRY_JOBS (build jobs, 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
tests=("$@")
if ((${#tests[@]} == 0)); then
  for src in tests/test_*.cpp; do tests+=("$(basename "$src" .cpp)"); done
fi

start=$SECONDS
cmake --preset asan-ci >/dev/null
cmake --build build/asan-ci -j"${FERRY_JOBS:-2}" --target "${tests[@]}"
echo "sanitizers: built ${#tests[@]} tests in $((SECONDS - start)) s"

here=$PWD
export UBSAN_OPTIONS="suppressions=$here/tests/sanitizers/ubsan.supp:print_stacktrace=1:halt_on_error=1"
# intercept_tls_get_addr=0: clang 14's (and 15's) runtime records each thread's dynamic TLS blocks
# in its __tls_get_addr hook, and where a block starts 16 bytes past a page it reads a header of
# an old glibc (size, start) that Debian 12's glibc does not write: the leak check at exit then
# scans a garbage range and dies ("Tracer caught signal 11", "DTLS 7 at 0x10a1-0x8000021a3") after
# every test has passed (docs/testing.md). Unhooked, dynamic TLS is not a root of the leak scan:
# an object only it points to would be reported, never hidden; static TLS is still scanned.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:intercept_tls_get_addr=0"
export LSAN_OPTIONS="suppressions=$here/tests/sanitizers/lsan.supp:print_suppressions=0"
# Kernels built by an earlier stage are reused (the cache is keyed by device and source).
export FERRY_CACHE_DIR=${FERRY_CACHE_DIR:-$here/build/asan-ci/program-cache}
export FERRY_DATA_DIR=${FERRY_DATA_DIR:-/usr/share/datasets/fashion-mnist}
failed=()
for t in "${tests[@]}"; do
  log=build/asan-ci/$t.log
  t0=$SECONDS
  if "build/asan-ci/tests/$t" --gtest_brief=1 >"$log" 2>&1; then
    echo "sanitizers: $t passed in $((SECONDS - t0)) s"
  else
    failed+=("$t")
    echo "sanitizers: $t FAILED in $((SECONDS - t0)) s; the end of $log:"
    tail -n 60 "$log"
  fi
done
if ((${#failed[@]})); then
  echo "sanitizers: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "sanitizers: ${#tests[@]} tests ran under ASan + UBSan without a report in $((SECONDS - start)) s"
