#!/usr/bin/env bash
# The `ferry` command as a user runs it: the JSON fields the docs promise, the trace and profile
# files, and clear failures (a non-zero exit status and a message naming the problem) for bad input.
# usage: run.sh <path to the ferry binary> <scratch folder>
set -uo pipefail
ferry=$1
work=$2
rm -rf "$work" && mkdir -p "$work"
failures=0
check() {  # check <description> <command...>: the command must succeed
  local what=$1
  shift
  if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; failures=$((failures + 1)); fi
}
expect_error() {  # expect_error <description> <text the message must contain> <ferry args...>
  local what=$1 needle=$2
  shift 2
  local out status
  out=$("$ferry" "$@" 2>&1)
  status=$?
  if [ "$status" -ne 0 ] && grep -qF -- "$needle" <<<"$out"; then
    echo "ok: $what"
  else
    echo "FAILED: $what (exit $status, wanted a message containing '$needle'):"
    echo "$out" | tail -5
    failures=$((failures + 1))
  fi
}

check "ferry devices lists a device" bash -c "'$ferry' devices | grep -q '^\[0\]'"

json=$("$ferry" train --model mlp --epochs 1 --train-limit 1024 --quiet --json \
  --trace "$work/trace.json" --profile "$work/profile.csv" --trace-steps 2)
status=$?
check "ferry train exits 0" test "$status" -eq 0
for key in test_accuracy train_loss samples_per_s step_ms device_peak_bytes training_state_bytes \
  optimizer_state_bytes device_budget_bytes residency host_state_bytes fetch_bytes_per_step weights_home \
  state_home; do
  check "JSON has $key" grep -q "\"$key\":" <<<"$json"
done
check "on a device without a driver count the JSON says why" bash -c "grep -q '\"driver_memory_source\":null' <<<'$json' && grep -q '\"driver_memory_unavailable\":\"[a-z]' <<<'$json' && grep -q '\"driver_device_used_peak_bytes\":null' <<<'$json'"

# The driver's count read through NVML (a stand-in library, tests/stand_ins/fake_nvml.cpp, whose
# reads return FAKE_NVML_USED's values in turn: its own first check, before the context, after it,
# then every later read): a run the plan explains, then one whose driver counts 8 GiB more.
if [ -n "${FERRY_TEST_FAKE_NVML:-}" ]; then
  nvml_run() {
    FERRY_NVML_LIBRARY=$FERRY_TEST_FAKE_NVML FERRY_NVML_GPU=00000000:3b:00.0 FAKE_NVML_USED=$1 \
      "$ferry" train --model mlp --epochs 1 --train-limit 512 --json "${@:2}" 2>"$work/nvml.err"
  }
  counted=$(nvml_run 1073741824,1073741824,2147483648)
  check "the JSON has the driver's counts before and after the context and at the peak" bash -c \
    "grep -q '\"driver_memory_source\":\"nvml\"' <<<'$counted' && grep -q '\"driver_device_used_before_bytes\":1073741824,' <<<'$counted' && grep -q '\"driver_device_used_after_context_bytes\":2147483648,' <<<'$counted' && grep -q '\"driver_device_used_peak_bytes\":2147483648,' <<<'$counted' && grep -q '\"driver_device_bytes_beyond_plan\":-[1-9]' <<<'$counted'"
  check "ferry train prints the driver's count, and no warning where the plan explains it" bash -c \
    "grep -q 'device memory as the driver counts it (nvml): 2.0 GiB in use at the peak' '$work/nvml.err' && ! grep -q 'warning: the driver' '$work/nvml.err'"
  counted=$(nvml_run 1073741824,1073741824,2147483648,10737418240 --device-budget 64MiB)
  check "a driver count beyond the plan and the context is a warning that places it against the budget" bash -c \
    "grep -q 'warning: the driver (nvml) counted 10.0 GiB of device memory in use, 8.0 GiB more than' '$work/nvml.err' && grep -q 'over the device budget (64.0 MiB)' '$work/nvml.err' && grep -q '\"driver_device_used_peak_bytes\":10737418240,' <<<'$counted'"
  check "FERRY_NVML_GPU naming no GPU is a warning that names it and says why nothing is read" bash -c \
    "FERRY_NVML_LIBRARY='$FERRY_TEST_FAKE_NVML' FERRY_NVML_GPU=garbage '$ferry' devices 2>&1 >/dev/null | grep -q 'warning: FERRY_NVML_LIBRARY=.* FERRY_NVML_GPU=garbage is set, but no device memory count is read: NVML (.*): nvmlDeviceGetHandleByPciBusId_v2(\"garbage\") returned 6'"
  check "ferry devices says what the driver counts in use" bash -c \
    "FERRY_NVML_LIBRARY='$FERRY_TEST_FAKE_NVML' FERRY_NVML_GPU=00000000:3b:00.0 '$ferry' devices | grep -q ', 1.0 GiB in use as the driver counts it,'"
  # Others hold all but 100 MiB of the stand-in's 80 GiB (less the 512 MiB its driver reserves) from the
  # context on.
  crowded=1073741824,1073741824,85257617408
  counted=$(nvml_run $crowded)
  check "with no budget, a crowded device's budget is what the driver counts free less headroom, and ferry says so" \
    bash -c "grep -q '\"device_budget_bytes\":52428800,' <<<'$counted' && grep -q 'budget (planned); no --device-budget given, so the budget is the free memory as the driver (nvml) counts it (79.4 GiB of 80.0 GiB in use), less headroom' '$work/nvml.err'"
  nvml_run $crowded --device-budget 1GiB >/dev/null
  status=$?
  check "a budget above what the driver counts free is refused, naming both" bash -c \
    "[ $status -eq 1 ] && grep -q 'error: device budget 1.0 GiB is more than the driver (nvml) counts 100.0 MiB free' '$work/nvml.err'"
  # ferry plan plans in the budget ferry train would take there, and says when it would refuse one.
  nvml_plan() {
    FERRY_NVML_LIBRARY=$FERRY_TEST_FAKE_NVML FERRY_NVML_GPU=00000000:3b:00.0 FAKE_NVML_USED=$crowded \
      "$ferry" plan --model mlp "$@"
  }
  planned=$(nvml_plan --json)
  check "ferry plan on a crowded device plans in what ferry train would take, and says where it came from" bash -c \
    "grep -q '\"device_budget_bytes\":52428800,' <<<'$planned' && grep -q '\"device_budget_source\":\"driver_free_memory\"' <<<'$planned' && grep -q '\"device_budget_refused\":null' <<<'$planned'"
  nvml_plan --device-budget 1GiB >"$work/nvml-plan.txt"  # (the device's name in it is quoted)
  check "ferry plan of a budget above what the driver counts free plans it and says ferry train would refuse it" \
    bash -c "grep -q 'device budget 1.0 GiB, host budget' '$work/nvml-plan.txt' && grep -q 'ferry train here would refuse this budget now: device budget 1.0 GiB is more than the driver (nvml) counts 100.0 MiB free' '$work/nvml-plan.txt'"
