#!/usr/bin/env bash
# Runs one test binary on Oclgrind, the OpenCL simulator that checks every kernel it runs, and
# fails on any finding. Used by the ctest label `oclgrind` (tests/CMakeLists.txt); run by hand as
#
#   tests/oclgrind/run_test.sh build/release/tests/test_pool --gtest_filter='*Small*'
#
# Oclgrind is loaded through its ICD (Debian's oclgrind package ships the library but no .icd
# file, so a private vendors folder naming only it is made here) and picked with
# FERRY_DEVICE=oclgrind. Checks on: out-of-bounds accesses and API errors (always on), data races
# (OCLGRIND_DATA_RACES), barrier and work-group function divergence (always on). Off: the
# uninitialised-value check (OCLGRIND_UNINITIALIZED), which reports false positives for
# sub-buffer offsets. Oclgrind's kernel diagnostics go to a log file (OCLGRIND_LOG), its API
# errors ("Oclgrind - OpenCL runtime error detected") to stderr, which is copied to a file too;
# either fails the test even when the test's own checks passed.
#
# Environment: FERRY_OCLGRIND_ICD, the ICD library (default /usr/lib/oclgrind/liboclgrind-rt-icd.so).
set -uo pipefail
(($# >= 1)) || {
  echo "usage: $0 TEST_BINARY [gtest options]" >&2
  exit 2
}
icd=${FERRY_OCLGRIND_ICD:-/usr/lib/oclgrind/liboclgrind-rt-icd.so}
[[ -r $icd ]] || {
  echo "oclgrind: no Oclgrind ICD at $icd (apt-get install oclgrind)" >&2
  exit 2
}
work=$(mktemp -d "${TMPDIR:-/tmp}/ferry-oclgrind.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/vendors"
echo "$icd" >"$work/vendors/oclgrind.icd"
log=$work/oclgrind.log

export OCL_ICD_VENDORS=$work/vendors
unset OCL_ICD_FILENAMES OPENCL_VENDOR_PATH
export FERRY_DEVICE=oclgrind
export FERRY_TEST_SMALL=1
export OCLGRIND_CHECK_API=1
export OCLGRIND_DATA_RACES=1
export OCLGRIND_UNINITIALIZED=0
export OCLGRIND_LOG=$log
export OCLGRIND_MAX_ERRORS=${OCLGRIND_MAX_ERRORS:-20}
# Oclgrind simulates work-items on host threads; the test runs beside others under ctest -j2.
export OCLGRIND_NUM_THREADS=${OCLGRIND_NUM_THREADS:-1}

# stderr through tee (pipefail keeps the test's exit status); stdout as it is.
{ "$@" 2>&1 1>&3 3>&- | tee "$work/stderr" >&2; } 3>&1
rc=$?
if [[ -s $log ]]; then
  echo "oclgrind: findings while running $*:" >&2
  cat "$log" >&2
  ((rc == 0)) && rc=1
fi
if grep -q "Oclgrind - OpenCL runtime error detected" "$work/stderr"; then
  echo "oclgrind: OpenCL API errors while running $* (above on stderr)" >&2
  ((rc == 0)) && rc=1
fi
exit "$rc"
