// The stop signals of a first-use tuning search (ops/gemm_tuning.cpp, ops/attention_tuner.cpp).
// Private to the library (ops/; the training loop names the signals by it too).
#pragma once

#include <csignal>
#include <string>

namespace ferry::ops {

// While one lives, SIGINT, SIGTERM and SIGHUP are recorded instead of taking their default action
// (which ended the process at once, the search lost, its progress line unended and nothing said)
// or their handler's (PoCL's LLVM has one that ends the process too; whatever handles them is
// replaced, as the training loop's StopSignals replaces it), and `acknowledgement` is written to
// stderr the moment one arrives; a second signal takes the default action at once (SA_RESETHAND).
// Where the handler is an outer TuneStopSignals' (the attention's search settles the GEMM's row
// first), the inner one shares it. The previous handlers come back with the object.
class TuneStopSignals {
 public:
  explicit TuneStopSignals(const std::string& acknowledgement);
  ~TuneStopSignals();
  TuneStopSignals(const TuneStopSignals&) = delete;
  TuneStopSignals& operator=(const TuneStopSignals&) = delete;
  // The signal recorded since the outermost TuneStopSignals alive was made, or 0.
  static int received() noexcept;
  // "SIGINT", "SIGTERM", "SIGHUP" (another: "a signal").
  static const char* name(int signal) noexcept;

 private:
  struct sigaction old_[3]{};
  bool installed_[3] = {};
};

}  // namespace ferry::ops