fi
check "the JSON is one line" test "$(wc -l <<<"$json")" -eq 1
check "the trace is a Chrome trace with lanes" bash -c "head -c 40 '$work/trace.json' | grep -q traceEvents && grep -q '\"compute\"' '$work/trace.json'"
summary_py="$(dirname "${BASH_SOURCE[0]}")/../../bench/trace_summary.py"
check "bench/trace_summary.py accounts for the traced step's compute lane" bash -c \
  "python3 '$summary_py' '$work/trace.json' --step 1 | grep -q '\"compute\": {\"nodes\": [1-9]'"
check "bench/trace_summary.py gives the compute lane's time per kind of node" bash -c \
  "python3 '$summary_py' '$work/trace.json' --step 1 | grep -q '\"by_kind\": \[{\"kind\": \"[a-z]'"
check "the trace names what each node waited for" bash -c "grep -q '\"after\":\"[a-z]' '$work/trace.json'"
check "the profile is CSV with per-node device bytes" bash -c "head -1 '$work/profile.csv' | grep -q '^variant,step,node,kind,lane,section,live_device_bytes' && [ \$(wc -l < '$work/profile.csv') -gt 20 ]"

# Without --quiet every epoch ends with an evaluation, and the final report takes the last one's
# figures rather than evaluating the same weights again: they must be those a quiet run computes.
loud=$("$ferry" train --model mlp --epochs 2 --train-limit 512 --json 2>/dev/null)
quiet=$("$ferry" train --model mlp --epochs 2 --train-limit 512 --json --quiet)
for key in test_loss test_accuracy; do
  loud_value=$(grep -o "\"$key\":[0-9.e-]*" <<<"$loud")
  check "the final $key with per-epoch evaluations is a quiet run's ($loud_value)" \
    test -n "$loud_value" -a "$loud_value" = "$(grep -o "\"$key\":[0-9.e-]*" <<<"$quiet")"
done

streamed=$("$ferry" train --model mlp --epochs 1 --train-limit 512 --quiet --json --residency stream --device-budget 24MiB)
check "streaming under a budget reports fetches" bash -c "grep -q '\"residency\":\"stream\"' <<<'$streamed' && ! grep -q '\"fetch_bytes_per_step\":0,' <<<'$streamed'"

state=$("$ferry" train --model mlp --epochs 1 --train-limit 512 --quiet --json --state-home host)
check "--state-home host streams only the optimizer state" bash -c "grep -q '\"state_home\":\"host_pinned\"' <<<'$state' && grep -q '\"weights_home\":\"device\"' <<<'$state' && ! grep -q '\"fetch_bytes_per_step\":0,' <<<'$state'"

# An explicit 'stream' that moves only the state: evaluation (no optimizer state) moves nothing and
# is planned all the same (it was refused as "moves nothing" at the first evaluation).
state_only=$("$ferry" train --model mlp --epochs 1 --train-limit 512 --quiet --json --residency stream --weights-home device)
check "--residency stream --weights-home device trains and evaluates" bash -c \
  "grep -q '\"weights_home\":\"device\"' <<<'$state_only' && grep -q '\"test_accuracy\":0\.[1-9]' <<<'$state_only'"
