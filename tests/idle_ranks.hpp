// A communicator for trainers and plans that are only built (or only save and load checkpoints):
// rank `rank` of `size`, answering the construction's agreement as if every rank agreed; any
// collective of a step is a test failure (std::logic_error).
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
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "idle ranks"; }
  void allreduce_sum(std::span<const std::span<float>>) override { refuse(); }
  void allreduce_sum(std::span<double>) override { refuse(); }
  void reduce_scatter_sum(std::span<const ops::ScatterBuffer>) override { refuse(); }
  void allgather(std::span<ops::GatherBuffer>) override { refuse(); }
  std::vector<std::uint64_t> allgather(std::uint64_t value) override {
    return std::vector<std::uint64_t>(static_cast<std::size_t>(size_), value);
  }
  std::unique_ptr<ops::Communicator> split() const override { return std::make_unique<IdleRanks>(rank_, size_); }
  [[noreturn]] void abort(int) const override { std::abort(); }

 private:
  [[noreturn]] static void refuse() { throw std::logic_error("no step expected"); }
  int rank_, size_;
};

}  // namespace ferry::test
