// Home names and the factory of home stores.
#include "ferry/offload/home.hpp"

#include <fmt/format.h>

#include <cstring>
#include <stdexcept>
#include <vector>

#include "homes/stores.hpp"
#include "offload/home_store.hpp"

namespace ferry::offload {

const char* home_name(Home h) {
  switch (h) {
    case Home::device:
      return "device";
    case Home::host_pinned:
      return "host_pinned";
    case Home::host_mapped:
      return "host_mapped";
    case Home::host_compressed:
      return "host_compressed";
    case Home::host_int8:
      return "host_int8";
    case Home::dropped:
      return "dropped";
  }
  return "?";
}

Home parse_home(std::string_view s) {
  for (int i = 0; i < home_count; ++i) {
    if (s == home_name(static_cast<Home>(i))) return static_cast<Home>(i);
  }
  throw std::invalid_argument(
      fmt::format("unknown home '{}': use device, host_pinned, host_mapped, host_compressed, host_int8 or dropped", s));
}

HomeTraits home_traits(Home h) {
  switch (h) {
    case Home::device:
      return {.available = true, .addressed_in_place = true};
    case Home::host_pinned:
      // commits, and keeps two copies, only when the store is asked for them (pinned_copies)
      return {.available = true, .needs_transfers = true, .host_copies = 1};
    case Home::host_mapped:
      return {.available = true, .addressed_in_place = true, .needs_unified_memory = true, .host_copies = 1};
    case Home::host_compressed:
      return {.available = true, .needs_transfers = true, .commits = true, .staged = true};
    case Home::host_int8:
      return {.needs_transfers = true, .commits = true, .staged = true};  // planned: the phases issue
    case Home::dropped:
      return {.available = true, .needs_transfers = true, .staged = true, .keeps_value = false};
  }
  return {};
}

std::uint32_t host_copies(Home h, const HomeStoreOptions& options) {
  return h == Home::host_pinned ? options.pinned_copies : home_traits(h).host_copies;
}

bool changes_in_place(Home h, std::uint32_t copies) {
  return home_traits(h).addressed_in_place || ((h == Home::host_pinned || h == Home::host_compressed) && copies == 1);
}

void HomeStore::unpack(const HomePlace& p, void* dst, std::size_t bytes) const {
  read(p, dst, bytes);
}

void HomeStore::pack(const HomePlace& p, const void* src, std::size_t bytes) {
  std::memcpy(next(p), src, bytes);
}

void HomeStore::write_zeros(const HomePlace& p, std::size_t bytes) {
  const std::vector<std::byte> zeros(bytes);
  write(p, zeros.data(), bytes);
}

std::unique_ptr<HomeStore> make_home_store(Home home, const cl::Context& context,
                                           std::span<const std::uint64_t> buffer_bytes,
                                           std::span<const HomeTensor> tensors, const HomeStoreOptions& options,
                                           std::string_view what) {
  switch (home) {
    case Home::device:
      return homes::make_device_store(context, buffer_bytes, what);
    case Home::host_pinned:
      return homes::make_pinned_store(context, buffer_bytes, options.pinned_copies, options.host_memory, what);
    case Home::host_mapped:
      if (home_traits(home).needs_unified_memory && !context.device().host_unified_memory) {
        throw std::invalid_argument(fmt::format(
            "home 'host_mapped' for {} needs a device whose memory is the host's (CL_DEVICE_HOST_UNIFIED_MEMORY); "
            "this device ({}) is discrete: use host_pinned (streamed) instead",
            what, context.device().name));
      }
      return homes::make_mapped_store(context, buffer_bytes, what);
    case Home::host_compressed:
      return homes::make_compressed_store(tensors, options.codec, changes_in_place(home, options.pinned_copies), what);
    case Home::dropped:
      return homes::make_dropped_store(tensors);
    case Home::host_int8:
      break;
  }
  throw std::invalid_argument(
      fmt::format("home '{}' for {} has no storage strategy in this version of ferry: use "
                  "device, host_pinned, host_mapped, host_compressed or dropped",
                  home_name(home), what));
}

}  // namespace ferry::offload