small=$("$ferry" train --model mlp --epochs 1 --train-limit 512 --quiet --json --optimizer adamw8bit --state-home compressed)
check "adamw8bit with compressed state reports its state home and unpacks" bash -c "grep -q '\"state_home\":\"host_compressed\"' <<<'$small' && grep -q '\"optimizer\":\"adamw8bit\"' <<<'$small' && ! grep -q '\"unpacks_per_step\":0,' <<<'$small'"

hybrid=$("$ferry" train --model mlp --epochs 1 --train-limit 2048 --quiet --json --phases hybrid --warmup-steps 2 --confidence 0.05 --profile-phases "$work/phases.csv")
check "the per-phase memory CSV has 7 fields on every line and a predict row" bash -c "head -1 '$work/phases.csv' | grep -q '^variant,section,peak_device_bytes,peak_node,mean_device_bytes,min_device_bytes,spikes$' && awk -F, 'NF != 7 { bad = 1 } END { exit bad }' '$work/phases.csv' && grep -q '^predict,all,[1-9]' '$work/phases.csv'"
check "hybrid phases report the predicted fraction and the steps per phase" bash -c "grep -q '\"phases\":\"hybrid\"' <<<'$hybrid' && grep -q '\"predict_fraction\":0\.[0-9]*[1-9]' <<<'$hybrid' && grep -q '\"phase_steps\":{\"correct\"' <<<'$hybrid'"
accumulated=$("$ferry" train --model mlp --epochs 1 --train-limit 1024 --batch 64 --accumulate 4 --quiet --json)
check "--accumulate 4 makes one update per 4 micro-batches" bash -c "grep -q '\"optimizer_updates\":4,' <<<'$accumulated' && grep -q '\"accumulate\":4' <<<'$accumulated'"
# A loss-scaled run whose steps mostly overflow (fp16 at a learning rate of 1000: 9 of 10) says so.
"$ferry" train --model mlp --epochs 1 --train-limit 640 --batch 64 --precision fp16 --lr 1000 --quiet >/dev/null 2>"$work/overflowed.txt"
check "an fp16 run whose steps mostly overflowed ends with a warning" grep -q "steps overflowed under fp16 loss scaling" "$work/overflowed.txt"
plan=$("$ferry" plan --model mlp --phases hybrid --device-budget 24MiB --json)
check "ferry plan --json has each phase's bytes and a recommendation" bash -c "grep -q '\"predict\":{' <<<'$plan' && grep -q '\"min_budget_streamed_bytes\":[1-9]' <<<'$plan' && grep -q '\"recommended\":{\"device_bytes\":[1-9][0-9]*,\"flags\":\"--' <<<'$plan'"
check "ferry plan prints a table" bash -c "'$ferry' plan --model cnn | grep -q 'minimum budget'"
# An explicit --recompute that keeps the CNN's peak where it is only adds compute: said, with the
# figures; a GPT whose activations set its peak recomputes to lower it, and nothing is said.
check "ferry plan says an explicit --recompute that does not lower the peak costs compute" bash -c \
  "'$ferry' plan --model cnn --recompute 1 | grep -q 'recompute 1 does not lower this step.s device peak (.* with it, .* without) and adds [0-9.]* GFLOP'"
check "ferry plan is silent on a --recompute that lowers the peak" bash -c \
  "! '$ferry' plan --model gpt --width 768 --depth 12 --heads 12 --recompute 2 | grep -q 'does not lower'"
# The minimum it prints is rounded up: given back as the budget, the step fits (rounded to the
# nearest tenth of a MiB it was 0.1 MiB short and ferry train refused it).
min_streamed=$("$ferry" plan --model cnn | sed -n 's/^minimum budget: .* with everything resident, \(.* mapped, \)\{0,1\}\([^,]*\) streamed$/\2/p' | tr -d ' ')
check "ferry plan's streamed minimum ($min_streamed) is a budget ferry train takes" "$ferry" train --model cnn --epochs 1 \
  --train-limit 128 --quiet --residency stream --device-budget "${min_streamed:-none}"
# Where nothing fits, the smallest budget it names is the least of the ways to hold the state (on a
# unified-memory device the mapped one, which it had left out), and ferry train takes it.
smallest=$("$ferry" plan --model mlp --device-budget 64KiB | sed -n 's/.*no configuration fits; the smallest device budget is \(.*\) (\(--residency [a-z]*\))$/\1|\2/p')
check "ferry plan's smallest budget where nothing fits ($smallest) is one ferry train takes" bash -c \
  "[ -n '$smallest' ] && '$ferry' train --model mlp --epochs 1 --train-limit 512 --quiet --device-budget '$(tr -d ' ' <<<"${smallest%%|*}")' ${smallest#*|}"
# Over 4 ranks, with too little device memory for the state at ZeRO stage 0 and too little host
# memory to stream it, the plan is rank 0's and recommends a higher ZeRO stage.
check "ferry plan --ranks 4 recommends a ZeRO stage when nothing fits without" bash -c "'$ferry' plan --model gpt --width 768 --depth 12 --heads 12 --context 256 --batch 32 --ranks 4 --device-budget 1000MiB --host-budget 300MiB --link-gbps 25 --gemm-gflops 40000 --device-gbps 3000 --device-8bit-gbps 1000 --launch-us 8 --host-gbps 20 --host-8bit-gbps 5 --codec-gbps 1 --json | grep -q '\"recommended\":{\"device_bytes\":[1-9][0-9]*,\"flags\":\"--zero [12]'"
check "ferry plan with --host-optimizer recommends a streamed configuration" bash -c "'$ferry' plan --model mlp --host-optimizer --device-budget 24MiB --json | grep -q '\"recommended\":{\"device_bytes\":[1-9][0-9]*,\"flags\":\"--residency stream'"

