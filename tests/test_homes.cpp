// Home stores: each strategy alone (placement, copies, commit, bytes), homes the device cannot
// serve, and a model whose homes differ per role.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/cl/error.hpp"
#include "ferry/offload/host_memory.hpp"
#include "offload/fetch_ring.hpp"
#include "offload/home_store.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

using offload::Home;

TEST(Homes, NamesRoundTripAndUnknownNamesAreErrors) {
  for (int h = 0; h < offload::home_count; ++h) {
    EXPECT_EQ(offload::parse_home(offload::home_name(static_cast<Home>(h))), static_cast<Home>(h));
  }
  EXPECT_THROW(offload::parse_home("gpu"), std::invalid_argument);
}

TEST(Homes, TraitsSayWhatEachHomeAsksOfTheGraph) {
  using offload::home_traits;
  EXPECT_TRUE(home_traits(Home::device).addressed_in_place);
  EXPECT_FALSE(home_traits(Home::device).needs_transfers);
  EXPECT_TRUE(home_traits(Home::host_pinned).needs_transfers);
  EXPECT_FALSE(home_traits(Home::host_pinned).commits) << "one copy unless the store is asked for two";
  EXPECT_TRUE(home_traits(Home::host_mapped).addressed_in_place);
  EXPECT_TRUE(home_traits(Home::host_mapped).needs_unified_memory);
  for (Home h : {Home::host_compressed, Home::dropped}) {
    EXPECT_TRUE(home_traits(h).available);
    EXPECT_TRUE(home_traits(h).staged);
    EXPECT_TRUE(home_traits(h).needs_transfers);
  }
  EXPECT_TRUE(home_traits(Home::host_compressed).commits);
  EXPECT_FALSE(home_traits(Home::dropped).keeps_value);
  EXPECT_FALSE(home_traits(Home::host_int8).available);
}

// The compressed store: a tensor's value round-trips bit for bit; what a step packs is what it
// unpacks later in the step, but reads (and other steps) see it only after commit; abort drops it;
// host memory is the chunks.
// With two copies (HomeStoreOptions::pinned_copies) packed chunks become current at commit; with one (the default)
// a pack replaces the chunks at once, its updates coming after the step's commit point.
TEST(Homes, CompressedKeepsChunksAndCommitsPackedValues) {
  auto& dev = TestDevice::get();
  const std::array<std::uint64_t, 1> sizes{1 << 20};
  const std::vector<offload::HomeTensor> tensors = {{{0, 0}, 40000, 4, "a.adam_m"}, {{0, 40192}, 1000, 1, "b.q"}};
  offload::HomeStoreOptions options;
  options.codec.chunk_bytes = 3000;  // does not divide either tensor
  options.pinned_copies = 2;
  auto store = offload::make_home_store(Home::host_compressed, dev.context, sizes, tensors, options, "test tensors");
  EXPECT_FALSE(store->kernels_address_directly());
  EXPECT_THROW(store->current({0, 0}), std::logic_error);
  std::vector<float> zeros(10000), out(10000);
  store->read({0, 0}, out.data(), 40000);
  EXPECT_EQ(out, zeros) << "never written: zeros";
  const std::vector<float> v = random_vector(10000, 4, -1e-3f, 1e-3f), w = random_vector(10000, 5);
  store->write({0, 0}, v.data(), 40000);
  EXPECT_GT(store->host_bytes(), 0u);
  EXPECT_LT(store->host_bytes(), 40000u + 64 * 14) << "chunks, no plain copy";
  store->read({0, 0}, out.data(), 40000);
  EXPECT_EQ(out, v);
  store->pack({0, 0}, w.data(), 40000);
  store->unpack({0, 0}, out.data(), 40000);
  EXPECT_EQ(out, w) << "a step sees what it packed";
  store->read({0, 0}, out.data(), 40000);
  EXPECT_EQ(out, v) << "not current before commit";
  store->abort();
  store->unpack({0, 0}, out.data(), 40000);
  EXPECT_EQ(out, v) << "abort drops the packed value";
  store->pack({0, 0}, w.data(), 40000);
  store->commit();
  store->read({0, 0}, out.data(), 40000);
  EXPECT_EQ(out, w);
  offload::CompressedTensor* chunks = store->chunks({0, 0});
  ASSERT_NE(chunks, nullptr);
  EXPECT_EQ(chunks->chunk_count(), 14u) << "3000-byte chunks of 4-byte elements: 750 elements each";
  std::vector<std::uint8_t> q(1000), q_out(1000);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<std::uint8_t>(i * 7);
  store->write({0, 40192}, q.data(), q.size());
  store->read({0, 40192}, q_out.data(), q_out.size());
  EXPECT_EQ(q_out, q);
  EXPECT_THROW(store->read({0, 64}, out.data(), 4), std::logic_error) << "no tensor there";
  EXPECT_THROW(store->read({0, 0}, out.data(), 4), std::logic_error) << "wrong size";
  EXPECT_FALSE(store->updates_in_place());

  options.pinned_copies = 1;
  auto one = offload::make_home_store(Home::host_compressed, dev.context, sizes, tensors, options, "test tensors");
  EXPECT_TRUE(one->updates_in_place());
  one->write({0, 0}, v.data(), 40000);
  const std::uint64_t one_set = one->host_bytes();
  one->pack({0, 0}, w.data(), 40000);
  one->read({0, 0}, out.data(), 40000);
  EXPECT_EQ(out, w) << "in place: current once packed";
  EXPECT_LE(one->host_bytes(), one_set + 64 * 14) << "one set of chunks, the old ones freed";
  one->abort();
  one->read({0, 0}, out.data(), 40000);
  EXPECT_EQ(out, w) << "nothing to drop";
}

