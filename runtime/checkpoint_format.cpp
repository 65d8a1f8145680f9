// The checkpoint file format (runtime/checkpoint_format.hpp): writer, reader, sections, records.
#include "checkpoint_format.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <tuple>
#include <type_traits>

#include "cl/fnv1a.hpp"
#include "output_file.hpp"

#ifndef FERRY_VERSION
#define FERRY_VERSION "unknown"
#endif

namespace ferry {

static_assert(std::endian::native == std::endian::little, "checkpoints are written little-endian, as the host is");

const char* ferry_version() noexcept {
  return FERRY_VERSION;
}

// FNV-1a's prime over 8-byte words (cl/fnv1a.hpp hashes bytes): the format's own checksum,
// documented in docs/checkpoints.md, about eight times fewer multiplies than bytewise.
std::uint64_t checkpoint_checksum(const void* data, std::size_t bytes, std::uint64_t seed) noexcept {
  constexpr std::uint64_t prime = cl::fnv1a_prime;
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t h = seed;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * prime;
  }
  for (; i < bytes; ++i) h = (h ^ p[i]) * prime;
  return h;
}

void check_checkpoint_path(const std::filesystem::path& path) {
  ckpt::check_names_a_file(path);
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw std::runtime_error(
        fmt::format("cannot write checkpoints to '{}': it is a folder; give a file name in it, e.g. '{}'",
                    path.string(), (path / "run.ckpt").string()));
  }
  const auto folder = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  if (const auto why = missing_folder(path)) {
    throw std::runtime_error(fmt::format("cannot write checkpoints to '{}': {}", path.string(), *why));
  }
  if (const std::size_t longest = longest_file_name(path); path.filename().string().size() > longest) {
    throw std::runtime_error(fmt::format(
        "cannot write checkpoints to '{}': its file name is {} bytes long, longer than the {} the file system of '{}' "
        "takes: give a shorter name",
        path.string(), path.filename().string().size(), longest, folder.string()));
  }
  ckpt::AtomicFile probe(path);  // created, then removed by its destructor: the folder is writable
  probe.put(std::uint64_t{0});
}

namespace ckpt {
namespace {

std::string errno_text(int e) {
  return std::strerror(e);
}

// A small section's payload, built in memory.
class Payload {
 public:
  template <class T>
  void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof v);
  }
  void put_string(const std::string& s) {
    put(static_cast<std::uint32_t>(s.size()));
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    bytes_.insert(bytes_.end(), p, p + s.size());
  }
  void put_doubles(const std::vector<double>& v) {
    put(static_cast<std::uint32_t>(v.size()));
    for (double d : v) put(d);
  }
  const std::vector<std::byte>& bytes() const { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

// Reads a small section's payload back; running past its end means the writer and reader
// disagree, which the checksum has already ruled out for damage, so it is reported as corrupt.
class Cursor {
 public:
  Cursor(const std::vector<std::byte>& bytes, const Reader& r) : bytes_(bytes), r_(r) {}
  template <class T>
  T get() {
    T v;
    need(sizeof v);
    std::memcpy(&v, bytes_.data() + at_, sizeof v);
    at_ += sizeof v;
    return v;
  }
  std::string get_string() {
    const auto n = get<std::uint32_t>();
    need(n);
    std::string s(reinterpret_cast<const char*>(bytes_.data() + at_), n);
    at_ += n;
    return s;
  }
  std::vector<double> get_doubles() {
    const auto n = get<std::uint32_t>();
    need(std::uint64_t{n} * sizeof(double));
    std::vector<double> v(n);
    for (auto& d : v) d = get<double>();
    return v;
  }
  void finish() const {
    if (at_ != bytes_.size()) fail();
  }
  std::size_t left() const { return bytes_.size() - at_; }

 private:
  void need(std::uint64_t n) const {
    if (n > bytes_.size() - at_) fail();
  }
  [[noreturn]] void fail() const {
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' is corrupt: a section's contents do not parse although its checksum holds (written by "
        "another ferry build?); {}: use another checkpoint",
        r_.path().string(), r_.unchanged()));
  }
  const std::vector<std::byte>& bytes_;
  const Reader& r_;
  std::size_t at_ = 0;
};

// The checksum of a section's head (tag, reserved 0, length), to be continued over its payload.
Checksum head_checksum(std::uint32_t tag, std::uint64_t length) {
  const std::uint32_t reserved = 0;
  Checksum sum;
  sum.add(&tag, 4);
  sum.add(&reserved, 4);
  sum.add(&length, 8);
  return sum;
}

// Writes one section: its head, then payload pieces adding up to the length announced, then
// the checksum.
class SectionWriter {
 public:
  SectionWriter(AtomicFile& f, std::uint32_t t, std::uint64_t length)
      : f_(f), left_(length), sum_(head_checksum(t, length)) {
    const std::uint32_t reserved = 0;
    f_.put(t);
    f_.put(reserved);
    f_.put(length);
  }
  void add(const void* data, std::size_t n) {
    if (n > left_) throw std::logic_error("checkpoint section longer than announced");
    sum_.add(data, n);
    f_.write(data, n);
    left_ -= n;
  }
  void end() {
    if (left_ != 0) throw std::logic_error("checkpoint section shorter than announced");
    f_.put(sum_.value());
  }

