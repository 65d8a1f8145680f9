#!/usr/bin/env bash
# Package test (CTest: package_install_and_example). Installs a built ferry tree into a temporary
# prefix and uses it the way a user would:
#   1. cmake --install <build dir> --prefix <work>/prefix; the installed programs run
#   2. every installed public header compiles on its own against ferry::ferry
#   3. examples/ configures out of tree with -DCMAKE_PREFIX_PATH=<prefix> (find_package(ferry CONFIG
#      REQUIRED) must find the installed package, not another one), builds, and train_mlp trains one
#      epoch on a slice of Fashion-MNIST and prints its test accuracy; custom_op registers its own
#      op (SiLU) from outside ferry's tree, trains a regression model with it and checks its
#      predictions against a CPU forward pass (it exits non-zero otherwise); stream_gpt trains a
#      GPT on the fortunes text with five times more training state than its device budget
#      (streamed from host memory, the optimizer on the host) and must learn.
#
#   run.sh --build-dir DIR --source-dir DIR --work-dir DIR [--cmake PATH] [--generator NAME] [--cxx PATH]
#          [--cxx-flags FLAGS] [--exe-linker-flags FLAGS]
#
# The flags are the build tree's own CMAKE_CXX_FLAGS and CMAKE_EXE_LINKER_FLAGS: a sanitized ferry
# (the asan preset) needs the sanitizer in every program that links it, as a user's would.
set -Eeuo pipefail

build_dir="" source_dir="" work_dir="" cmake_bin=cmake generator="" cxx="" cxx_flags="" exe_linker_flags=""
while (($#)); do
  case "$1" in
    --build-dir) build_dir=$2 ;;
    --source-dir) source_dir=$2 ;;
    --work-dir) work_dir=$2 ;;
    --cmake) cmake_bin=$2 ;;
    --generator) generator=$2 ;;
    --cxx) cxx=$2 ;;
    --cxx-flags) cxx_flags=$2 ;;
    --exe-linker-flags) exe_linker_flags=$2 ;;
    *)
      echo "package test: unknown argument $1" >&2
      exit 2
      ;;
  esac
  shift 2
done
[[ -n $build_dir && -n $source_dir && -n $work_dir ]] || {
  echo "usage: run.sh --build-dir DIR --source-dir DIR --work-dir DIR [--cmake PATH] [--generator NAME] [--cxx PATH]" >&2
  exit 2
}

step="starting"
trap 'echo "package test: FAILED while ${step}" >&2' ERR
say() { printf 'package test: %s\n' "$*"; }
fail() {
  printf 'package test: FAILED: %s\n' "$*" >&2
  exit 1
}
start=$SECONDS

prefix=$work_dir/prefix
rm -rf "$work_dir"
mkdir -p "$work_dir"
# A consumer needs only the OpenCL development package besides ferry's own: find_package of
# ferry's private dependencies is disabled in every consumer project below.
configure_args=(-DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$prefix"
  -DCMAKE_DISABLE_FIND_PACKAGE_TBB=ON -DCMAKE_DISABLE_FIND_PACKAGE_fmt=ON -DCMAKE_DISABLE_FIND_PACKAGE_ZLIB=ON
  -DCMAKE_DISABLE_FIND_PACKAGE_PkgConfig=ON -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON
  -DCMAKE_DISABLE_FIND_PACKAGE_CLI11=ON)
[[ -n $generator ]] && configure_args+=(-G "$generator")
[[ -n $cxx ]] && configure_args+=("-DCMAKE_CXX_COMPILER=$cxx")
[[ -n $cxx_flags ]] && configure_args+=("-DCMAKE_CXX_FLAGS=$cxx_flags")
[[ -n $exe_linker_flags ]] && configure_args+=("-DCMAKE_EXE_LINKER_FLAGS=$exe_linker_flags")

# 1. Install.
step="installing $build_dir into $prefix"
say "$step"
"$cmake_bin" --install "$build_dir" --prefix "$prefix" >"$work_dir/install.log"
config=$(find "$prefix" -path '*/cmake/ferry/ferryConfig.cmake' | head -n1)
[[ -n $config ]] || fail "no ferryConfig.cmake under $prefix"
config_dir=$(dirname "$config")
[[ -f $config_dir/ferryConfigVersion.cmake ]] || fail "no ferryConfigVersion.cmake in $config_dir"
[[ -f $prefix/include/ferry/ferry.hpp ]] || fail "ferry/ferry.hpp was not installed"
ls "$prefix"/lib*/libferry.so* >/dev/null 2>&1 || fail "libferry.so was not installed"
# The installed package must not point back into the source or build tree.
if grep -rlF -e "$source_dir" -e "$build_dir" "$config_dir" >/dev/null; then
  fail "the installed CMake package refers to the source or build tree: $(grep -rlF -e "$source_dir" -e "$build_dir" "$config_dir" | tr '\n' ' ')"
