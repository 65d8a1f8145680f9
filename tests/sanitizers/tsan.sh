#!/usr/bin/env bash
# ThreadSanitizer run of the test suite: builds ferry with -fsanitize=thread into build/tsan and
# runs ctest there. Not part of CI.
#
#   TBB_TSAN_DIR=/opt/onetbb-tsan tests/sanitizers/tsan.sh [ctest options]
#
# It needs a oneTBB built with ThreadSanitizer: TSan only understands synchronisation it sees,
# and Debian's libtbb is not instrumented, so its task scheduler's hand-offs (the flow graph's
# queues, async_node's gateway, the arena's task stealing) look like unsynchronised accesses
# and drown any real report. Build one once (minutes; not in CI) from the oneTBB sources:
#
#   git clone --branch v2021.8.0 https://github.com/uxlfoundation/oneTBB
#   cmake -S oneTBB -B onetbb-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
#         -DTBB_SANITIZE=thread -DTBB_TEST=OFF -DCMAKE_INSTALL_PREFIX=/opt/onetbb-tsan
#   cmake --build onetbb-tsan && cmake --install onetbb-tsan
#
# and point TBB_TSAN_DIR at the prefix. The OpenCL driver (PoCL) is not instrumented either:
# tests/sanitizers/tsan.supp names the races inside it that TSan reports on its worker threads.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
tbb=${TBB_TSAN_DIR:-}
if [[ -z $tbb || ! -d $tbb ]]; then
  echo "tsan: set TBB_TSAN_DIR to a oneTBB installed with -DTBB_SANITIZE=thread (see the top of $0)" >&2
  exit 2
fi
flags="-fsanitize=thread -fno-omit-frame-pointer -g"
cmake -S . -B build/tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFERRY_BUILD_BENCH=OFF \
  -DCMAKE_PREFIX_PATH="$tbb" -DTBB_DIR="$tbb/lib/cmake/TBB" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" -DCMAKE_BUILD_RPATH="$tbb/lib"
cmake --build build/tsan
TSAN_OPTIONS="suppressions=$PWD/tests/sanitizers/tsan.supp:halt_on_error=1:second_deadlock_stack=1" \
  LD_LIBRARY_PATH="$tbb/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  ctest --test-dir build/tsan --output-on-failure -LE oclgrind -E package "$@"