 private:
  AtomicFile& f_;
  std::uint64_t left_;
  Checksum sum_;
};

void write_section(AtomicFile& f, std::uint32_t t, const std::vector<std::byte>& payload) {
  SectionWriter w(f, t, payload.size());
  w.add(payload.data(), payload.size());
  w.end();
}

// Finds the first value that is not finite in a tensor section's payload (its name, 4 + name
// bytes, then the elements), fed in the chunks its checksum reads, which need not end on an element.
class FirstNonFinite {
 public:
  FirstNonFinite(std::size_t name_bytes, ops::DType dtype)
      : skip_(4 + name_bytes),
        width_(dtype == ops::DType::f32 ? 4 : 2),
        exponent_(dtype == ops::DType::f32   ? 0x7F800000u
                  : dtype == ops::DType::f16 ? 0x7C00u
                                             : 0x7F80u),
        mantissa_(dtype == ops::DType::f32   ? 0x7FFFFFu
                  : dtype == ops::DType::f16 ? 0x3FFu
                                             : 0x7Fu) {}
  static bool applies(ops::DType d) { return d == ops::DType::f32 || d == ops::DType::f16 || d == ops::DType::bf16; }
  void feed(const std::byte* p, std::size_t n) {
    if (found_) return;
    if (skip_ > 0) {
      const std::size_t s = std::min(skip_, n);
      skip_ -= s, p += s, n -= s;
    }
    while (n > 0 && partial_ > 0) {  // an element begun in the last chunk
      element_[partial_++] = *p++, --n;
      if (partial_ == width_) {
        partial_ = 0;
        if (check(element_, 1)) return;
      }
    }
    const std::size_t whole = n / width_;
    if (check(p, whole)) return;
    for (std::size_t i = whole * width_; i < n; ++i) element_[partial_++] = p[i];
  }
  const std::optional<Contents::NonFinite>& found() const { return found_; }

 private:
  // Checks `count` elements at `p`; true when one is not finite (found_ then says which).
  bool check(const std::byte* p, std::size_t count) {
    const auto bits = [&](std::size_t i) {
      if (width_ == 4) {
        std::uint32_t u = 0;
        std::memcpy(&u, p + 4 * i, 4);
        return u;
      }
      std::uint16_t h = 0;
      std::memcpy(&h, p + 2 * i, 2);
      return std::uint32_t{h};
    };
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint32_t u = bits(i);
      if ((u & exponent_) != exponent_) continue;
      Contents::NonFinite f;
      f.element = seen_ + i;
      f.nan = (u & mantissa_) != 0;
      f.negative = (u >> (8 * width_ - 1)) != 0;
      found_ = f;
      return true;
    }
    seen_ += count;
    return false;
  }
  std::size_t skip_;
  std::size_t width_;
  std::uint32_t exponent_, mantissa_;  // the bits of an exponent of all ones, and of the mantissa
  std::byte element_[4] = {};
  std::size_t partial_ = 0;
  std::uint64_t seen_ = 0;  // elements checked
  std::optional<Contents::NonFinite> found_;
};

