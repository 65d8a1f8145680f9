// Fashion-MNIST loader: gzipped IDX files (big-endian header, then unsigned bytes) read with zlib.
#include "ferry/runtime/fashion_mnist.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "output_file.hpp"

namespace ferry {
namespace {

constexpr std::uint32_t kImagesMagic = 0x00000803;  // IDX, unsigned byte, 3 dimensions
constexpr std::uint32_t kLabelsMagic = 0x00000801;  // IDX, unsigned byte, 1 dimension
constexpr std::size_t kClasses = 10;
constexpr std::uint32_t kSide = 28;  // every Fashion-MNIST image is 28x28
// Sanity bounds on header fields, so a corrupt header cannot make us allocate gigabytes.
constexpr std::uint32_t kMaxSide = 4096;
constexpr std::uint64_t kMaxPayloadBytes = std::uint64_t{1} << 32;

constexpr std::string_view kInstallHint =
    "install it with `apt-get install dataset-fashion-mnist`, or set FERRY_DATA_DIR to a folder holding the four "
    "Fashion-MNIST .gz files";
constexpr std::string_view kReinstallHint =
    "reinstall the data set (`apt-get install --reinstall dataset-fashion-mnist`) or point FERRY_DATA_DIR at a "
    "folder with intact copies of the original files";

[[noreturn]] void fail(const std::filesystem::path& file, std::string_view problem, std::string_view what_to_do) {
  throw std::runtime_error(fmt::format("Fashion-MNIST file {}: {}; {}", file.string(), problem, what_to_do));
}

std::string describe_magic(std::uint32_t magic) {
  switch (magic) {
    case kImagesMagic:
      return "0x00000803 (an image file)";
    case kLabelsMagic:
      return "0x00000801 (a label file)";
    default:
      return fmt::format("{:#010x}", magic);
  }
}

// What to do about a data file that exists but cannot be reached (ec from its status): not a
// reinstall, which would not help, but what the reason points at.
std::string_view unreachable_hint(const std::error_code& ec) {
  if (ec == std::errc::permission_denied) {
    return "give this user search permission on the folders above it and read permission on the file (chmod a+rx "
           "on the folders, a+r on the file), or copy the data set to a folder of your own and point FERRY_DATA_DIR "
           "(or --data) at it";
  }
  if (ec == std::errc::too_many_symbolic_link_levels) {
    return "a symbolic link on its path leads round in a loop (or through too many links): point the link at the "
           "real file, or FERRY_DATA_DIR (or --data) at the folder that holds it";
  }
  return "check the path, or point FERRY_DATA_DIR (or --data) at a folder holding the four Fashion-MNIST .gz files";
}

// A gzip file read with zlib's inflate over the file's bytes, with every failure turned into an
// exception naming the file. Not gzread: it ends quietly at bytes after the gzip stream that are
// not another gzip member, and such a file is damaged as surely as one with data after its payload.
class GzInput {
 public:
  explicit GzInput(std::filesystem::path path) : path_(std::move(path)) {
    check_reachable();
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      const int err = errno;
      // Unreadable is not missing: reinstalling would not help, the permissions would.
      fail(path_, fmt::format("cannot be opened ({})", std::generic_category().message(err)),
           err == EACCES ? std::string_view("give this user read access to it (chmod a+r), or copy the data set to a "
                                            "folder of your own and point FERRY_DATA_DIR at it")
                         : kInstallHint);
    }
    if (inflateInit2(&zs_, 16 + MAX_WBITS) != Z_OK) {  // 16: a gzip wrapper, its CRC-32 and length checked
      ::close(fd_);
      throw std::bad_alloc();
    }
    buffer_.resize(std::size_t{1} << 20);
  }
  ~GzInput() {
    inflateEnd(&zs_);
    ::close(fd_);
  }
  GzInput(const GzInput&) = delete;
  GzInput& operator=(const GzInput&) = delete;

