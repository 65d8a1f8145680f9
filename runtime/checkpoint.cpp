// Checkpoints (ferry/runtime/checkpoint.hpp, docs/checkpoints.md): the file format, its atomic
// writer, and Trainer::save_checkpoint / load_checkpoint.
//
// Layout (little-endian): a 40-byte header (magic, format version, reserved, the ferry version in
// 16 NUL-padded bytes, the checksum of the 32 bytes before it), then sections, each
//   tag (4 ASCII bytes) | reserved u32 | payload length u64 | payload | checksum u64
// whose checksum covers the tag, the reserved word, the length and the payload. The sections, in
// order: MODL (the model's fingerprint), TRNR (the trainer's counters, learning rate, loss scaler,
// predictor gains), PHAS (the phase controller), CALR (the caller's bytes), one TENS per
// persistent tensor, one RSTP per weight when saved inside a Predict run (the weights to put
// back), and END! (the count of sections before it and its own offset). Nothing follows END!.
#include "ferry/runtime/checkpoint.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/runtime/trainer.hpp"

#ifndef FERRY_VERSION
#define FERRY_VERSION "unknown"
#endif

namespace ferry {

static_assert(std::endian::native == std::endian::little, "checkpoints are written little-endian, as the host is");

const char* ferry_version() noexcept {
  return FERRY_VERSION;
}

std::uint64_t checkpoint_checksum(const void* data, std::size_t bytes, std::uint64_t seed) noexcept {
  constexpr std::uint64_t prime = 0x100000001b3ull;
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

namespace {

constexpr std::size_t header_bytes = 40;
constexpr std::size_t section_head_bytes = 16;
constexpr std::size_t io_chunk = 1 << 20;

constexpr std::uint32_t tag(const char (&s)[5]) {
  return static_cast<std::uint32_t>(static_cast<unsigned char>(s[0])) |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[1])) << 8 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[2])) << 16 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[3])) << 24;
}
constexpr std::uint32_t tag_model = tag("MODL"), tag_trainer = tag("TRNR"), tag_phases = tag("PHAS"),
                        tag_caller = tag("CALR"), tag_tensor = tag("TENS"), tag_restore = tag("RSTP"),
                        tag_end = tag("END!");

std::string tag_text(std::uint32_t t) {
  std::string s;
  for (int i = 0; i < 4; ++i) {
    const char c = static_cast<char>((t >> (8 * i)) & 0xff);
    s += (c >= 0x20 && c < 0x7f) ? c : '?';
  }
  return s;
}

// A streamed checksum of words split across calls: up to 7 bytes wait for the rest of their word.
class Checksum {
 public:
  void add(const void* data, std::size_t n) {
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
  std::uint64_t value() const { return checkpoint_checksum(pending_, pending_n_, h_); }

 private:
  std::uint64_t h_ = checkpoint_checksum_basis;
  unsigned char pending_[8] = {};
  std::size_t pending_n_ = 0;
};

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
  Cursor(const std::vector<std::byte>& bytes, std::string what) : bytes_(bytes), what_(std::move(what)) {}
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

 private:
  void need(std::uint64_t n) const {
    if (n > bytes_.size() - at_) fail();
  }
  [[noreturn]] void fail() const {
    throw std::runtime_error(fmt::format(
        "{} is corrupt: a section's contents do not parse although its checksum holds (written by another ferry "
        "build?); the trainer was not changed: use another checkpoint",
        what_));
  }
  const std::vector<std::byte>& bytes_;
  std::string what_;
  std::size_t at_ = 0;
};

