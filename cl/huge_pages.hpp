// Memory advised into 2 MiB pages: a CPU device's buffers (pinned ones too), and ferry's pageable host blocks
// (offload/host_memory.cpp). Private to the library (the cl layer and those above it).
//
// On a CPU device a buffer's memory is the host's, and PoCL allocates it in 4 KiB pages unless
// the kernel's transparent huge pages are `always` (installed default: `madvise`). A product of
// 2048-square operands then walks 48 MiB through a TLB that reaches a few MiB: with huge pages
// for all memory ferry's products ran about 3% faster on an AVX2 EPYC, and with these blocks the
// 2048 square 2% on an AVX-512 one (bench/RESULTS.md, seventy-second session). So ferry maps
// such buffers itself, 2 MiB-aligned and advised MADV_HUGEPAGE, and hands them to the driver
// with CL_MEM_USE_HOST_PTR, which a CPU driver uses in place.
#pragma once

#include <CL/cl.h>

#include <cstddef>

namespace ferry::cl {

// Buffers smaller than this keep the driver's own memory: no whole huge page fits them.
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

// `bytes` (more than 0) of zeroed anonymous memory; from kHugePageBytes on 2 MiB-aligned and
// advised into huge pages (a hint: where the kernel declines it the memory is still good).
// nullptr where mmap fails (errno says why).
void* map_anonymous_pages(std::size_t bytes) noexcept;
void unmap_anonymous_pages(void* p, std::size_t bytes) noexcept;

// Whether the kernel gives advised memory huge pages (transparent_hugepage/enabled is `always`
// or `madvise`); false where it says `never` or the file is missing.
bool huge_pages_advisable();

// Gives the block back when the driver releases `mem` (clSetMemObjectDestructorCallback), so the
// buffer owns its memory as a driver-allocated one does. Returns the driver's error where the
// callback cannot be set: the caller then releases `mem` and unmaps the block itself.
cl_int unmap_with_buffer(cl_mem mem, void* p, std::size_t bytes) noexcept;

}  // namespace ferry::cl