TEST(Homes, DroppedKeepsNothing) {
  auto& dev = TestDevice::get();
  const std::array<std::uint64_t, 1> sizes{4096};
  const std::vector<offload::HomeTensor> tensors = {{{0, 0}, 64, 4, "a.adam_v"}};
  auto store = offload::make_home_store(Home::dropped, dev.context, sizes, tensors, {}, "test tensors");
  const std::vector<float> v = random_vector(16, 6);
  std::vector<float> out(16, 1.0f);
  store->write({0, 0}, v.data(), 64);
  store->pack({0, 0}, v.data(), 64);
  store->commit();
  store->unpack({0, 0}, out.data(), 64);
  EXPECT_EQ(out, std::vector<float>(16, 0.0f));
  EXPECT_EQ(store->host_bytes(), 0u);
  EXPECT_EQ(store->device_bytes(), 0u);
}

offload::HomeStoreOptions two_copies() {
  offload::HomeStoreOptions o;
  o.pinned_copies = 2;
  return o;
}

// One copy (the default): a step's write-back changes the tensor in place.
TEST(Homes, PinnedKeepsOneCopyUpdatedInPlace) {
  auto& dev = TestDevice::get();
  const std::array<std::uint64_t, 2> sizes{1024, 512};
  auto store = offload::make_home_store(Home::host_pinned, dev.context, sizes, {}, {}, "test tensors");
  EXPECT_FALSE(store->kernels_address_directly());
  EXPECT_TRUE(store->updates_in_place());
  EXPECT_EQ(store->host_bytes(), 1024u + 512u);
  const offload::HomePlace p{1, 256};
  const float before[4] = {1, 2, 3, 4}, after[4] = {5, 6, 7, 8};
  store->write(p, before, sizeof(before));
  EXPECT_EQ(store->current(p), store->next(p));
  std::memcpy(store->next(p), after, sizeof(after));
  float out[4];
  store->read(p, out, sizeof(out));
  EXPECT_EQ(std::memcmp(out, after, sizeof(out)), 0);
  offload::HomeStoreOptions three;
  three.pinned_copies = 3;
  EXPECT_THROW(offload::make_home_store(Home::host_pinned, dev.context, sizes, {}, three, "test tensors"),
               std::invalid_argument);
}

