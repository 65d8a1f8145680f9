// FetchRing (offload/fetch_ring.hpp): the pipeline of one chunked fetch.
#include "offload/fetch_ring.hpp"

#include <fmt/format.h>

#include <cstring>
#include <stdexcept>
#include <utility>

#include "cl/env_switch.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/offload/host_memory.hpp"

namespace ferry::offload {

namespace {

// The event's final status: CL_COMPLETE, or the error it ended with. Asked first and waited for
// only while it runs, so that a copy that failed already is not waited for (a wait on a failed
// event is an API error to some implementations' checkers: Oclgrind's).
cl_int settle(cl_event e) {
  cl_int status = CL_QUEUED;
  cl_int rc = clGetEventInfo(e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof(status), &status, nullptr);
  if (rc != CL_SUCCESS) return rc;
  if (status <= CL_COMPLETE) return status;
  rc = clWaitForEvents(1, &e);
  if (rc == CL_SUCCESS) return CL_COMPLETE;
  rc = clGetEventInfo(e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof(status), &status, nullptr);
  return rc != CL_SUCCESS ? rc : status < 0 ? status : CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST;
}

}  // namespace

// A slot is free once the copy reading it has completed. A failed copy frees it too (its error
// is reported here, through the fetch that is waiting).
void FetchRing::wait_for_slot(std::size_t s) {
  if (!busy_[s]) return;
  const cl_int status = settle(busy_[s].get());
  busy_[s] = cl::Event();
  if (status < 0) {
    // Every slot's copy may have failed with it (they wait for each other on one queue): settle
    // them all so that later fetches start from a free ring.
    for (auto& b : busy_) {
      if (b) settle(b.get());
      b = cl::Event();
    }
    cl::check(status, "a chunked fetch's copy to the device, from the pinned slot it needed next");
  }
}

FetchRing::Filling FetchRing::filling_for(const cl::DeviceFacts& device) {
  const bool filler = cl::env_switch("FERRY_FETCH_FILLER",
                                     "1 fills staged host memory's chunked fetches on a thread of their own; 0 or "
                                     "unset: on the thread that enqueues them")
                          .value_or(false);
  if (filler && cl::is_simulator(device)) {
    throw std::invalid_argument(fmt::format(
        "FERRY_FETCH_FILLER=1 on '{}', a simulator: it runs a queue's commands inside clFlush on the thread that "
        "flushes, which the filler thread would race; leave FERRY_FETCH_FILLER unset there",
        device.name));
  }
  return filler ? Filling::filler_thread : Filling::enqueuing_thread;
}

FetchRing::~FetchRing() {
  {
    std::lock_guard lock(chunks_mutex_);
    stop_ = true;
  }
  chunks_ready_.notify_all();
  if (filler_.joinable()) filler_.join();
}

cl::Event FetchRing::copy(cl_command_queue queue, const std::byte* src, cl_mem dst, std::size_t offset,
                          std::size_t bytes, std::span<const cl_event> wait, cl::Event* first_chunk) {
  std::lock_guard lock(mutex_);
  cl::Event last;
  if (bytes == 0) {  // nothing to copy: the fetch completes with what it waits for
    FERRY_CL(clEnqueueMarkerWithWaitList(queue, static_cast<cl_uint>(wait.size()), wait.empty() ? nullptr : wait.data(),
                                         last.out()));
    return last;
  }
  return filling_ == Filling::filler_thread ? copy_through_filler(queue, src, dst, offset, bytes, wait, first_chunk)
                                            : copy_inline(queue, src, dst, offset, bytes, wait, first_chunk);
}

cl::Event FetchRing::copy_inline(cl_command_queue queue, const std::byte* src, cl_mem dst, std::size_t offset,
                                 std::size_t bytes, std::span<const cl_event> wait, cl::Event* first_chunk) {
  cl::Event last;
  for (std::size_t off = 0; off < bytes; off += chunk_) {
    const std::size_t len = std::min(chunk_, bytes - off);
    const std::size_t s = next_;
    next_ = (next_ + 1) % busy_.size();
    wait_for_slot(s);
    std::byte* slot = memory_ + s * chunk_;
    copy_in_parallel(slot, src + off, len);
    const bool first = off == 0;
    cl::Event e;
    FERRY_CL(clEnqueueWriteBuffer(queue, dst, CL_FALSE, offset + off, len, slot,
                                  first ? static_cast<cl_uint>(wait.size()) : 0,
                                  first && !wait.empty() ? wait.data() : nullptr, e.out()));
    FERRY_CL(clFlush(queue));  // the link starts on this chunk while the host copies the next
    busy_[s] = e;
    if (first && first_chunk && len < bytes) *first_chunk = e;
    last = std::move(e);
  }
  return last;
}

cl::Event FetchRing::copy_through_filler(cl_command_queue queue, const std::byte* src, cl_mem dst, std::size_t offset,
                                         std::size_t bytes, std::span<const cl_event> wait, cl::Event* first_chunk) {
  cl_context context = nullptr;
  FERRY_CL(clGetCommandQueueInfo(queue, CL_QUEUE_CONTEXT, sizeof context, &context, nullptr));
  start_filler();  // before any copy waits for it
  cl::Event last;
  std::vector<cl_event> waits;
  for (std::size_t off = 0; off < bytes; off += chunk_) {
    const std::size_t len = std::min(chunk_, bytes - off);
    const std::size_t s = next_;
    std::byte* slot = memory_ + s * chunk_;
    cl_int rc = CL_SUCCESS;
    cl::Event ready(clCreateUserEvent(context, &rc));
    FERRY_CL(rc);
    const bool first = off == 0;
    waits.assign(1, ready.get());
    if (first) waits.insert(waits.end(), wait.begin(), wait.end());
    cl::Event e;
    rc = clEnqueueWriteBuffer(queue, dst, CL_FALSE, offset + off, len, slot, static_cast<cl_uint>(waits.size()),
                              waits.data(), e.out());
    if (rc != CL_SUCCESS) {
      clSetUserEventStatus(ready.get(), CL_COMPLETE);  // no command waits for it
      FERRY_CL(rc);
    }
    next_ = (next_ + 1) % busy_.size();
    const cl::Event ready_ref = ready;  // a reference of its own, should the chunk not reach the filler
    try {
      give_filler({slot, src + off, len, std::exchange(busy_[s], e), std::move(ready), queue});
    } catch (...) {
      // The filler will never see this chunk: let its copy run (on whatever the slot holds; the
      // fetch fails with this exception, and its step with it) rather than wait for ever.
      clSetUserEventStatus(ready_ref.get(), CL_COMPLETE);
      throw;
    }
    if (first && first_chunk && len < bytes) *first_chunk = e;
    last = std::move(e);
  }
  FERRY_CL(clFlush(queue));
  return last;
}

void FetchRing::give_filler(Chunk chunk) {
  {
    std::lock_guard lock(chunks_mutex_);
    chunks_.push_back(std::move(chunk));
  }
  chunks_ready_.notify_one();
}

void FetchRing::start_filler() {
  if (!filler_.joinable()) filler_ = std::thread([this] { run_filler(); });
}

// Each chunk once its slot is free. A slot whose last copy failed is free too, and the chunk is
// copied into it all the same: the failure is reported through that copy's fetch, and a user event
// set to an error status would end the process on PoCL (test_faults). Stops when told to and
// nothing is left, so every chunk's copy is released before the ring goes.
void FetchRing::run_filler() {
  for (;;) {
    Chunk c;
    {
      std::unique_lock lock(chunks_mutex_);
      chunks_ready_.wait(lock, [this] { return stop_ || !chunks_.empty(); });
      if (chunks_.empty()) return;
      c = std::move(chunks_.front());
      chunks_.pop_front();
    }
    if (c.slot_free) settle(c.slot_free.get());
    try {
      copy_in_parallel(c.slot, c.src, c.bytes);
    } catch (...) {
      std::memcpy(c.slot, c.src, c.bytes);  // the workers refused: the same bytes on this thread
    }
    clSetUserEventStatus(c.ready.get(), CL_COMPLETE);
    clFlush(c.queue);  // the driver may hold a command whose user event was set until a flush
  }
}

}  // namespace ferry::offload
