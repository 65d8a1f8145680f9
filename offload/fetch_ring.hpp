// Host-to-device copies from pageable memory through a ring of pinned chunks: staged host
// memory's chunked fetches (graph::ResidencyOptions::staging_chunk_bytes). Chunk i of a source is
// copied into a free slot on all cores while the link copies chunk i - 1 out of its own slot, so
// the host copy and the link's copy run as a pipeline inside one fetch, with no host-lane node
// between them (an unpack node's two hand-offs between host and device per tensor). The slots are
// shared by every chunked fetch of a step, one fetch at a time.
//
// Who fills the slots (`Filling`):
// - `enqueuing_thread`: the thread that enqueues the fetch, before each chunk's copy; it waits there while
//   every slot is still being copied, so a fetch holds that thread (in a compiled step, the one
//   enqueuing the step's other nodes too) until the link has taken all but the last slots' worth.
// - `filler_thread`: a thread of the ring's own. The fetch enqueues every chunk's copy at once, each
//   waiting for a user event that the filler sets once it has copied that chunk into its slot, and
//   returns; the filler takes the chunks in order, each once the copy that last read its slot has
//   completed. The enqueuing thread never waits for the link. The source must then stay as it is
//   until the fetch's event completes (a compiled step's writers of it wait for that event).
#pragma once

#include <CL/cl.h>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "ferry/cl/device.hpp"
#include "ferry/cl/handle.hpp"
#include "ferry/ops/op_table.hpp"

namespace ferry::offload {

class FetchRing final : public ops::StagedCopier {
 public:
  static constexpr std::size_t default_slots = 4;  // what a compiled step's ring has
  enum class Filling { enqueuing_thread, filler_thread };
  // The filling a compiled step's ring on `device` uses: FERRY_FETCH_FILLER=1 gives it a filler
  // thread; unset or 0, inline. Throws std::invalid_argument for another value, and for 1 on a
  // simulator: Oclgrind runs a queue's commands inside clFlush on the thread that flushes, which a
  // filler thread's calls would race.
  static Filling filling_for(const cl::DeviceFacts& device);

  // `memory`: slots * chunk_bytes of pinned host memory the ring uses for its life (the caller's).
  FetchRing(std::byte* memory, std::size_t chunk_bytes, std::size_t slots = default_slots,
            Filling filling = Filling::enqueuing_thread)
      : memory_(memory), chunk_(chunk_bytes), busy_(slots), filling_(filling) {}
  FetchRing(const FetchRing&) = delete;
  FetchRing& operator=(const FetchRing&) = delete;
  // With a filler: waits for the chunks it was given, then stops it.
  ~FetchRing() override;

  // Copies `bytes` from `src` to `dst` at `offset` on `queue` (in order), the first chunk's copy
  // waiting for `wait`. Returns with the event of the last chunk's copy, which completes after
  // every chunk's (and in *first, when not null and there are several, the first chunk's). Inline,
  // it returns once `src` has been read (it may change afterwards) and blocks while every slot is
  // still being copied to the device; with a filler it returns at once and `src` is read until the
  // returned event completes. Throws cl::Error when a copy fails or cannot be enqueued; the ring
  // stays usable.
  cl::Event copy(cl_command_queue queue, const std::byte* src, cl_mem dst, std::size_t offset, std::size_t bytes,
                 std::span<const cl_event> wait, cl::Event* first = nullptr) override;
  std::size_t chunk_bytes() const noexcept { return chunk_; }

 private:
  // One chunk for the filler: into `slot` once `slot_free` (the copy that last read the slot, if
  // any) has completed; then `ready`, which the chunk's copy waits for, is set and `queue` flushed.
  struct Chunk {
    std::byte* slot = nullptr;
    const std::byte* src = nullptr;
    std::size_t bytes = 0;
    cl::Event slot_free, ready;
    cl_command_queue queue = nullptr;
  };
  void wait_for_slot(std::size_t s);
  cl::Event copy_inline(cl_command_queue queue, const std::byte* src, cl_mem dst, std::size_t offset, std::size_t bytes,
                        std::span<const cl_event> wait, cl::Event* first);
  cl::Event copy_through_filler(cl_command_queue queue, const std::byte* src, cl_mem dst, std::size_t offset,
                                std::size_t bytes, std::span<const cl_event> wait, cl::Event* first);
  void start_filler();
  void give_filler(Chunk chunk);
  void run_filler();

  std::mutex mutex_;  // one fetch at a time
  std::byte* memory_;
  std::size_t chunk_;
  std::size_t next_ = 0;         // the slot the next chunk takes
  std::vector<cl::Event> busy_;  // per slot: the copy to the device that reads it
  Filling filling_;
  // The filler's queue of chunks, in the order their copies were enqueued.
  std::mutex chunks_mutex_;
  std::condition_variable chunks_ready_;
  std::deque<Chunk> chunks_;
  bool stop_ = false;
  std::thread filler_;  // started by the first chunk given to it
};

}  // namespace ferry::offload
