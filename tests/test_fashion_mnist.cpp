// Fashion-MNIST loader: the real Debian files (shape, balance, pixel statistics, known samples) and
// clear errors for every kind of bad input (written as small files into a temporary folder).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ferry/runtime/fashion_mnist.hpp"
#include "unprivileged.hpp"

namespace ferry::test {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;

// ---------------------------------------------------------------------------------------------
// The real data set.

const Dataset& cached(Split split) {
  static const Dataset train = load_fashion_mnist(default_fashion_mnist_dir(), Split::train);
  static const Dataset test = load_fashion_mnist(default_fashion_mnist_dir(), Split::test);
  return split == Split::train ? train : test;
}

double mean_pixel(const Dataset& ds) {
  double sum = 0;
  for (float p : ds.images) sum += p;
  return sum / static_cast<double>(ds.images.size());
}

// Sum of the raw 0..255 bytes of image i, recovered from the floats.
long long image_byte_sum(const Dataset& ds, std::size_t i) {
  long long sum = 0;
  for (std::size_t k = 0; k < ds.sample_elems(); ++k) sum += std::lround(ds.images[i * ds.sample_elems() + k] * 255.0f);
  return sum;
}

TEST(FashionMnist, DefaultDirHonoursFerryDataDir) {
  const char* saved = std::getenv("FERRY_DATA_DIR");
  const std::string keep = saved ? saved : "";
  setenv("FERRY_DATA_DIR", "/some/where", 1);
  EXPECT_EQ(default_fashion_mnist_dir(), fs::path("/some/where"));
  unsetenv("FERRY_DATA_DIR");
  EXPECT_EQ(default_fashion_mnist_dir(), fs::path("/usr/share/datasets/fashion-mnist"));
  if (saved) setenv("FERRY_DATA_DIR", keep.c_str(), 1);
}

TEST(FashionMnist, TrainSplitLoadsQuickly) {
  const auto start = std::chrono::steady_clock::now();
  const Dataset ds = load_fashion_mnist(default_fashion_mnist_dir(), Split::train);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "loaded 60000 training images in " << seconds << " s\n";
  RecordProperty("load_seconds", std::to_string(seconds));
  EXPECT_EQ(ds.count, 60000u);
  // Generous: about 0.3 s here; the bound only catches a pathological slowdown on a shared machine.
  EXPECT_LT(seconds, 10.0);
}

TEST(FashionMnist, SplitsHaveTheirShapes) {
  for (auto [split, n] : {std::pair{Split::train, 60000u}, std::pair{Split::test, 10000u}}) {
    const Dataset& ds = cached(split);
    EXPECT_EQ(ds.count, n);
    EXPECT_EQ(ds.rows, 28u);
    EXPECT_EQ(ds.cols, 28u);
    EXPECT_EQ(ds.sample_elems(), 784u);
    EXPECT_EQ(ds.images.size(), n * 784u);
    EXPECT_EQ(ds.labels.size(), n);
  }
}

TEST(FashionMnist, LabelsAreBalanced) {
  for (auto [split, per_class] : {std::pair{Split::train, 6000}, std::pair{Split::test, 1000}}) {
    std::array<int, 10> counts{};
    for (std::int32_t l : cached(split).labels) {
      ASSERT_GE(l, 0);
      ASSERT_LT(l, 10);
      ++counts[static_cast<std::size_t>(l)];
    }
    for (int c = 0; c < 10; ++c) EXPECT_EQ(counts[static_cast<std::size_t>(c)], per_class) << "class " << c;
  }
}

TEST(FashionMnist, PixelsAreScaledBytes) {
  for (Split split : {Split::train, Split::test}) {
    const Dataset& ds = cached(split);
    float lo = 1, hi = 0;
    std::size_t off_grid = 0;
    for (float p : ds.images) {
      lo = std::min(lo, p);
      hi = std::max(hi, p);
      if (std::abs(p * 255.0f - std::round(p * 255.0f)) > 1e-3f) ++off_grid;
    }
    EXPECT_EQ(lo, 0.0f);
    EXPECT_EQ(hi, 1.0f);
    EXPECT_EQ(off_grid, 0u) << "every pixel should be a byte / 255";
  }
}

TEST(FashionMnist, KnownStatistics) {
  // Figures computed from the original files (sum of all bytes / (count * 784 * 255)).
  EXPECT_NEAR(mean_pixel(cached(Split::train)), 0.286041, 1e-5);
  EXPECT_NEAR(mean_pixel(cached(Split::test)), 0.286849, 1e-5);
}

TEST(FashionMnist, KnownSamples) {
  const Dataset& train = cached(Split::train);
  const std::vector<std::int32_t> train_first{9, 0, 0, 3, 0, 2, 7, 2, 5, 5, 0, 9};
  EXPECT_EQ(std::vector<std::int32_t>(train.labels.begin(), train.labels.begin() + 12), train_first);
  EXPECT_EQ(image_byte_sum(train, 0), 76247);
  EXPECT_EQ(image_byte_sum(train, train.count - 1), 16684);
  EXPECT_FLOAT_EQ(train.images[14 * 28 + 14], 217.0f / 255.0f);  // image 0, centre pixel (row-major)

  const Dataset& test = cached(Split::test);
  const std::vector<std::int32_t> test_first{9, 2, 1, 1, 6, 1, 4, 6, 5, 7, 4, 5};
  EXPECT_EQ(std::vector<std::int32_t>(test.labels.begin(), test.labels.begin() + 12), test_first);
  EXPECT_EQ(image_byte_sum(test, 0), 33456);
  EXPECT_EQ(image_byte_sum(test, test.count - 1), 24390);
  EXPECT_FLOAT_EQ(test.images[14 * 28 + 14], 110.0f / 255.0f);
}

// ---------------------------------------------------------------------------------------------
// Bad input, written as small files into a fresh temporary folder.

void put_be32(Bytes& b, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) b.push_back(static_cast<unsigned char>(v >> shift));
}