expect_error "unknown device" "no OpenCL device matches 'no-such-device'" train --device no-such-device --epochs 1
expect_error "missing data set" "$work/nowhere" train --data "$work/nowhere" --epochs 1
expect_error "budget below one layer" "raise the budget to at least" \
  train --model deep --width 256 --depth 2 --residency stream --device-budget 64KiB --epochs 1
expect_error "bad size unit" "unknown unit" train --device-budget 64XB --epochs 1
expect_error "an unknown residency mode" "--residency: sideways not in" train --residency sideways
expect_error "a home with no store yet (not offered)" "--state-home: int8 not in" \
  train --state-home int8 --epochs 1
expect_error "dropped weights" "only optimizer state can be dropped" train --weights-home dropped --epochs 1
expect_error "a bad zstd level" "zstd level 99" train --state-home compressed --compress-level 99 --epochs 1
expect_error "a bad 8-bit block" "2000" train --optimizer adamw8bit --optimizer-block 2000 --epochs 1
expect_error "hybrid phases that never predict" "maximum predict length of 0" train --phases hybrid --max-predict 0 --epochs 1
expect_error "a confidence outside (0, 1]" "confidence must be in (0, 1]" train --phases hybrid --confidence 1.5 --epochs 1
expect_error "accumulation over 0 micro-batches" "0 micro-batches" train --accumulate 0 --epochs 1
expect_error "a recompute interval beyond the depth" "nothing to recompute" \
  train --model deep --width 64 --depth 2 --recompute 50 --epochs 1
expect_error "an unknown predictor" "unknown predictor 'cubic'" train --phases hybrid --predictor cubic --epochs 1

# Checkpoints (docs/checkpoints.md): 1 epoch then --resume to 2 gives the 2-epoch run's results;
# interrupt <signal> <stderr file> <progress pattern> [--stdout FILE] <ferry args...>: runs ferry in
# the background with stderr to the file (stdout to FILE, else nowhere), sends the signal once the
# file shows the pattern, and sets `status` to the exit status. The file must not exist before (the
# shell truncates a redirect in the forked child, so polling a reused name could see the previous
# run's line and signal too early). Variables set before the call (VAR=x interrupt ...) reach ferry.
interrupt() {
  local signal=$1 err=$2 pattern=$3 out=/dev/null pid
  shift 3
  if [ "$1" = --stdout ]; then
    out=$2
    shift 2
  fi
  "$ferry" "$@" >"$out" 2>"$err" &
  pid=$!
  for _ in $(seq 1 1200); do grep -qs -- "$pattern" "$err" && break; sleep 0.05; done
  kill -"$signal" "$pid"
  wait "$pid"
  status=$?
}

# SIGINT, SIGTERM and SIGHUP (a closed terminal or session) stop between steps, write a checkpoint
# and print the command that resumes.
results() {  # the fields of a JSON line that must not depend on timing
  grep -o '"\(test_accuracy\|test_loss\|train_loss\|optimizer_updates\)":[^,}]*' <<<"$1" | tr '\n' ' '
}
ck=(--model mlp --train-limit 2048 --schedule constant --quiet --json)
two=$("$ferry" train "${ck[@]}" --epochs 2 --checkpoint "$work/two.ckpt")
check "--checkpoint writes a checkpoint" test -s "$work/two.ckpt"
check "--checkpoint leaves no temporary file" test "$(ls -A "$work" | grep -c '\.tmp-')" -eq 0
one=$("$ferry" train "${ck[@]}" --epochs 1 --checkpoint "$work/one.ckpt")
resumed=$("$ferry" train "${ck[@]}" --epochs 2 --resume "$work/one.ckpt")
check "1 epoch + --resume to 2 epochs gives the 2-epoch results" test "$(results "$resumed")" = "$(results "$two")"
check "... which differ from 1 epoch's" test "$(results "$one")" != "$(results "$two")"
check "the results to compare are there" grep -q '"test_loss":' <<<"$two"
again=$("$ferry" train "${ck[@]}" --epochs 2 --resume "$work/two.ckpt")
check "resuming a finished run reports it without training" test "$(results "$again")" = "$(results "$two")"
said=$("$ferry" train --model mlp --train-limit 2048 --schedule constant --epochs 2 --resume "$work/two.ckpt" 2>&1 >/dev/null)
check "... and says so" grep -q "every epoch --epochs 2 asks for is done, so none is trained" <<<"$said"
expect_error "--trace never replaces a checkpoint, --force or not" "holds a ferry checkpoint" \
  train "${ck[@]}" --epochs 1 --trace "$work/two.ckpt" --force
check "... which is left as it was" bash -c "head -c 8 '$work/two.ckpt' | grep -q FERRYCKP"