// The file being written: a new file with a unique name beside `path`, buffered, synced and
// renamed over `path` by commit(); removed if commit() is never reached.
class AtomicFile {
 public:
  explicit AtomicFile(const std::filesystem::path& path) : path_(path) {
    static std::atomic<std::uint64_t> counter{0};
    const auto folder = path_.parent_path().empty() ? std::filesystem::path(".") : path_.parent_path();
    for (int attempt = 0;; ++attempt) {
      const auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
      temp_ = folder / fmt::format(".{}.tmp-{}-{}-{:x}", path_.filename().string(), getpid(), counter++,
                                   static_cast<std::uint64_t>(stamp) & 0xffffff);
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
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(temp_.c_str());
  }
  void write(const void* data, std::size_t n) {
    const auto* p = static_cast<const std::byte*>(data);
    if (buffer_.size() + n > io_chunk) flush();
    if (n >= io_chunk) {
      write_all(p, n);
    } else {
      buffer_.insert(buffer_.end(), p, p + n);
    }
    offset_ += n;
  }
  template <class T>
  void put(T v) {
    write(&v, sizeof v);
  }
  std::uint64_t offset() const { return offset_; }
  void commit() {
    flush();
    if (::fsync(fd_) != 0) fail("syncing");
    if (::close(fd_) != 0) {
      fd_ = -1;
      fail("closing");
    }
    fd_ = -1;
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

 private:
  void flush() {
    if (!buffer_.empty()) write_all(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  void write_all(const std::byte* p, std::size_t n) {
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
  [[noreturn]] void fail(const std::string& doing) const {
    const int e = errno;
    throw std::runtime_error(fmt::format(
        "cannot write checkpoint '{}': {} the temporary file '{}' failed ({}); any earlier checkpoint at that path "
        "is unchanged: free space or choose another folder",
        path_.string(), doing, temp_.string(), errno_text(e)));
  }

  std::filesystem::path path_, temp_;
  int fd_ = -1;
  bool committed_ = false;
  std::vector<std::byte> buffer_;
  std::uint64_t offset_ = 0;
};

// Writes one section: its head, then payload pieces adding up to the length announced, then
// the checksum.
class SectionWriter {
 public:
  SectionWriter(AtomicFile& f, std::uint32_t t, std::uint64_t length) : f_(f), left_(length) {
    const std::uint32_t reserved = 0;
    sum_.add(&t, 4);
    sum_.add(&reserved, 4);
    sum_.add(&length, 8);
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

// The file being read, by position; every failure names the file.
class Reader {
 public:
  explicit Reader(const std::filesystem::path& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      throw std::runtime_error(
          fmt::format("cannot open checkpoint '{}': {}: check the path", path.string(), errno_text(errno)));
    }
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw std::runtime_error(
          fmt::format("checkpoint '{}' is not a regular file: pass the file --checkpoint wrote", path.string()));
    }
    size_ = static_cast<std::uint64_t>(st.st_size);
  }
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;
  ~Reader() { ::close(fd_); }
  std::uint64_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }
  void read(std::uint64_t offset, void* dst, std::size_t n) const {
    auto* p = static_cast<char*>(dst);
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) {
        throw std::runtime_error(fmt::format("cannot read checkpoint '{}' at byte {}: {}; the trainer was not changed",
                                             path_.string(), offset, errno_text(errno)));
      }
      if (r == 0) throw truncated(offset, "the file");
      p += r;
      offset += static_cast<std::uint64_t>(r);
      n -= static_cast<std::size_t>(r);
    }
  }
  std::runtime_error corrupt(const std::string& what) const {
    return std::runtime_error(fmt::format(
        "checkpoint '{}' is corrupt: {}; the trainer was not changed: use another checkpoint (an earlier one, or "
        "retrain)",
        path_.string(), what));
  }
  std::runtime_error truncated(std::uint64_t at, const std::string& where) const {
    return std::runtime_error(fmt::format(
        "checkpoint '{}' is truncated or corrupt: {} needs bytes past its end ({} bytes, needed at byte {}); the "
        "writer may have been stopped, or the file damaged in a copy; the trainer was not changed: use another "
        "checkpoint",
        path_.string(), where, size_, at));
  }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

struct Section {
  std::uint32_t tag = 0;
  std::uint64_t offset = 0;  // of the head
  std::uint64_t length = 0;  // of the payload
  std::uint64_t checksum = 0;
  std::uint64_t payload() const { return offset + section_head_bytes; }
  std::uint64_t end() const { return payload() + length + 8; }
};

// Reads the section at `offset`, checks its tag is `expected` and (when given) its length, and
// verifies its checksum by reading it through; small payloads are kept in `keep`.
Section read_section(const Reader& r, std::uint64_t offset, std::uint32_t expected, const std::string& what,
                     std::optional<std::uint64_t> length = std::nullopt, std::vector<std::byte>* keep = nullptr) {
  if (offset + section_head_bytes + 8 > r.size()) throw r.truncated(offset, fmt::format("section {}", what));
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
  if (s.tag != expected || reserved != 0) {
    throw r.corrupt(fmt::format("at byte {} the file has a section '{}' where section {} ('{}') belongs", offset,
                                tag_text(s.tag), what, tag_text(expected)));
  }
  if (s.length > r.size() - offset - section_head_bytes - 8) {
    throw r.truncated(offset, fmt::format("section {} (at byte {}, {} bytes long)", what, offset, s.length));
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

void read_header(const Reader& r) {
  unsigned char h[header_bytes] = {};
  const std::size_t have = std::min<std::uint64_t>(r.size(), header_bytes);
  r.read(0, h, have);
  if (have < 8 || std::memcmp(h, checkpoint_magic, 8) != 0) {
    if (have < 8 && std::memcmp(h, checkpoint_magic, have) == 0) throw r.truncated(0, "the header");
    throw std::runtime_error(
        fmt::format("'{}' is not a ferry checkpoint (it does not start with {}): pass a file written by ferry train "
                    "--checkpoint or Trainer::save_checkpoint",
                    r.path().string(), checkpoint_magic));
  }
  if (have < header_bytes) throw r.truncated(have, "the header");
  std::uint64_t sum = 0;
  std::memcpy(&sum, h + 32, 8);
  if (checkpoint_checksum(h, 32) != sum) throw r.corrupt("the header (bytes 0 to 40) fails its checksum");
  std::uint32_t version = 0;
  std::memcpy(&version, h + 8, 4);
  char writer[16] = {};
  std::memcpy(writer, h + 16, 15);
  if (version > checkpoint_format_version) {
    throw std::runtime_error(fmt::format(
        "checkpoint '{}' has format version {} (written by ferry {}), newer than this ferry {} reads (up to version "
        "{}): load it with ferry {} or newer",
        r.path().string(), version, writer, ferry_version(), checkpoint_format_version, writer));
  }
  if (version == 0) throw r.corrupt("the header's format version is 0");
}

}  // namespace

void check_checkpoint_path(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw std::runtime_error(
        fmt::format("cannot write checkpoints to '{}': it is a folder; give a file name in it, e.g. '{}'",
                    path.string(), (path / "run.ckpt").string()));
  }
  const auto folder = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  if (!std::filesystem::is_directory(folder, ec)) {
    throw std::runtime_error(
        fmt::format("cannot write checkpoints to '{}': the folder '{}' does not exist: create it first (mkdir -p {})",
                    path.string(), folder.string(), folder.string()));
  }
  AtomicFile probe(path);  // created, then removed by its destructor: the folder is writable
  probe.put(std::uint64_t{0});
}

std::vector<TensorId> Trainer::checkpoint_tensors() const {
  const auto& t = train_->graph().tensors;
  std::vector<TensorId> ids;
  for (const graph::Role role :
       {graph::Role::weight, graph::Role::optimizer_state, graph::Role::predictor_state, graph::Role::gradient_sum}) {
    for (TensorId id = 0; id < t.size(); ++id) {
      if (t.role[id] == role && t.alias_of[id] == graph::no_tensor) ids.push_back(id);
    }
  }
  return ids;
}

namespace {

// The model fingerprint: what a trainer must share with the one that saved.
struct Fingerprint {
  std::string model, optimizer;
  std::uint32_t batch = 0, accumulate = 1;
  std::uint8_t precision = 0, scaled = 0, hybrid = 0;
  struct Tensor {
    std::string name;
    std::uint8_t dtype = 0;
    graph::Shape shape;
    std::uint64_t bytes = 0;
  };
  std::vector<Tensor> tensors;

  std::vector<std::byte> encode() const {
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
  static Fingerprint decode(const std::vector<std::byte>& bytes, const Reader& r) {
    Cursor c(bytes, fmt::format("checkpoint '{}'", r.path().string()));
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
};

std::string tensor_text(const Fingerprint::Tensor& t) {
  return fmt::format("'{}' ({} {})", t.name, graph::dtype_name(static_cast<graph::DType>(t.dtype)), t.shape.str());
}

// Throws std::invalid_argument naming the first difference between the checkpoint's fingerprint
// and this trainer's.
void compare(const Fingerprint& file, const Fingerprint& here, const std::filesystem::path& path) {
  const auto mismatch = [&](const std::string& what, const std::string& todo) {
    return std::invalid_argument(
        fmt::format("checkpoint '{}' was written for another training setup: {}; the trainer was not changed: {}",
                    path.string(), what, todo));
  };
  if (file.model != here.model) {
    throw mismatch(fmt::format("its model is '{}', this trainer's is '{}'", file.model, here.model),
                   "load it into the model that wrote it (the same --model and sizes)");
  }
  if (file.optimizer != here.optimizer) {
    throw mismatch(fmt::format("its optimizer is {}, this trainer's is {}", file.optimizer, here.optimizer),
                   fmt::format("use --optimizer {}", file.optimizer));
  }
  if (file.batch != here.batch) {
    throw mismatch(fmt::format("its batch is {}, this trainer's is {}", file.batch, here.batch),
                   fmt::format("use --batch {}", file.batch));
  }
  if (file.accumulate != here.accumulate) {
    throw mismatch(
        fmt::format("it accumulates {} micro-batches per update, this trainer {}", file.accumulate, here.accumulate),
        fmt::format("use --accumulate {}", file.accumulate));
  }
  if (file.precision != here.precision || file.scaled != here.scaled) {
    const auto name = [](const Fingerprint& f) {
      return fmt::format("{}{}", graph::dtype_name(static_cast<graph::DType>(f.precision)),
                         f.scaled ? " with loss scaling" : "");
    };
    throw mismatch(fmt::format("its precision is {}, this trainer's is {}", name(file), name(here)),
                   "use the --precision and --loss-scaling it was written with");
  }
  if (file.hybrid != here.hybrid) {
    throw mismatch(
        fmt::format("its phases are {}, this trainer's are {}", phases_name(file.hybrid), phases_name(here.hybrid)),
        fmt::format("use --phases {}", phases_name(file.hybrid)));
  }
  for (std::size_t i = 0; i < std::max(file.tensors.size(), here.tensors.size()); ++i) {
    if (i >= file.tensors.size()) {
      throw mismatch(fmt::format("it has no tensor {}", tensor_text(here.tensors[i])),
                     "load it into the model that wrote it (the same sizes and options)");
    }
    if (i >= here.tensors.size()) {
      throw mismatch(fmt::format("this trainer has no tensor {}", tensor_text(file.tensors[i])),
                     "load it into the model that wrote it (the same sizes and options)");
    }
    const auto &a = file.tensors[i], &b = here.tensors[i];
    if (a.name != b.name || a.dtype != b.dtype || !(a.shape == b.shape) || a.bytes != b.bytes) {
      throw mismatch(fmt::format("its tensor {} is {} here", tensor_text(a), tensor_text(b)),
                     "load it into the model that wrote it (the same sizes and options)");
    }
  }
}

// The fingerprint of a trainer of `model` with `options` whose checkpointed tensors are `ids`.
Fingerprint fingerprint_of(const ModelSpec& model, const TrainerOptions& options, bool hybrid,
                           const graph::TensorTable& t, const std::vector<TensorId>& ids) {
  Fingerprint fp;
  fp.model = model.name;
  fp.optimizer = optimizer_name(options.optimizer.kind);
  fp.batch = options.batch;
  fp.accumulate = options.accumulate;
  fp.precision = static_cast<std::uint8_t>(options.precision.compute);
  fp.scaled = options.precision.scaled();
  fp.hybrid = hybrid;
  for (const TensorId id : ids) {
    fp.tensors.push_back({t.name[id], static_cast<std::uint8_t>(t.dtype[id]), t.shape[id], t.bytes(id)});
  }
  return fp;
}

}  // namespace

void Trainer::save_checkpoint(const std::filesystem::path& path, std::span<const std::byte> caller) const {
  refuse_if_inconsistent("save a checkpoint");
  const auto& t = train_->graph().tensors;
  const auto ids = checkpoint_tensors();
  const auto& arena = *train_->persistent();

  const Fingerprint fp = fingerprint_of(model_, options_, phases_ != nullptr, t, ids);

  AtomicFile f(path);
  std::uint64_t sections = 0;
  write_header(f);
  write_section(f, tag_model, fp.encode());
  ++sections;

  Payload tr;
  tr.put(steps_);
  tr.put(micro_);
  tr.put(lr_);
  for (std::size_t i = 0; i < phase_count; ++i) {
    tr.put(phase_ms_[i]);
    tr.put(phase_steps_[i]);
  }
  tr.put(scaler_.scale());
  tr.put(scaler_.clean_steps());
  tr.put(scaler_.overflows());
  tr.put(static_cast<std::uint8_t>(in_predict_run_));
  tr.put(static_cast<std::uint32_t>(gains_.size()));
  for (float g : gains_) tr.put(g);
  write_section(f, tag_trainer, tr.bytes());
  ++sections;

  Payload ph;
  ph.put(static_cast<std::uint8_t>(phases_ != nullptr));
  if (phases_) {
    const PhaseController::State s = phases_->state();
    ph.put(static_cast<std::uint8_t>(s.next));
    for (auto n : s.counts.steps) ph.put(n);
    ph.put(s.counts.runs);
    ph.put(s.counts.ended);
    ph.put(s.counts.restores);
    ph.put(s.length);
    ph.put(s.in_phase);
    ph.put(s.since_fit);
    ph.put(static_cast<std::uint8_t>(s.cut_short));
    ph.put(s.last_quality);
    ph.put_doubles(s.losses);
    ph.put_doubles(s.qualities);
    ph.put_doubles(s.predict_losses);
  }
  write_section(f, tag_phases, ph.bytes());
  ++sections;

  write_section(f, tag_caller, std::vector<std::byte>(caller.begin(), caller.end()));
  ++sections;

  // One tensor at a time, through one buffer.
  std::vector<std::byte> buf;
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
  for (const TensorId id : ids) {
    buf.resize(t.bytes(id));
    arena.read(t.home[id], t.placement[id], buf.data(), buf.size());
    write_tensor_section(tag_tensor, t.name[id], buf.data(), buf.size());
  }
  if (in_predict_run_) {
    for (std::size_t i = 0; i < weights_.size(); ++i) {
      write_tensor_section(tag_restore, fp.tensors[i].name, restore_point_[i].data(), restore_point_[i].size());
    }
  }
  Payload end;
  end.put(sections);
  end.put(f.offset());
  write_section(f, tag_end, end.bytes());
  f.commit();
}

std::vector<std::byte> Trainer::load_checkpoint(const std::filesystem::path& path) {
  const Reader r(path);
  read_header(r);
  std::uint64_t at = header_bytes, sections = 0;
  std::vector<std::byte> small;

  // Pass 1: every section read and verified, everything but the tensors decoded.
  Section s = read_section(r, at, tag_model, "MODL (the model fingerprint)", std::nullopt, &small);
  const Fingerprint file = Fingerprint::decode(small, r);
  at = s.end();
  ++sections;
  const auto& t = train_->graph().tensors;
  const auto ids = checkpoint_tensors();
  const Fingerprint here = fingerprint_of(model_, options_, phases_ != nullptr, t, ids);
  // The rest is verified before the fingerprint is compared: a damaged file is reported as
  // damaged, not as another model's.
  std::vector<std::byte> trainer_bytes, phase_bytes, caller;
  s = read_section(r, at, tag_trainer, "TRNR (the trainer's counters)", std::nullopt, &trainer_bytes);
  at = s.end();
  ++sections;
  s = read_section(r, at, tag_phases, "PHAS (the phase controller)", std::nullopt, &phase_bytes);
  at = s.end();
  ++sections;
  s = read_section(r, at, tag_caller, "CALR (the caller's state)", std::nullopt, &caller);
  at = s.end();
  ++sections;

  const std::string where = fmt::format("checkpoint '{}'", path.string());
  Cursor tc(trainer_bytes, where);
  const auto steps = tc.get<std::uint64_t>();
  const auto micro = tc.get<std::uint32_t>();
  const auto lr = tc.get<float>();
  double phase_ms[phase_count];
  std::uint64_t phase_steps[phase_count];
  for (std::size_t i = 0; i < phase_count; ++i) {
    phase_ms[i] = tc.get<double>();
    phase_steps[i] = tc.get<std::uint64_t>();
  }
  const auto scale = tc.get<float>();
  const auto clean = tc.get<std::uint32_t>();
  const auto overflows = tc.get<std::uint64_t>();
  const bool in_predict_run = tc.get<std::uint8_t>() != 0;
  std::vector<float> gains(tc.get<std::uint32_t>());
  if (gains.size() > trainer_bytes.size()) throw r.corrupt("section TRNR holds more gains than bytes");
  for (auto& g : gains) g = tc.get<float>();
  tc.finish();

  Cursor pc(phase_bytes, where);
  std::optional<PhaseController::State> phase_state;
  if (pc.get<std::uint8_t>()) {
    PhaseController::State ps;
    ps.next = static_cast<Phase>(pc.get<std::uint8_t>());
    for (auto& n : ps.counts.steps) n = pc.get<std::uint64_t>();
    ps.counts.runs = pc.get<std::uint64_t>();
    ps.counts.ended = pc.get<std::uint64_t>();
    ps.counts.restores = pc.get<std::uint64_t>();
    ps.length = pc.get<std::uint32_t>();
    ps.in_phase = pc.get<std::uint32_t>();
    ps.since_fit = pc.get<std::uint32_t>();
    ps.cut_short = pc.get<std::uint8_t>() != 0;
    ps.last_quality = pc.get<double>();
    ps.losses = pc.get_doubles();
    ps.qualities = pc.get_doubles();
    ps.predict_losses = pc.get_doubles();
    phase_state = std::move(ps);
  }
  pc.finish();

  // The tensors: verified by reading them through, their places kept for pass 2.
  const auto tensor_section = [&](std::uint32_t tg, const Fingerprint::Tensor& ft, const char* kind) {
    const std::string what = fmt::format("{} {} of tensor '{}'", tag_text(tg), kind, ft.name);
    // The name first, so a section of another tensor is named as such.
    if (at + section_head_bytes + 4 + ft.name.size() <= r.size()) {
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
    const Section sec = read_section(r, at, tg, what, 4 + ft.name.size() + ft.bytes);
    at = sec.end();
    ++sections;
    return sec;
  };
  std::vector<Section> tensor_sections, restore_sections;
  for (const auto& ft : file.tensors) tensor_sections.push_back(tensor_section(tag_tensor, ft, "(a tensor)"));
  if (in_predict_run) {
    // Two gains per weight (ops/predictor.hpp: the gain of d and the weight of r), so the weights
    // are the first gains.size() / 2 tensors.
    if (gains.size() % 2 != 0 || gains.size() / 2 > file.tensors.size())
      throw r.corrupt("section TRNR holds an odd number of gains, or more than two per weight");
    for (std::size_t i = 0; i < gains.size() / 2; ++i) {
      restore_sections.push_back(tensor_section(tag_restore, file.tensors[i], "(the weight before a Predict run)"));
    }
  }
  std::vector<std::byte> end_bytes;
  s = read_section(r, at, tag_end, "END! (the end)", 16, &end_bytes);
  Cursor ec(end_bytes, where);
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

  // The file is whole: now does it fit this trainer?
  compare(file, here, path);
  if (micro >= options_.accumulate)
    throw r.corrupt(fmt::format("{} micro-batches done of {}", micro, options_.accumulate));
  if (!std::isfinite(lr) || lr < 0) throw r.corrupt(fmt::format("the learning rate is {}", lr));
  if (phases_ ? gains.size() != 2 * weights_.size() : !gains.empty()) {
    throw r.corrupt(fmt::format("{} predictor gains for {} weights (two each)", gains.size(), weights_.size()));
  }
  if (phase_state.has_value() != (phases_ != nullptr))
    throw r.corrupt("the phase section disagrees with the fingerprint");
  LossScaler scaler = scaler_;
  std::optional<PhaseController> controller;
  try {
    scaler.restore(scale, clean, overflows);
    if (phases_) {
      controller.emplace(*phases_);
      controller->restore(*phase_state);
    }
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(
        fmt::format("checkpoint '{}' does not fit this trainer's settings: {}; the trainer was not changed: use the "
                    "--loss-scale-interval and phase settings it was written with",
                    path.string(), e.what()));
  }

  // Pass 2: the tensors, one at a time, each checked again against pass 1's checksum (the file
  // stays open, so a checkpoint renamed over it meanwhile is not mixed in).
  std::vector<std::byte> buf;
  const auto read_payload = [&](const Section& sec, const Fingerprint::Tensor& ft) {
    buf.resize(sec.length);
    r.read(sec.payload(), buf.data(), buf.size());
    Checksum sum;
    const std::uint32_t reserved = 0;
    sum.add(&sec.tag, 4);
    sum.add(&reserved, 4);
    sum.add(&sec.length, 8);
    sum.add(buf.data(), buf.size());
    if (sum.value() != sec.checksum) {
      inconsistent_ =
          fmt::format("the load of checkpoint '{}' stopped part-way (tensor '{}' changed while it was read)",
                      path.string(), ft.name);
      throw std::runtime_error(fmt::format(
          "checkpoint '{}' changed while it was loaded (tensor '{}' no longer matches its checksum): the trainer's "
          "tensors are now partly loaded; load a checkpoint again before training",
          path.string(), ft.name));
    }
    return std::span<const std::byte>(buf).subspan(4 + ft.name.size());
  };
  std::vector<std::vector<std::byte>> restore_point(restore_sections.size());
  for (std::size_t i = 0; i < restore_sections.size(); ++i) {
    const auto v = read_payload(restore_sections[i], file.tensors[i]);
    restore_point[i].assign(v.begin(), v.end());
  }
  auto& arena = *train_->persistent();
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto v = read_payload(tensor_sections[i], file.tensors[i]);
    arena.write(t.home[ids[i]], t.placement[ids[i]], v.data(), v.size());
  }
  steps_ = steps;
  micro_ = micro;
  lr_ = lr;
  for (std::size_t i = 0; i < phase_count; ++i) {
    phase_ms_[i] = phase_ms[i];
    phase_steps_[i] = phase_steps[i];
  }
  scaler_ = scaler;
  if (controller) *phases_ = std::move(*controller);
  gains_ = std::move(gains);
  in_predict_run_ = in_predict_run;
  restore_point_ = std::move(restore_point);
  inconsistent_.clear();  // every tensor now holds the checkpoint's value
  return caller;
}

}  // namespace ferry