// Reads the section at `offset`, checks its tag is `expected` and (when given) its length, and
// verifies its checksum by reading it through; small payloads are kept in `keep`; a large one
// is shown to `watch` chunk by chunk.
Section read_section(const Reader& r, std::uint64_t offset, std::uint32_t expected, const std::string& what,
                     std::optional<std::uint64_t> length = std::nullopt, std::vector<std::byte>* keep = nullptr,
                     FirstNonFinite* watch = nullptr) {
  if (offset > r.size() || r.size() - offset < section_head_bytes + 8) {
    throw r.truncated(offset + section_head_bytes + 8, fmt::format("section {} (at byte {})", what, offset));
  }
  unsigned char head[section_head_bytes];
  r.read(offset, head, sizeof head);
  Section s;
  s.offset = offset;
  std::uint32_t reserved = 0;
  std::memcpy(&s.tag, head, 4);
  std::memcpy(&reserved, head + 4, 4);
  std::memcpy(&s.length, head + 8, 8);
  Checksum sum;
  sum.add(head, sizeof head);
  if (s.tag != expected) {
    throw r.corrupt(fmt::format("at byte {} the file has a section '{}' where section {} ('{}') belongs", offset,
                                tag_text(s.tag), what, tag_text(expected)));
  }
  if (reserved != 0) {
    throw r.corrupt(
        fmt::format("section {} at byte {} has {:#x} in its reserved word (bytes {} to {}), which a "
                    "writer leaves 0",
                    what, offset, reserved, offset + 4, offset + 7));
  }
  if (s.length > r.size() - offset - section_head_bytes - 8) {
    throw r.truncated(
        offset + section_head_bytes + 8 + s.length,
        fmt::format("section {} (at byte {}, {} bytes long by its length field)", what, offset, s.length));
  }
  if (length && s.length != *length) {
    throw r.corrupt(fmt::format("section {} at byte {} is {} bytes long, not {}", what, offset, s.length, *length));
  }
  std::vector<std::byte> local;
  std::vector<std::byte>& buf = keep ? *keep : local;
  if (keep) {
    buf.resize(s.length);
    r.read(s.payload(), buf.data(), buf.size());
    sum.add(buf.data(), buf.size());
  } else {
    buf.resize(std::min<std::uint64_t>(s.length, io_chunk));
    for (std::uint64_t done = 0; done < s.length;) {
      const std::size_t n = std::min<std::uint64_t>(buf.size(), s.length - done);
      r.read(s.payload() + done, buf.data(), n);
      sum.add(buf.data(), n);
      if (watch) watch->feed(buf.data(), n);
      done += n;
    }
  }
  r.read(s.payload() + s.length, &s.checksum, 8);
  if (sum.value() != s.checksum) {
    throw r.corrupt(fmt::format("section {} (bytes {} to {}) fails its checksum", what, offset, s.end()));
  }
  return s;
}

// The header: magic, format version, the writer's ferry version, its checksum.
void write_header(AtomicFile& f) {
  unsigned char h[header_bytes] = {};
  std::memcpy(h, checkpoint_magic, 8);
  const std::uint32_t version = checkpoint_format_version;
  std::memcpy(h + 8, &version, 4);
  std::strncpy(reinterpret_cast<char*>(h + 16), ferry_version(), 15);
  const std::uint64_t sum = checkpoint_checksum(h, 32);
  std::memcpy(h + 32, &sum, 8);
  f.write(h, sizeof h);
}

// Returns the file's format version and the release that wrote it.
std::pair<std::uint32_t, std::string> read_header(const Reader& r) {
  unsigned char h[header_bytes] = {};
  const std::size_t have = std::min<std::uint64_t>(r.size(), header_bytes);
  r.read(0, h, have);
  if (have == 0) {
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' is empty (0 bytes): its writer may have been stopped before writing anything; {}: use "
        "another checkpoint",
        r.path().string(), r.unchanged()));
  }
  if (have < 8 || std::memcmp(h, checkpoint_magic, 8) != 0) {
    if (have < 8 && std::memcmp(h, checkpoint_magic, have) == 0) throw r.truncated(header_bytes, "the header");
    throw std::runtime_error(
        fmt::format("'{}' is not a ferry checkpoint (it does not start with {}): pass a file written by ferry train "
                    "--checkpoint or Trainer::save_checkpoint",
                    r.path().string(), checkpoint_magic));
  }
  if (have < header_bytes) throw r.truncated(header_bytes, "the header");
  std::uint64_t sum = 0;
  std::memcpy(&sum, h + 32, 8);
  if (checkpoint_checksum(h, 32) != sum) throw r.corrupt("the header (bytes 0 to 40) fails its checksum");
  std::uint32_t version = 0;
  std::memcpy(&version, h + 8, 4);
  // The writer's version as text: printable ASCII kept, anything else (a damaged or crafted header
  // whose checksum holds) shown as '?', never sent to a terminal as it is.
  char writer[16] = {};
  std::memcpy(writer, h + 16, 15);
  for (char* c = writer; *c; ++c) {
    if (*c < 0x20 || *c > 0x7e) *c = '?';
  }
  if (version > checkpoint_format_version) {
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' has format version {} (written by ferry {}), newer than this ferry {} reads (up to version "
        "{}): load it with ferry {} or newer",
        r.path().string(), version, writer, ferry_version(), checkpoint_format_version, writer));
  }
  if (version == 0) throw r.corrupt("the header's format version is 0");
  return {version, std::string(writer)};
}