// Which memory `auto` gives: pageable where the driver backs pinned buffers with device memory too
// (NVIDIA's OpenCL on a discrete GPU), pinned elsewhere.
TEST(HostMemory, AutomaticIsPageableOnlyWherePinnedBuffersTakeDeviceMemory) {
  using offload::HostMemory;
  const cl::DeviceFacts nvidia{"NVIDIA CUDA", "NVIDIA Corporation", "NVIDIA H200", "NVIDIA Corporation",
                               CL_DEVICE_TYPE_GPU};
  const cl::DeviceFacts amd{"AMD Accelerated Parallel Processing", "Advanced Micro Devices, Inc.", "gfx90a",
                            "Advanced Micro Devices, Inc.", CL_DEVICE_TYPE_GPU};
  const cl::DeviceFacts pocl{"Portable Computing Language", "The pocl project", "cpu", "AuthenticAMD",
                             CL_DEVICE_TYPE_CPU};
  EXPECT_TRUE(offload::pinned_buffers_take_device_memory(nvidia, false));
  EXPECT_FALSE(offload::pinned_buffers_take_device_memory(nvidia, true));  // an integrated one
  EXPECT_FALSE(offload::pinned_buffers_take_device_memory(amd, false));
  EXPECT_FALSE(offload::pinned_buffers_take_device_memory(pocl, true));
  for (const HostMemory m : offload::all_host_memories) {
    EXPECT_EQ(offload::parse_host_memory(offload::host_memory_name(m)), m);
  }
  EXPECT_EQ(offload::host_memory_names(),
            (std::vector<std::string>{"auto", "pinned", "pageable", "staged", "registered"}));
  try {
    offload::parse_host_memory("locked");
    ADD_FAILURE();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("use auto, pinned, pageable, staged or registered"), std::string::npos)
        << e.what();
  }
  auto& dev = TestDevice::get();
  const HostMemory here = offload::resolve_host_memory(HostMemory::automatic, dev.context.device());
  EXPECT_EQ(here, offload::pinned_buffers_take_device_memory(dev.context.device().facts(),
                                                             dev.context.device().host_unified_memory)
                      ? HostMemory::pageable
                      : HostMemory::pinned);
  EXPECT_EQ(offload::resolve_host_memory(HostMemory::pageable, dev.context.device()), HostMemory::pageable);
  EXPECT_EQ(offload::resolve_host_memory(HostMemory::staged, dev.context.device()), HostMemory::staged);
  // Staged memory is pageable where it is allocated: only the step's staging is pinned.
  EXPECT_FALSE(offload::allocate_host(dev.context, 4096, HostMemory::staged, "a staged block").pinned());
  EXPECT_EQ(offload::resolve_host_memory(HostMemory::registered, dev.context.device()), HostMemory::registered);
  EXPECT_TRUE(offload::is_pinned(HostMemory::registered));
  EXPECT_FALSE(offload::is_pinned(HostMemory::staged));
}

// Each store says what kind of host memory it keeps (the memory profile prints it beside the
// home's name, which for host_pinned says nothing of whether its memory is pinned).
TEST(Homes, StoresNameTheirHostMemory) {
  auto& dev = TestDevice::get();
  const std::vector<std::uint64_t> sizes{4096};
  const std::vector<offload::HomeTensor> tensors{{{0, 0}, 4096, 4, "t"}};
  using offload::HostMemory;
  for (const HostMemory m : {HostMemory::pinned, HostMemory::pageable, HostMemory::staged}) {
    offload::HomeStoreOptions options;
    options.host_memory = m;
    auto store = offload::make_home_store(Home::host_pinned, dev.context, sizes, tensors, options, "test tensors");
    EXPECT_STREQ(store->host_memory(), offload::host_memory_name(m));
  }
  EXPECT_STREQ(offload::make_home_store(Home::host_compressed, dev.context, sizes, tensors, {}, "t")->host_memory(),
               "pageable");
  EXPECT_STREQ(offload::make_home_store(Home::device, dev.context, sizes, tensors, {}, "t")->host_memory(), "");
}

