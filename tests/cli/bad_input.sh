#!/usr/bin/env bash
# Every bad input of docs/bad_input.md, given to the `ferry` command: each must fail (or warn,
# where the table says so) with a message holding the row's key phrase, and that phrase must
# still be in docs/bad_input.md, so the table and the messages cannot drift apart.
# usage: bad_input.sh <ferry binary> <scratch folder> [--markdown]
#   --markdown: print the table's rows (case, command, exit status, message) instead of checking.
set -uo pipefail
ferry=$1
work=$2
markdown=${3:-}
doc="$(cd "$(dirname "$0")/../.." && pwd)/docs/bad_input.md"
rm -rf "$work" && mkdir -p "$work"
# A private program cache (one entry of it is corrupted below), started from the shared one.
mkdir -p "$work/cache"
[ -n "${FERRY_CACHE_DIR:-}" ] && [ -d "$FERRY_CACHE_DIR" ] && cp -r "$FERRY_CACHE_DIR/." "$work/cache/" 2>/dev/null
export FERRY_CACHE_DIR=$work/cache
failures=0

# row <what> <key phrase> <expected: error|warning|any (a warning whose exit status depends on the machine)> <env assignments or -> <ferry args...>
row() {
  local what=$1 needle=$2 kind=$3 envs=$4
  shift 4
  local out status
  if [ "$envs" = - ]; then
    out=$("$ferry" "$@" 2>&1 >/dev/null)
  else
    out=$(env $envs "$ferry" "$@" 2>&1 >/dev/null)
  fi
  status=$?
  local msg
  msg=$(grep -m1 -F -- "$needle" <<<"$out" || grep -m1 . <<<"$out")
  [ ${#msg} -gt 330 ] && msg="${msg:0:330}..."
  if [ -n "$markdown" ]; then
    # Each argument as a shell reads it back: an empty one as '' (bare, it had shown as nothing,
    # and the row's command failed otherwise when copied), one with blanks or shell characters quoted.
    local cmd="ferry" arg
    for arg in "$@"; do
      if [ -z "$arg" ]; then
        arg="''"
      elif [[ "$arg" =~ [][[:space:]\"\'\$\`\\\|\&\;\<\>\(\)\*\?] ]]; then
        arg="'${arg//\'/\'\\\'\'}'"
      fi
      cmd+=" $arg"
    done
    cmd=${cmd//$work/\$WORK}
    [ "$envs" != - ] && cmd="${envs//$work/\$WORK} $cmd"
    msg=${msg//$work/\$WORK}
    printf '| %s | `%s` | %s | %s | `%s` |\n' "$what" "$cmd" "$status" "${msg//|/\\|}" "${needle//$work/\$WORK}"
    return
  fi
  local ok=1
  if [ "$kind" = error ] && [ "$status" -eq 0 ]; then ok=0; fi
  if [ "$kind" = warning ] && [ "$status" -ne 0 ]; then ok=0; fi
  grep -qF -- "$needle" <<<"$out" || ok=0
  grep -qF -- "${needle//$work/\$WORK}" "$doc" || {
    echo "FAILED: $what: docs/bad_input.md no longer shows '$needle'"
    failures=$((failures + 1))
  }
  if [ "$ok" = 1 ]; then
    echo "ok: $what"
  else
    echo "FAILED: $what (exit $status, wanted a $kind with '$needle'):"
    tail -5 <<<"$out"
    failures=$((failures + 1))
  fi
}

quick=(--epochs 1 --train-limit 512 --quiet)

# Flags and values.
row "learning rate NaN" "--lr: must be a finite number > 0, got nan" error - train --lr nan "${quick[@]}"
row "learning rate negative" "--lr: must be a finite number > 0, got -1" error - train --lr -1 "${quick[@]}"
row "momentum 1" "optimizer sgd: momentum = 1: it must be in [0, 1)" error - train --optimizer sgd --momentum 1 "${quick[@]}"
row "weight decay NaN" "weight decay = nan: it must be a finite number >= 0" error - train --weight-decay nan "${quick[@]}"
row "batch 0" "--batch: must be a finite number > 0, got 0" error - train --batch 0 "${quick[@]}"
row "batch 1.5" "--batch: 1.5 is not a whole number" error - train --batch 1.5 "${quick[@]}"
row "epochs beyond what the option holds" "--epochs: 99999999999 is more than this option can hold" error - \
  train --epochs 99999999999 --train-limit 512 --quiet
row "batch above the training samples" "batch 1024 is larger than the 512 training samples" error - \
  train --batch 1024 "${quick[@]}"
row "unknown optimizer" "unknown optimizer 'rmsprop'" error - train --optimizer rmsprop "${quick[@]}"
row "unknown model" "--model: resnet not in" error - train --model resnet "${quick[@]}"
row "unknown precision" "--precision: fp8 not in {fp32,fp16,bf16}" error - train --precision fp8 "${quick[@]}"
row "budget too small for one layer" "raise the budget to at least" error - \
  train --model deep --width 256 --depth 2 --residency stream --device-budget 64KiB "${quick[@]}"
row "host budget too small for the streamed state" "more than the host budget of" error - \
  train --residency stream --host-budget 1MiB "${quick[@]}"
row "staging chunk without staged host memory" "chunked fetches are a way of staged host memory" error - \
  train --staging-chunk 1MiB "${quick[@]}"
row "staging chunk too small" "use 4.0 KiB to 256.0 MiB" error - \
  train --host-memory staged --staging-chunk 1KiB "${quick[@]}"
row "transfer slack with resident residency" "--transfer-slack applies to tensors fetched from host memory" error - \
  train "${quick[@]}" --transfer-slack 2 --residency resident
row "host optimizer with resident residency" "or run the optimizer on the device (no --host-optimizer" error - \
  train "${quick[@]}" --host-optimizer --residency resident
row "overlapped host updates with mapped residency" "(which --overlap-host-updates implies)" error - \
  train "${quick[@]}" --overlap-host-updates --residency mapped
row "host optimizer with compressed state" "leave the state's home to the residency mode" error - \
  train "${quick[@]}" --host-optimizer --state-home compressed
row "overlapped host updates with the optimizer on the device" "are the host optimizer's: add --host-optimizer" \
  error - train "${quick[@]}" --residency stream --no-host-optimizer --overlap-host-updates
row "the optimizer on the host and on the device" "--host-optimizer excludes --no-host-optimizer" error - \
  train "${quick[@]}" --host-optimizer --no-host-optimizer
row "ferry plan --zero without --ranks" "plan it with --ranks N" error - plan --model mlp --zero 1
row "--host-budget 0" "--host-budget 0: a budget must be more than 0 bytes" error - train "${quick[@]}" --host-budget 0
: >"$work/not_a_folder"
row "ferry tune with a cache folder that is a file" "is not a folder, so what the search finds could not be saved" \
  error "FERRY_CACHE_DIR=$work/not_a_folder" tune --budget-seconds 5 --quiet
row "ferry tune with the program cache off" "the program cache is off" error "FERRY_PROGRAM_CACHE=0" \
  tune --budget-seconds 5 --quiet
row "ferry tune with a cache folder that cannot be made" "is not usable (cannot create it:" error \
  "FERRY_CACHE_DIR=/proc/ferry-no-cache" tune --budget-seconds 5 --quiet
row "ferry plan --network-gbps without --ranks" "--network-gbps applies to a plan of several ranks only" error - \
  plan --model mlp --network-gbps 10
row "ferry plan, both ways at once faster than each alone" "both ways at once carry at most their sum" error - \
  plan --model mlp --link-gbps 5 --link-both-gbps 50
row "ferry plan with a flag that does not apply" "--momentum applies to --optimizer sgd only" error - \
  plan --model mlp --momentum 0.9
row "--weights-home int8 (the library names it; it has no store)" "--weights-home: int8 not in" error - \
  train "${quick[@]}" --weights-home int8
row "--trace-steps 0" "--trace-steps 0 traces and profiles no step" error - \
  train --trace-steps 0 --trace "$work/no-steps.json" "${quick[@]}"
row "--trace-steps without --trace or --profile" "--trace-steps applies to --trace and --profile only" error - \
  train "${quick[@]}" --trace-steps 2
row "--prompt without --sample" "--prompt applies with --sample only" error - \
  train --model gpt --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 --quiet --prompt "The"
row "--weight-decay-on without weight decay" "--weight-decay-on applies with a --weight-decay above 0 only" error - \
  train "${quick[@]}" --weight-decay-on matrices
row "--zero on one rank (a warning; stage 0 is run)" "one rank, which keeps all of it" warning - \
  train "${quick[@]}" --zero 1
row "--bucket-size on one rank (a warning)" "this run has one rank, which sums nothing" warning - \
  train "${quick[@]}" --bucket-size 1MiB
row "--accumulate over the run's batches" "it would train nothing" error - \
  train --epochs 1 --train-limit 256 --quiet --accumulate 2
row "--seed -1" "--seed: must be a whole number >= 0, got -1" error - train "${quick[@]}" --seed -1
row "--lr past a float's range" "--lr: must be between" error - train "${quick[@]}" --lr 1e39
row "a size option with a negative size" "--device-budget: size '-5MiB' is out of range" error - \
  train "${quick[@]}" --device-budget -5MiB
row "--depth past its range" "--depth: Value 100000 not in range" error - train "${quick[@]}" --model deep --depth 100000
row "an empty --resume (an unset shell variable)" "--resume: is empty" error - train "${quick[@]}" --resume ""
row "an empty --device" "--device: is empty" error - train "${quick[@]}" --device ""
row "--width for the MLP (it has fixed sizes)" "--width applies to --model deep and gpt" error - \
  train "${quick[@]}" --width 64
row "--momentum with Adam" "--momentum applies to --optimizer sgd only" error - train "${quick[@]}" --momentum 0.5
row "--optimizer-block without 8-bit state" "--optimizer-block applies to --optimizer adamw8bit only" error - \
  train "${quick[@]}" --optimizer-block 256
row "--compress-level without a compressed home" "--compress-level applies to a compressed home only" error - \
  train "${quick[@]}" --compress-level 3
row "compressed chunks of a few bytes" "chunks below 4.0 KiB hold more than they save" error - \
  train "${quick[@]}" --state-home compressed --compress-chunk 1
row "--warmup-steps without hybrid phases" "--warmup-steps applies to --phases hybrid only" error - \
  train "${quick[@]}" --warmup-steps 3
row "--loss-scaling on with fp32 layers (nothing to scale)" "loss scaling on with fp32 layers" error - \
  train "${quick[@]}" --loss-scaling on
row "--residency stream with both homes on the device (streams nothing)" "moves nothing" error - \
  train "${quick[@]}" --residency stream --weights-home device --state-home device
row "--initial-loss-scale without loss scaling" "--initial-loss-scale applies with loss scaling only" error - \
  train "${quick[@]}" --initial-loss-scale 1024
row "--host-memory with resident residency" "--host-memory applies to tensors fetched from host memory" error - \
  train "${quick[@]}" --residency resident --host-memory staged

# Output files, probed before any work.
row "--trace in a missing folder" "--trace $work/no-such-folder/t.json: the folder" error - \
  train --trace "$work/no-such-folder/t.json" "${quick[@]}"
row "--trace where no file can be created" "--trace /proc/ferry-trace.json: cannot create a file in '/proc'" \
  error - train --trace /proc/ferry-trace.json "${quick[@]}"
row "--profile is a folder" "--profile $work: it is a folder" error - train --profile "$work" "${quick[@]}"
row "--profile-phases in a missing folder" "--profile-phases $work/none/p.csv: the folder" error - \
  train --profile-phases "$work/none/p.csv" "${quick[@]}"
row "--checkpoint in a missing folder" "does not exist: create it first" error - \
  train --checkpoint "$work/none/run.ckpt" "${quick[@]}"
long_name=$(printf 'n%.0s' $(seq 300))
row "--checkpoint with a file name too long for the file system" "give a shorter name" error - \
  train --checkpoint "$work/$long_name.ckpt" "${quick[@]}"

# Data.
data=/usr/share/datasets/fashion-mnist
idx() {  # idx <file> <magic> <dims...>: an IDX header, big endian
  local f=$1 magic=$2
  shift 2
  printf "\\x00\\x00\\x08\\x$(printf %02x "$magic")" >"$f"
  for d in "$@"; do printf "\\x$(printf %02x $((d >> 24 & 255)))\\x$(printf %02x $((d >> 16 & 255)))\\x$(printf %02x $((d >> 8 & 255)))\\x$(printf %02x $((d & 255)))" >>"$f"; done
}
mkdir -p "$work/data32"
ln -sf "$data/train-images-idx3-ubyte.gz" "$data/train-labels-idx1-ubyte.gz" "$work/data32/"
idx "$work/data32/t10k-images-idx3-ubyte" 3 4 32 32 && head -c $((4 * 32 * 32)) /dev/zero >>"$work/data32/t10k-images-idx3-ubyte"
idx "$work/data32/t10k-labels-idx1-ubyte" 1 4 && printf '\x01\x02\x03\x04' >>"$work/data32/t10k-labels-idx1-ubyte"
gzip -f "$work/data32/t10k-images-idx3-ubyte" "$work/data32/t10k-labels-idx1-ubyte"
row "test split of another image size" "holds 32x32 images, but Fashion-MNIST's are 28x28" error - \
  train --data "$work/data32" "${quick[@]}"
# 14x56 holds 784 values per image, as 28x28 does: refused all the same.
mkdir -p "$work/data14"
ln -sf "$data/train-images-idx3-ubyte.gz" "$data/train-labels-idx1-ubyte.gz" "$data/t10k-labels-idx1-ubyte.gz" \
  "$work/data14/"
idx "$work/data14/t10k-images-idx3-ubyte" 3 10000 14 56 && head -c $((10000 * 784)) /dev/zero >>"$work/data14/t10k-images-idx3-ubyte"
gzip -f "$work/data14/t10k-images-idx3-ubyte"
row "test split of 14x56 images (784 values each)" "holds 14x56 images, but Fashion-MNIST's are 28x28" error - \
  train --data "$work/data14" "${quick[@]}"
# Bytes after the gzip stream that are not gzip, and a file out of reach (a link to itself).
mkdir -p "$work/gz-tail" "$work/link-loop"
ln -sf "$data/train-images-idx3-ubyte.gz" "$data/train-labels-idx1-ubyte.gz" "$data/t10k-images-idx3-ubyte.gz" \
  "$work/gz-tail/"
{ cat "$data/t10k-labels-idx1-ubyte.gz" && printf 'junk'; } >"$work/gz-tail/t10k-labels-idx1-ubyte.gz"
row "data after the gzip stream" "has data after the end of its gzip stream (4 bytes" error - \
  train --data "$work/gz-tail" "${quick[@]}"
ln -sf train-images-idx3-ubyte.gz "$work/link-loop/train-images-idx3-ubyte.gz"
row "data file that is a link loop" "cannot be reached (Too many levels of symbolic links)" error - \
  train --data "$work/link-loop" "${quick[@]}"
mkdir -p "$work/labels"
ln -sf "$data/train-images-idx3-ubyte.gz" "$data/train-labels-idx1-ubyte.gz" "$work/labels/"
idx "$work/labels/t10k-images-idx3-ubyte" 3 1 28 28 && head -c 784 /dev/zero >>"$work/labels/t10k-images-idx3-ubyte"
idx "$work/labels/t10k-labels-idx1-ubyte" 1 1 && printf '\x0c' >>"$work/labels/t10k-labels-idx1-ubyte"
gzip -f "$work/labels/t10k-images-idx3-ubyte" "$work/labels/t10k-labels-idx1-ubyte"
row "test split with a label outside the classes" "label 12 of sample 0 is out of range" error - \
  train --data "$work/labels" "${quick[@]}"
# Unpacked (gunzip, or a download of the plain files): named as such, not reported missing.
mkdir -p "$work/unpacked"
ln -sf "$data/train-images-idx3-ubyte.gz" "$data/train-labels-idx1-ubyte.gz" "$data/t10k-images-idx3-ubyte.gz" \
  "$work/unpacked/"
zcat "$data/t10k-labels-idx1-ubyte.gz" >"$work/unpacked/t10k-labels-idx1-ubyte"
row "data file unpacked" "is there uncompressed; compress it (gzip -k" error - train --data "$work/unpacked" "${quick[@]}"
row "missing data set" "$work/nowhere" error - train --data "$work/nowhere" "${quick[@]}"
row "--data naming a file" "is a file, not a folder" error - train --data "$data/train-images-idx3-ubyte.gz" "${quick[@]}"

# Devices.
mkdir -p "$work/no-icd"
row "no OpenCL device" "no OpenCL device" error "OCL_ICD_VENDORS=$work/no-icd OCL_ICD_FILENAMES=" \
  train "${quick[@]}"
# HOME a file (as for some service users): PoCL could not create its kernel cache and would load
# no device; ferry points it at a private folder under FERRY_CACHE_DIR and says so.
printf 'not a folder\n' >"$work/home-file"
row "HOME where PoCL cannot keep its kernel cache (a note; runs)" "PoCL's kernel cache folder" warning \
  "HOME=$work/home-file XDG_CACHE_HOME= POCL_CACHE_DIR=" devices
row "neither HOME nor XDG_CACHE_HOME (a note; runs)" \
  "PoCL has no kernel cache folder (neither HOME nor XDG_CACHE_HOME is set)" warning \
  "HOME= XDG_CACHE_HOME= POCL_CACHE_DIR=" devices
# POCL_CACHE_DIR naming a folder that cannot be created: PoCL loads no device, and "no OpenCL
# device found" alone would send the user to install a driver they have. ferry keeps the user's
# folder and says what is wrong with it.
row "POCL_CACHE_DIR that cannot be created (a warning; PoCL then loads no device)" \
  "POCL_CACHE_DIR='$work/home-file/pocl' cannot be created or written by this user" any \
  "POCL_CACHE_DIR=$work/home-file/pocl" devices
row "wrong FERRY_DEVICE" "no OpenCL device matches 'no-such-gpu'" error "FERRY_DEVICE=no-such-gpu" train "${quick[@]}"
row "--lr 0" "--lr: must be a finite number > 0, got 0" error - train "${quick[@]}" --lr 0
row "--device-budget 0" "a budget must be more than 0 bytes" error - train "${quick[@]}" --device-budget 0
row "--device-budget above the device's memory" "is more than the device" error - \
  train "${quick[@]}" --device-budget 100TiB
row "--train-limit 0" "--train-limit: must be a finite number > 0, got 0" error - train --epochs 1 --train-limit 0
row "--temperature nan" "--temperature: must be a finite number > 0, got nan" error - \
  train --model gpt --temperature nan
row "--steps for the MLP" "--steps applies to --model gpt only" error - train "${quick[@]}" --steps 5
row "--epochs for the GPT" "--epochs applies to the Fashion-MNIST models" error - train --model gpt --epochs 2
row "--predict-int8 without hybrid phases" "--predict-int8 applies to Predict steps" error - \
  train "${quick[@]}" --predict-int8
row "unknown FERRY_TUNE" "FERRY_TUNE='fast': expected off, quick or full" error "FERRY_TUNE=fast" train "${quick[@]}"
row "FERRY_TUNE_BUDGET_S not a decimal number of seconds" "FERRY_TUNE_BUDGET_S='0x10': expected a decimal number" \
  error "FERRY_TUNE_BUDGET_S=0x10" train "${quick[@]}"
row "FERRY_PROGRAM_CACHE neither on nor off" "FERRY_PROGRAM_CACHE='of': expected 0 or 1 (also off/on" error \
  "FERRY_PROGRAM_CACHE=of" train "${quick[@]}"
row "FERRY_HUGE_PAGES neither on nor off" "FERRY_HUGE_PAGES='maybe': expected 0 or 1 (also off/on" error \
  "FERRY_HUGE_PAGES=maybe" train "${quick[@]}"
# A budget above the device memory the driver counts free: NVML read from a stand-in
# (tests/stand_ins/fake_nvml.cpp, copied here so the row names no build folder) whose GPU has
# all but 100 MiB of its 80 GiB in use or reserved by its driver from the context on.
if [ -n "${FERRY_TEST_FAKE_NVML:-}" ]; then
  cp "$FERRY_TEST_FAKE_NVML" "$work/libnvidia-ml-stand-in.so"
  row "--device-budget above what the driver counts free" "is more than the driver (nvml) counts 100.0 MiB free" \
    error "FERRY_NVML_LIBRARY=$work/libnvidia-ml-stand-in.so FERRY_NVML_GPU=00000000:3b:00.0 FAKE_NVML_USED=1073741824,1073741824,85257617408" \
    train "${quick[@]}" --device-budget 1GiB
fi
row "FERRY_BUILD_THREADS not a whole number from 1" "FERRY_BUILD_THREADS='0': expected a whole number from 1 to 1024" \
  error "FERRY_BUILD_THREADS=0" train "${quick[@]}"
row "unknown FERRY_ATTENTION_KERNEL" "FERRY_ATTENTION_KERNEL='flash': attention: unknown kernel 'flash'" error \
  "FERRY_ATTENTION_KERNEL=flash" \
  train --model gpt --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 --quiet
row "FERRY_ROW_GROUP_SIZE not a whole number" "FERRY_ROW_GROUP_SIZE='abc': expected a whole number from 1 to 1024" \
  error "FERRY_ROW_GROUP_SIZE=abc" train "${quick[@]}"
row "FERRY_GEMM_TUNING naming a device" "FERRY_GEMM_TUNING: '/dev/zero' is a device, not a regular file" error \
  "FERRY_GEMM_TUNING=/dev/zero" train "${quick[@]}"
row "unknown ferry tune --mode" "--mode: slow not in {quick,full}" error - tune --mode slow

# Checkpoints and the program cache.
"$ferry" train "${quick[@]}" --checkpoint "$work/good.ckpt" >/dev/null 2>&1
cp "$work/good.ckpt" "$work/flipped.ckpt"
printf '\xff' | dd of="$work/flipped.ckpt" bs=1 seek=5000 conv=notrunc status=none
row "--checkpoint over another run's checkpoint" "add --resume $work/good.ckpt to go on from it" error - \
  train "${quick[@]}" --checkpoint "$work/good.ckpt"
row "corrupt checkpoint (one byte flipped)" "fails its checksum" error - train "${quick[@]}" --resume "$work/flipped.ckpt"
head -c 1000 "$work/good.ckpt" >"$work/cut.ckpt"
row "truncated checkpoint" "and it has 1000 bytes" error - train "${quick[@]}" --resume "$work/cut.ckpt"
row "truncated checkpoint described" "and it has 1000 bytes" error - checkpoint "$work/cut.ckpt"
mkfifo "$work/pipe.ckpt"
row "--resume from a FIFO" "checkpoint '$work/pipe.ckpt' is a FIFO (named pipe), not a regular file" error - \
  train "${quick[@]}" --resume "$work/pipe.ckpt"
row "a FIFO described as a checkpoint" "checkpoint '$work/pipe.ckpt' is a FIFO (named pipe), not a regular file" error - \
  checkpoint "$work/pipe.ckpt"
row "checkpoint of another model" "its model is 'mlp-784-1024-1024-10'" error - \
  train --model cnn "${quick[@]}" --resume "$work/good.ckpt"
cp "$work/good.ckpt" "$work/lost.ckpt"
cp "$work/good.ckpt" "$work/lost.ckpt.rank2"
row "ZeRO checkpoint missing a rank's file" "so a rank's file of this checkpoint is missing" error - \
  train "${quick[@]}" --resume "$work/lost.ckpt"
# The test split's first 512 images as the training set: as many samples, other data.
mkdir -p "$work/other-data"
for split in train t10k; do
  ln -sf "$data/t10k-images-idx3-ubyte.gz" "$work/other-data/$split-images-idx3-ubyte.gz"
  ln -sf "$data/t10k-labels-idx1-ubyte.gz" "$work/other-data/$split-labels-idx1-ubyte.gz"
done
row "checkpoint resumed on other data of as many samples" "resume with the same --data and --train-limit" error - \
  train "${quick[@]}" --data "$work/other-data" --resume "$work/good.ckpt"
# Options that change what the training computes, given other values on resume.
row "checkpoint resumed with another --weight-decay" "use --weight-decay 0" error - \
  train "${quick[@]}" --weight-decay 0.01 --resume "$work/good.ckpt"
row "checkpoint resumed with another --precision" "its precision is fp32, this trainer's is bf16" error - \
  train "${quick[@]}" --precision bf16 --resume "$work/good.ckpt"
"$ferry" train "${quick[@]}" --optimizer sgd --checkpoint "$work/sgd.ckpt" >/dev/null 2>&1
row "SGD checkpoint resumed with another --momentum" "use --momentum 0.9" error - \
  train "${quick[@]}" --optimizer sgd --momentum 0.5 --resume "$work/sgd.ckpt"
row "SGD checkpoint resumed without momentum" "trained with --momentum 0.9, this trainer has --momentum 0" error - \
  train "${quick[@]}" --optimizer sgd --momentum 0 --resume "$work/sgd.ckpt"
"$ferry" train "${quick[@]}" --optimizer adamw8bit --checkpoint "$work/8bit.ckpt" >/dev/null 2>&1
row "8-bit checkpoint resumed with another --optimizer-block" "use --optimizer-block 2048" error - \
  train "${quick[@]}" --optimizer adamw8bit --optimizer-block 256 --resume "$work/8bit.ckpt"
# GPT checkpoints: resumed on another text of the same alphabet, and past --steps.
mkdir -p "$work/text" "$work/text2"
for i in $(seq 1 40); do echo "the quick brown fox $i jumps over the lazy dog"; done >"$work/text/a"
cat "$work/text/a" "$work/text/a" >"$work/text2/a"
gpt=(train --model gpt --width 16 --depth 1 --heads 2 --context 16 --batch 4 --eval-every 2 --quiet)
"$ferry" "${gpt[@]}" --text "$work/text" --steps 2 --checkpoint "$work/gpt.ckpt" >/dev/null 2>&1
row "GPT checkpoint resumed on another text" "resume with the same --text" error - \
  "${gpt[@]}" --text "$work/text2" --steps 4 --resume "$work/gpt.ckpt"
# As many characters of the same alphabet, in another order.
mkdir -p "$work/text3" && sed 's/quick/kciuq/' "$work/text/a" >"$work/text3/a"
row "GPT checkpoint resumed on a text of the same length and letters" "resume with the same --text" error - \
  "${gpt[@]}" --text "$work/text3" --steps 4 --resume "$work/gpt.ckpt"
row "GPT checkpoint resumed to fewer --steps than done" "give --steps 2 or more" error - \
  "${gpt[@]}" --text "$work/text" --steps 1 --resume "$work/gpt.ckpt"
row "GPT checkpoint resumed with another --dropout" "use --dropout 0" error - \
  "${gpt[@]}" --text "$work/text" --steps 4 --dropout 0.1 --resume "$work/gpt.ckpt"
mkdir -p "$work/short-text" "$work/binary-text"
echo "a few words of text, no more" >"$work/short-text/a"
row "text too short for --context" "use --context 2 or less, or give --text a folder with more text" error - \
  train --model gpt --width 16 --depth 1 --heads 2 --context 64 --batch 4 --steps 1 --quiet --text "$work/short-text"
mkdir -p "$work/no-newline" && printf 'abcab%.0s' $(seq 200) >"$work/no-newline/a"
row "--sample with no --prompt on a text without newlines" "--prompt is a newline (its default) and this text has none" \
  error - train --model gpt --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 --quiet --sample 5 \
  --text "$work/no-newline"
row "--prompt empty" "--prompt: is empty: give a value, or leave the option out" error - \
  train --model gpt --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 --quiet --sample 5 --prompt ""
mkdir -p "$work/hidden-only/sub" && echo text >"$work/hidden-only/.notes" && echo text >"$work/hidden-only/sub/a"
row "--text folder with nothing read as text" "hidden files, subfolders and special files are skipped" error - \
  train --model gpt --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 --quiet --text "$work/hidden-only"
head -c 4096 /dev/urandom >"$work/binary-text/blob.bin"
row "--text folder holding a binary file" "looks binary, not text" error - \
  train --model gpt --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 --quiet --text "$work/binary-text"
mkdir -p "$work/gzip-text" && gzip -c "$work/text/a" >"$work/gzip-text/a.gz"
row "--text folder holding a gzip-compressed file" "is gzip-compressed: gunzip it" error - \
  train --model gpt --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 --quiet --text "$work/gzip-text"
mkdir -p "$work/one-char-text"
head -c 4096 /dev/zero | tr '\0' z >"$work/one-char-text/a"
row "--text folder holding one character repeated" "it holds a single distinct character ('z', 4096 times)" error - \
  train --model gpt --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 --quiet --text "$work/one-char-text"
# A sparse file: its size says it would not fit in memory as 4-byte token ids, and no byte is read.
mkdir -p "$work/huge-text" && echo "some text" >"$work/huge-text/a"
truncate -s "$(($(getconf _PHYS_PAGES) * $(getconf PAGESIZE) / 3))" "$work/huge-text/b"
row "--text folder larger than memory as token ids" "as token ids (4 bytes a character), more than this machine's" \
  error - train --model gpt --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 --quiet \
  --text "$work/huge-text"
row "GPT head dimension past the fused attention's limit" "is past the fused kernels' limit of 128" error - \
  train --model gpt --width 512 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 --quiet --text "$work/text"
row "GPT --accumulate over the run's steps" "it would train nothing" error - \
  train --model gpt --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 3 --accumulate 4 --quiet \
  --text "$work/text"
row "GPT --prompt with a character the text lacks (before training)" "--prompt: character 0" error - \
  train --model gpt --width 16 --depth 1 --heads 2 --context 16 --batch 4 --steps 1 --sample 5 --prompt "~~{}" \
  --quiet --text "$work/text"
# A cache of its own, filled by the same command, so the damaged entry is one the run loads (the
# shared test cache holds entries of other tests, which other tests may rewrite meanwhile).
rm -rf "$work/own-cache"
FERRY_CACHE_DIR="$work/own-cache" "$ferry" train "${quick[@]}" >/dev/null 2>&1
entry=$(find "$work/own-cache" -type f -name '*.bin' | head -1)
if [ -n "$entry" ]; then
  printf '\x00\x00\x00\x00' | dd of="$entry" bs=1 seek=100 conv=notrunc status=none
fi
row "corrupt program cache entry (a warning; rebuilt)" "is invalid" warning "FERRY_CACHE_DIR=$work/own-cache" \
  train "${quick[@]}"
# An entry that is a folder: that entry alone is given up, the cache stays on for the others.
if [ -n "$entry" ]; then
  rm -f "$entry" && mkdir "$entry"
fi
row "program cache entry that is a folder (a warning; runs)" "is a folder, not a file, so its program is built" \
  warning "FERRY_CACHE_DIR=$work/own-cache" train "${quick[@]}"

# Output paths: refused before any work, and what they name is left as it was.
cp -r "$data" "$work/data-copy"
printf 'my notes\n' >"$work/notes.txt"
ln -sf "$work/notes.txt" "$work/link.ckpt"
row "--checkpoint onto a device node" "it is a character device" error - train "${quick[@]}" --checkpoint /dev/null
row "--checkpoint onto a file ferry did not write" "is not a checkpoint ferry wrote" error - \
  train "${quick[@]}" --checkpoint "$work/notes.txt"
row "--checkpoint onto a data file, even with --force" "is a file of the data set" error - \
  train "${quick[@]}" --data "$work/data-copy" --force --checkpoint "$work/data-copy/train-labels-idx1-ubyte.gz"
row "--checkpoint onto a symbolic link" "it is a symbolic link" error - train "${quick[@]}" --checkpoint "$work/link.ckpt"
row "two outputs with one path" "--checkpoint and --trace name the same file" error - \
  train "${quick[@]}" --checkpoint "$work/run.out" --trace "$work/run.out"
row "--profile onto the --resume file" "holds a ferry checkpoint" error - \
  train "${quick[@]}" --resume "$work/good.ckpt" --profile "$work/good.ckpt"
survived=1
[ -c /dev/null ] || survived=0
[ "$(cat "$work/notes.txt")" = "my notes" ] || survived=0
[ -L "$work/link.ckpt" ] || survived=0
cmp -s "$data/train-labels-idx1-ubyte.gz" "$work/data-copy/train-labels-idx1-ubyte.gz" || survived=0
if [ -z "$markdown" ]; then
  if [ "$survived" = 1 ]; then
    echo "ok: /dev/null, the notes, the link and the data file are unchanged"
  else
    echo "FAILED: an output check let a file be replaced"
    failures=$((failures + 1))
  fi
fi

# A side output that cannot be written (a file size limit: writes fail with EFBIG, as on a full
# disk): a warning with the reason, the previous trace kept whole, the results and JSON printed,
# and exit status 3 (results printed, a side output lost).
printf '{"traceEvents":[\n]}\n' >"$work/old-trace.json"
cp "$work/old-trace.json" "$work/old-trace.copy"
out=$(bash -c 'ulimit -f 4; trap "" XFSZ; exec "$@"' - "$ferry" train "${quick[@]}" --trace "$work/old-trace.json" --json \
  2>"$work/full.err")
status=$?
if [ -z "$markdown" ]; then
  if [ "$status" = 3 ] && grep -q '"test_accuracy"' <<<"$out" && grep -q '"output_errors":\["trace file' <<<"$out" &&
    grep -q "warning: trace file '$work/old-trace.json': writing failed: File too large" "$work/full.err" &&
    cmp -s "$work/old-trace.json" "$work/old-trace.copy"; then
    echo "ok: a trace that cannot be written is a warning; the old trace and the results survive"
  else
    echo "FAILED: trace on a full disk (exit $status):"
    tail -3 "$work/full.err"
    head -c 300 <<<"$out"
    failures=$((failures + 1))
  fi
else
  printf '| trace that cannot be written (file size limit, as a full disk) | `ulimit -f 4; trap "" XFSZ; ferry train %s --trace $WORK/old-trace.json --json` | 3 | %s | `writing failed` |\n' \
    "${quick[*]}" "$(grep -m1 warning "$work/full.err" | sed "s|$work|\$WORK|g")"
fi

# Results printed to a standard output that cannot take them (a full disk; closed): an error and
# a non-zero exit, never a silent exit 0.
for where in full closed; do
  if [ $where = full ]; then
    out=$("$ferry" plan --model mlp --json 2>&1 >/dev/full)
  else
    out=$("$ferry" plan --model mlp --json 2>&1 >&-)
  fi
  status=$?
  needle="standard output"
  if [ -n "$markdown" ]; then
    printf '| results printed to a %s standard output | `ferry plan --model mlp --json %s` | %s | %s | `%s` |\n' \
      "$([ $where = full ] && echo full || echo closed)" "$([ $where = full ] && echo '>/dev/full' || echo '>&-')" \
      "$status" "$(grep -m1 "$needle" <<<"$out")" "$needle"
  elif [ "$status" -ne 0 ] && grep -q "ferry: error: .*$needle" <<<"$out"; then
    echo "ok: results lost on a $where standard output are an error"
  else
    echo "FAILED: results printed to a $where standard output (exit $status): $out"
    failures=$((failures + 1))
  fi
done

# Training that diverges.
row "learning rate 1e37 (the loss turns NaN)" "training diverged at optimizer update 2" error - \
  train --optimizer sgd --momentum 0 --lr 1e37 "${quick[@]}"

[ -n "$markdown" ] && exit 0
echo "$failures failed"
[ "$failures" -eq 0 ]