std::vector<std::byte> encode_trainer(const TrainerRecord& t) {
  Payload p;
  p.put(t.steps);
  p.put(t.micro);
  p.put(t.lr);
  for (std::size_t i = 0; i < phase_count; ++i) {
    p.put(t.phase_ms[i]);
    p.put(t.phase_steps[i]);
  }
  p.put(t.loss_scale);
  p.put(t.clean_steps);
  p.put(t.overflows);
  p.put(static_cast<std::uint8_t>(t.in_predict_run));
  p.put(static_cast<std::uint32_t>(t.gains.size()));
  for (float g : t.gains) p.put(g);
  return p.bytes();
}

TrainerRecord decode_trainer(const std::vector<std::byte>& bytes, const Reader& r) {
  Cursor c(bytes, r);
  TrainerRecord t;
  t.steps = c.get<std::uint64_t>();
  t.micro = c.get<std::uint32_t>();
  t.lr = c.get<float>();
  for (std::size_t i = 0; i < phase_count; ++i) {
    t.phase_ms[i] = c.get<double>();
    t.phase_steps[i] = c.get<std::uint64_t>();
  }
  t.loss_scale = c.get<float>();
  t.clean_steps = c.get<std::uint32_t>();
  t.overflows = c.get<std::uint64_t>();
  t.in_predict_run = c.get<std::uint8_t>() != 0;
  const auto gains = c.get<std::uint32_t>();
  if (gains > c.left() / sizeof(float)) throw r.corrupt("section TRNR holds more gains than bytes");
  t.gains.resize(gains);
  for (auto& g : t.gains) g = c.get<float>();
  c.finish();
  return t;
}

std::vector<std::byte> encode_phases(const std::optional<PhaseController::State>& phases) {
  Payload p;
  p.put(static_cast<std::uint8_t>(phases.has_value()));
  if (phases) {
    const PhaseController::State& s = *phases;
    p.put(static_cast<std::uint8_t>(s.next));
    for (auto n : s.counts.steps) p.put(n);
    p.put(s.counts.runs);
    p.put(s.counts.ended);
    p.put(s.counts.restores);
    p.put(s.length);
    p.put(s.in_phase);
    p.put(s.since_fit);
    p.put(static_cast<std::uint8_t>(s.cut_short));
    p.put(s.last_quality);
    p.put_doubles(s.losses);
    p.put_doubles(s.qualities);
    p.put_doubles(s.predict_losses);
  }
  return p.bytes();
}

std::optional<PhaseController::State> decode_phases(const std::vector<std::byte>& bytes, const Reader& r) {
  Cursor c(bytes, r);
  std::optional<PhaseController::State> phases;
  if (c.get<std::uint8_t>()) {
    PhaseController::State s;
    const auto next = c.get<std::uint8_t>();
    if (next >= phase_count) throw r.corrupt(fmt::format("section PHAS names phase {} of {}", next, phase_count));
    s.next = static_cast<Phase>(next);
    for (auto& n : s.counts.steps) n = c.get<std::uint64_t>();
    s.counts.runs = c.get<std::uint64_t>();
    s.counts.ended = c.get<std::uint64_t>();
    s.counts.restores = c.get<std::uint64_t>();
    s.length = c.get<std::uint32_t>();
    s.in_phase = c.get<std::uint32_t>();
    s.since_fit = c.get<std::uint32_t>();
    s.cut_short = c.get<std::uint8_t>() != 0;
    s.last_quality = c.get<double>();
    s.losses = c.get_doubles();
    s.qualities = c.get_doubles();
    s.predict_losses = c.get_doubles();
    phases = std::move(s);
  }
  c.finish();
  return phases;
}

}  // namespace

std::string tag_text(std::uint32_t t) {
  std::string s;
  for (int i = 0; i < 4; ++i) {
    const char c = static_cast<char>((t >> (8 * i)) & 0xff);
    s += (c >= 0x20 && c < 0x7f) ? c : '?';
  }
  return s;
}

void Checksum::add(const void* data, std::size_t n) {
  if (n == 0) return;  // data may be null then (an empty span), which memcpy must not see
  const auto* p = static_cast<const unsigned char*>(data);
  if (pending_n_) {
    const std::size_t take = std::min(n, 8 - pending_n_);
    std::memcpy(pending_ + pending_n_, p, take);
    pending_n_ += take;
    p += take;
    n -= take;
    if (pending_n_ < 8) return;
    h_ = checkpoint_checksum(pending_, 8, h_);
    pending_n_ = 0;
  }
  const std::size_t whole = n & ~std::size_t{7};
  h_ = checkpoint_checksum(p, whole, h_);
  std::memcpy(pending_, p + whole, n - whole);
  pending_n_ = n - whole;
}