# SIGINT after the first progress line (mid-epoch, cosine schedule), then the printed command.
sig=(train --model mlp --epochs 2 --train-limit 8192 --json --checkpoint "$work/sig.ckpt")
uninterrupted=$("$ferry" "${sig[@]}" --quiet)
for signal in INT TERM HUP; do
  err="$work/sig-$signal.err"  # a log of its own per signal (see interrupt)
  rm -f "$work/sig.ckpt" "$err"
  interrupt "$signal" "$err" 'epoch 1/2 \[' "${sig[@]}"
  want=$(case $signal in INT) echo 130 ;; TERM) echo 143 ;; HUP) echo 129 ;; esac)
  before=$failures
  check "SIG$signal during training exits $want" test "$status" -eq "$want"
  check "SIG$signal says where training stopped" grep -q "stopped by SIG$signal at epoch 1/2, step [0-9]*/32" "$err"
  check "SIG$signal writes the checkpoint" test -s "$work/sig.ckpt"
  check "SIG$signal is acknowledged when it arrives" \
    grep -q "^ferry: SIG$signal received: stopping once the step (or evaluation) in flight ends, then checkpoint $work/sig.ckpt is written" "$err"
  [ "$failures" -eq "$before" ] || tail -5 "$err"  # what the run printed, when one of these failed
  cmd=$(sed -n 's/^ferry: resume with: //p' "$err")
  check "SIG$signal prints a resume command" grep -q -- "--resume $work/sig.ckpt" <<<"$cmd"
  after=$(bash -c "$cmd --quiet")
  check "the printed command (SIG$signal) finishes the run as if uninterrupted" \
    test "$(results "$after")" = "$(results "$uninterrupted")"
done

# A signal keeps what was traced and profiled: the first steps' trace and the memory profiles are
# written before the run stops.
err="$work/sig-trace.err"
rm -f "$work/sig-trace.json" "$err"
rm -f "$work/sig-profile.csv" "$work/sig-phases.csv"
interrupt INT "$err" 'epoch 1/2 \[' train --model mlp --epochs 2 --train-limit 8192 --trace "$work/sig-trace.json" \
  --trace-steps 2 --profile "$work/sig-profile.csv" --profile-phases "$work/sig-phases.csv"
check "SIGINT with --trace exits 130" test "$status" -eq 130
check "SIGINT with --trace writes the steps traced so far" grep -q '"traceEvents"' "$work/sig-trace.json"
check "... whole (it ends with the closing object)" grep -q '"otherData":{"schema":1' "$work/sig-trace.json"
check "SIGINT with --profile and --profile-phases writes both profiles" bash -c \
  "grep -q '^train,0,' '$work/sig-profile.csv' && grep -q '^train,all,[1-9]' '$work/sig-phases.csv'"

expect_error "a checkpoint folder that does not exist (before training)" "does not exist" \
  train --epochs 1 --checkpoint "$work/no-such-folder/x.ckpt"
expect_error "resuming a missing file" "cannot open checkpoint" train --epochs 1 --resume "$work/none.ckpt"
expect_error "resuming another model" "its model is 'mlp-784-1024-1024-10'" \
  train --model cnn --epochs 1 --train-limit 512 --resume "$work/one.ckpt"
expect_error "resuming with another seed" "resume with --seed 1" \
  train "${ck[@]}" --epochs 2 --seed 5 --resume "$work/one.ckpt"
expect_error "resuming to fewer epochs than done" "give --epochs 2 or more" \
  train "${ck[@]}" --epochs 1 --resume "$work/two.ckpt"
head -c 1000 "$work/one.ckpt" >"$work/cut.ckpt"
expect_error "resuming a truncated checkpoint" "truncated" train "${ck[@]}" --epochs 2 --resume "$work/cut.ckpt"

# The GPT on a small text this test writes (no package needed): JSON fields, a sample, errors.
mkdir -p "$work/text"
for i in $(seq 1 60); do echo "The quick brown fox $i jumps over the lazy dog; a stitch in time saves nine."; done >"$work/text/a"
gpt=$("$ferry" train --model gpt --text "$work/text" --width 16 --depth 1 --heads 2 --context 16 --batch 4 \
  --steps 6 --eval-every 3 --sample 20 --quiet --json)
check "ferry train --model gpt exits 0" test $? -eq 0
for key in train_loss val_loss tokens_per_s parameters curve sample; do
  check "GPT JSON has $key" grep -q "\"$key\":" <<<"$gpt"
done
check "the GPT curve has a point per validation (steps 3 and 6)" test "$(grep -o '"step":[0-9]*' <<<"$gpt" | tr '\n' ' ')" = '"step":3 "step":6 ' 
few=$("$ferry" train --model gpt --text "$work/text" --width 16 --depth 1 --heads 2 --context 16 --batch 4 \
  --steps 2 --val-windows 2 2>&1 >/dev/null)
check "--val-windows 2 validates on 2 held-out windows" grep -q "(2 validation windows of 16)" <<<"$few"
many_err="$work/many-windows.err"
many=$("$ferry" train --model gpt --text "$work/text" --width 16 --depth 1 --heads 2 --context 16 --batch 4 \
  --steps 2 --val-windows 100000 --json 2>"$many_err")