// Registered blocks: ferry's zeroed pages with an OpenCL buffer over them (CL_MEM_USE_HOST_PTR);
// copies to the device from their pointer and back into them carry every byte.
TEST(HostMemory, RegisteredBlocksAreTheProcesssPagesWithABuffer) {
  auto& dev = TestDevice::get();
  constexpr std::size_t bytes = 3 << 20;
  offload::HostBuffer block =
      offload::allocate_host(dev.context, bytes, offload::HostMemory::registered, "a registered block");
  ASSERT_TRUE(block.pinned());
  ASSERT_NE(block.mem(), nullptr);
  ASSERT_EQ(block.bytes(), bytes);
  auto* host = static_cast<float*>(block.data());
  EXPECT_EQ(host[0] + host[bytes / 4 - 1], 0.0f);
  // 2 MiB-aligned, as every pageable block of 2 MiB and more (advised into huge pages).
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block.data()) % (std::size_t{2} << 20), 0u);
  for (std::size_t i = 0; i < bytes / 4; ++i) host[i] = static_cast<float>(i % 1000) - 3.5f;
  cl::Mem device = dev.context.create_buffer(bytes, "a device copy");
  dev.context.write(device.get(), 0, block.data(), bytes);
  std::vector<float> want(host, host + bytes / 4);
  std::memset(block.data(), 0, bytes);
  dev.context.read(device.get(), 0, block.data(), bytes);
  EXPECT_EQ(std::memcmp(want.data(), host, bytes), 0);

  // A driver that refuses the registration: an error naming the block and what to use instead.
  dev.context.inject_allocation_failure(0);
  try {
    (void)offload::allocate_host(dev.context, 4096, offload::HostMemory::registered, "a refused block");
    ADD_FAILURE() << "the refused registration did not throw";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("could not register 4096 bytes of host memory for a refused block"), std::string::npos) << what;
    EXPECT_NE(what.find("--host-memory pinned or pageable"), std::string::npos) << what;
  }
  dev.context.inject_allocation_failure(-1);
}

// Pageable blocks: zeroed, writable, no OpenCL buffer; pinned ones have one. The pinned home in
// pageable memory copies to and from the device as the pinned one does.
TEST(HostMemory, PageableBlocksAndAPinnedHomeInPageableMemory) {
  auto& dev = TestDevice::get();
  offload::HostBuffer paged =
      offload::allocate_host(dev.context, 3 << 20, offload::HostMemory::pageable, "a test block");
  EXPECT_FALSE(paged.pinned());
  EXPECT_EQ(paged.mem(), nullptr);
  ASSERT_EQ(paged.bytes(), 3u << 20);
  const auto* bytes = static_cast<const unsigned char*>(paged.data());
  EXPECT_EQ(bytes[0] + bytes[(3 << 20) - 1], 0);
  std::memset(paged.data(), 7, paged.bytes());
  const offload::HostBuffer pinned = offload::allocate_host(dev.context, 4096, offload::HostMemory::pinned, "a block");
  EXPECT_TRUE(pinned.pinned());
  EXPECT_NE(pinned.mem(), nullptr);

  offload::HomeStoreOptions o;
  o.host_memory = offload::HostMemory::pageable;
  const std::array<std::uint64_t, 1> sizes{1024};
  auto store = offload::make_home_store(Home::host_pinned, dev.context, sizes, {}, o, "test tensors");
  const offload::HomePlace p{0, 64};
  const std::vector<float> x = {1.5f, -2.f, 3.25f, 4.f};
  store->write(p, x.data(), x.size() * 4);
  cl::Mem device = dev.context.create_buffer(x.size() * 4, "a device copy");
  dev.context.write(device.get(), 0, store->current(p), x.size() * 4);
  std::vector<float> back(x.size());
  dev.context.read(device.get(), 0, store->next(p), x.size() * 4);
  store->read(p, back.data(), back.size() * 4);
  EXPECT_EQ(back, x);
}