// ---- AtomicFile ----

void check_names_a_file(const std::filesystem::path& path) {
  if (path.empty() || path.filename().empty() || path.filename() == "." || path.filename() == "..") {
    throw std::runtime_error(fmt::format(
        "cannot write checkpoints to '{}': it names no file; give a file name, e.g. 'run.ckpt'", path.string()));
  }
}

AtomicFile::AtomicFile(const std::filesystem::path& path) : path_(path) {
  check_names_a_file(path_);
  const auto folder = path_.parent_path().empty() ? std::filesystem::path(".") : path_.parent_path();
  remove_stale_temporaries(path_, "tmp");  // a killed write's leftovers, as large as the checkpoint
  for (int attempt = 0;; ++attempt) {
    temp_ = temporary_beside(path_, "tmp");  // a new name each attempt
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ >= 0) break;
    if (errno != EEXIST || attempt > 100) {
      throw std::runtime_error(
          fmt::format("cannot write checkpoint '{}': creating a file in '{}' failed ({}): choose a writable folder",
                      path_.string(), folder.string(), errno_text(errno)));
    }
  }
  buffer_.reserve(io_chunk);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temp_.c_str());
}

void AtomicFile::write(const void* data, std::size_t n) {
  const auto* p = static_cast<const std::byte*>(data);
  if (buffer_.size() + n > io_chunk) flush();
  if (n >= io_chunk) {
    write_all(p, n);
  } else {
    buffer_.insert(buffer_.end(), p, p + n);
  }
  offset_ += n;
}

void AtomicFile::finish() {
  if (fd_ < 0) return;
  flush();
  if (::fsync(fd_) != 0) fail("syncing");
  if (::close(fd_) != 0) {
    fd_ = -1;
    fail("closing");
  }
  fd_ = -1;
}

void AtomicFile::commit() {
  finish();
  keep_mode_of(path_, temp_);
  if (::rename(temp_.c_str(), path_.c_str()) != 0) fail(fmt::format("renaming it to '{}'", path_.string()));
  committed_ = true;
  // The rename is durable once the folder is synced.
  const auto folder = path_.parent_path().empty() ? std::filesystem::path(".") : path_.parent_path();
  const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

void AtomicFile::flush() {
  if (!buffer_.empty()) write_all(buffer_.data(), buffer_.size());
  buffer_.clear();
}

void AtomicFile::write_all(const std::byte* p, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("writing");
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

void AtomicFile::fail(const std::string& doing) const {
  const int e = errno;
  throw std::runtime_error(fmt::format(
      "cannot write checkpoint '{}': {} the temporary file '{}' failed ({}); any earlier checkpoint at that path "
      "is unchanged: free space or choose another folder",
      path_.string(), doing, temp_.string(), errno_text(e)));
}

// ---- Reader ----

Reader::Reader(const std::filesystem::path& path, std::string unchanged)
    : path_(path), unchanged_(std::move(unchanged)) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever, before the
  // check below could refuse it. Cleared once the file is known to be a regular one.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) {
    throw std::runtime_error(
        fmt::format("cannot open checkpoint '{}': {}: check the path", path.string(), errno_text(errno)));
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    std::error_code ec;
    throw std::runtime_error(
        fmt::format("checkpoint '{}' is {}, not a regular file: pass the checkpoint file itself (what "
                    "Trainer::save_checkpoint or ferry train --checkpoint wrote)",
                    path.string(), file_type_name(std::filesystem::status(path, ec).type())));
  }
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags != -1) ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK);
  size_ = static_cast<std::uint64_t>(st.st_size);
}

Reader::~Reader() {
  ::close(fd_);
}

void Reader::read(std::uint64_t offset, void* dst, std::size_t n) const {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      throw std::runtime_error(fmt::format("cannot read checkpoint '{}' at byte {}: {}; {}", path_.string(), offset,
                                           errno_text(errno), unchanged_));
    }
    if (r == 0) throw truncated(offset + n, "the file");
    p += r;
    offset += static_cast<std::uint64_t>(r);
    n -= static_cast<std::size_t>(r);
  }
}

std::runtime_error Reader::corrupt(const std::string& what) const {
  return std::runtime_error(
      fmt::format("checkpoint '{}' is corrupt: {}; {}: use another checkpoint (an earlier one, or retrain)",
                  path_.string(), what, unchanged_));
}

std::runtime_error Reader::truncated(std::uint64_t end, const std::string& where) const {
  return std::runtime_error(fmt::format(
      "checkpoint '{}' is truncated or corrupt: {} needs the file to reach byte {}, and it has {} bytes; the "
      "writer may have been stopped, or the file damaged in a copy; {}: use another checkpoint",
      path_.string(), where, end, size_, unchanged_));
}

