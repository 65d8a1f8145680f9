#!/usr/bin/env bash
# Builds the libFuzzer targets (the `fuzz` preset: clang, ASan + UBSan + libFuzzer) and runs each
# for a bounded time on its checked-in seed corpus.
#
#   fuzz/run.sh [seconds per target, default 60] [target ...]   # targets: program_cache_entry fashion_mnist units checkpoint chunk_codec tuning attention_config
#
# New inputs found go to build/fuzz/corpus/<target>/ (the seeds in fuzz/corpus/ are not touched);
# a crash leaves crash-*/oom-*/timeout-* files in build/fuzz/artifacts/<target>/ and fails the run.
# Reproduce one with: build/fuzz/fuzz/fuzz_<target> <file>.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds=${1:-60}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(program_cache_entry fashion_mnist units checkpoint chunk_codec tuning attention_config)

cmake --preset fuzz >/dev/null
cmake --build build/fuzz --target "${targets[@]/#/fuzz_}"

failed=()
for t in "${targets[@]}"; do
  work=build/fuzz/corpus/$t
  artifacts=build/fuzz/artifacts/$t
  mkdir -p "$work" "$artifacts"
  echo "fuzz: ${t} for ${seconds} s"
  # -rss_limit_mb: a header that makes a reader allocate gigabytes is a finding, not a pass.
  # FERRY_FUZZ_QUIET: the tuning target's warnings (one per input) are not written to the log.
  if ! UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 FERRY_FUZZ_QUIET=1 \
    "build/fuzz/fuzz/fuzz_${t}" -max_total_time="$seconds" -rss_limit_mb=1024 -timeout=10 \
    -max_len=4096 -print_final_stats=1 -artifact_prefix="${artifacts}/" \
    "$work" "fuzz/corpus/$t" 2>"build/fuzz/${t}.log"; then
    failed+=("$t")
    tail -n 40 "build/fuzz/${t}.log"
  fi
  grep -E '^stat::number_of_executed_units|^stat::peak_rss_mb' "build/fuzz/${t}.log" | sed "s/^/fuzz: ${t}: /" || true
done
if ((${#failed[@]})); then
  echo "fuzz: FAILED: ${failed[*]} (inputs in build/fuzz/artifacts/)" >&2
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets ran ${seconds} s without a finding"
