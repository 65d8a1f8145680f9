// The stop signals of a first-use tuning search (ops/tune_signals.hpp).
#include "tune_signals.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>

namespace ferry::ops {
namespace {

constexpr int stop_signals[3] = {SIGINT, SIGTERM, SIGHUP};

volatile std::sig_atomic_t received_signal = 0;
std::atomic<int> depth{0};  // TuneStopSignals alive
char acknowledgement_text[512];
std::size_t acknowledgement_size = 0;

extern "C" void record_tune_stop(int sig) {
  received_signal = sig;
  const int saved = errno;  // write() may change it under the interrupted code
  const char* name = TuneStopSignals::name(sig);
  std::size_t length = 0;
  while (name[length]) ++length;
  // "\n<name> received: <acknowledgement>": from a line of its own, a progress line may be open.
  [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, "\nferry: ", 8);
  n = ::write(STDERR_FILENO, name, length);
  n = ::write(STDERR_FILENO, " received: ", 11);
  n = ::write(STDERR_FILENO, acknowledgement_text, acknowledgement_size);
  errno = saved;
}

}  // namespace

TuneStopSignals::TuneStopSignals(const std::string& acknowledgement) {
  const bool outermost = depth++ == 0;
  if (outermost) {
    received_signal = 0;
    const std::string text = acknowledgement + "\n";
    acknowledgement_size = std::min(text.size(), sizeof acknowledgement_text);
    std::copy_n(text.data(), acknowledgement_size, acknowledgement_text);
  }
  for (std::size_t i = 0; i < 3; ++i) {
    struct sigaction now {};
    if (sigaction(stop_signals[i], nullptr, &now) != 0) continue;
    // Whatever handles it now is replaced while the search runs, as the training loop's StopSignals
    // replaces it: the default action, an ignored signal (a script's `ferry train &` ignores
    // SIGINT) and a driver's own handler (PoCL's LLVM installs one for SIGINT, SIGTERM and SIGHUP
    // that ends the process) alike. An outer search's (ours) is shared as it is.
    if (!(now.sa_flags & SA_SIGINFO) && now.sa_handler == record_tune_stop) continue;
    struct sigaction sa {};
    sa.sa_handler = record_tune_stop;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_RESETHAND;  // a second signal: the default action, at once
    installed_[i] = sigaction(stop_signals[i], &sa, &old_[i]) == 0;
  }
}

TuneStopSignals::~TuneStopSignals() {
  for (std::size_t i = 0; i < 3; ++i) {
    if (installed_[i]) sigaction(stop_signals[i], &old_[i], nullptr);
  }
  --depth;
}

int TuneStopSignals::received() noexcept {
  return received_signal;
}

const char* TuneStopSignals::name(int signal) noexcept {
  switch (signal) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    default:
      return "a signal";
  }
}

}  // namespace ferry::ops
