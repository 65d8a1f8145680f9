// Binding of the 8-bit block-wise Adam kernels: on CPU devices a work-item per block
// (ops/kernels/optimizer8bit_rows.cl, built with the host optimizer's quantization tables in front
// of it), elsewhere a work-group per block (ops/kernels/optimizer8bit.cl), whose work-group size and
// elements per work-item are -D parameters, so a work-item's share of its block lives in private
// memory of a fixed size. The learning rate and bias corrections are set per step.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "ferry/cl/error.hpp"
#include "ferry/cl/program.hpp"
#include "ferry/ops/optimizer.hpp"
#include "ferry/ops/quant_map.hpp"
#include "ops/quant_buckets.hpp"

namespace ferry::ops {
namespace {

constexpr cl_uint kLrArg = 17;  // followed by inv_bc1, inv_bc2

// The largest power of two <= min(the preferred size, the device's work-group limit): on CPU
// devices 32 (PoCL runs a work-group's barriers as loops over its work-items, and a kernel with
// 32 work-items of 64 elements each took 0.6x the time of 256 work-items of 8), elsewhere
// adam8bit_max_group.
std::uint32_t device_group(const cl::DeviceInfo& device) {
  std::size_t cap = device.is_cpu() ? 32 : adam8bit_max_group;
  if (device.max_work_group_size != 0) cap = std::min(cap, device.max_work_group_size);
  std::uint32_t group = 1;
  while (group * 2 <= cap) group *= 2;
  return group;
}

}  // namespace

void check_adam8bit_block(std::uint32_t block, std::uint32_t group) {
  const std::uint32_t example = std::max<std::uint32_t>(2048, group);
  if (block == 0) {
    throw std::invalid_argument(
        fmt::format("adamw8bit: block size 0: use a positive multiple of {}, e.g. {}", group, example));
  }
  if (block % group != 0) {
    throw std::invalid_argument(fmt::format(
        "adamw8bit: block size {} is not a multiple of the work-group size {} of this device: use a multiple of {}, "
        "e.g. {}",
        block, group, group, example));
  }
  if (block > adam8bit_max_block) {
    throw std::invalid_argument(
        fmt::format("adamw8bit: block size {} is larger than {}: use a multiple of {} up to {}, e.g. {}", block,
                    adam8bit_max_block, group, adam8bit_max_block, example));
  }
}

// optimizer8bit_rows.cl's source: the code maps' values and the bucket tables the host optimizer
// quantizes with (ops/quant_buckets.hpp), as OpenCL constants, then the kernel file. Values as
// hexadecimal floats, so the kernel reads the host's bits.
const std::string& rows_source() {
  static const std::string source = [] {
    namespace qb = quant_buckets;
    std::string s = fmt::format("#define Q8_COUNT {}u\n#define Q8_FIRST_EXPONENT {}u\n", qb::count, qb::first_exponent);
    s += "__constant float q8_codes[512] = {";
    for (const bool is_signed : {true, false}) {
      for (std::uint32_t c = 0; c < 256; ++c)
        s += fmt::format("{:a}f,", dynamic_value(static_cast<std::uint8_t>(c), is_signed));
    }
    s += "};\n__constant uint q8_steps[" +
         std::to_string(qb::signed_tables.entry.size() + qb::unsigned_tables.entry.size()) + "] = {";
    for (const std::uint32_t e : qb::signed_tables.entry) s += fmt::format("{}u,", e);
    for (const std::uint32_t e : qb::unsigned_tables.entry) s += fmt::format("{}u,", e);
    s += "};\n";
    s += cl::kernel_source("optimizer8bit_rows");
    return s;
  }();
  return source;
}

// The kernel a work-item per block, where it serves: on CPU devices whose local memory holds a
// block's new moments, unless a work-group size is asked for (tests).
cl::Kernel rows_kernel(OpEnv& env, std::uint32_t block, std::uint32_t group) {
  const cl::DeviceInfo& device = env.device();
  if (group != 0 || !device.is_cpu() || 2ull * block * sizeof(float) > device.local_mem_bytes || block % 16 != 0) {
    return {};
  }
  check_adam8bit_block(block, 16);
  cl_program p = env.kernels.program_from_source("optimizer8bit_rows", rows_source(), fmt::format("-DBLOCK={}", block));
  cl_int status = CL_SUCCESS;
  cl::Kernel k(clCreateKernel(p, "adam8bit_update_rows", &status));
  cl::check(status, "clCreateKernel(adam8bit_update_rows)");
  return k;
}

LaunchList adam8bit_update(OpEnv& env, const AdamConfig& c, std::uint32_t block, DeviceSpan w, DeviceSpan g,
                           DeviceSpan m, DeviceSpan v, DeviceSpan scales, std::size_t n, DeviceSpan guard,
                           std::uint32_t group, DeviceSpan status) {
  if (n > std::numeric_limits<cl_uint>::max()) throw std::invalid_argument("adamw8bit: more than 2^32-1 parameters");
  cl::Kernel k = rows_kernel(env, block, group);
  const bool rows = k.get() != nullptr;
  // Else the device's group size; smaller while the compiled kernel allows less (each size is its
  // own program; a block that suits one power of two suits the smaller ones).
  if (group == 0) {
    group = device_group(env.device());
  } else if (group > adam8bit_max_group || (group & (group - 1)) != 0) {
    throw std::invalid_argument(
        fmt::format("adamw8bit: work-group size {} is not a power of two up to {}", group, adam8bit_max_group));
  }
  while (!rows) {
    check_adam8bit_block(block, group);
    k = env.kernels.kernel("optimizer8bit", "adam8bit_update", fmt::format("-DWG={} -DPER={}", group, block / group));
    if (kernel_group_limit(k, env.device()) >= group || group == 1) break;
    group /= 2;
  }
  LaunchList list;
  if (n == 0) return list;
  const std::size_t blocks = adam8bit_blocks(n, block);
  if (rows) group = 1;
  if (blocks > std::numeric_limits<cl_uint>::max() / group) throw std::invalid_argument("adamw8bit: too many blocks");
  const float l2 = c.decoupled_weight_decay ? 0.0f : c.weight_decay;
  const float decoupled = c.decoupled_weight_decay ? c.weight_decay : 0.0f;
  cl::set_args(k.get(), w.buffer, w.elem_offset(), g.buffer, g.elem_offset(), m.buffer, m.elem_offset(1), v.buffer,
               v.elem_offset(1), scales.buffer, scales.elem_offset(), cl_uint(n), cl_uint(blocks), c.beta1, c.beta2,
               c.eps, l2, decoupled, 0.0f, 1.0f, 1.0f, guard.buffer ? guard.buffer : w.buffer, guard.elem_offset(),
               cl_uint(guard.buffer ? 1 : 0), status.buffer ? status.buffer : w.buffer, status.elem_offset(),
               cl_uint(status.buffer ? 1 : 0));
  KernelLaunch l;
  l.kernel = std::move(k);
  l.global[0] = blocks * group;
  l.local[0] = group;
  l.per_step = adam_step_args("adam8bit_update", c, kLrArg);
  list.push_back(std::move(l));
  return list;
}

}  // namespace ferry::ops
