// The stop signals of a first-use tuning search (ops/gemm_tuning.cpp, ops/attention_tuner.cpp).
// Private to the library (ops/; the training loop names the signals by it too).
#pragma once

#include <csignal>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>

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

// Runs `search(options)`, a first-use tuner's search, under TuneStopSignals where `install`
// (OpEnv::tune_stop_signals): a signal ends it after the candidate being timed, as a spent budget
// does. Returns the search's result and the signal that stopped it (0 where none came); where one
// came and `progress_open`, the progress line is ended. `family` ("GEMM") and `cached_best` ("row
// is") word the acknowledgement.
template <class Options, class Search>
auto search_until_signal(bool install, bool progress_open, const std::string& family, const std::string& cached_best,
                         Options& options, Search&& search) {
  std::optional<TuneStopSignals> signals;
  if (install) {
    signals.emplace("the " + family + " tuning stops after the candidate being timed, keeps its best so far where no " +
                    "more complete search's " + cached_best + " cached, and the run ends; a second signal stops at " +
                    "once, saving nothing");
    options.stop = [] { return TuneStopSignals::received() != 0; };
  }
  auto result = search(options);
  const int signal = signals ? TuneStopSignals::received() : 0;  // read while the handlers are ours
  if (signal != 0 && progress_open) std::fputc('\n', stderr);
  return std::pair{std::move(result), signal};
}

}  // namespace ferry::ops
