#!/usr/bin/env bash
# ThreadSanitizer run of the test suite: builds ferry with -fsanitize=thread into build/tsan and
# runs ctest there (all but the `oclgrind` label and the package test). Not part of CI: with the
# oneTBB build below it takes longer than CI's budget on two cores.
#
#   tests/sanitizers/tsan.sh [ctest options]                          # e.g. -R 'residency|graph'
#   TBB_TSAN_DIR=/opt/onetbb-tsan tests/sanitizers/tsan.sh [ctest options]
#   FERRY_TSAN_TARGETS='ferry-cli test_residency' tests/sanitizers/tsan.sh -R '^test_residency$'
#
# FERRY_TSAN_TARGETS (optional, space-separated) builds only those targets instead of everything;
# pair it with a ctest -R that selects only tests whose binaries it names (a test whose binary
# was not built fails as "Not Run"). Unset, the whole tree is built, as the full suite needs.
#
# It needs a oneTBB built with ThreadSanitizer: TSan only understands synchronisation it sees,
# and Debian's libtbb is not instrumented, so its task scheduler's hand-offs (the flow graph's
# queues, async_node's gateway, the arena's task stealing) look like unsynchronised accesses
# and drown any real report. Without TBB_TSAN_DIR the script builds one once into
# build/onetbb-tsan from Debian's own source package of the oneTBB it links (`apt-get source
# onetbb`, which needs a `deb-src` entry in the apt sources; the script says so when it is
# missing), with -DTBB_SANITIZE=thread. The OpenCL driver (PoCL) and the ICD loader are not
# instrumented either: tests/sanitizers/tsan.supp is for reports inside them only, and says why
# it lists none yet.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
root=$PWD
tbb=${TBB_TSAN_DIR:-}
if [[ -z $tbb ]]; then
  tbb=$root/build/onetbb-tsan/install
  if [[ ! -f $tbb/lib/cmake/TBB/TBBConfig.cmake ]]; then
    version=$(dpkg-query -W -f='${Version}' libtbb-dev 2>/dev/null || true)
    [[ -n $version ]] || { echo "tsan: libtbb-dev is not installed" >&2; exit 2; }
    src=$root/build/onetbb-tsan/src
    rm -rf "$root/build/onetbb-tsan" && mkdir -p "$src"
    echo "tsan: fetching Debian's source of onetbb ${version}"
    if ! (cd "$src" && apt-get source -qq "onetbb=${version}" >/dev/null); then
      echo "tsan: 'apt-get source onetbb' failed: add a deb-src line for Debian's main archive to the apt" >&2
      echo "      sources (e.g. a copy of /etc/apt/sources.list.d/debian.sources with 'Types: deb-src')," >&2
      echo "      run apt-get update, or set TBB_TSAN_DIR to a oneTBB built with -DTBB_SANITIZE=thread" >&2
      exit 2
    fi
    tree=$(find "$src" -mindepth 1 -maxdepth 1 -type d | head -1)
    echo "tsan: building oneTBB with -DTBB_SANITIZE=thread (a few minutes, once)"
    # TBB_STRICT=OFF: oneTBB builds with -Werror, and GCC 12 warns (-Wtsan) that TSan does not
    # model atomic_thread_fence (concurrent_monitor.h, arena.cpp), which stopped the build.
    cmake -S "$tree" -B "$root/build/onetbb-tsan/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DTBB_SANITIZE=thread -DTBB_STRICT=OFF -DTBB_TEST=OFF -DTBB_EXAMPLES=OFF -DTBBMALLOC_BUILD=OFF \
      -DCMAKE_INSTALL_PREFIX="$tbb" >/dev/null
    cmake --build "$root/build/onetbb-tsan/build"
    cmake --install "$root/build/onetbb-tsan/build" >/dev/null
  fi
fi
if [[ ! -d $tbb ]]; then
  echo "tsan: TBB_TSAN_DIR=$tbb is not a folder" >&2
  exit 2
fi
flags="-fsanitize=thread -fno-omit-frame-pointer -g"
cmake -S . -B build/tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFERRY_BUILD_BENCH=OFF \
  -DCMAKE_PREFIX_PATH="$tbb" -DTBB_DIR="$tbb/lib/cmake/TBB" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" -DCMAKE_BUILD_RPATH="$tbb/lib"
targets=()
for t in ${FERRY_TSAN_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build build/tsan "${targets[@]}"
TSAN_OPTIONS="suppressions=$PWD/tests/sanitizers/tsan.supp:halt_on_error=1:second_deadlock_stack=1" \
  LD_LIBRARY_PATH="$tbb/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  ctest --test-dir build/tsan --output-on-failure -LE oclgrind -E package "$@"