fi

# The exported target's link interface names only OpenCL: no oneTBB, fmt, zlib, hwloc or zstd
# (private to libferry.so), and no public header includes them.
if grep -nE 'TBB|fmt::|ZLIB|HWLOC|ZSTD|hwloc|zstd' "$config_dir"/ferryTargets*.cmake; then
  fail "the exported ferry::ferry target names a private dependency (above) in its interface"
fi
if grep -rnE '#include *[<"](fmt|tbb|oneapi|nlohmann|CLI|zstd|hwloc|zlib)' "$prefix/include/ferry"; then
  fail "an installed public header includes a private dependency (above)"
fi
say "ferry::ferry's link interface is OpenCL only"

# The installed programs must find the installed library (no build-tree RPATH survives install).
step="running the installed programs"
if [[ -x $prefix/bin/ferry ]]; then
  "$prefix/bin/ferry" devices >"$work_dir/ferry-devices.log" || fail "installed 'ferry devices' failed: $(cat "$work_dir/ferry-devices.log")"
  say "installed 'ferry devices' runs"
fi
if [[ -x $prefix/bin/ferry-bench ]]; then
  "$prefix/bin/ferry-bench" >"$work_dir/ferry-bench.log" || fail "installed 'ferry-bench' failed"
  "$prefix/bin/ferry-bench" --version >>"$work_dir/ferry-bench.log" || fail "installed 'ferry-bench --version' failed"
  say "installed 'ferry-bench' runs"
  # Its PyTorch peers are installed beside it and found there, not in the source tree.
  [[ -f $prefix/share/ferry/peers/torch_step.py ]] || fail "the peer script was not installed in share/ferry/peers"
  "$prefix/bin/ferry-bench" step --help >"$work_dir/ferry-bench-step.log" 2>&1 || true
  grep -qF "$(realpath "$prefix")/share/ferry/peers/torch_step.py" "$work_dir/ferry-bench-step.log" ||
    fail "installed 'ferry-bench step' does not default to its installed peer script: $(grep -i peer "$work_dir/ferry-bench-step.log")"
fi

