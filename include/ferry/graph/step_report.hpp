// What a training step reports to its caller beyond its results: the device timeline of its
// nodes (ferry::ChromeTrace draws it) and, when a step failed after it had begun changing state
// in place, PartialUpdateError (ferry::Trainer::step documents when).
#pragma once

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ferry/graph/ir.hpp"

namespace ferry::graph {

// One node's span on the device timeline of the last step (needs a profiling context).
// Device-lane nodes carry their commands' OpenCL profiling times. Host-lane nodes (optimizer
// updates on the host) are timed with the host's steady clock and shifted onto the device
// clock by the offset between the host's and the driver's time of enqueueing the step's device
// commands (the smallest one seen), so both share one time base.
struct TimelineEntry {
  std::string name;
  Lane lane;
  std::uint64_t queued_ns, start_ns, end_ns;  // device clock, nanoseconds
  std::string op;                             // the op kind (ops/op_table)
  std::uint64_t bytes = 0;                    // bytes of the tensors it reads and writes
  std::vector<std::string> inputs, outputs;   // the names of those tensors
  // Host-lane nodes only (0 elsewhere), device clock: when every node before it had been enqueued
  // and it began waiting for their commands, and when the driver reported the last of those
  // done. start_ns - ready_ns is the node's wait; start_ns - events_done_ns what the host took to
  // begin its work after the driver's report.
  std::uint64_t ready_ns = 0, events_done_ns = 0;
  // The name of the listed node it waited for that ended last (the one before it on its lane, or
  // another lane's it depends on); empty for a lane's first node with no dependency listed.
  std::string after;
};

// Thrown by a compiled step when a step failed after it had enqueued nodes that change
// persistent state in place (device or host_mapped homes): those tensors may hold this step's
// update, while state in homes that commit (streamed, compressed) was rolled back. what() is the
// failure's message followed by that; cause() is the original failure.
class PartialUpdateError : public std::runtime_error {
 public:
  PartialUpdateError(const std::string& what, std::vector<std::string> tensors, std::exception_ptr cause)
      : std::runtime_error(what), tensors_(std::move(tensors)), cause_(std::move(cause)) {}
  // The persistent tensors that may have been changed, in graph order.
  const std::vector<std::string>& tensors() const noexcept { return tensors_; }
  std::exception_ptr cause() const noexcept { return cause_; }

 private:
  std::vector<std::string> tensors_;
  std::exception_ptr cause_;
};

}  // namespace ferry::graph