TEST(Homes, PinnedKeepsTwoCopiesAndCommitMakesTheNextCurrent) {
  auto& dev = TestDevice::get();
  const std::array<std::uint64_t, 2> sizes{1024, 512};
  auto store = offload::make_home_store(Home::host_pinned, dev.context, sizes, {}, two_copies(), "test tensors");
  EXPECT_FALSE(store->kernels_address_directly());
  EXPECT_FALSE(store->updates_in_place());
  EXPECT_EQ(store->host_bytes(), 2u * (1024 + 512));
  EXPECT_EQ(store->device_bytes(), 0u);
  const offload::HomePlace p{1, 256};
  const float before[4] = {1, 2, 3, 4}, after[4] = {5, 6, 7, 8};
  store->write(p, before, sizeof(before));
  std::memcpy(store->next(p), after, sizeof(after));  // what a step's write-back does
  float out[4];
  store->read(p, out, sizeof(out));
  EXPECT_EQ(std::memcmp(out, before, sizeof(out)), 0) << "uncommitted values must not be current";
  store->commit();
  store->read(p, out, sizeof(out));
  EXPECT_EQ(std::memcmp(out, after, sizeof(out)), 0);
  EXPECT_NE(store->current(p), store->next(p));
  store->abort();  // next() above asked for a write that never came
}

// A step that writes one tensor and not another (a Predict step: weights, not optimizer state)
// flips only the one it wrote; a failed step flips none.
TEST(Homes, PinnedCommitFlipsOnlyTheTensorsTheStepWrote) {
  auto& dev = TestDevice::get();
  const std::array<std::uint64_t, 1> sizes{1024};
  auto store = offload::make_home_store(Home::host_pinned, dev.context, sizes, {}, two_copies(), "test tensors");
  const offload::HomePlace a{0, 0}, b{0, 256};
  const float a0 = 1, b0 = 2, a1 = 3, b1 = 4, a2 = 5;
  store->write(a, &a0, 4);
  store->write(b, &b0, 4);
  // Step 1 writes both.
  std::memcpy(store->next(a), &a1, 4);
  std::memcpy(store->next(b), &b1, 4);
  store->commit();
  // Step 2 writes only a.
  std::memcpy(store->next(a), &a2, 4);
  store->commit();
  float out = 0;
  store->read(a, &out, 4);
  EXPECT_EQ(out, a2);
  store->read(b, &out, 4);
  EXPECT_EQ(out, b1) << "b was not written by step 2: its value must stay";
  // A failed step that wrote b: nothing flips.
  const float b_bad = 99;
  std::memcpy(store->next(b), &b_bad, 4);
  store->abort();
  store->read(b, &out, 4);
  EXPECT_EQ(out, b1);
  store->commit();  // a later success with no writes changes nothing
  store->read(b, &out, 4);
  EXPECT_EQ(out, b1);
}

// Two places answer whether a step changes a home's tensors where they are: the store built for it
// (what the compiled step commits by) and offload::changes_in_place (what the residency pass and the
// planner decide by, before any store exists). They must agree for every home and copy count.
TEST(Homes, TheStoreAndThePlannerAgreeOnWhatChangesInPlace) {
  auto& dev = TestDevice::get();
  const std::array<std::uint64_t, 1> sizes{4096};
  const std::vector<offload::HomeTensor> tensors = {{{0, 0}, 64, 4, "a.adam_m"}};
  for (const Home home : {Home::device, Home::host_pinned, Home::host_mapped, Home::host_compressed, Home::dropped}) {
    // Mapped homes need a device whose memory is the host's (not a discrete one, or Oclgrind).
    if (home == Home::host_mapped && !dev.context.device().host_unified_memory) continue;
    for (const std::uint32_t copies : {1u, 2u}) {
      offload::HomeStoreOptions options;
      options.pinned_copies = copies;
      const auto store = offload::make_home_store(home, dev.context, sizes, tensors, options, "test tensors");
      EXPECT_EQ(store->updates_in_place(), offload::changes_in_place(home, copies))
          << offload::home_name(home) << " with " << copies << " copies";
    }
  }
}

