// Home stores: each strategy alone (placement, copies, commit, bytes), homes the device cannot
// serve, and a model whose homes differ per role.
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <string>

#include "ferry/offload/home.hpp"
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
  EXPECT_TRUE(home_traits(Home::host_pinned).commits);
  EXPECT_TRUE(home_traits(Home::host_mapped).addressed_in_place);
  EXPECT_TRUE(home_traits(Home::host_mapped).needs_unified_memory);
  for (Home h : {Home::host_compressed, Home::host_int8, Home::dropped}) EXPECT_FALSE(home_traits(h).available);
}

TEST(Homes, PinnedKeepsTwoCopiesAndCommitMakesTheNextCurrent) {
  auto& dev = TestDevice::get();
  const std::array<std::uint64_t, 2> sizes{1024, 512};
  auto store = offload::make_home_store(Home::host_pinned, dev.context, sizes, "test tensors");
  EXPECT_FALSE(store->kernels_address_directly());
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
}

TEST(Homes, DeviceStoreRoundTripsThroughTheDevice) {
  auto& dev = TestDevice::get();
  const std::array<std::uint64_t, 1> sizes{4096};
  auto store = offload::make_home_store(Home::device, dev.context, sizes, "test tensors");
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

TEST(Homes, HomesWithoutAStoreAndHomesTheDeviceCannotServeAreClearErrors) {
  auto& dev = TestDevice::get();
  const std::array<std::uint64_t, 1> sizes{256};
  for (Home h : {Home::host_compressed, Home::host_int8, Home::dropped}) {
    EXPECT_FALSE(offload::home_available(h));
    try {
      offload::make_home_store(h, dev.context, sizes, "optimizer state of linear0.w");
      FAIL() << offload::home_name(h);
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(offload::home_name(h)), std::string::npos) << what;
      EXPECT_NE(what.find("linear0.w"), std::string::npos) << what;
    }
  }
  if (!dev.context.device().host_unified_memory) {
    EXPECT_THROW(offload::make_home_store(Home::host_mapped, dev.context, sizes, "weights"), std::invalid_argument);
  } else {
    auto mapped = offload::make_home_store(Home::host_mapped, dev.context, sizes, "weights");
    EXPECT_TRUE(mapped->kernels_address_directly());
    EXPECT_EQ(mapped->current({0, 0}), mapped->next({0, 0})) << "mapped keeps one copy";
  }
}

}  // namespace
}  // namespace ferry::test
