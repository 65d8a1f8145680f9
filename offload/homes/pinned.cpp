// The host_pinned home (streaming) and the host_mapped home (zero-copy): NUMA-bound host memory,
// pinned (mapped always; host_pinned unless HomeStoreOptions::host_memory makes it pageable, where
// the driver's pinned buffers take device memory too). Mapped keeps one copy, which kernels use
// directly. Pinned keeps one copy that a step's write-backs update in place after its commit point
// (host memory equals the state), or, when asked for (HomeStoreOptions::pinned_copies), two, so
// that updates written before the step is known good become current only when it succeeds. In
// pageable memory some of a step's copies (all of them with staged memory) go through pinned
// staging, filled and drained here (unpack, pack) on all cores.
//
// With two, which copy is current is kept per tensor: a step flips only the tensors it wrote
// (asked for their next copy), so a step that writes some tensors and not others leaves the
// others as they were.
#include <fmt/format.h>

#include <cstring>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "ferry/offload/host_memory.hpp"
#include "stores.hpp"

namespace ferry::offload::homes {
namespace {

class HostStore final : public HomeStore {
 public:
  HostStore(Home home, int copies, HostMemory memory, const cl::Context& context, std::span<const std::uint64_t> sizes,
            std::string_view what)
      : home_(home), memory_(memory), copies_in_use_(copies) {
    for (int c = 0; c < copies; ++c) {
      for (std::size_t b = 0; b < sizes.size(); ++b) {
        copies_[c].push_back(allocate_host(context, sizes[b], memory,
                                           fmt::format("host buffer {} (copy {}) of {} ({}, {} memory)", b, c, what,
                                                       home_name(home), host_memory_name(memory))));
        bytes_ += sizes[b];
      }
    }
  }
  Home home() const override { return home_; }
  const char* host_memory() const override { return host_memory_name(memory_); }
  bool kernels_address_directly() const override { return home_ == Home::host_mapped; }
  bool updates_in_place() const override { return !two(); }
  cl_mem device_buffer(std::uint32_t b) const override {
    if (home_ != Home::host_mapped) throw std::logic_error("kernels reach streamed tensors through fetched copies");
    return copies_[0].at(b).mem();
  }
  std::byte* current(const HomePlace& p) const override {
    if (!two()) return at(0, p);
    const std::lock_guard lock(mutex_);
    return at(slot(p), p);
  }
  // Asked for when a step writes the tensor at p (write-backs enqueue with it): p flips at commit.
  std::byte* next(const HomePlace& p) const override {
    if (!two()) return at(0, p);
    const std::lock_guard lock(mutex_);
    written_.insert(key(p));
    return at(1 - slot(p), p);
  }
  void commit() override {
    const std::lock_guard lock(mutex_);
    for (const std::uint64_t k : written_) slot_[k] ^= 1;
    written_.clear();
  }
  void abort() override {
    const std::lock_guard lock(mutex_);
    written_.clear();
  }
  // Copies through pinned staging (graph/passes/staging.cpp): the value as the step sees it (what
  // it wrote earlier in this step, with two copies) into staging, and the written-back value from there.
  void unpack(const HomePlace& p, void* dst, std::size_t n) const override {
    const std::byte* src = at(0, p);
    if (two()) {
      const std::lock_guard lock(mutex_);
      src = at(written_.contains(key(p)) ? 1 - slot(p) : slot(p), p);
    }
    copy_in_parallel(dst, src, n);
  }
  void pack(const HomePlace& p, const void* src, std::size_t n) override { copy_in_parallel(next(p), src, n); }
  void write(const HomePlace& p, const void* src, std::size_t n) override {
    for (int c = 0; c < (two() ? 2 : 1); ++c) std::memcpy(at(c, p), src, n);
  }
  void read(const HomePlace& p, void* dst, std::size_t n) const override { std::memcpy(dst, current(p), n); }
  bool fill_in_place(const HomePlace& p, std::size_t n, const std::function<void(std::byte*)>& fill) override {
    fill(at(0, p));
    if (two()) std::memcpy(at(1, p), at(0, p), n);
    return true;
  }
  std::uint64_t device_bytes() const override { return 0; }
  std::uint64_t host_bytes() const override { return bytes_; }

 private:
  bool two() const { return copies_in_use_ == 2; }
  static std::uint64_t key(const HomePlace& p) { return (std::uint64_t{p.buffer} << 40) | p.offset_bytes; }
  // The current copy of the tensor at p (the caller holds mutex_).
  int slot(const HomePlace& p) const {
    const auto it = slot_.find(key(p));
    return it == slot_.end() ? 0 : it->second;
  }
  std::byte* at(int copy, const HomePlace& p) const {
    return static_cast<std::byte*>(copies_[copy].at(p.buffer).data()) + p.offset_bytes;
  }
  Home home_;
  HostMemory memory_;  // resolved for the device
  int copies_in_use_;
  std::vector<HostBuffer> copies_[2];
  mutable std::mutex mutex_;
  std::unordered_map<std::uint64_t, int> slot_;        // the current copy of a tensor, by place; absent: 0
  mutable std::unordered_set<std::uint64_t> written_;  // places this step wrote
  std::uint64_t bytes_ = 0;
};

}  // namespace

std::unique_ptr<HomeStore> make_pinned_store(const cl::Context& context, std::span<const std::uint64_t> buffer_bytes,
                                             std::uint32_t copies, HostMemory memory, std::string_view what) {
  if (copies != 1 && copies != 2) {
    throw std::invalid_argument(
        fmt::format("host_pinned keeps 1 or 2 copies of {}, not {} (HomeStoreOptions::pinned_copies)", what, copies));
  }
  return std::make_unique<HostStore>(Home::host_pinned, static_cast<int>(copies),
                                     resolve_host_memory(memory, context.device()), context, buffer_bytes, what);
}

std::unique_ptr<HomeStore> make_mapped_store(const cl::Context& context, std::span<const std::uint64_t> buffer_bytes,
                                             std::string_view what) {
  return std::make_unique<HostStore>(Home::host_mapped, 1, HostMemory::pinned, context, buffer_bytes, what);
}

}  // namespace ferry::offload::homes
