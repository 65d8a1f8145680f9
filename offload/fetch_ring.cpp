// FetchRing (offload/fetch_ring.hpp): the pipeline of one chunked fetch.
#include "offload/fetch_ring.hpp"

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

cl::Event FetchRing::copy(cl_command_queue queue, const std::byte* src, cl_mem dst, std::size_t offset,
                          std::size_t bytes, std::span<const cl_event> wait, cl::Event* first_chunk) {
  std::lock_guard lock(mutex_);
  cl::Event last;
  if (bytes == 0) {  // nothing to copy: the fetch completes with what it waits for
    FERRY_CL(clEnqueueMarkerWithWaitList(queue, static_cast<cl_uint>(wait.size()), wait.empty() ? nullptr : wait.data(),
                                         last.out()));
    return last;
  }
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

}  // namespace ferry::offload