  // Reads up to n bytes; returns how many were read (fewer only at the end of the data).
  std::size_t read(void* dst, std::size_t n) {
    auto* out = static_cast<unsigned char*>(dst);
    std::size_t done = 0;
    while (done < n && !finished_) {
      if (zs_.avail_in < 2 && !refill() && zs_.avail_in == 0) {
        if (!seen_bytes_) fail(path_, "is empty (0 bytes)", kReinstallHint);
        if (in_member_) fail(path_, "is truncated (the gzip stream ends early)", kReinstallHint);
        finished_ = true;
        break;
      }
      seen_bytes_ = true;
      const bool gzip_magic = zs_.avail_in >= 2 && zs_.next_in[0] == 0x1f && zs_.next_in[1] == 0x8b;
      if (!checked_gzip_) {
        checked_gzip_ = true;
        if (!gzip_magic) fail(path_, "is not gzip-compressed (expected the .gz file as distributed)", kReinstallHint);
      }
      if (!in_member_) {
        // After a gzip member only another one may follow (as `cat a.gz b.gz` makes).
        if (!gzip_magic) fail(path_, trailing_bytes(), kReinstallHint);
        inflateReset(&zs_);
        in_member_ = true;
      }
      const auto chunk = static_cast<uInt>(std::min<std::size_t>(n - done, 1u << 30));
      zs_.next_out = out + done;
      zs_.avail_out = chunk;
      const int r = inflate(&zs_, Z_NO_FLUSH);
      done += chunk - zs_.avail_out;
      if (r == Z_STREAM_END) {
        in_member_ = false;
      } else if (r != Z_OK && r != Z_BUF_ERROR) {  // Z_BUF_ERROR: it needs more input, read above
        fail(path_, fmt::format("is corrupt (zlib: {})", zs_.msg ? zs_.msg : "unknown error"), kReinstallHint);
      }
    }
    return done;
  }

  std::uint32_t read_be32(std::string_view field) {
    std::array<unsigned char, 4> b{};
    const std::size_t got = read(b.data(), b.size());
    if (got != b.size()) {
      fail(path_, fmt::format("is truncated (the IDX header ends before the {} field)", field), kReinstallHint);
    }
    return (std::uint32_t{b[0]} << 24) | (std::uint32_t{b[1]} << 16) | (std::uint32_t{b[2]} << 8) | b[3];
  }

  // Reads exactly n payload bytes, then checks that nothing follows them. The buffer grows as
  // data arrives, so a header that promises gigabytes of a short file is reported as truncated
  // instead of allocating what it promises (fuzz/corpus/fashion_mnist/promises_1gib).
  std::vector<unsigned char> read_payload(std::size_t n, std::string_view what) {
    constexpr std::size_t step = std::size_t{16} << 20;
    std::vector<unsigned char> bytes;
    std::size_t got = 0;
    while (got < n) {
      const std::size_t want = std::min(step, n - got);
      bytes.resize(got + want);
      const std::size_t chunk = read(bytes.data() + got, want);
      got += chunk;
      if (chunk < want) break;
    }
    bytes.resize(got);
    if (got != n) {
      fail(path_, fmt::format("is truncated: its header promises {} bytes of {} but only {} follow", n, what, got),
           kReinstallHint);
    }
    unsigned char extra = 0;
    if (read(&extra, 1) != 0) {
      fail(path_, fmt::format("has data after the {} bytes of {} its header declares", n, what), kReinstallHint);
    }
    return bytes;
  }

  const std::filesystem::path& path() const { return path_; }

