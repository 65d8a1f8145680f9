#!/usr/bin/env bash
# `ferry plan` of a 7B-parameter GPT plans without allocating it: it must finish within 10 s and
# 1 GiB of maximum resident memory on a CPU device (it once constructed Trainers and was killed at
# 23 GB), and its JSON line must carry the planner's figures.
# usage: plan_scale.sh <ferry binary> <scratch folder>
set -uo pipefail
ferry=$1
work=$2
rm -rf "$work" && mkdir -p "$work"
max_s=10
max_rss_kib=$((1024 * 1024))
# A Debug or sanitizer build (FERRY_PLAN_SCALE_BOUNDS=0, set by tests/cli/CMakeLists.txt) checks
# what the plan says, not how fast or lean it is: Debug code runs several times slower and
# AddressSanitizer's shadow memory counts in the resident set.
bounds=${FERRY_PLAN_SCALE_BOUNDS:-1}
# GNU time measures the maximum resident set; a minimal Debian has no /usr/bin/time (bash's
# `time` keyword reports no memory).
if [ ! -x /usr/bin/time ]; then
  echo "FAIL: plan_scale needs /usr/bin/time (Debian package 'time': apt-get install time; .ci/quickstart installs it)"
  exit 1
fi
/usr/bin/time -v -o "$work/time.txt" "$ferry" plan --model gpt --width 4096 --depth 32 --heads 32 --context 256 \
  --batch 8 --device-budget 24GiB --optimizer adamw8bit --json >"$work/plan.json" 2>"$work/stderr.txt"
status=$?
failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
# ferry plan exits 1 when no configuration fits this machine (the state alone is larger than its
# memory); anything else is a failure.
[ $status -le 1 ] || fail "ferry plan exited $status: $(cat "$work/stderr.txt")"
rss=$(awk -F: '/Maximum resident set size/ {gsub(/ /, "", $2); print $2}' "$work/time.txt")
wall=$(awk '/Elapsed \(wall clock\)/ {print $NF}' "$work/time.txt")
seconds=$(awk -v t="$wall" 'BEGIN {n = split(t, p, ":"); s = 0; for (i = 1; i <= n; ++i) s = s * 60 + p[i]; print s}')
echo "ferry plan (7B GPT): ${seconds} s, maximum RSS ${rss} KiB, exit ${status}"
if [ "$bounds" = 1 ]; then
  awk -v s="$seconds" -v m="$max_s" 'BEGIN {exit !(s <= m)}' || fail "took ${seconds} s (limit ${max_s} s)"
  [ -n "$rss" ] && [ "$rss" -le $max_rss_kib ] || fail "maximum RSS ${rss} KiB (limit ${max_rss_kib} KiB)"
else
  echo "plan_scale: time and memory bounds not checked (FERRY_PLAN_SCALE_BOUNDS=0: a Debug or sanitizer build)"
fi
json=$(cat "$work/plan.json")
for field in device_peak_bytes host_bytes host_store_bytes fetch_bytes write_back_bytes moved_bytes flops \
  predicted_step_ms link_gbps gemm_gflops link_gbps_source gemm_gflops_source min_budget_resident_bytes \
  min_budget_streamed_bytes recommended phases fits gemm_products_probed gemm_products gemm_probed_flops_share \
  gemm_probe_batch gemm_probes; do
  grep -q "\"$field\":" <<<"$json" || fail "the JSON has no '$field': $json"
done
for rate in link_gbps link_d2h_gbps link_both_gbps; do
  grep -q "\"${rate}_source\":\"measured\"" <<<"$json" || fail "$rate was not measured: $json"
  grep -q "\"${rate}\":[0-9]*\.[0-9]*[1-9]" <<<"$json" || fail "$rate is not a positive number: $json"
done
grep -q '"to_device_ms":' <<<"$json" && grep -q '"to_host_ms":' <<<"$json" || fail "no per-direction link times: $json"
# The GEMM rate is measured at the step's own products: at least the largest one was probed.
grep -q '"gemm_products_probed":[1-9]' <<<"$json" || fail "no product of the step was probed: $json"
grep -q '"device_peak_bytes":[1-9]' <<<"$json" || fail "no device peak: $json"
grep -q '"predicted_step_ms":[1-9]' <<<"$json" || fail "no predicted step time: $json"
# A host budget larger than this machine's memory plans for that host: the same model streamed
# fits 200 GiB of host memory (about 60 GiB of weights, 8-bit state and gradients), which this
# machine, whose memory is smaller, would refuse to run.
"$ferry" plan --model gpt --width 4096 --depth 32 --heads 32 --context 256 --batch 8 --device-budget 24GiB \
  --optimizer adamw8bit --residency stream --host-budget 200GiB --link-gbps 50 --gemm-gflops 30000 \
  --device-gbps 3000 --device-8bit-gbps 1000 --launch-us 10 --host-gbps 20 --host-8bit-gbps 20 --codec-gbps 5 \
  --json >"$work/larger_host.json" 2>"$work/larger_host.txt"
status=$?
[ $status -eq 0 ] || fail "the plan for a 200 GiB host exited $status: $(tail -3 "$work/larger_host.txt")"
# The configuration as given (top level: keys are sorted, so "fits" follows "fetch_bytes" there
# alone; a candidate's follows its "error" or "device_bytes").
grep -q '"fetch_bytes":[0-9]*,"fits":true' "$work/larger_host.json" || fail "the plan for a 200 GiB host does not fit: $(cat "$work/larger_host.json")"
grep -q '"host_budget_bytes":214748364800' "$work/larger_host.json" || fail "the 200 GiB host budget is not the limit"
# A link given by its rate alone carries both directions at it, one at a time.
grep -q '"link_d2h_gbps":50.0,"link_d2h_gbps_source":"from --link-gbps"' "$work/larger_host.json" ||
  fail "the way back did not take --link-gbps: $(cat "$work/larger_host.json")"
grep -q '"link_both_gbps":0.0,"link_both_gbps_source":"from --link-gbps"' "$work/larger_host.json" ||
  fail "both ways at once was not left at one direction at a time: $(cat "$work/larger_host.json")"
[ $failures -eq 0 ] && echo "plan_scale: ok"
exit $((failures > 0))