TEST(Homes, DeviceStoreRoundTripsThroughTheDevice) {
  auto& dev = TestDevice::get();
  const std::array<std::uint64_t, 1> sizes{4096};
  auto store = offload::make_home_store(Home::device, dev.context, sizes, {}, {}, "test tensors");
  EXPECT_TRUE(store->kernels_address_directly());
  EXPECT_EQ(store->device_bytes(), 4096u);
  EXPECT_EQ(store->host_bytes(), 0u);
  const std::vector<float> v = random_vector(100, 3);
  store->write({0, 512}, v.data(), v.size() * 4);
  std::vector<float> out(v.size());
  store->read({0, 512}, out.data(), out.size() * 4);
  EXPECT_EQ(out, v);
  EXPECT_THROW(store->current({0, 0}), std::logic_error);
}

// Set-up's fill in place: host homes hand their memory to the filler, every copy of it; homes
// without host memory of the tensor's value say no and leave the filler uncalled.
TEST(Homes, HostHomesFillTensorsInPlaceAndOtherHomesDecline) {
  auto& dev = TestDevice::get();
  const std::array<std::uint64_t, 2> sizes{1024, 512};
  const offload::HomePlace p{1, 256};
  const float values[4] = {1, 2, 3, 4};
  const auto filler = [&](int& calls) {
    return [&](std::byte* dst) {
      ++calls;
      std::memcpy(dst, values, sizeof(values));
    };
  };
  for (const int copies : {1, 2}) {
    offload::HomeStoreOptions o;
    o.pinned_copies = static_cast<std::uint32_t>(copies);
    auto store = offload::make_home_store(Home::host_pinned, dev.context, sizes, {}, o, "test tensors");
    int calls = 0;
    ASSERT_TRUE(store->fill_in_place(p, sizeof(values), filler(calls)));
    EXPECT_EQ(calls, 1);
    EXPECT_EQ(std::memcmp(store->current(p), values, sizeof(values)), 0) << copies << " copies";
    EXPECT_EQ(std::memcmp(store->next(p), values, sizeof(values)), 0) << copies << " copies: every copy is set";
    store->abort();
  }
  int calls = 0;
  if (dev.context.device().host_unified_memory) {  // (mapped homes need the host's memory)
    auto mapped = offload::make_home_store(Home::host_mapped, dev.context, sizes, {}, {}, "test tensors");
    ASSERT_TRUE(mapped->fill_in_place(p, sizeof(values), filler(calls)));
    float out[4];
    mapped->read(p, out, sizeof(out));
    EXPECT_EQ(std::memcmp(out, values, sizeof(out)), 0);
  }
  const std::vector<offload::HomeTensor> tensors = {{p, sizeof(values), 4, "a.adam_m"}};
  for (const Home h : {Home::device, Home::host_compressed, Home::dropped}) {
    auto store = offload::make_home_store(h, dev.context, sizes, tensors, {}, "test tensors");
    calls = 0;
    EXPECT_FALSE(store->fill_in_place(p, sizeof(values), filler(calls))) << offload::home_name(h);
    EXPECT_EQ(calls, 0) << offload::home_name(h);
  }
}

TEST(Homes, HomesWithoutAStoreAndHomesTheDeviceCannotServeAreClearErrors) {
  auto& dev = TestDevice::get();
  const std::array<std::uint64_t, 1> sizes{256};
  for (Home h : {Home::host_int8}) {
    EXPECT_FALSE(offload::home_available(h));
    try {
      offload::make_home_store(h, dev.context, sizes, {}, {}, "optimizer state of linear0.w");
      FAIL() << offload::home_name(h);
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(offload::home_name(h)), std::string::npos) << what;
      EXPECT_NE(what.find("linear0.w"), std::string::npos) << what;
    }
  }
  if (!dev.context.device().host_unified_memory) {
    EXPECT_THROW(offload::make_home_store(Home::host_mapped, dev.context, sizes, {}, {}, "weights"),
                 std::invalid_argument);
  } else {
    auto mapped = offload::make_home_store(Home::host_mapped, dev.context, sizes, {}, {}, "weights");
    EXPECT_TRUE(mapped->kernels_address_directly());
    EXPECT_EQ(mapped->current({0, 0}), mapped->next({0, 0})) << "mapped keeps one copy";
  }
}

