// Anonymous memory, blocks of 2 MiB and more advised into 2 MiB pages.
#include "cl/huge_pages.hpp"

#include <sys/mman.h>

#include <cstdint>
#include <fstream>
#include <new>
#include <string>

namespace ferry::cl {

void* map_anonymous_pages(std::size_t bytes) noexcept {
  if (bytes < kHugePageBytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }
  // Over-map by one huge page and trim both ends: mmap alone promises 4 KiB alignment. munmap
  // takes whole 4 KiB pages, so the page `bytes` ends in is kept.
  const std::size_t length = bytes + kHugePageBytes;
  void* raw = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (start + kHugePageBytes - 1) & ~(std::uintptr_t{kHugePageBytes} - 1);
  const std::size_t page = 4096, kept = (bytes + page - 1) / page * page, end = start + length - aligned;
  if (aligned > start) munmap(raw, aligned - start);
  if (end > kept) munmap(reinterpret_cast<void*>(aligned + kept), end - kept);
  void* block = reinterpret_cast<void*>(aligned);
  // Advice only: a kernel without transparent huge pages refuses it and the pages stay 4 KiB.
  madvise(block, kept, MADV_HUGEPAGE);
  return block;
}

void unmap_anonymous_pages(void* p, std::size_t bytes) noexcept {
  if (p) munmap(p, bytes);
}

bool huge_pages_advisable() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(in, line)) return false;
  return line.find("[always]") != std::string::npos || line.find("[madvise]") != std::string::npos;
}

namespace {

struct Block {
  void* p;
  std::size_t bytes;
};

void CL_CALLBACK unmap_block(cl_mem, void* user) {
  auto* block = static_cast<Block*>(user);
  unmap_anonymous_pages(block->p, block->bytes);
  delete block;
}

}  // namespace

cl_int unmap_with_buffer(cl_mem mem, void* p, std::size_t bytes) noexcept {
  auto* block = new (std::nothrow) Block{p, bytes};
  const cl_int status = block ? clSetMemObjectDestructorCallback(mem, unmap_block, block) : CL_OUT_OF_HOST_MEMORY;
  if (status != CL_SUCCESS) delete block;
  return status;
}

}  // namespace ferry::cl
