// Context, queues and buffers.
#include "ferry/cl/context.hpp"

#include <fmt/format.h>

#include "cl/env_switch.hpp"
#include "cl/huge_pages.hpp"
#include "ferry/cl/error.hpp"

namespace ferry::cl {

const char* queue_name(QueueKind q) {
  switch (q) {
    case QueueKind::compute:
      return "compute";
    case QueueKind::h2d:
      return "copy in";
    case QueueKind::d2h:
      return "copy out";
  }
  return "?";
}

Context::Context(const DeviceInfo& device, ContextOptions options) : device_(device), options_(options) {
  if (auto on = env_switch("FERRY_HUGE_PAGES", "0 leaves a CPU device's buffers in the driver's own pages"))
    options_.huge_pages = *on;
  huge_page_buffers_ = options_.huge_pages && device_.is_cpu() && huge_pages_advisable();
  cl_int status = CL_SUCCESS;
  cl_context_properties props[] = {CL_CONTEXT_PLATFORM, reinterpret_cast<cl_context_properties>(device.platform), 0};
  context_ = ContextHandle(clCreateContext(props, 1, &device_.id, nullptr, nullptr, &status));
  check(status, "clCreateContext");
  const cl_command_queue_properties qprops = options.profiling ? CL_QUEUE_PROFILING_ENABLE : 0;
  for (auto& q : queues_) {
    q = QueueHandle(clCreateCommandQueue(context_.get(), device_.id, qprops, &status));
    check(status, "clCreateCommandQueue");
  }
}

Mem Context::create_buffer(std::size_t bytes, std::string_view what, cl_mem_flags flags, void* host) const {
  if (bytes > device_.max_alloc_bytes) {
    throw std::runtime_error(
        fmt::format("buffer '{}' of {} bytes exceeds the device's largest allocation ({} bytes) "
                    "on {}: split it or lower the device budget",
                    what, bytes, device_.max_alloc_bytes, device_.name));
  }
  cl_int status = CL_SUCCESS;
  Mem mem;
  // inject_allocation_failure(): count down to the allocation that fails.
  if (int n = fail_allocation_in_.load(); n >= 0 && fail_allocation_in_.compare_exchange_strong(n, n - 1) && n == 0) {
    status = CL_MEM_OBJECT_ALLOCATION_FAILURE;
  } else if (huge_page_buffers_ && host == nullptr && bytes >= kHugePageBytes &&
             // pinned memory (CL_MEM_ALLOC_HOST_PTR) is the host's on a CPU device as every buffer is
             (flags == CL_MEM_READ_WRITE || flags == (CL_MEM_READ_WRITE | CL_MEM_ALLOC_HOST_PTR))) {
    mem = create_in_huge_pages(bytes, what);
  } else {
    mem = Mem(clCreateBuffer(context_.get(), flags, bytes == 0 ? 4 : bytes, host, &status));
  }
  if (status != CL_SUCCESS) {
    throw Error(fmt::format("clCreateBuffer({} bytes for '{}')", bytes, what), status, std::string(OpScope::current()));
  }
  return mem;
}

Mem Context::create_in_huge_pages(std::size_t bytes, std::string_view what) const {
  void* block = map_anonymous_pages(bytes);
  if (block == nullptr) {
    throw std::runtime_error(
        fmt::format("could not map {} bytes of host memory for buffer '{}' of {}: is there "
                    "enough free memory (and is ulimit -v high enough)?",
                    bytes, what, device_.name));
  }
  cl_int status = CL_SUCCESS;
  Mem mem(clCreateBuffer(context_.get(), CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR, bytes, block, &status));
  if (status == CL_SUCCESS) status = unmap_with_buffer(mem.get(), block, bytes);
  if (status != CL_SUCCESS) {
    mem = Mem();  // the driver lets go of the block before it is unmapped
    unmap_anonymous_pages(block, bytes);
    throw Error(fmt::format("clCreateBuffer({} bytes in huge pages for '{}'; FERRY_HUGE_PAGES=off leaves the "
                            "driver's own allocation)",
                            bytes, what),
                status, std::string(OpScope::current()));
  }
  return mem;
}

PinnedBuffer Context::map_for_life(Mem mem, std::size_t bytes, std::string_view what) const {
  cl_int status = CL_SUCCESS;
  void* host = clEnqueueMapBuffer(compute(), mem.get(), CL_TRUE, CL_MAP_READ | CL_MAP_WRITE, 0, bytes == 0 ? 4 : bytes,
                                  0, nullptr, nullptr, &status);
  check(status, fmt::format("clEnqueueMapBuffer({})", what).c_str());
  return PinnedBuffer(std::move(mem), compute(), host, bytes);
}

PinnedBuffer Context::create_pinned(std::size_t bytes, std::string_view what) const {
  return map_for_life(create_buffer(bytes, what, CL_MEM_READ_WRITE | CL_MEM_ALLOC_HOST_PTR), bytes,
                      "pinned host buffer");
}

PinnedBuffer Context::register_host(void* pages, std::size_t bytes, std::string_view what) const {
  return map_for_life(create_buffer(bytes, what, CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR, pages), bytes,
                      "registered host memory");
}

void Context::write(cl_mem dst, std::size_t offset_bytes, const void* src, std::size_t bytes) const {
  if (bytes == 0) return;
  FERRY_CL(clEnqueueWriteBuffer(compute(), dst, CL_TRUE, offset_bytes, bytes, src, 0, nullptr, nullptr));
}

void Context::read(cl_mem src, std::size_t offset_bytes, void* dst, std::size_t bytes) const {
  if (bytes == 0) return;
  FERRY_CL(clEnqueueReadBuffer(compute(), src, CL_TRUE, offset_bytes, bytes, dst, 0, nullptr, nullptr));
}

void Context::zero(cl_mem dst, std::size_t offset_bytes, std::size_t bytes) const {
  if (bytes == 0) return;
  // A one-byte pattern: any offset and size, and the fastest on PoCL (256 MiB in 6-13 ms,
  // against 8-19 with a 128-byte pattern and 16-34 with a 4-byte one).
  const unsigned char zero = 0;
  FERRY_CL(clEnqueueFillBuffer(compute(), dst, &zero, 1, offset_bytes, bytes, 0, nullptr, nullptr));
  FERRY_CL(clFinish(compute()));
}

void Context::finish_all() const {
  for (const auto& q : queues_) FERRY_CL(clFinish(q.get()));
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept
    : mem_(std::move(o.mem_)),
      queue_(std::exchange(o.queue_, nullptr)),
      host_(std::exchange(o.host_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    release();
    mem_ = std::move(o.mem_);
    queue_ = std::exchange(o.queue_, nullptr);
    host_ = std::exchange(o.host_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  release();
}

void PinnedBuffer::release() noexcept {
  if (host_ && mem_) {
    cl_event done = nullptr;
    if (clEnqueueUnmapMemObject(queue_, mem_.get(), host_, 0, nullptr, &done) == CL_SUCCESS && done) {
      clWaitForEvents(1, &done);
      clReleaseEvent(done);
    }
  }
  host_ = nullptr;
  mem_ = Mem();
}

void wait(std::span<const cl_event> events) {
  if (!events.empty()) FERRY_CL(clWaitForEvents(static_cast<cl_uint>(events.size()), events.data()));
}

}  // namespace ferry::cl