check "--val-windows above what the held-out text holds is said on the set-up line" \
  grep -q "; fewer than --val-windows 100000: the held-out text holds no more)" "$many_err"
check "--json's val_windows names the windows validated on (fewer than asked)" \
  python3 -c 'import json,sys; n=json.loads(sys.argv[1])["val_windows"]; sys.exit(not 0 < n < 100000)' "$many"
expect_error "a missing text folder" "apt-get install fortunes" train --model gpt --text "$work/no-text" --steps 1
mkdir -p "$work/empty-text" && : >"$work/empty-text/a"
expect_error "an empty text file" "is empty" train --model gpt --text "$work/empty-text" --steps 1
expect_error "width not a multiple of heads" "multiple of heads" \
  train --model gpt --text "$work/text" --width 10 --heads 3 --steps 1
expect_error "a sample prompt outside the vocabulary" "not in the corpus's vocabulary" \
  train --model gpt --text "$work/text" --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 \
  --sample 5 --prompt "Zebra!"
expect_error "an empty sample prompt" "--prompt: is empty" \
  train --model gpt --text "$work/text" --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 \
  --sample 5 --prompt ""
mkdir -p "$work/one-line" && printf 'abcab%.0s' $(seq 200) >"$work/one-line/a"
expect_error "no --prompt and a text without newlines (checked before training)" \
  "--prompt is a newline (its default) and this text has none" \
  train --model gpt --text "$work/one-line" --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 --sample 5

# GPT checkpoints: 3 steps + --resume to 6 gives the 6-step run's results bit for bit (losses and
# validation curve), SIGINT writes a checkpoint and the printed command finishes the run.
gresults() { grep -o '"\(train_loss\|val_loss\|steps\|optimizer_updates\)":[^,}]*' <<<"$1" | tr '\n' ' '; }
g=(train --model gpt --text "$work/text" --width 16 --depth 1 --heads 2 --context 16 --batch 4 --eval-every 3
  --schedule constant --dropout 0.1 --quiet --json)
gpt6=$("$ferry" "${g[@]}" --steps 6 --checkpoint "$work/g6.ckpt")
gpt3=$("$ferry" "${g[@]}" --steps 3 --checkpoint "$work/g3.ckpt")
gpt36=$("$ferry" "${g[@]}" --steps 6 --resume "$work/g3.ckpt")
check "GPT: --checkpoint writes a checkpoint" test -s "$work/g3.ckpt"
check "GPT: 3 steps + --resume to 6 gives the 6-step results" test "$(gresults "$gpt36")" = "$(gresults "$gpt6")"
check "GPT: ... which differ from 3 steps'" test "$(gresults "$gpt3")" != "$(gresults "$gpt6")"
check "GPT: the resumed curve holds both reports" test "$(grep -o '"step":[0-9]*' <<<"$gpt36" | tr '\n' ' ')" = '"step":3 "step":6 '
# A run that ends off the --eval-every grid reports at its end; resumed to more steps, that report
# goes, and losses and curve are the straight run's (the constant schedule has no warm-up, whose
# length --steps would set: 10 steps once warmed up over 1 update, 20 over 2).
g4=(train --model gpt --text "$work/text" --width 16 --depth 1 --heads 2 --context 16 --batch 4 --eval-every 4
  --schedule constant --quiet --json)
gcurve() { grep -o '"step":[0-9]*,"val_loss":[^}]*' <<<"$1" | tr '\n' ' '; }
gpt20=$("$ferry" "${g4[@]}" --steps 20)
"$ferry" "${g4[@]}" --steps 10 --checkpoint "$work/g10.ckpt" >/dev/null
gpt1020=$("$ferry" "${g4[@]}" --steps 20 --resume "$work/g10.ckpt")
check "GPT: 10 steps (off the report grid) + --resume to 20 gives the 20-step results" \
  test "$(gresults "$gpt1020")" = "$(gresults "$gpt20")"
check "GPT: ... and the 20-step curve" test "$(gcurve "$gpt1020")" = "$(gcurve "$gpt20")"
check "GPT: ... which reports at 4, 8, 12, 16, 20" test "$(grep -o '"step":[0-9]*' <<<"$gpt1020" | tr '\n' ' ')" = \
  '"step":4 "step":8 "step":12 "step":16 "step":20 '
expect_error "GPT: resuming with another seed" "resume with --seed 1" "${g[@]}" --steps 6 --seed 2 --resume "$work/g3.ckpt"
expect_error "GPT: resuming to fewer steps than done" "give --steps 6 or more" "${g[@]}" --steps 4 --resume "$work/g6.ckpt"
expect_error "GPT: resuming a classifier's checkpoint" "its model is 'mlp-784-1024-1024-10'" \
  "${g[@]}" --steps 6 --resume "$work/one.ckpt"
# The GPT writes its memory profiles as the classifiers do (it once left both out and said nothing).
"$ferry" "${g[@]}" --steps 2 --profile "$work/gprofile.csv" --profile-phases "$work/gphases.csv" >/dev/null
check "GPT: --profile writes per-node device bytes of its attention" bash -c \
  "head -1 '$work/gprofile.csv' | grep -q '^variant,step,node,kind,lane,section,live_device_bytes' && grep -q ',attention,' '$work/gprofile.csv'"
