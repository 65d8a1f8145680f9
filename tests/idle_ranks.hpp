// A communicator for trainers and plans that are only built (or only save and load checkpoints):
// rank `rank` of `size`, answering the construction's agreement as if every rank agreed; any
// collective of a step is a test failure (std::logic_error). After fail_rank(r), rank r answers
// every agreement with 0, as a rank whose checkpoint write failed does (this communicator and the
// ones split from it alike).
#pragma once

#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/ops/communicator.hpp"

namespace ferry::test {

class IdleRanks final : public ops::Communicator {
 public:
  IdleRanks(int rank, int size) : rank_(rank), size_(size) {}
  void fail_rank(int r) { *failing_ = r; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "idle ranks"; }
  void allreduce_sum(std::span<const std::span<float>>) override { refuse(); }
  void allreduce_sum(std::span<double>) override { refuse(); }
  void reduce_scatter_sum(std::span<const ops::ScatterBuffer>) override { refuse(); }
  void allgather(std::span<ops::GatherBuffer>) override { refuse(); }
  std::vector<std::uint64_t> allgather(std::uint64_t value) override {
    std::vector<std::uint64_t> all(static_cast<std::size_t>(size_), value);
    if (*failing_ >= 0 && *failing_ < size_) all[static_cast<std::size_t>(*failing_)] = 0;
    return all;
  }
  std::unique_ptr<ops::Communicator> split() const override {
    auto other = std::make_unique<IdleRanks>(rank_, size_);
    other->failing_ = failing_;
    return other;
  }
  [[noreturn]] void abort(int) const override { std::abort(); }

 private:
  [[noreturn]] static void refuse() { throw std::logic_error("no step expected"); }
  int rank_, size_;
  std::shared_ptr<int> failing_ = std::make_shared<int>(-1);
};

}  // namespace ferry::test