// ---- Fingerprint ----

std::vector<std::byte> Fingerprint::encode() const {
  Payload p;
  p.put_string(model);
  p.put_string(optimizer);
  p.put(batch);
  p.put(accumulate);
  p.put(precision);
  p.put(scaled);
  p.put(hybrid);
  p.put(static_cast<std::uint32_t>(tensors.size()));
  for (const auto& t : tensors) {
    p.put_string(t.name);
    p.put(t.dtype);
    p.put(t.shape.rank);
    for (std::uint8_t i = 0; i < t.shape.rank; ++i) p.put(t.shape.dims[i]);
    p.put(t.bytes);
  }
  return p.bytes();
}

Fingerprint Fingerprint::decode(const std::vector<std::byte>& bytes, const Reader& r) {
  Cursor c(bytes, r);
  Fingerprint f;
  f.model = c.get_string();
  f.optimizer = c.get_string();
  f.batch = c.get<std::uint32_t>();
  f.accumulate = c.get<std::uint32_t>();
  f.precision = c.get<std::uint8_t>();
  f.scaled = c.get<std::uint8_t>();
  f.hybrid = c.get<std::uint8_t>();
  const auto n = c.get<std::uint32_t>();
  for (std::uint32_t i = 0; i < n; ++i) {
    Tensor t;
    t.name = c.get_string();
    t.dtype = c.get<std::uint8_t>();
    t.shape.rank = c.get<std::uint8_t>();
    if (t.shape.rank > t.shape.dims.size()) throw r.corrupt("a tensor in the fingerprint has rank above 4");
    for (std::uint8_t d = 0; d < t.shape.rank; ++d) t.shape.dims[d] = c.get<std::uint32_t>();
    t.bytes = c.get<std::uint64_t>();
    f.tensors.push_back(std::move(t));
  }
  c.finish();
  return f;
}

std::vector<std::byte> Fingerprint::encode_settings() const {
  Payload p;
  const std::vector<TrainingSetting> none;
  const auto& list = settings ? *settings : none;
  p.put(static_cast<std::uint32_t>(list.size()));
  for (const auto& s : list) {
    p.put_string(s.name);
    p.put_string(s.flag);
    p.put_string(s.value);
  }
  return p.bytes();
}

std::vector<TrainingSetting> Fingerprint::decode_settings(const std::vector<std::byte>& bytes, const Reader& r) {
  Cursor c(bytes, r);
  std::vector<TrainingSetting> out;
  const auto n = c.get<std::uint32_t>();
  for (std::uint32_t i = 0; i < n; ++i) {
    TrainingSetting s;
    s.name = c.get_string();
    s.flag = c.get_string();
    s.value = c.get_string();
    out.push_back(std::move(s));
  }
  c.finish();
  return out;
}

// ---- Whole files ----

std::string Contents::NonFinite::value_text() const {
  return nan ? "nan" : negative ? "-inf" : "inf";
}