check "GPT: --profile-phases writes the per-phase profile" grep -q '^variant' "$work/gphases.csv"
gsig=(train --model gpt --text "$work/text" --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 300
  --eval-every 100 --json --checkpoint "$work/gsig.ckpt")
guninterrupted=$("$ferry" "${gsig[@]}" --quiet)
rm -f "$work/gsig.err" "$work/gsig.ckpt" # a new run over another run's checkpoint is refused without --force
interrupt INT "$work/gsig.err" '^step [0-9]*/300 \[' "${gsig[@]}"
check "GPT: SIGINT during training exits 130" test "$status" -eq 130
check "GPT: SIGINT says where training stopped" grep -q "stopped by SIGINT at step [0-9]*/300" "$work/gsig.err"
cmd=$(sed -n 's/^ferry: resume with: //p' "$work/gsig.err")
check "GPT: SIGINT prints a resume command" grep -q -- "--resume $work/gsig.ckpt" <<<"$cmd"
gafter=$(bash -c "$cmd --quiet")
check "GPT: the printed command finishes the run as if uninterrupted" \
  test "$(gresults "$gafter")" = "$(gresults "$guninterrupted")"

# SIGINT while sampling (training done): the sample so far and the results are printed, exit 130.
rm -f "$work/ssig.err"
"$ferry" train --model gpt --text "$work/text" --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 2 \
  --sample 1000000 --json >"$work/ssig.json" 2>"$work/ssig.err" &
pid=$!
for _ in $(seq 1 1200); do grep -qs -- '^ferry: sampling 1000000 characters' "$work/ssig.err" && break; sleep 0.05; done
kill -INT "$pid"
wait "$pid"
status=$?
check "GPT: SIGINT while sampling exits 130" test "$status" -eq 130
check "GPT: SIGINT while sampling says how far it came" \
  grep -q "sampling stopped by SIGINT after [0-9]* of 1000000 characters; training had finished" "$work/ssig.err"
check "GPT: SIGINT while sampling still prints the JSON line, sample_stopped in it" \
  python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); sys.exit(not (j["sample_stopped"] and len(j["sample"]) < 1000000))' "$work/ssig.json"

# ferry tune stopped by SIGINT: the search ends as a spent budget ends it, the best so far is saved
# and used, exit 130 (it died with everything measured lost).
tune_cache="$work/tune-cache"
rm -rf "$tune_cache" "$work/tune.err"
FERRY_CACHE_DIR="$tune_cache" interrupt INT "$work/tune.err" '\] *[1-9][0-9]*/' --stdout "$work/tune.json" \
  tune --family gemm --budget-seconds 600 --json
check "ferry tune: SIGINT exits 130" test "$status" -eq 130
check "ferry tune: SIGINT is acknowledged and said" bash -c \
  "grep -q '^ferry tune: SIGINT received: the search stops after the candidate being timed' '$work/tune.err' &&
   grep -q '^ferry tune: stopped by SIGINT; the best found before it is saved' '$work/tune.err'"
check "ferry tune: SIGINT still saves the best so far" bash -c \
  "python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); sys.exit(not (j[\"stopped\"] and j[\"cache_path\"]))' '$work/tune.json' &&
   ls '$tune_cache' | grep -q ."

# A shorter ferry tune keeps the cached row of a search that measured more candidates (a 0.001 s
# search, 1 candidate, had replaced a complete one) and says so; --force replaces it. The cached
# row's comment is made to claim 11 candidates more, its checksum (64-bit FNV-1a) redone.
keep_cache="$work/tune-keep"
rm -rf "$keep_cache"
FERRY_CACHE_DIR="$keep_cache" "$ferry" tune --family gemm --budget-seconds 0.001 --quiet
row_file=$(ls "$keep_cache"/gemm-tuning-*.tsv)
python3 - "$row_file" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
body = re.sub(r"search, (\d+) of (\d+) candidates",
              lambda m: f"search, {int(m[1]) + 11} of {int(m[2]) + 11} candidates", text[:text.rindex("# checksum ")])
h = 0xCBF29CE484222325
for b in body.encode():
    h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
open(path, "w").write(body + f"# checksum {h:016x}\n")
PY
cp "$row_file" "$work/kept-row.tsv"
FERRY_CACHE_DIR="$keep_cache" "$ferry" tune --family gemm --budget-seconds 0.001 2>"$work/keep.err"
status=$?
check "ferry tune: a shorter search keeps the more complete cached row, and says so" bash -c \
  "[ $status -eq 0 ] && cmp -s '$row_file' '$work/kept-row.tsv' &&
   grep -q '^ferry tune: kept the cached row in $row_file, which measured 1[2-9] of [0-9]* candidates (this run measured 1); --force replaces it' '$work/keep.err'"
FERRY_CACHE_DIR="$keep_cache" "$ferry" tune --family gemm --budget-seconds 0.001 --force 2>"$work/keep.err"
check "ferry tune --force replaces a more complete cached row" bash -c \
  "grep -q '^ferry tune: saved in $row_file' '$work/keep.err' && grep -q 'search, 1 of ' '$row_file'"
