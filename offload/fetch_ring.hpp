// Host-to-device copies from pageable memory through a ring of pinned chunks: staged host
// memory's chunked fetches (graph::ResidencyOptions::staging_chunk_bytes). The thread that enqueues
// a fetch copies chunk i of its source into a free slot on all cores while the link copies chunk
// i - 1 out of its own slot, so the host copy and the link's copy run as a pipeline inside one
// fetch, with no host-lane node between them (an unpack node's two hand-offs between host and
// device per tensor). The slots are shared by every chunked fetch of a step, one fetch at a time.
#pragma once

#include <CL/cl.h>

#include <cstddef>
#include <mutex>
#include <span>
#include <vector>

#include "ferry/cl/handle.hpp"
#include "ferry/ops/op_table.hpp"

namespace ferry::offload {

class FetchRing final : public ops::StagedCopier {
 public:
  static constexpr std::size_t default_slots = 4;  // what a compiled step's ring has
  // `memory`: slots * chunk_bytes of pinned host memory the ring uses for its life (the caller's).
  FetchRing(std::byte* memory, std::size_t chunk_bytes, std::size_t slots = default_slots)
      : memory_(memory), chunk_(chunk_bytes), busy_(slots) {}
  FetchRing(const FetchRing&) = delete;
  FetchRing& operator=(const FetchRing&) = delete;

  // Copies `bytes` from `src` to `dst` at `offset` on `queue` (in order), the first chunk's copy
  // waiting for `wait`. Returns once `src` has been read (it may change afterwards), with the event
  // of the last chunk's copy, which completes after every chunk's (and in *first, when not null and
  // there are several, the first chunk's). Blocks while every slot is still being copied to the
  // device. Throws cl::Error when a copy fails or cannot be enqueued; the ring stays usable.
  cl::Event copy(cl_command_queue queue, const std::byte* src, cl_mem dst, std::size_t offset, std::size_t bytes,
                 std::span<const cl_event> wait, cl::Event* first = nullptr) override;
  std::size_t chunk_bytes() const noexcept { return chunk_; }

 private:
  void wait_for_slot(std::size_t s);
  std::mutex mutex_;
  std::byte* memory_;
  std::size_t chunk_;
  std::size_t next_ = 0;         // the slot the next chunk takes
  std::vector<cl::Event> busy_;  // per slot: the copy to the device that reads it
};

}  // namespace ferry::offload
