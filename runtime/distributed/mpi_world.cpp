// ops::Communicator over Open MPI (built when CMake finds MPI). MPI is initialised with thread
// level multiple on first use: a step's collectives are started on TBB workers and tested by the
// step's request poller while the trainer reduces its loss on the calling thread, each on its own
// communicator.
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/runtime/distributed.hpp"

namespace ferry {
namespace {

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  throw std::runtime_error(fmt::format("{} failed: {}", what, std::string(text, static_cast<std::size_t>(length))));
}

// Finalises MPI at exit, after the last communicator of static storage is gone.
struct MpiSession {
  MpiSession() {
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (initialised) return;  // the embedding program did it
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    owned = true;
    if (provided < MPI_THREAD_MULTIPLE) {
      throw std::runtime_error(fmt::format(
          "this MPI library gives thread level {} where ferry needs MPI_THREAD_MULTIPLE ({}): gradient reductions run "
          "on worker threads; use an MPI built with thread support (Debian's Open MPI is)",
          provided, MPI_THREAD_MULTIPLE));
    }
  }
  ~MpiSession() {
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (owned && !finalised) MPI_Finalize();
  }
  bool owned = false;
};

std::string library_name() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(text, &length);
  std::string s(text, static_cast<std::size_t>(length));
  // "Open MPI v4.1.4, package: ...": the part before the first comma or line end.
  s = s.substr(0, s.find_first_of(",\n"));
  return s;
}

// The MPI requests of one bucket's collectives, and the count arrays MPI reads until they
// complete. A request that was started is waited for when destroyed: MPI forbids freeing a
// non-blocking collective's request, and the other ranks are in the collective too.
class MpiRequest final : public ops::CommRequest {
 public:
  explicit MpiRequest(const char* what) : what_(what) {}
  ~MpiRequest() override {
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (!done_ && !requests_.empty() && !finalised) {
      MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
    }
  }
  MPI_Request* add() {
    requests_.push_back(MPI_REQUEST_NULL);
    return &requests_.back();
  }
  // Called every few microseconds while the collective runs: allocates nothing unless it failed.
  bool test() override {
    if (done_) return true;
    int flag = 0;
    const int rc = MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) {
      done_ = true;  // failed requests are not waited for again
      check(rc, fmt::format("MPI_Testall of {}", what_).c_str());
    }
    done_ = flag != 0;
    return done_;
  }
  std::vector<ops::ScatterBuffer> scatters;
  std::vector<ops::GatherBuffer> gathers;
  float none = 0.0f;

 private:
  const char* what_;
  std::vector<MPI_Request> requests_;
  bool done_ = false;
};

class MpiCommunicator final : public ops::Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  ~MpiCommunicator() override {
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (owned_ && !finalised) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return library_name(); }

  // The blocking collectives are the non-blocking ones waited for on this thread.
  void allreduce_sum(std::span<const std::span<float>> buffers) override {
    ops::wait(*start_allreduce_sum({buffers.begin(), buffers.end()}));
  }
  void reduce_scatter_sum(std::span<const ops::ScatterBuffer> buffers) override {
    ops::wait(*start_reduce_scatter_sum({buffers.begin(), buffers.end()}));
  }
  void allgather(std::span<ops::GatherBuffer> buffers) override {
    ops::wait(*start_allgather({buffers.begin(), buffers.end()}));
  }

  std::unique_ptr<ops::CommRequest> start_allreduce_sum(std::vector<std::span<float>> buffers) override {
    auto r = std::make_unique<MpiRequest>("MPI_Iallreduce of a gradient bucket");
    for (const std::span<float>& b : buffers) {
      // MPI counts are ints: a buffer over 2^31 - 1 elements goes in pieces.
      for (std::size_t at = 0; at < b.size(); at += INT_MAX) {
        const int count = static_cast<int>(std::min<std::size_t>(b.size() - at, INT_MAX));
        check(MPI_Iallreduce(MPI_IN_PLACE, b.data() + at, count, MPI_FLOAT, MPI_SUM, comm_, r->add()),
              "MPI_Iallreduce of a gradient bucket");
      }
    }
    return r;
  }
  std::unique_ptr<ops::CommRequest> start_reduce_scatter_sum(std::vector<ops::ScatterBuffer> buffers) override {
    for (const ops::ScatterBuffer& b : buffers) {
      if (b.data.size() > static_cast<std::size_t>(INT_MAX)) {
        throw std::invalid_argument(
            fmt::format("a reduce-scatter of {} elements: MPI counts are ints, at most {} elements a tensor",
                        b.data.size(), INT_MAX));
      }
    }
    auto r = std::make_unique<MpiRequest>("MPI_Ireduce_scatter of a gradient bucket");
    r->scatters = std::move(buffers);  // MPI reads the counts until the collective completes
    for (const ops::ScatterBuffer& b : r->scatters) {
      // A rank with no run of this tensor still gives its part of the sum; it receives nothing, into a
      // valid address.
      check(MPI_Ireduce_scatter(b.data.data(), b.shard.empty() ? &r->none : b.shard.data(), b.counts.data(), MPI_FLOAT,
                                MPI_SUM, comm_, r->add()),
            "MPI_Ireduce_scatter of a gradient bucket");
    }
    return r;
  }
  std::unique_ptr<ops::CommRequest> start_allgather(std::vector<ops::GatherBuffer> buffers) override {
    for (const ops::GatherBuffer& b : buffers) {
      if (b.data.size() > static_cast<std::size_t>(INT_MAX)) {
        throw std::invalid_argument(fmt::format(
            "an all-gather of {} elements: MPI counts are ints, at most {} elements a tensor", b.data.size(), INT_MAX));
      }
    }
    auto r = std::make_unique<MpiRequest>("MPI_Iallgatherv of a weight bucket");
    r->gathers = std::move(buffers);
    for (ops::GatherBuffer& b : r->gathers) {
      check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, b.data.data(), b.counts.data(), b.displs.data(),
                            MPI_FLOAT, comm_, r->add()),
            "MPI_Iallgatherv of a weight bucket");
    }
    return r;
  }
  void allreduce_sum(std::span<double> values) override {
    check(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_DOUBLE, MPI_SUM, comm_),
          "MPI_Allreduce");
  }
  std::vector<std::uint64_t> allgather(std::uint64_t value) override {
    std::vector<std::uint64_t> all(static_cast<std::size_t>(size_));
    check(MPI_Allgather(&value, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, comm_), "MPI_Allgather");
    return all;
  }
  std::unique_ptr<ops::Communicator> split() const override {
    MPI_Comm dup;
    check(MPI_Comm_dup(comm_, &dup), "MPI_Comm_dup");
    return std::make_unique<MpiCommunicator>(dup, true);
  }
  [[noreturn]] void abort(int exit_code) const override {
    MPI_Abort(comm_, exit_code);
    std::abort();  // MPI_Abort does not return; if it did, this rank still must not go on
  }

 private:
  MPI_Comm comm_;
  bool owned_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

bool built_with_mpi() {
  return true;
}

std::shared_ptr<ops::Communicator> mpi_world() {
  static MpiSession session;
  static const std::shared_ptr<ops::Communicator> world = std::make_shared<MpiCommunicator>(MPI_COMM_WORLD, false);
  return world;
}

}  // namespace ferry