Bytes idx_images(std::uint32_t magic, std::uint32_t count, std::uint32_t rows, std::uint32_t cols) {
  Bytes b;
  put_be32(b, magic);
  put_be32(b, count);
  put_be32(b, rows);
  put_be32(b, cols);
  for (std::size_t i = 0; i < std::size_t{count} * rows * cols; ++i) b.push_back(static_cast<unsigned char>(i * 7));
  return b;
}

Bytes idx_labels(std::uint32_t magic, const Bytes& labels) {
  Bytes b;
  put_be32(b, magic);
  put_be32(b, static_cast<std::uint32_t>(labels.size()));
  b.insert(b.end(), labels.begin(), labels.end());
  return b;
}

// A minimal gzip writer (RFC 1952 around RFC 1951 "stored" blocks), written here so the test does
// not depend on the library's zlib and checks the loader against an independent encoder. The real
// data tests above cover compressed (deflated) blocks.
std::uint32_t crc32_of(const Bytes& data) {
  std::uint32_t crc = 0xffffffffu;
  for (unsigned char byte : data) {
    crc ^= byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

void put_le(Bytes& b, std::uint32_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) b.push_back(static_cast<unsigned char>(v >> (8 * i)));
}

constexpr std::size_t kGzipHeaderBytes = 10;

Bytes gzip_bytes(const Bytes& raw) {
  Bytes gz{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff};  // magic, deflate, no flags, no mtime, unknown OS
  std::size_t pos = 0;
  do {
    const std::size_t n = std::min<std::size_t>(raw.size() - pos, 65535);
    const bool last = pos + n == raw.size();
    gz.push_back(last ? 1 : 0);  // BFINAL, BTYPE = 00 (stored), padded to the byte
    put_le(gz, static_cast<std::uint32_t>(n), 2);
    put_le(gz, static_cast<std::uint32_t>(~n & 0xffffu), 2);
    gz.insert(gz.end(), raw.begin() + static_cast<std::ptrdiff_t>(pos),
              raw.begin() + static_cast<std::ptrdiff_t>(pos + n));
    pos += n;
  } while (pos < raw.size());
  put_le(gz, crc32_of(raw), 4);
  put_le(gz, static_cast<std::uint32_t>(raw.size()), 4);
  return gz;
}

class FashionMnistBadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    dir_ =
        fs::temp_directory_path() / ("ferry-fmnist-" + std::to_string(getpid()) + "-" + std::to_string(rd() % 1000000));
    fs::create_directories(dir_);
    // A valid small test split: 3 images of 28x28 pixels (the only size Fashion-MNIST has).
    write_raw("t10k-images-idx3-ubyte.gz", gzip_bytes(idx_images(0x803, 3, 28, 28)));
    write_raw("t10k-labels-idx1-ubyte.gz", gzip_bytes(idx_labels(0x801, {4, 9, 0})));
  }
  void TearDown() override { fs::remove_all(dir_); }

  void write_raw(const std::string& name, const Bytes& bytes) {
    std::ofstream out(dir_ / name, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }

  // Loads the test split and returns the error message ("" if it loaded).
  std::string load_error() {
    try {
      load_fashion_mnist(dir_, Split::test);
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
};

#define EXPECT_ERROR_MENTIONS(message, file, ...)                                                                \
  do {                                                                                                           \
    const std::string m_ = (message);                                                                            \
    ASSERT_FALSE(m_.empty()) << "expected an error";                                                             \
    EXPECT_NE(m_.find(file), std::string::npos) << "the error should name " << (file) << ": " << m_;             \
    for (const char* part : {__VA_ARGS__}) EXPECT_NE(m_.find(part), std::string::npos) << part << " in: " << m_; \
  } while (0)

TEST_F(FashionMnistBadInput, ValidSmallFilesLoad) {
  const Dataset ds = load_fashion_mnist(dir_, Split::test);
  EXPECT_EQ(ds.count, 3u);
  EXPECT_EQ(ds.rows, 28u);
  EXPECT_EQ(ds.cols, 28u);
  EXPECT_EQ(ds.labels, (std::vector<std::int32_t>{4, 9, 0}));
  ASSERT_EQ(ds.images.size(), 3u * 784);
  for (std::size_t i = 0; i < 3 * 784; ++i) {
    EXPECT_FLOAT_EQ(ds.images[i], static_cast<float>(static_cast<unsigned char>(i * 7)) / 255.0f);
  }
}

TEST_F(FashionMnistBadInput, MissingFile) {
  fs::remove(dir_ / "t10k-labels-idx1-ubyte.gz");
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-labels-idx1-ubyte.gz", "not found", "apt-get install dataset-fashion-mnist",
                        "FERRY_DATA_DIR");
}

// The files unpacked (gunzip, or a download of the plain files) were reported as missing, with
// advice to install the package; they are named, with what to do.
TEST_F(FashionMnistBadInput, UncompressedFileIsNamed) {
  fs::remove(dir_ / "t10k-labels-idx1-ubyte.gz");
  write_raw("t10k-labels-idx1-ubyte", idx_labels(0x801, {4, 9, 0}));
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-labels-idx1-ubyte.gz", "is there uncompressed", "gzip -k");
}

TEST_F(FashionMnistBadInput, MissingFolder) {
  std::string message;
  try {
    load_fashion_mnist(dir_ / "nowhere", Split::train);
  } catch (const std::runtime_error& e) {
    message = e.what();
  }
  EXPECT_ERROR_MENTIONS(message, "train-images-idx3-ubyte.gz", "does not exist", "dataset-fashion-mnist",
                        "FERRY_DATA_DIR");
}

TEST_F(FashionMnistBadInput, NotGzip) {
  write_raw("t10k-images-idx3-ubyte.gz", idx_images(0x803, 3, 28, 28));  // the raw IDX bytes, uncompressed
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-images-idx3-ubyte.gz", "not gzip");
  write_raw("t10k-images-idx3-ubyte.gz", {'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd', '\n'});
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-images-idx3-ubyte.gz", "not gzip");
}

TEST_F(FashionMnistBadInput, CorruptGzip) {
  const Bytes good = gzip_bytes(idx_images(0x803, 3, 28, 28));
  Bytes gz = good;
  gz[kGzipHeaderBytes + 5 + 20] ^= 0x5a;  // one pixel changed: the CRC-32 in the trailer no longer matches
  write_raw("t10k-images-idx3-ubyte.gz", gz);
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-images-idx3-ubyte.gz", "corrupt");
  gz = good;
  gz[kGzipHeaderBytes] = 0x07;  // a deflate block of the reserved type 11
  write_raw("t10k-images-idx3-ubyte.gz", gz);
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-images-idx3-ubyte.gz", "corrupt");
}

TEST_F(FashionMnistBadInput, TruncatedGzipStream) {
  Bytes gz = gzip_bytes(idx_images(0x803, 200, 28, 28));
  gz.resize(gz.size() / 2);
  write_raw("t10k-images-idx3-ubyte.gz", gz);
  // As many labels as the header promises images: the end of the stream is met reading the pixels.
  write_raw("t10k-labels-idx1-ubyte.gz", gzip_bytes(idx_labels(0x801, Bytes(200, 1))));
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-images-idx3-ubyte.gz", "truncated");
}

TEST_F(FashionMnistBadInput, TruncatedPayload) {
  // A complete gzip stream whose IDX content stops early: the header promises 3 images, 2 follow.
  Bytes raw = idx_images(0x803, 3, 28, 28);
  raw.resize(raw.size() - 784);
  write_raw("t10k-images-idx3-ubyte.gz", gzip_bytes(raw));
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-images-idx3-ubyte.gz", "truncated", "2352", "1568");
}

TEST_F(FashionMnistBadInput, TruncatedHeader) {
  write_raw("t10k-labels-idx1-ubyte.gz", gzip_bytes({0, 0, 8, 1, 0, 0}));
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-labels-idx1-ubyte.gz", "truncated", "label count");
  write_raw("t10k-labels-idx1-ubyte.gz", gzip_bytes({}));
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-labels-idx1-ubyte.gz", "truncated");
}

TEST_F(FashionMnistBadInput, TrailingData) {
  Bytes raw = idx_labels(0x801, {4, 9, 0});
  raw.push_back(1);
  write_raw("t10k-labels-idx1-ubyte.gz", gzip_bytes(raw));
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-labels-idx1-ubyte.gz", "data after");
}

// 14x56 holds 784 values per image as 28x28 does, so a model took it without a word (and the
// splits could disagree): anything but 28x28 is refused, naming the file and its shape.
TEST_F(FashionMnistBadInput, ImagesOfAnotherShapeAreRefused) {
  for (const auto& [rows, cols] : {std::pair{14u, 56u}, std::pair{32u, 32u}, std::pair{2u, 4u}}) {
    write_raw("t10k-images-idx3-ubyte.gz", gzip_bytes(idx_images(0x803, 3, rows, cols)));
    const std::string shape = fmt::format("holds {}x{} images, but Fashion-MNIST's are 28x28", rows, cols);
    EXPECT_ERROR_MENTIONS(load_error(), "t10k-images-idx3-ubyte.gz", shape.c_str(), "reinstall");
  }
}

// Bytes after the end of the gzip stream that are not another gzip member were skipped by gzread:
// they are reported as data after the IDX payload is. A second member is gzip's own format.
TEST_F(FashionMnistBadInput, DataAfterTheGzipStream) {
  const Bytes labels = gzip_bytes(idx_labels(0x801, {4, 9, 0}));
  for (const Bytes& tail : {Bytes{'x'}, Bytes{'j', 'u', 'n', 'k', '\n'}, Bytes{0x1f}, Bytes(70000, 0)}) {
    Bytes gz = labels;
    gz.insert(gz.end(), tail.begin(), tail.end());
    write_raw("t10k-labels-idx1-ubyte.gz", gz);
    const std::string after = fmt::format("has data after the end of its gzip stream ({} byte", tail.size());
    EXPECT_ERROR_MENTIONS(load_error(), "t10k-labels-idx1-ubyte.gz", after.c_str(), "reinstall");
  }
  // The labels split over two gzip members, as `cat a.gz b.gz` makes: read as one stream.
  const Bytes raw = idx_labels(0x801, {4, 9, 0});
  Bytes two = gzip_bytes(Bytes(raw.begin(), raw.begin() + 5));
  const Bytes second = gzip_bytes(Bytes(raw.begin() + 5, raw.end()));
  two.insert(two.end(), second.begin(), second.end());
  write_raw("t10k-labels-idx1-ubyte.gz", two);
  EXPECT_EQ(load_error(), "");
}

// A file that is there but cannot be reached is not "not found; install it": the message gives
// the system's reason and a fix that fits it.
TEST_F(FashionMnistBadInput, AFileOutOfReachSaysWhy) {
  fs::remove(dir_ / "t10k-labels-idx1-ubyte.gz");
  fs::create_symlink("t10k-labels-idx1-ubyte.gz", dir_ / "t10k-labels-idx1-ubyte.gz");  // a link to itself
  const std::string loop = load_error();
  EXPECT_ERROR_MENTIONS(loop, "t10k-labels-idx1-ubyte.gz", "cannot be reached (Too many levels of symbolic links)",
                        "point the link at the real file");
  EXPECT_EQ(loop.find("not found"), std::string::npos) << loop;

  // No search permission on the folder: for others (0700) when root runs the test as nobody, else
  // for anyone (0000), restored for TearDown.
  fs::permissions(dir_, ::geteuid() == 0 ? fs::perms::owner_all : fs::perms::none);
  const std::string denied = unprivileged([&] { return load_error(); });
  fs::permissions(dir_, fs::perms::owner_all);
  EXPECT_ERROR_MENTIONS(denied, "t10k-images-idx3-ubyte.gz", "cannot be reached (Permission denied)",
                        "search permission");
}

TEST_F(FashionMnistBadInput, WrongMagic) {
  write_raw("t10k-images-idx3-ubyte.gz", gzip_bytes(idx_images(0x12345678, 3, 2, 4)));
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-images-idx3-ubyte.gz", "magic", "0x12345678", "0x00000803");
}

TEST_F(FashionMnistBadInput, SwappedFiles) {
  write_raw("t10k-labels-idx1-ubyte.gz", gzip_bytes(idx_images(0x803, 3, 28, 28)));
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-labels-idx1-ubyte.gz", "magic", "0x00000801", "swapped");
}

TEST_F(FashionMnistBadInput, ImplausibleHeader) {
  write_raw("t10k-images-idx3-ubyte.gz", gzip_bytes(idx_images(0x803, 3, 0, 4)));
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-images-idx3-ubyte.gz", "0x4");
  Bytes huge;
  put_be32(huge, 0x803);
  put_be32(huge, 0xffffffffu);
  put_be32(huge, 4000);
  put_be32(huge, 4000);
  write_raw("t10k-images-idx3-ubyte.gz", gzip_bytes(huge));
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-images-idx3-ubyte.gz", "implausibly large");
}

TEST_F(FashionMnistBadInput, CountMismatch) {
  write_raw("t10k-labels-idx1-ubyte.gz", gzip_bytes(idx_labels(0x801, {4, 9})));
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-labels-idx1-ubyte.gz", "2 labels", "t10k-images-idx3-ubyte.gz", "3 images");
}

// An image file cut short, whose header still declares more images than the intact label file has
// labels: the image file is said to be truncated, not the label file blamed for the counts.
TEST_F(FashionMnistBadInput, ImagesCutShortAreTruncatedNotACountMismatch) {
  Bytes raw = idx_images(0x803, 5, 28, 28);
  raw.resize(raw.size() - 2 * 784);  // 3 of the 5 images, as many as the labels
  write_raw("t10k-images-idx3-ubyte.gz", gzip_bytes(raw));
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-images-idx3-ubyte.gz", "truncated");
}

// A path that is not a file says what it is, and a link to nothing says where it points.
TEST_F(FashionMnistBadInput, NotAFileSaysWhatItIs) {
  fs::remove(dir_ / "t10k-images-idx3-ubyte.gz");
  fs::create_directory(dir_ / "t10k-images-idx3-ubyte.gz");
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-images-idx3-ubyte.gz", "is a folder, not a regular file", "--data");
  fs::remove(dir_ / "t10k-images-idx3-ubyte.gz");
  fs::create_symlink(dir_ / "nowhere.gz", dir_ / "t10k-images-idx3-ubyte.gz");
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-images-idx3-ubyte.gz", "is a symbolic link to", "nowhere.gz",
                        "which does not exist");
}

TEST_F(FashionMnistBadInput, LabelOutOfRange) {
  write_raw("t10k-labels-idx1-ubyte.gz", gzip_bytes(idx_labels(0x801, {4, 10, 0})));
  EXPECT_ERROR_MENTIONS(load_error(), "t10k-labels-idx1-ubyte.gz", "label 10", "sample 1", "out of range");
}

// A count above what the vectors hold is an error before anything is read, never a read past
// their end; a smaller count uses the first samples.
TEST(Dataset, CountBeyondTheVectorsIsRefused) {
  Dataset d;
  d.rows = d.cols = 2;
  d.count = 3;
  d.images.assign(2 * 4, 0.5f);
  d.labels.assign(2, 1);
  std::vector<std::byte> out(4 * sizeof(float));
  EXPECT_THROW(d.read("input", 0, 1, out), std::invalid_argument);
  d.count = 2;
  EXPECT_NO_THROW(d.read("input", 1, 1, out));
  d.count = 1;
  EXPECT_NO_THROW(d.validate());
}

}  // namespace
}  // namespace ferry::test
