// Enqueueing bound kernel launches.
#include "ferry/ops/launch.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>

#include "cl/env_whole_number.hpp"
#include "ferry/cl/error.hpp"

namespace ferry::ops {

std::uint64_t DeviceSpan::elem_offset(std::size_t elem_bytes) const {
  if (offset_bytes % elem_bytes != 0) {
    throw std::logic_error("device operand at byte offset " + std::to_string(offset_bytes) +
                           " is not aligned to its element size " + std::to_string(elem_bytes));
  }
  return offset_bytes / elem_bytes;
}

cl::Event enqueue(cl_command_queue queue, const LaunchList& launches, std::span<const cl_event> wait,
                  const StepInfo& step, cl::Event* first_event) {
  cl::Event last;
  cl_event previous = nullptr;
  for (std::size_t i = 0; i < launches.size(); ++i) {
    const KernelLaunch& l = launches[i];
    const bool first = i == 0;
    // Each launch after the first waits on the one before it, although the queue is in order: a
    // command that fails on the device does not fail the next one in its queue everywhere
    // (Oclgrind runs it), only those that wait on it, and the list's last event must report a
    // failure of any of its commands.
    const std::span<const cl_event> waits = first ? wait : std::span<const cl_event>(&previous, previous ? 1 : 0);
    cl::Event begun;  // a custom call's first command, where it enqueued several
    if (l.custom) {
      last = l.custom(queue, waits, first && first_event ? &begun : nullptr);
    } else {
      if (l.per_step) l.per_step(l.kernel.get(), step);
      const bool any_local = l.local[0] != 0;
      cl::Event ev;
      FERRY_CL(clEnqueueNDRangeKernel(queue, l.kernel.get(), l.dims, nullptr, l.global.data(),
                                      any_local ? l.local.data() : nullptr, static_cast<cl_uint>(waits.size()),
                                      waits.empty() ? nullptr : waits.data(), ev.out()));
      last = std::move(ev);
    }
    if (first && first_event) *first_event = begun.get() ? std::move(begun) : last;
    previous = last.get();
  }
  return last;
}

void run_blocking(cl_command_queue queue, const LaunchList& launches, const StepInfo& step) {
  cl::Event ev = enqueue(queue, launches, {}, step);
  FERRY_CL(clFinish(queue));
}

cl_uint element_count(const char* op, std::size_t n) {
  if (n > std::numeric_limits<cl_uint>::max()) {
    throw std::invalid_argument(fmt::format("{}: {} elements, more than 2^32-1", op, n));
  }
  return static_cast<cl_uint>(n);
}

KernelLaunch elementwise_launch(cl::Kernel kernel, std::size_t n) {
  KernelLaunch l;
  l.kernel = std::move(kernel);
  l.global[0] = round_up(n == 0 ? 1 : n, 64);
  l.local[0] = 64;
  return l;
}

void set_nullable_arg(const cl::Kernel& k, cl_uint index, DeviceSpan p) {
  const cl_ulong offset = p.elem_offset();
  FERRY_CL(clSetKernelArg(k.get(), index, sizeof(cl_mem), &p.buffer));
  FERRY_CL(clSetKernelArg(k.get(), index + 1, sizeof(cl_ulong), &offset));
}

std::size_t kernel_group_limit(const cl::Kernel& k, const cl::DeviceInfo& device) {
  std::size_t limit = 0;
  FERRY_CL(clGetKernelWorkGroupInfo(k.get(), device.id, CL_KERNEL_WORK_GROUP_SIZE, sizeof(limit), &limit, nullptr));
  if (device.max_work_group_size != 0) limit = std::min(limit, device.max_work_group_size);
  return std::max<std::size_t>(1, limit);
}

std::pair<std::size_t, std::size_t> column_group_size(const cl::Kernel& k, const cl::DeviceInfo& device) {
  std::size_t columns = 16, lanes = 16;
  const std::size_t limit = kernel_group_limit(k, device);
  while (columns * lanes > limit && lanes > 1) lanes /= 2;
  while (columns * lanes > limit && columns > 1) columns /= 2;
  return {columns, lanes};
}

namespace {
// FERRY_ROW_GROUP_SIZE, or 0 when unset or empty; any other value but a whole number from 1 to
// 1024 (no device takes larger work-groups) is an error naming the variable.
std::size_t forced_row_group() {
  return static_cast<std::size_t>(
      cl::env_whole_number("FERRY_ROW_GROUP_SIZE", 1, 1024,
                           "work-items per row of the row reductions, rounded down to a power of two and to what "
                           "the kernel allows; unset it to let ferry choose")
          .value_or(0));
}
}  // namespace

bool row_group_forced() {
  return forced_row_group() != 0;
}

std::size_t row_group_size(const cl::Kernel& k, const cl::DeviceInfo& device, std::size_t extent) {
  // The smallest power of two covering `want`, within `cap` and the kernel's limit.
  std::size_t want = device.is_cpu() ? 1 : extent, cap = 256;
  if (const std::size_t forced = forced_row_group()) want = cap = forced;
  cap = std::min(cap, kernel_group_limit(k, device));
  std::size_t size = 1;
  while (size * 2 <= cap && size < want) size *= 2;
  return size;
}

}  // namespace ferry::ops