 private:
  void check_reachable() const {
    std::error_code ec;
    const auto status = std::filesystem::status(path_, ec);
    if (ec && status.type() != std::filesystem::file_type::not_found) {
      // There, but out of reach (no search permission, a link loop): "not found" would mislead.
      fail(path_, fmt::format("cannot be reached ({})", ec.message()), unreachable_hint(ec));
    }
    if (!std::filesystem::exists(status)) {
      const auto dir = path_.parent_path();
      if (!dir.empty() && std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec)) {
        fail(path_, fmt::format("not found: {} is a file, not a folder", dir.string()),
             "give --data (or FERRY_DATA_DIR) the folder holding the four Fashion-MNIST .gz files");
      }
      if (!dir.empty() && !std::filesystem::is_directory(dir, ec)) {
        fail(path_, fmt::format("not found (the folder {} does not exist)", dir.string()), kInstallHint);
      }
      if (std::filesystem::is_symlink(std::filesystem::symlink_status(path_, ec))) {
        fail(path_,
             fmt::format("is a symbolic link to {}, which does not exist",
                         std::filesystem::read_symlink(path_, ec).string()),
             "point the link at the file, or give --data (or FERRY_DATA_DIR) the folder holding the files");
      }
      if (path_.extension() == ".gz") {
        // Unpacked (gunzip, or a download of the plain files): said, not taken for a missing file.
        std::filesystem::path plain = path_;
        plain.replace_extension();
        if (std::filesystem::is_regular_file(plain, ec)) {
          fail(path_, fmt::format("not found, but {} is there uncompressed", plain.string()),
               fmt::format("compress it (gzip -k {}): ferry reads the four Fashion-MNIST files as .gz files",
                           plain.string()));
        }
      }
      fail(path_, "not found", kInstallHint);
    }
    if (!std::filesystem::is_regular_file(status)) {
      fail(path_, fmt::format("is {}, not a regular file", file_type_name(status.type())),
           "give --data (or FERRY_DATA_DIR) a folder whose four Fashion-MNIST files are .gz files");
    }
  }

  // Moves the unread input to the front of the buffer and reads more behind it; false at the end
  // of the file.
  bool refill() {
    if (zs_.avail_in > 0) std::memmove(buffer_.data(), zs_.next_in, zs_.avail_in);
    for (;;) {
      const ssize_t got = ::read(fd_, buffer_.data() + zs_.avail_in, buffer_.size() - zs_.avail_in);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) {
        fail(path_, fmt::format("cannot be read ({})", std::generic_category().message(errno)), kReinstallHint);
      }
      zs_.next_in = buffer_.data();
      zs_.avail_in += static_cast<uInt>(got);
      return got > 0;
    }
  }

  std::string trailing_bytes() const {
    struct stat st {};
    const off_t at = ::lseek(fd_, 0, SEEK_CUR);
    if (::fstat(fd_, &st) != 0 || at < 0 || st.st_size < at) {
      return "has data after the end of its gzip stream (bytes that are not gzip data)";
    }
    const std::uint64_t n = static_cast<std::uint64_t>(st.st_size - at) + zs_.avail_in;
    return fmt::format("has data after the end of its gzip stream ({} byte{} that {} not gzip data)", n,
                       n == 1 ? "" : "s", n == 1 ? "is" : "are");
  }

  std::filesystem::path path_;
  int fd_ = -1;
  z_stream zs_{};
  std::vector<unsigned char> buffer_;
  bool checked_gzip_ = false, seen_bytes_ = false, in_member_ = true, finished_ = false;
};

void expect_magic(GzInput& in, std::uint32_t expected) {
  const std::uint32_t magic = in.read_be32("magic number");
  if (magic != expected) {
    std::string hint = std::string(kReinstallHint);
    if (magic == kImagesMagic || magic == kLabelsMagic) {
      hint = "the image and label files look swapped; " + hint;
    }
    fail(in.path(),
         fmt::format("bad IDX magic number {}, expected {}", describe_magic(magic), describe_magic(expected)), hint);
  }
}

std::filesystem::path split_file(const std::filesystem::path& dir, Split split, std::string_view kind) {
  const std::string_view prefix = split == Split::train ? "train" : "t10k";
  return dir / fmt::format("{}-{}-ubyte.gz", prefix, kind);
}

}  // namespace

std::filesystem::path default_fashion_mnist_dir() {
  if (const char* dir = std::getenv("FERRY_DATA_DIR"); dir && *dir) return dir;
  return "/usr/share/datasets/fashion-mnist";
}

