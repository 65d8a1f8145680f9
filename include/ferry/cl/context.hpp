// An OpenCL context on one device with ferry's three in-order queues and buffer factories.
#pragma once

#include <atomic>
#include <cstddef>
#include <span>
#include <string>

#include "ferry/cl/device.hpp"
#include "ferry/cl/handle.hpp"

namespace ferry::cl {

// Which queue a command goes to. Compute kernels, host-to-device and device-to-host copies each
// have their own in-order queue so that transfers can overlap compute; events order them.
enum class QueueKind : std::uint8_t { compute, h2d, d2h };
const char* queue_name(QueueKind q);

struct ContextOptions {
  bool profiling = false;  // CL_QUEUE_PROFILING_ENABLE on all queues (needed for traces)
  // On a CPU device, buffers of 2 MiB and more (pinned ones too) in memory ferry maps 2 MiB-aligned
  // and advises into huge pages (handed to the driver with CL_MEM_USE_HOST_PTR): fewer TLB misses
  // in the products.
  // Where the kernel's transparent huge pages are `never` nothing changes. FERRY_HUGE_PAGES=off
  // (or on) overrides it.
  bool huge_pages = true;
};

// Host memory the device can copy from asynchronously (CL_MEM_ALLOC_HOST_PTR, mapped for the
// life of the object). Only such memory lets a copy overlap compute on discrete GPUs.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(Mem mem, cl_command_queue queue, void* host, std::size_t bytes)
      : mem_(std::move(mem)), queue_(queue), host_(host), bytes_(bytes) {}
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  ~PinnedBuffer();
  void* data() const noexcept { return host_; }
  float* floats() const noexcept { return static_cast<float*>(host_); }
  std::size_t bytes() const noexcept { return bytes_; }
  cl_mem mem() const noexcept { return mem_.get(); }

 private:
  void release() noexcept;
  Mem mem_;
  cl_command_queue queue_ = nullptr;
  void* host_ = nullptr;
  std::size_t bytes_ = 0;
};

class Context {
 public:
  explicit Context(const DeviceInfo& device, ContextOptions options = {});
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  const DeviceInfo& device() const noexcept { return device_; }
  cl_context get() const noexcept { return context_.get(); }
  cl_command_queue queue(QueueKind q) const noexcept { return queues_[static_cast<int>(q)].get(); }
  cl_command_queue compute() const noexcept { return queue(QueueKind::compute); }
  bool profiling() const noexcept { return options_.profiling; }
  // Whether create_buffer puts large buffers in memory advised into huge pages (ContextOptions::huge_pages,
  // on a CPU device, where the kernel allows it).
  bool huge_page_buffers() const noexcept { return huge_page_buffers_; }

  // Device buffer; `what` names it in the error if the allocation fails.
  // host: the buffer's own memory where flags include CL_MEM_USE_HOST_PTR.
  Mem create_buffer(std::size_t bytes, std::string_view what, cl_mem_flags flags = CL_MEM_READ_WRITE,
                    void* host = nullptr) const;
  // Host memory the driver allocates and pins (CL_MEM_ALLOC_HOST_PTR), mapped for the buffer's life.
  PinnedBuffer create_pinned(std::size_t bytes, std::string_view what) const;
  // The caller's own page-aligned memory handed to the driver as a buffer's (CL_MEM_USE_HOST_PTR),
  // mapped for the buffer's life: pinned where the driver pins such memory in place. `pages` must
  // outlive the returned buffer.
  PinnedBuffer register_host(void* pages, std::size_t bytes, std::string_view what) const;
  // Test hook (tests/test_faults.cpp): allocation number `nth` from now (0: the next
  // create_buffer or create_pinned) fails as if the driver had refused it, with
  // CL_MEM_OBJECT_ALLOCATION_FAILURE and the usual message naming the buffer; -1 clears it.
  void inject_allocation_failure(int nth) const noexcept { fail_allocation_in_.store(nth); }

  // Blocking helpers for set-up, tests and tools; never used inside a compiled step.
  void write(cl_mem dst, std::size_t offset_bytes, const void* src, std::size_t bytes) const;
  void read(cl_mem src, std::size_t offset_bytes, void* dst, std::size_t bytes) const;
  // Zeros over the range, filled by the device (clEnqueueFillBuffer): nothing made or copied on
  // the host.
  void zero(cl_mem dst, std::size_t offset_bytes, std::size_t bytes) const;
  void finish_all() const;

 private:
  // `mem` mapped for reading and writing for its life: the host side of a pinned or registered buffer.
  PinnedBuffer map_for_life(Mem mem, std::size_t bytes, std::string_view what) const;
  // A read-write buffer over a block of huge pages that it owns (ContextOptions::huge_pages).
  Mem create_in_huge_pages(std::size_t bytes, std::string_view what) const;
  DeviceInfo device_;
  ContextOptions options_;
  bool huge_page_buffers_ = false;
  ContextHandle context_;
  QueueHandle queues_[3];
  mutable std::atomic<int> fail_allocation_in_{-1};  // inject_allocation_failure()
};

// Waits for events on the calling thread. For set-up and tests only.
void wait(std::span<const cl_event> events);

}  // namespace ferry::cl
