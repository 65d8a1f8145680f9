// The device home: device buffers that kernels use in place.
#include <fmt/format.h>

#include <stdexcept>

#include "stores.hpp"

namespace ferry::offload::homes {
namespace {

class DeviceStore final : public HomeStore {
 public:
  DeviceStore(const cl::Context& context, std::span<const std::uint64_t> sizes, std::string_view what)
      : context_(context) {
    for (std::size_t b = 0; b < sizes.size(); ++b) {
      buffers_.push_back(context.create_buffer(sizes[b], fmt::format("device buffer {} of {}", b, what)));
      bytes_ += sizes[b];
    }
  }
  Home home() const override { return Home::device; }
  bool kernels_address_directly() const override { return true; }
  cl_mem device_buffer(std::uint32_t b) const override { return buffers_.at(b).get(); }
  std::byte* current(const HomePlace&) const override { throw std::logic_error("the device home has no host memory"); }
  std::byte* next(const HomePlace&) const override { throw std::logic_error("the device home has no host memory"); }
  void write(const HomePlace& p, const void* src, std::size_t n) override {
    context_.write(buffers_.at(p.buffer).get(), p.offset_bytes, src, n);
  }
  void read(const HomePlace& p, void* dst, std::size_t n) const override {
    context_.read(buffers_.at(p.buffer).get(), p.offset_bytes, dst, n);
  }
  void write_zeros(const HomePlace& p, std::size_t n) override {
    context_.zero(buffers_.at(p.buffer).get(), p.offset_bytes, n);
  }
  std::uint64_t device_bytes() const override { return bytes_; }
  std::uint64_t host_bytes() const override { return 0; }

 private:
  const cl::Context& context_;
  std::vector<cl::Mem> buffers_;
  std::uint64_t bytes_ = 0;
};

}  // namespace

std::unique_ptr<HomeStore> make_device_store(const cl::Context& context, std::span<const std::uint64_t> buffer_bytes,
                                             std::string_view what) {
  return std::make_unique<DeviceStore>(context, buffer_bytes, what);
}

}  // namespace ferry::offload::homes