Contents read_contents(const Reader& r) {
  Contents c;
  std::tie(c.format_version, c.writer) = read_header(r);
  const std::uint32_t version = c.format_version;
  std::uint64_t at = header_bytes, sections = 0;
  std::vector<std::byte> bytes;
  const auto next = [&](std::uint32_t tg, const char* what, std::vector<std::byte>* keep) {
    const Section s = read_section(r, at, tg, what, std::nullopt, keep);
    at = s.end();
    ++sections;
  };
  next(tag_model, "MODL (the model fingerprint)", &bytes);
  c.fingerprint = Fingerprint::decode(bytes, r);
  if (version >= 2) {
    next(tag_settings, "SETS (the training settings)", &bytes);
    c.fingerprint.settings = Fingerprint::decode_settings(bytes, r);
  }
  next(tag_trainer, "TRNR (the trainer's counters)", &bytes);
  c.trainer = decode_trainer(bytes, r);
  next(tag_phases, "PHAS (the phase controller)", &bytes);
  c.phases = decode_phases(bytes, r);
  next(tag_caller, "CALR (the caller's state)", &c.caller);

  // The tensors: verified by reading them through, their places kept for read_tensor.
  const auto tensor_section = [&](std::uint32_t tg, const Fingerprint::Tensor& ft, const char* kind) {
    const std::string what = fmt::format("{} {} of tensor '{}'", tag_text(tg), kind, ft.name);
    // The name first, so a section of another tensor is named as such.
    if (at <= r.size() && r.size() - at >= section_head_bytes + 4 + ft.name.size()) {
      std::uint32_t len = 0;
      r.read(at + section_head_bytes, &len, 4);
      std::string name(len == ft.name.size() ? len : 0, '\0');
      if (len == ft.name.size()) r.read(at + section_head_bytes + 4, name.data(), len);
      if (len != ft.name.size() || name != ft.name) {
        // Either damage or sections out of order: the checksum tells which.
        read_section(r, at, tg, what);
        throw r.corrupt(
            fmt::format("at byte {} the file holds another tensor than '{}', which belongs there", at, ft.name));
      }
    }
    if (ft.bytes > r.size()) throw r.truncated(at + ft.bytes, what);
    const auto dtype = static_cast<ops::DType>(ft.dtype);
    std::optional<FirstNonFinite> watch;
    if (FirstNonFinite::applies(dtype)) watch.emplace(ft.name.size(), dtype);
    const Section sec =
        read_section(r, at, tg, what, 4 + ft.name.size() + ft.bytes, nullptr, watch ? &*watch : nullptr);
    if (watch && watch->found()) {
      Contents::NonFinite f = *watch->found();
      f.tensor = static_cast<std::size_t>(&ft - c.fingerprint.tensors.data());
      f.restore = tg == tag_restore;
      c.non_finite.push_back(f);
    }
    at = sec.end();
    ++sections;
    return sec;
  };
  for (const auto& ft : c.fingerprint.tensors) c.tensors.push_back(tensor_section(tag_tensor, ft, "(a tensor)"));
  if (c.trainer.in_predict_run) {
    // Two gains per weight (ops/predictor.hpp: the gain of d and the weight of r), so the weights
    // are the first gains.size() / 2 tensors.
    const std::size_t gains = c.trainer.gains.size();
    if (gains % 2 != 0 || gains / 2 > c.fingerprint.tensors.size())
      throw r.corrupt("section TRNR holds an odd number of gains, or more than two per weight");
    for (std::size_t i = 0; i < gains / 2; ++i) {
      c.restores.push_back(tensor_section(tag_restore, c.fingerprint.tensors[i], "(the weight before a Predict run)"));
    }
  }
  const Section s = read_section(r, at, tag_end, "END! (the end)", 16, &bytes);
  Cursor ec(bytes, r);
  const auto end_sections = ec.get<std::uint64_t>();
  const auto end_offset = ec.get<std::uint64_t>();
  if (end_sections != sections || end_offset != at) {
    throw r.corrupt(fmt::format("the END! section counts {} sections before byte {}, the file has {} before byte {}",
                                end_sections, end_offset, sections, at));
  }
  if (s.end() != r.size()) {
    throw r.corrupt(
        fmt::format("{} bytes follow the END! section, which ends at byte {}", r.size() - s.end(), s.end()));
  }
  return c;
}

std::optional<std::span<const std::byte>> read_tensor(const Reader& r, const Section& s, std::size_t name_bytes,
                                                      std::vector<std::byte>& buf) {
  buf.resize(s.length);
  r.read(s.payload(), buf.data(), buf.size());
  Checksum sum = head_checksum(s.tag, s.length);
  sum.add(buf.data(), buf.size());
  if (sum.value() != s.checksum) return std::nullopt;
  return std::span<const std::byte>(buf).subspan(4 + name_bytes);
}

namespace {

// The sections of a checkpoint, in order, into `f` (write_checkpoint).
void write_sections(AtomicFile& f, const Fingerprint& fingerprint, const TrainerRecord& trainer,
                    const std::optional<PhaseController::State>& phases, std::span<const std::byte> caller,
                    const std::function<void(std::size_t, std::vector<std::byte>&)>& tensor,
                    std::span<const std::vector<std::byte>> restores) {
  std::uint64_t sections = 0;
  write_header(f);
  write_section(f, tag_model, fingerprint.encode());
  write_section(f, tag_settings, fingerprint.encode_settings());
  write_section(f, tag_trainer, encode_trainer(trainer));
  write_section(f, tag_phases, encode_phases(phases));
  write_section(f, tag_caller, std::vector<std::byte>(caller.begin(), caller.end()));
  sections += 5;

  // One tensor at a time, through one buffer.
  const auto write_tensor_section = [&](std::uint32_t tg, const std::string& name, const void* data,
                                        std::size_t bytes) {
    const auto name_len = static_cast<std::uint32_t>(name.size());
    SectionWriter w(f, tg, 4 + name.size() + bytes);
    w.add(&name_len, 4);
    w.add(name.data(), name.size());
    w.add(data, bytes);
    w.end();
    ++sections;
  };
  std::vector<std::byte> buf;
  for (std::size_t i = 0; i < fingerprint.tensors.size(); ++i) {
    buf.resize(fingerprint.tensors[i].bytes);
    tensor(i, buf);
    write_tensor_section(tag_tensor, fingerprint.tensors[i].name, buf.data(), buf.size());
  }
  for (std::size_t i = 0; i < restores.size(); ++i) {
    write_tensor_section(tag_restore, fingerprint.tensors[i].name, restores[i].data(), restores[i].size());
  }
  Payload end;
  end.put(sections);
  end.put(f.offset());
  write_section(f, tag_end, end.bytes());
}

}  // namespace