Dataset load_fashion_mnist(const std::filesystem::path& dir, Split split) {
  const auto images_path = split_file(dir, split, "images-idx3");
  const auto labels_path = split_file(dir, split, "labels-idx1");

  // Open both before reading either, so a missing label file is reported without decoding images.
  GzInput images(images_path);
  GzInput labels(labels_path);

  expect_magic(images, kImagesMagic);
  const std::uint32_t count = images.read_be32("image count");
  const std::uint32_t rows = images.read_be32("row count");
  const std::uint32_t cols = images.read_be32("column count");
  if (rows == 0 || cols == 0 || rows > kMaxSide || cols > kMaxSide) {
    fail(images_path, fmt::format("has implausible image size {}x{} in its header", rows, cols), kReinstallHint);
  }
  if (count == 0) fail(images_path, "holds no images (count 0 in its header)", kReinstallHint);
  const std::uint64_t pixels = std::uint64_t{count} * rows * cols;
  if (pixels > kMaxPayloadBytes) {
    fail(images_path, fmt::format("declares {} images of {}x{}, which is implausibly large", count, rows, cols),
         kReinstallHint);
  }
  // 14x56 holds 784 values too, so a model would train on it without a word, and the splits could
  // then disagree: only Fashion-MNIST's own shape is taken.
  if (rows != kSide || cols != kSide) {
    fail(images_path,
         fmt::format("holds {}x{} images, but Fashion-MNIST's are {}x{}: it is not a Fashion-MNIST image file", rows,
                     cols, kSide, kSide),
         kReinstallHint);
  }

  // The pixels before the labels: an image file cut short is said to be, rather than blamed on a
  // label file whose count differs from the one its header declares.
  const auto raw_pixels = images.read_payload(static_cast<std::size_t>(pixels), "pixels");

  expect_magic(labels, kLabelsMagic);
  const std::uint32_t label_count = labels.read_be32("label count");
  if (label_count != count) {
    fail(labels_path,
         fmt::format("holds {} labels but {} holds {} images", label_count, images_path.filename().string(), count),
         "the two files must come from the same split; " + std::string(kReinstallHint));
  }

  Dataset ds;
  ds.count = count;
  ds.rows = rows;
  ds.cols = cols;

  const auto raw_labels = labels.read_payload(count, "labels");
  ds.labels.resize(count);
  for (std::size_t i = 0; i < count; ++i) {
    if (raw_labels[i] >= kClasses) {
      fail(labels_path,
           fmt::format("label {} of sample {} is out of range (Fashion-MNIST has classes 0 to {})", raw_labels[i], i,
                       kClasses - 1),
           kReinstallHint);
    }
    ds.labels[i] = raw_labels[i];
  }

  std::array<float, 256> scale{};
  for (std::size_t v = 0; v < scale.size(); ++v) scale[v] = static_cast<float>(v) / 255.0f;
  ds.images.resize(raw_pixels.size());
  std::transform(raw_pixels.begin(), raw_pixels.end(), ds.images.begin(), [&](unsigned char p) { return scale[p]; });
  return ds;
}

void Dataset::validate() const {
  if (images.size() < count * sample_elems() || labels.size() < count) {
    throw std::invalid_argument(fmt::format(
        "dataset: count {} of {}x{} images needs {} pixels and {} labels, but it holds {} and {}: set count to at "
        "most the samples the vectors hold",
        count, rows, cols, count * sample_elems(), count, images.size(), labels.size()));
  }
}

void Dataset::read(std::string_view name, std::size_t first, std::size_t n, std::span<std::byte> out) const {
  validate();
  if (first + n > count) {
    throw std::invalid_argument(fmt::format("dataset: samples [{}, {}) requested of {}", first, first + n, count));
  }
  std::span<const std::byte> src;
  if (name == "input") {
    src = std::as_bytes(std::span(images).subspan(first * sample_elems(), n * sample_elems()));
  } else if (name == "labels") {
    src = std::as_bytes(std::span(labels).subspan(first, n));
  } else {
    throw std::invalid_argument(fmt::format(
        "a Fashion-MNIST dataset provides 'input' and 'labels', not '{}' (is the model a classifier?)", name));
  }
  if (out.size() != src.size()) {
    throw std::invalid_argument(fmt::format(
        "dataset: '{}' samples are {} bytes each, the model's are {}: give the model the data set's sample shape "
        "(Fashion-MNIST's input is [1, 28, 28] f32, its labels one i32 each)",
        name, src.size() / std::max<std::size_t>(n, 1), out.size() / std::max<std::size_t>(n, 1)));
  }
  std::memcpy(out.data(), src.data(), src.size());
}

}  // namespace ferry
