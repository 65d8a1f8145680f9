#include "initial_values.hpp"

#include <fmt/format.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>
#include <vector>

#include "cl/fnv1a.hpp"
#include "graph/compiled_step.hpp"

namespace ferry {
namespace {

// A 64-bit value whose every bit depends on every bit of z (SplitMix64's output function).
inline std::uint64_t mix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr std::uint64_t golden_gamma = 0x9E3779B97F4A7C15ull;
// Elements a task of initial_values_parallel makes: large enough that scheduling costs nothing,
// small enough that a 4 MiB tensor already spreads over cores.
constexpr std::uint64_t parallel_grain = std::uint64_t{1} << 18;

bool all_zeros(const graph::WeightInit& init) {
  return init.kind == graph::WeightInit::Kind::zeros || init.kind == graph::WeightInit::Kind::none;
}

}  // namespace

std::uint64_t initial_values_key(std::uint64_t seed, std::string_view tensor_name) noexcept {
  return mix64(seed ^ cl::fnv1a(tensor_name));
}

void initial_values(const graph::WeightInit& init, std::uint64_t key, std::uint64_t first, std::span<float> out) {
  switch (init.kind) {
    case graph::WeightInit::Kind::ones:
      std::fill(out.begin(), out.end(), 1.0f);
      return;
    case graph::WeightInit::Kind::uniform: {
      // u = 24 bits / 2^24 in [0, 1) exactly; -b + 2b u stays below b.
      const float lo = -init.bound, width = 2.0f * init.bound;
      std::uint64_t counter = key + (first + 1) * golden_gamma;
      for (float& v : out) {
        const float u = static_cast<float>(mix64(counter) >> 40) * 0x1p-24f;
        v = lo + width * u;
        counter += golden_gamma;
      }
      return;
    }
    default:
      std::fill(out.begin(), out.end(), 0.0f);
  }
}

void initial_values_parallel(const graph::WeightInit& init, std::uint64_t key, std::uint64_t first, std::uint64_t count,
                             std::uint32_t elem_bytes, std::byte* dst, std::string_view what) {
  const bool zeros = all_zeros(init);
  if (!zeros && elem_bytes != sizeof(float)) {
    throw std::invalid_argument(fmt::format(
        "cannot initialise '{}': only zeros are defined for tensors of {}-byte elements", what, elem_bytes));
  }
  tbb::parallel_for(std::uint64_t{0}, (count + parallel_grain - 1) / parallel_grain, [&](std::uint64_t block) {
    const std::uint64_t begin = block * parallel_grain, n = std::min(parallel_grain, count - begin);
    if (zeros) {
      std::memset(dst + begin * elem_bytes, 0, n * elem_bytes);
      return;
    }
    initial_values(init, key, first + begin, {reinterpret_cast<float*>(dst) + begin, n});
  });
}

namespace {

// Elements [first, first + count) of tensor `id`'s initial value at dst, on all cores.
struct ValueMaker {
  const graph::TensorTable& t;
  std::uint64_t seed;
  void operator()(graph::TensorId id, std::uint64_t first, std::uint64_t count, std::byte* dst) const {
    initial_values_parallel(t.init[id], initial_values_key(seed, t.name[id]), first, count,
                            static_cast<std::uint32_t>(graph::dtype_bytes(t.dtype[id])), dst, t.name[id]);
  }
};

// One device buffer's tensors, written in order of their offsets from the buffer's start: runs of
// small tensors and padding through one reused host image (a blocking write per tensor dominated
// set-up for thousands of small ones), zero ranges of 1 MiB or more filled on the device
// (optimizer state: nothing made on the host), large tensors in image-sized pieces. An image of
// each whole buffer made set-up hold a host copy as large as the buffer, page-faulted afresh.
void write_device_buffer(graph::PersistentArena& arena, const graph::TensorTable& t, std::uint32_t buffer,
                         std::vector<graph::TensorId>& ids, const ValueMaker& make) {
  constexpr std::uint64_t image_bytes = std::uint64_t{64} << 20;
  constexpr std::uint64_t device_zeros_min_bytes = std::uint64_t{1} << 20;
  std::sort(ids.begin(), ids.end(), [&](graph::TensorId a, graph::TensorId b) {
    return t.placement[a].offset_bytes < t.placement[b].offset_bytes;
  });
  std::vector<std::byte> image;
  std::uint64_t run_begin = 0, run_end = 0;  // the bytes of the buffer the image holds, not yet written
  const auto flush = [&] {
    if (run_end > run_begin) {
      arena.write(graph::Home::device, {buffer, run_begin}, image.data(), run_end - run_begin);
    }
    run_begin = run_end;
  };
  // Where [at, at + bytes) goes in the image (at is where the run ends, or a new run starts there).
  const auto in_image = [&](std::uint64_t at, std::uint64_t bytes) {
    if (at != run_end || at + bytes - run_begin > image_bytes) {
      flush();
      run_begin = run_end = at;
    }
    const std::uint64_t need = at + bytes - run_begin;
    if (image.size() < need) image.resize(std::min(image_bytes, std::max(need, 2 * image.size())));
    run_end = at + bytes;
    return image.data() + (at - run_begin);
  };
  const auto zeros = [&](std::uint64_t at, std::uint64_t bytes) {
    if (bytes < device_zeros_min_bytes) {
      std::memset(in_image(at, bytes), 0, bytes);
      return;
    }
    flush();
    arena.write_zeros(graph::Home::device, {buffer, at}, bytes);
    run_begin = run_end = at + bytes;
  };
  std::uint64_t made = 0;  // the buffer's bytes before this are made
  for (const graph::TensorId id : ids) {
    const std::uint64_t at = t.placement[id].offset_bytes, bytes = t.bytes(id), n = t.shape[id].elems();
    if (at < made) {
      throw std::logic_error(
          fmt::format("initial values: '{}' overlaps the tensor before it in device buffer {}", t.name[id], buffer));
    }
    if (at > made) zeros(made, at - made);  // padding
    if (all_zeros(t.init[id])) {
      zeros(at, bytes);
    } else {
      const std::uint64_t per = image_bytes / sizeof(float);  // only f32 tensors have other kinds
      for (std::uint64_t first = 0; first < n; first += per) {
        const std::uint64_t count = std::min(per, n - first);
        make(id, first, count, in_image(at + first * sizeof(float), count * sizeof(float)));
      }
    }
    made = at + bytes;
  }
  flush();
}

}  // namespace

void write_initial_values(graph::PersistentArena& arena, const graph::TensorTable& t,
                          std::span<const graph::TensorId> ids, std::uint64_t seed) {
  for (const graph::TensorId id : ids) {
    if (t.dtype[id] != graph::DType::f32 && t.init[id].kind != graph::WeightInit::Kind::zeros) {
      throw std::logic_error(fmt::format("cannot initialise '{}': only zeros are defined for {} tensors", t.name[id],
                                         graph::dtype_name(t.dtype[id])));
    }
  }
  const ValueMaker make{t, seed};
  std::map<std::uint32_t, std::vector<graph::TensorId>> on_device;  // by buffer
  for (const graph::TensorId id : ids) {
    const graph::Home home = t.home[id];
    if (home == graph::Home::device) {
      on_device[t.placement[id].buffer].push_back(id);
      continue;
    }
    const std::uint64_t n = t.shape[id].elems();
    if (arena.fill_in_place(home, t.placement[id], t.bytes(id), [&](std::byte* dst) { make(id, 0, n, dst); })) {
      continue;
    }
    if (all_zeros(t.init[id])) {  // (the dropped home keeps nothing: no value is made for it)
      arena.write_zeros(home, t.placement[id], t.bytes(id));
      continue;
    }
    std::vector<std::byte> value(t.bytes(id));
    make(id, 0, n, value.data());
    arena.write(home, t.placement[id], value.data(), value.size());
  }
  for (auto& [buffer, on_buffer] : on_device) write_device_buffer(arena, t, buffer, on_buffer, make);
}

}  // namespace ferry
