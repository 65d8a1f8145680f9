// The host_compressed home: each tensor kept only as compressed chunks (offload/chunk_codec.hpp),
// no plain host copy. A step's host-lane nodes unpack a tensor into pinned staging before its
// fetch and pack the written-back value into new chunks after. In place (one copy, the default),
// the new chunks replace the old as soon as they are made: the updates that write the tensor come
// after the step's commit point, so host memory holds one set of chunks and a tensor's second
// only while it is packed. Otherwise (two copies, HomeStoreOptions::pinned_copies) they become
// current at commit, so a failed step (or one whose chunks could not be made) leaves
// the previous chunks in place, at the cost of holding both until then.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "stores.hpp"

namespace ferry::offload::homes {
namespace {

class CompressedStore final : public HomeStore {
 public:
  CompressedStore(std::span<const HomeTensor> tensors, const CodecOptions& codec, bool in_place, std::string_view what)
      : codec_(codec), what_(what), in_place_(in_place) {
    for (const HomeTensor& t : tensors) entries_.push_back({t, {}, std::nullopt, false});
    std::sort(entries_.begin(), entries_.end(),
              [](const Entry& a, const Entry& b) { return key(a.t.place) < key(b.t.place); });
  }
  Home home() const override { return Home::host_compressed; }
  const char* host_memory() const override { return "pageable"; }  // chunks in ordinary memory
  bool kernels_address_directly() const override { return false; }
  bool updates_in_place() const override { return in_place_; }
  cl_mem device_buffer(std::uint32_t) const override {
    throw std::logic_error("kernels reach compressed tensors through fetched copies");
  }
  std::byte* current(const HomePlace&) const override { throw no_plain_copy(); }
  std::byte* next(const HomePlace&) const override { throw no_plain_copy(); }
  void commit() override {
    for (Entry& e : entries_) {
      if (!e.next) continue;
      e.current = std::move(*e.next);
      e.next.reset();
      e.has_value = true;
    }
  }
  void abort() override {
    for (Entry& e : entries_) e.next.reset();
  }
  void write(const HomePlace& p, const void* src, std::size_t n) override {
    Entry& e = entry(p, n);
    e.current = codec_.compress(bytes_of(src, n), e.t.elem_bytes, e.t.name);  // replaces it only once made
    e.next.reset();
    e.has_value = true;
  }
  void read(const HomePlace& p, void* dst, std::size_t n) const override {
    const Entry& e = entry(p, n);
    decompress(e, e.has_value ? &e.current : nullptr, dst, n);
  }
  void unpack(const HomePlace& p, void* dst, std::size_t n) const override {
    const Entry& e = entry(p, n);
    decompress(e, e.next ? &*e.next : e.has_value ? &e.current : nullptr, dst, n);
  }
  void pack(const HomePlace& p, const void* src, std::size_t n) override {
    Entry& e = entry(p, n);
    if (!in_place_) {
      e.next = codec_.compress(bytes_of(src, n), e.t.elem_bytes, e.t.name);
      return;
    }
    e.current = codec_.compress(bytes_of(src, n), e.t.elem_bytes, e.t.name);  // replaces it only once made
    e.has_value = true;
  }
  CompressedTensor* chunks(const HomePlace& p) override {
    auto it = find(p);
    return it != entries_.end() && it->has_value ? &it->current : nullptr;
  }
  std::uint64_t device_bytes() const override { return 0; }
  std::uint64_t host_bytes() const override {
    std::uint64_t b = 0;
    for (const Entry& e : entries_) b += e.current.compressed_bytes() + (e.next ? e.next->compressed_bytes() : 0);
    return b;
  }

 private:
  struct Entry {
    HomeTensor t;
    CompressedTensor current;
    std::optional<CompressedTensor> next;  // written by this step, current at commit
    bool has_value;                        // false until first written: its value is zeros
  };
  static std::pair<std::uint32_t, std::uint64_t> key(const HomePlace& p) { return {p.buffer, p.offset_bytes}; }
  static std::span<const std::byte> bytes_of(const void* src, std::size_t n) {
    return {static_cast<const std::byte*>(src), n};
  }
  std::logic_error no_plain_copy() const {
    return std::logic_error(fmt::format("{} live compressed: there is no plain host copy to address", what_));
  }
  using EntryIterator = std::vector<Entry>::iterator;
  EntryIterator find(const HomePlace& p) {
    auto it = std::lower_bound(entries_.begin(), entries_.end(), key(p),
                               [](const Entry& e, const auto& k) { return key(e.t.place) < k; });
    return it != entries_.end() && key(it->t.place) == key(p) ? it : entries_.end();
  }
  const Entry& entry(const HomePlace& p, std::size_t n) const {
    auto it = const_cast<CompressedStore*>(this)->find(p);
    if (it == entries_.end()) {
      throw std::logic_error(fmt::format("no tensor of {} at buffer {}, offset {} of the compressed home", what_,
                                         p.buffer, p.offset_bytes));
    }
    if (n != it->t.bytes) {
      throw std::logic_error(
          fmt::format("tensor '{}' holds {} bytes in the compressed home, not {}", it->t.name, it->t.bytes, n));
    }
    return *it;
  }
  Entry& entry(const HomePlace& p, std::size_t n) {
    return const_cast<Entry&>(static_cast<const CompressedStore*>(this)->entry(p, n));
  }
  void decompress(const Entry& e, const CompressedTensor* value, void* dst, std::size_t n) const {
    if (value == nullptr) {
      std::memset(dst, 0, n);  // never written: zeros, as every home starts
      return;
    }
    codec_.decompress(*value, {static_cast<std::byte*>(dst), n}, e.t.name);
  }

  ChunkCodec codec_;
  std::string what_;
  bool in_place_;
  std::vector<Entry> entries_;  // by place
};

// The dropped home: nothing is kept. Every unpack gives zeros (the re-initialised state), packs
// and writes are discarded.
class DroppedStore final : public HomeStore {
 public:
  Home home() const override { return Home::dropped; }
  bool kernels_address_directly() const override { return false; }
  cl_mem device_buffer(std::uint32_t) const override { throw std::logic_error("dropped tensors have no buffer"); }
  std::byte* current(const HomePlace&) const override { throw std::logic_error("dropped tensors have no memory"); }
  std::byte* next(const HomePlace&) const override { throw std::logic_error("dropped tensors have no memory"); }
  void write(const HomePlace&, const void*, std::size_t) override {}
  void write_zeros(const HomePlace&, std::size_t) override {}
  void read(const HomePlace&, void* dst, std::size_t n) const override { std::memset(dst, 0, n); }
  void pack(const HomePlace&, const void*, std::size_t) override {}
  std::uint64_t device_bytes() const override { return 0; }
  std::uint64_t host_bytes() const override { return 0; }
};

}  // namespace

std::unique_ptr<HomeStore> make_compressed_store(std::span<const HomeTensor> tensors, const CodecOptions& codec,
                                                 bool in_place, std::string_view what) {
  return std::make_unique<CompressedStore>(tensors, codec, in_place, what);
}

std::unique_ptr<HomeStore> make_dropped_store(std::span<const HomeTensor>) {
  return std::make_unique<DroppedStore>();
}

}  // namespace ferry::offload::homes