bool load_refuses(graph::Role role, const Contents::NonFinite& bad) {
  if (bad.restore) return true;
  if (role == graph::Role::gradient_sum) return false;
  return role != graph::Role::optimizer_state || bad.nan;
}

std::string role_text(graph::Role role, const Contents::NonFinite& bad) {
  return bad.restore                            ? "the restore point (weights before a Predict run) of"
         : role == graph::Role::weight          ? "weight"
         : role == graph::Role::optimizer_state ? "optimizer state"
         : role == graph::Role::gradient_sum    ? "gradient sum"
                                                : "predictor state";
}

graph::Role role_by_name(const Fingerprint& f, std::size_t i) {
  const std::string& name = f.tensors.at(i).name;
  for (const Fingerprint::Tensor& other : f.tensors) {
    const std::string& base = other.name;
    if (base.size() + 1 >= name.size() || name.compare(0, base.size(), base) != 0 || name[base.size()] != '.') continue;
    const std::string_view suffix = std::string_view(name).substr(base.size() + 1);
    if (suffix == "grad_sum") return graph::Role::gradient_sum;
    if (suffix.starts_with("pred_")) return graph::Role::predictor_state;
    return graph::Role::optimizer_state;
  }
  return graph::Role::weight;
}

std::optional<std::string> resume_refusal(const Contents& c) {
  for (const Contents::NonFinite& n : c.non_finite) {
    const graph::Role role = role_by_name(c.fingerprint, n.tensor);
    if (!load_refuses(role, n)) continue;
    return fmt::format("element {} of {} '{}' is {}", n.element, role_text(role, n),
                       c.fingerprint.tensors[n.tensor].name, n.value_text());
  }
  return std::nullopt;
}

void write_checkpoint(const std::filesystem::path& path, const Fingerprint& fingerprint, const TrainerRecord& trainer,
                      const std::optional<PhaseController::State>& phases, std::span<const std::byte> caller,
                      const std::function<void(std::size_t, std::vector<std::byte>&)>& tensor,
                      std::span<const std::vector<std::byte>> restores, bool replace_foreign_file,
                      const std::function<bool(bool)>& agree, bool lock) {
  std::optional<OutputLock> held;  // until the file is in place
  std::optional<AtomicFile> file;
  try {
    refuse_to_replace(path, "checkpoint", std::string_view(checkpoint_magic, 8), replace_foreign_file);
    if (lock) held.emplace(path, "checkpoint");
    file.emplace(path);
    write_sections(*file, fingerprint, trainer, phases, caller, tensor, restores);
    file->finish();
  } catch (...) {
    if (agree) agree(false);  // the other ranks learn of it, and keep their files
    throw;
  }
  if (agree && !agree(true)) {
    throw std::runtime_error(fmt::format(
        "cannot write checkpoint '{}': another rank could not write its file of this checkpoint (its error says "
        "why), so no rank replaced its file: the earlier checkpoint is unchanged",
        path.string()));
  }
  file->commit();
}

std::uint64_t checkpoint_file_bytes(const Fingerprint& fingerprint, const TrainerRecord& trainer,
                                    const std::optional<PhaseController::State>& phases, std::size_t caller_bytes,
                                    std::size_t restored) {
  const auto section = [](std::uint64_t payload) { return section_head_bytes + payload + sizeof(std::uint64_t); };
  std::uint64_t bytes = header_bytes + section(fingerprint.encode().size()) +
                        section(fingerprint.encode_settings().size()) + section(encode_trainer(trainer).size()) +
                        section(encode_phases(phases).size()) + section(caller_bytes);
  for (std::size_t i = 0; i < fingerprint.tensors.size(); ++i) {
    const Fingerprint::Tensor& t = fingerprint.tensors[i];
    const std::uint64_t tensor = section(4 + t.name.size() + t.bytes);
    bytes += i < restored ? 2 * tensor : tensor;
  }
  return bytes + section(2 * sizeof(std::uint64_t));  // END!: the count of sections and its offset
}

}  // namespace ckpt
}  // namespace ferry