// The chunked fetches' ring, filled inline and by its filler thread: a copy of several chunks goes
// through the slots in turn (more chunks than slots, so they are reused within the copy) and
// arrives whole; it reports its first chunk's event beside the last one's (a trace spans the node
// from it), and a copy of one chunk reports none.
class FetchRingTest : public ::testing::TestWithParam<offload::FetchRing::Filling> {};

TEST_P(FetchRingTest, CopiesThroughItsSlotsAndReportsTheFirstChunk) {
  auto& dev = TestDevice::get();
  if (GetParam() == offload::FetchRing::Filling::filler_thread && cl::is_simulator(dev.context.device().facts())) {
    GTEST_SKIP() << "a simulator runs queues inside clFlush, which a filler thread would race (FetchRing::filling_for)";
  }
  constexpr std::size_t chunk = 4096, slots = 4, bytes = 11 * chunk + 100;
  const offload::HostBuffer ring_memory =
      offload::allocate_host(dev.context, chunk * slots, offload::HostMemory::pinned, "a test ring");
  offload::FetchRing ring(static_cast<std::byte*>(ring_memory.data()), chunk, slots, GetParam());
  std::vector<std::uint8_t> src(bytes);
  for (std::size_t i = 0; i < bytes; ++i) src[i] = static_cast<std::uint8_t>(i * 7 + i / 4096);
  cl::Mem device = dev.context.create_buffer(bytes + 64, "the ring's destination");
  const cl_command_queue q = dev.context.queue(cl::QueueKind::h2d);
  cl::Event first;
  cl::Event last = ring.copy(q, reinterpret_cast<const std::byte*>(src.data()), device.get(), 64, bytes, {}, &first);
  ASSERT_NE(first.get(), nullptr);
  EXPECT_NE(first.get(), last.get());
  cl_event both[] = {first.get(), last.get()};
  FERRY_CL(clWaitForEvents(2, both));
  std::vector<std::uint8_t> back(bytes);
  dev.context.read(device.get(), 64, back.data(), bytes);
  EXPECT_EQ(back, src);

  cl::Event single_first;
  cl::Event single =
      ring.copy(q, reinterpret_cast<const std::byte*>(src.data()), device.get(), 0, chunk, {}, &single_first);
  FERRY_CL(clFinish(q));
  EXPECT_EQ(single_first.get(), nullptr) << "one chunk: its event is the copy's only one";
  EXPECT_NE(single.get(), nullptr);
}

INSTANTIATE_TEST_SUITE_P(Fillings, FetchRingTest,
                         ::testing::Values(offload::FetchRing::Filling::enqueuing_thread,
                                           offload::FetchRing::Filling::filler_thread),
                         [](const auto& info) {
                           return std::string(info.param == offload::FetchRing::Filling::filler_thread ? "filler"
                                                                                                       : "inline");
                         });