# 2. Every installed header compiles on its own (includes what it uses, nothing uninstalled).
step="compiling each installed header on its own"
say "$step"
headers_project=$work_dir/headers
mkdir -p "$headers_project/src"
sources=()
while IFS= read -r header; do
  rel=${header#"$prefix/include/"}
  src=$headers_project/src/$(echo "$rel" | tr '/.' '__').cpp
  printf '#include <%s>\n#include <%s>\n' "$rel" "$rel" >"$src"
  sources+=("$src")
done < <(find "$prefix/include/ferry" -name '*.hpp' | sort)
((${#sources[@]} > 0)) || fail "no headers under $prefix/include/ferry"
# The README's example, as a user compiles it, with the same warnings.
readme_example=$headers_project/src/readme_example.cpp
awk '/^## Using the library/ {inside = 1} inside && /^```cpp/ {copy = 1; next} copy && /^```/ {exit} copy' \
  "$source_dir/README.md" >"$readme_example"
grep -q 'int main' "$readme_example" || fail "README.md's 'Using the library' has no C++ example with a main()"
sources+=("$readme_example")
{
  echo 'cmake_minimum_required(VERSION 3.25)'
  echo 'project(ferry_header_check LANGUAGES CXX)'
  # No CMAKE_CXX_STANDARD here: ferry::ferry itself must ask for C++20.
  echo 'find_package(ferry CONFIG REQUIRED)'
  echo 'add_library(ferry_header_check OBJECT'
  printf '  %s\n' "${sources[@]}"
  echo ')'
  echo 'target_compile_options(ferry_header_check PRIVATE -Wall -Wextra -Wpedantic -Werror)'
  echo 'target_link_libraries(ferry_header_check PRIVATE ferry::ferry)'
} >"$headers_project/CMakeLists.txt"
"$cmake_bin" -S "$headers_project" -B "$headers_project/build" "${configure_args[@]}" >"$work_dir/headers-configure.log" ||
  {
    cat "$work_dir/headers-configure.log" >&2
    false
  }
"$cmake_bin" --build "$headers_project/build" -j2 >"$work_dir/headers-build.log" 2>&1 || {
  cat "$work_dir/headers-build.log" >&2
  false
}
say "$((${#sources[@]} - 1)) headers compile on their own, and README.md's example with them"

# 3. The examples, as a user's project.
step="configuring examples/ against $prefix"
say "$step"
examples_build=$work_dir/examples
# -Werror as many users' projects build: a public struct designated-initialised in part must not warn.
"$cmake_bin" -S "$source_dir/examples" -B "$examples_build" "${configure_args[@]}" "-DCMAKE_CXX_FLAGS=${cxx_flags:+$cxx_flags }-Werror" \
  >"$work_dir/examples-configure.log" ||
  {
    cat "$work_dir/examples-configure.log" >&2
    false
  }
found_dir=$(sed -n 's/^ferry_DIR:PATH=//p' "$examples_build/CMakeCache.txt")
[[ $(realpath "$found_dir") == $(realpath "$config_dir") ]] ||
  fail "find_package(ferry) found $found_dir, not the package just installed in $config_dir"
say "find_package(ferry CONFIG REQUIRED) found $found_dir"

step="building examples/"
say "$step"
"$cmake_bin" --build "$examples_build" -j2 >"$work_dir/examples-build.log" 2>&1 || {
  cat "$work_dir/examples-build.log" >&2
  false
}
# The example must run from the installed library, not the build tree's.
if command -v ldd >/dev/null; then
  lib=$(ldd "$examples_build/train_mlp" | awk '/libferry\.so/ {print $3}')
  [[ $(realpath "$lib") == "$(realpath "$prefix")"/* ]] || fail "train_mlp loads libferry from $lib, not from $prefix"
fi

# A bad option stops each example before it touches a device: exit status 2, the option named.
step="giving the examples bad options"
for bad in "train_mlp --epochs 0" "train_mlp --lr 1e-3x" "stream_gpt --width" "stream_gpt --depth=-3" \
  "custom_op --steps abc" "custom_op --colour blue"; do
  read -r _ flag _ <<<"$bad"
  status=0
  # shellcheck disable=SC2086 # the case is split into the program and its options on purpose
  "$examples_build"/$bad >"$work_dir/bad.out" 2>"$work_dir/bad.err" || status=$?
  [[ $status == 2 ]] || fail "'$bad' exited $status, not 2"
  head -1 "$work_dir/bad.err" | grep -q -- "${flag%%=*}" ||
    fail "'$bad' did not name ${flag%%=*} first: $(head -2 "$work_dir/bad.err")"
  grep -q '^usage: ' "$work_dir/bad.err" || fail "'$bad' printed no usage"
done

step="running train_mlp"
say "running: train_mlp --epochs 1 --train-limit 2048"
"$examples_build/train_mlp" --epochs 1 --train-limit 2048 | tee "$work_dir/train_mlp.log"
accuracy=$(sed -n 's/^test accuracy \([0-9.]*\).*/\1/p' "$work_dir/train_mlp.log")
[[ -n $accuracy ]] || fail "train_mlp printed no 'test accuracy' line"
# One epoch on 2048 samples lands near 0.75; 0.5 tells training apart from chance (0.1).
awk -v a="$accuracy" 'BEGIN { exit !(a > 0.5) }' || fail "test accuracy $accuracy is not above 0.5: the example did not learn"


# A user's op from outside ferry's tree: registered, trained, checked against its CPU reference.
step="running custom_op"
say "running: custom_op"
"$examples_build/custom_op" | tee "$work_dir/custom_op.log"
grep -q '^predictions: ' "$work_dir/custom_op.log" || fail "custom_op printed no 'predictions' line"

# A GPT whose training state is about five times its device budget: weights and optimizer state
# streamed from host memory, updates on the host. It plans first, keeps to the plan, and learns:
# the held-out loss after 20 steps is well below a uniform guess over its ~100 characters (4.6).
step="running stream_gpt"
say "running: stream_gpt --steps 20"
"$examples_build/stream_gpt" --steps 20 2>"$work_dir/stream_gpt.err" | tee "$work_dir/stream_gpt.log" ||
  fail "stream_gpt failed: $(tail -3 "$work_dir/stream_gpt.err")"
state=$(sed -n 's/.*training state \([0-9.]*\) MiB.*/\1/p' "$work_dir/stream_gpt.log")
peak=$(sed -n 's/.*training state .*device peak \([0-9.]*\) MiB.*/\1/p' "$work_dir/stream_gpt.log")
held_out=$(sed -n 's/^step 20\/20: .*held-out loss \([0-9.]*\).*/\1/p' "$work_dir/stream_gpt.log")
[[ -n $state && -n $peak && -n $held_out ]] || fail "stream_gpt printed no state, peak or held-out loss"
awk -v s="$state" -v p="$peak" 'BEGIN { exit !(p * 4 < s) }' ||
  fail "stream_gpt's device peak $peak MiB is not under a quarter of its $state MiB of training state"
awk -v l="$held_out" 'BEGIN { exit !(l < 4.0) }' || fail "stream_gpt's held-out loss $held_out: it did not learn"

say "passed in $((SECONDS - start)) s (test accuracy $accuracy; custom_op trained and matched its reference;" \
  "stream_gpt: $state MiB of state under a $peak MiB device peak, held-out loss $held_out)"