# With tuning data whose only row is generic, the tuned row (the cache's, which names the device)
# is the one gemm() runs: said so, not that a row of the tuning data wins over it.
printf '*\t*\t*\tferry\tnaive\t-\n' >"$work/generic-only.tsv"
rm -rf "$work/tune-generic"
env -u FERRY_TUNE FERRY_CACHE_DIR="$work/tune-generic" FERRY_GEMM_TUNING="$work/generic-only.tsv" "$ferry" tune \
  --family gemm --budget-seconds 0.001 2>"$work/generic.err"  # (FERRY_TUNE=off would run the generic row)
check "ferry tune over generic tuning data says gemm() now runs the tuned row" bash -c \
  "grep -q '^ferry tune: gemm() now runs .*(.*/tune-generic/gemm-tuning-' '$work/generic.err' &&
   ! grep -q 'names this device' '$work/generic.err'"

# First-use tuning inside ferry train (FERRY_TUNE=quick, tuning data whose only row is generic, a
# cache folder without a tuned row): SIGINT ends the search with a message on a line of its own and
# exit 130, its best so far saved whole and marked as a stopped search's (it died by the signal,
# the search lost); the next run searches again, and with --quiet prints none of its progress.
first_cache="$work/first-use-cache"
rm -rf "$first_cache" && mkdir -p "$first_cache"
[ -n "${FERRY_CACHE_DIR:-}" ] && [ -d "$FERRY_CACHE_DIR" ] && cp -r "$FERRY_CACHE_DIR/." "$first_cache/" 2>/dev/null
rm -f "$first_cache"/gemm-tuning-* "$first_cache"/attention-tuning-*
printf '*\t*\t*\tferry\tnaive\t-\n' >"$work/generic.tsv"
first_use=(env FERRY_TUNE=quick "FERRY_GEMM_TUNING=$work/generic.tsv" "FERRY_CACHE_DIR=$first_cache")
FERRY_TUNE=quick FERRY_GEMM_TUNING="$work/generic.tsv" FERRY_CACHE_DIR="$first_cache" FERRY_TUNE_BUDGET_S=600 \
  interrupt INT "$work/first-use.err" 'tuning GEMM probe [1-9]' train --model mlp --epochs 1 --train-limit 256
check "first-use tuning in ferry train: SIGINT exits 130" test "$status" -eq 130
check "first-use tuning in ferry train: SIGINT is acknowledged and said on lines of their own" bash -c \
  "grep -q '^ferry: SIGINT received: the GEMM tuning stops after the candidate being timed' '$work/first-use.err' &&
   grep -q \"^ferry: GEMM tuning for '.*' stopped by SIGINT after [0-9]* of [0-9]* candidates; its best so far, .*, is saved in $first_cache/gemm-tuning-.* as a stopped search's\" '$work/first-use.err'"
check "first-use tuning in ferry train: SIGINT leaves a whole cache file, marked, and no temporary one" bash -c \
  "grep -q 'candidates in .* s, stopped by a signal' '$first_cache'/gemm-tuning-*.tsv && ! ls -a '$first_cache' | grep -q 'gemm-tuning.*\.tmp'"
"${first_use[@]}" FERRY_TUNE_BUDGET_S=0.01 "$ferry" train --model mlp --epochs 1 --train-limit 256 --quiet \
  >/dev/null 2>"$work/first-use-quiet.err"
status=$?
check "first-use tuning in ferry train --quiet prints no progress" bash -c \
  "[ $status -eq 0 ] && ! grep -qi 'tun\|search' '$work/first-use-quiet.err'"
[ "$status" -eq 0 ] || tail -5 "$work/first-use-quiet.err"

# A program cache folder this user may not look into: one note for the folder, not a line per
# program ("entry ... is invalid (cannot be read: Permission denied)" for each). Root looks into
# any folder, so the run is made as nobody.
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null; then
  locked="$work/locked-cache"
  ferry_path=$(realpath "$ferry")
  nobody_home="$work/nobody-home"
  mkdir -p "$locked" "$nobody_home"
  chown 65534 "$nobody_home"
  chmod a+rx "$work"
  FERRY_CACHE_DIR="$locked" "$ferry" train --model mlp --epochs 1 --train-limit 256 --quiet >/dev/null 2>&1
  chmod 000 "$locked"
  out=$(cd "$nobody_home" && HOME="$nobody_home" FERRY_CACHE_DIR="$locked" setpriv --reuid=65534 --regid=65534 \
    --clear-groups "$ferry_path" train --model mlp --epochs 1 --train-limit 256 --quiet 2>&1 >/dev/null)
  status=$?
  chmod 755 "$locked"
  check "a cache folder out of reach: the run goes on" test "$status" -eq 0
  check "a cache folder out of reach: one note naming it, no line per entry" bash -c \
    "[ \$(grep -c '^ferry: program cache' <<<'$out') -eq 1 ] &&
     grep -q 'program cache folder $locked is not usable (cannot look into it: Permission denied)' <<<'$out'"
  [ "$status" -eq 0 ] || echo "$out" | tail -5
fi

echo "$failures failed"
[ "$failures" -eq 0 ]