// With a filler, a fetch that has to wait for the device (its first chunk's wait list) and has
// more chunks than slots returns at once: the thread that enqueues a step's nodes goes on while
// the link and the filler work. Inline, the same copy would block that thread until the wait ended.
// Two fetches back to back then arrive whole, in order, once the device lets the first begin.
TEST(FetchRing, AFillerLetsTheEnqueuingThreadGoOnWhileTheFetchWaits) {
  auto& dev = TestDevice::get();
  if (cl::is_simulator(dev.context.device().facts())) {
    GTEST_SKIP() << "a simulator runs queues inside clFlush, which a filler thread would race (FetchRing::filling_for)";
  }
  constexpr std::size_t chunk = 4096, slots = 4, bytes = 9 * chunk + 10;
  const offload::HostBuffer ring_memory =
      offload::allocate_host(dev.context, chunk * slots, offload::HostMemory::pinned, "a test ring");
  offload::FetchRing ring(static_cast<std::byte*>(ring_memory.data()), chunk, slots,
                          offload::FetchRing::Filling::filler_thread);
  std::vector<std::uint8_t> a(bytes), b(bytes);
  for (std::size_t i = 0; i < bytes; ++i) {
    a[i] = static_cast<std::uint8_t>(i * 13 + 1);
    b[i] = static_cast<std::uint8_t>(i * 5 + 3);
  }
  cl::Mem device = dev.context.create_buffer(2 * bytes, "the ring's destination");
  const cl_command_queue q = dev.context.queue(cl::QueueKind::h2d);
  cl_int rc = CL_SUCCESS;
  cl::Event gate(clCreateUserEvent(dev.context.get(), &rc));
  FERRY_CL(rc);
  const cl_event waits[] = {gate.get()};
  const auto returned = within_deadline("a chunked fetch waiting for the device", [&] {
    cl::Event first_fetch = ring.copy(q, reinterpret_cast<const std::byte*>(a.data()), device.get(), 0, bytes, waits);
    cl::Event second_fetch = ring.copy(q, reinterpret_cast<const std::byte*>(b.data()), device.get(), bytes, bytes, {});
    return std::make_pair(std::move(first_fetch), std::move(second_fetch));
  });
  cl_int status = CL_COMPLETE;
  FERRY_CL(clGetEventInfo(returned.first.get(), CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, nullptr));
  EXPECT_GT(status, CL_COMPLETE) << "the copy ran before the device let it";
  FERRY_CL(clSetUserEventStatus(gate.get(), CL_COMPLETE));
  const cl_event both[] = {returned.first.get(), returned.second.get()};
  FERRY_CL(clWaitForEvents(2, both));
  std::vector<std::uint8_t> back(2 * bytes);
  dev.context.read(device.get(), 0, back.data(), back.size());
  EXPECT_TRUE(std::equal(a.begin(), a.end(), back.begin()));
  EXPECT_TRUE(std::equal(b.begin(), b.end(), back.begin() + bytes));
}

// FERRY_FETCH_FILLER chooses the filling of a compiled step's ring: inline unless it is 1, never
// a filler thread on a simulator (Oclgrind runs queues inside clFlush), and a misspelt value is
// an error rather than the default.
TEST(FetchRing, TheFillingComesFromTheEnvironmentAndIsRefusedOnASimulator) {
  const cl::DeviceFacts gpu{"NVIDIA CUDA", "NVIDIA Corporation", "NVIDIA H200", "NVIDIA Corporation",
                            CL_DEVICE_TYPE_GPU};
  const cl::DeviceFacts simulator{"Oclgrind", "University of Bristol", "Oclgrind Simulator", "University of Bristol",
                                  CL_DEVICE_TYPE_CPU | CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR};
  {
    const ScopedFetchFiller off(false);
    EXPECT_EQ(offload::FetchRing::filling_for(gpu), offload::FetchRing::Filling::enqueuing_thread);
    EXPECT_EQ(offload::FetchRing::filling_for(simulator), offload::FetchRing::Filling::enqueuing_thread);
  }
  {
    const ScopedFetchFiller on(true);
    EXPECT_EQ(offload::FetchRing::filling_for(gpu), offload::FetchRing::Filling::filler_thread);
    EXPECT_THROW(offload::FetchRing::filling_for(simulator), std::invalid_argument);
  }
  setenv("FERRY_FETCH_FILLER", "yes please", 1);
  EXPECT_THROW(offload::FetchRing::filling_for(gpu), std::invalid_argument);
  unsetenv("FERRY_FETCH_FILLER");
}

}  // namespace
}  // namespace ferry::test
