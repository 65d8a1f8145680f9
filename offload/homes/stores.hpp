// The home stores ferry ships, one file each (private to the library).
#pragma once

#include "offload/home_store.hpp"

namespace ferry::offload::homes {

std::unique_ptr<HomeStore> make_device_store(const cl::Context& context, std::span<const std::uint64_t> buffer_bytes,
                                             std::string_view what);
std::unique_ptr<HomeStore> make_pinned_store(const cl::Context& context, std::span<const std::uint64_t> buffer_bytes,
                                             std::uint32_t copies, HostMemory memory, std::string_view what);
std::unique_ptr<HomeStore> make_mapped_store(const cl::Context& context, std::span<const std::uint64_t> buffer_bytes,
                                             std::string_view what);

// `in_place`: a pack replaces the tensor's chunks at once (its updates come after the step's
// commit point); else the new chunks become current at commit.
std::unique_ptr<HomeStore> make_compressed_store(std::span<const HomeTensor> tensors, const CodecOptions& codec,
                                                 bool in_place, std::string_view what);
std::unique_ptr<HomeStore> make_dropped_store(std::span<const HomeTensor> tensors);

}  // namespace ferry::offload::homes
