// Character corpora: the fortune files, their byte vocabulary and windows as batches.
#include "ferry/runtime/text_corpus.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <stdexcept>
#include <system_error>

#include "ferry/runtime/plan.hpp"
#include "ferry/runtime/units.hpp"

namespace ferry {
namespace fs = std::filesystem;

namespace {

// What to do about a folder or file of the corpus that is there but out of this user's reach.
std::string reach_fix(const std::error_code& ec, const fs::path& p, bool folder) {
  if (ec == std::errc::permission_denied) {
    return folder ? fmt::format(
                        "give this user read and search permission on it (chmod a+rx '{}'), or give --text "
                        "(FERRY_TEXT_DIR) a folder of text files this user can read",
                        p.string())
                  : fmt::format("give this user read permission on it (chmod a+r '{}'), or move it out of the folder",
                                p.string());
  }
  return folder ? std::string("check the folder, or give --text (FERRY_TEXT_DIR) another folder of text files")
                : std::string("check the file, or move it out of the folder");
}

[[noreturn]] void unreachable_folder(const fs::path& dir, const std::error_code& ec) {
  throw std::runtime_error(fmt::format("text corpus: cannot list the folder {}: {}: {}", dir.string(), ec.message(),
                                       reach_fix(ec, dir, true)));
}

}  // namespace

std::vector<fs::path> fortune_files(fs::path dir) {
  if (dir.empty()) {
    const char* env = std::getenv("FERRY_TEXT_DIR");
    dir = env && *env ? fs::path(env) : fs::path("/usr/share/games/fortunes");
  }
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  if (ec && st.type() != fs::file_type::not_found) unreachable_folder(dir, ec);
  if (!fs::is_directory(st)) {
    throw std::runtime_error(
        fmt::format("no text corpus: {} {}; give --text (FERRY_TEXT_DIR) a folder of text files, or install Debian's "
                    "fortunes (apt-get install fortunes), the default",
                    dir.string(), fs::exists(st) ? "is not a folder" : "does not exist"));
  }
  std::set<fs::path> unique;  // resolved paths: several names link to one file
  // The error_code forms: the throwing ones gave "filesystem error: directory iterator cannot open
  // directory", naming neither the corpus nor a fix.
  fs::directory_iterator it(dir, ec);
  if (ec) unreachable_folder(dir, ec);
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.ends_with(".dat") || name.ends_with(".u8") || name.starts_with(".")) continue;
    std::error_code skip;  // a dangling link or a special file: not text, skipped
    const fs::path real = fs::canonical(it->path(), skip);
    if (skip || !fs::is_regular_file(real, skip)) continue;
    unique.insert(real);
  }
  if (ec) unreachable_folder(dir, ec);
  if (unique.empty()) {
    throw std::runtime_error(
        fmt::format("no text files in {} (files named *.dat or *.u8, hidden files, subfolders and special files "
                    "are skipped): give --text (FERRY_TEXT_DIR) a folder of text files, or install Debian's fortunes "
                    "(apt-get install fortunes), the default",
                    dir.string()));
  }
  return {unique.begin(), unique.end()};
}

namespace {

// Where a corpus of `files` is, for a message: the file, or the folder holding them all.
std::string corpus_place(const std::vector<fs::path>& files) {
  const fs::path folder = files.front().parent_path();
  const bool one_folder =
      std::all_of(files.begin(), files.end(), [&](const fs::path& f) { return f.parent_path() == folder; });
  if (files.size() == 1) return files.front().string();
  if (one_folder) return fmt::format("the {} files in {}", files.size(), folder.string());
  return fmt::format("{} and {} other files", files.front().string(), files.size() - 1);
}

// A model that predicts the next character learns nothing from one character repeated (and its
// builder refuses a vocabulary of 1 without naming the text): refused here, naming the corpus.
void refuse_one_character(const std::vector<fs::path>& files, const std::vector<std::int32_t>& bytes) {
  if (bytes.empty() || std::any_of(bytes.begin(), bytes.end(), [&](std::int32_t b) { return b != bytes.front(); }))
    return;
  const auto b = static_cast<unsigned char>(bytes.front());
  const std::string shown = b >= 32 && b < 127 ? fmt::format("'{}'", static_cast<char>(b)) : fmt::format("0x{:02x}", b);
  throw std::runtime_error(
      fmt::format("text corpus ({}): it holds a single distinct character ({}, {} times), but a next-character "
                  "model needs at least 2: give --text (FERRY_TEXT_DIR) a folder of ordinary text",
                  corpus_place(files), shown, bytes.size()));
}

// A character is a 4-byte token id in memory: a corpus that cannot fit this machine's memory as
// ids is refused before it is read (one larger than memory was killed by the kernel mid-read,
// saying nothing). Files whose size is unknown (pipes) are not counted. Returns the bytes counted.
std::uint64_t text_bytes_within_memory(const std::vector<fs::path>& files) {
  std::uint64_t bytes = 0;
  for (const auto& f : files) {
    std::error_code ec;
    const std::uintmax_t size = fs::file_size(f, ec);
    if (!ec) bytes += size;
  }
  const std::uint64_t needed = bytes * sizeof(std::int32_t), physical = physical_memory_bytes();
  if (physical == 0 || needed <= physical) return bytes;
  throw std::runtime_error(fmt::format(
      "text corpus ({}): {} of text takes {} of host memory as token ids (4 bytes a character), more than this "
      "machine's {}: give --text (FERRY_TEXT_DIR) a folder with at most {} of text",
      corpus_place(files), format_bytes(bytes), format_bytes(needed), format_bytes(physical),
      format_bytes(physical / sizeof(std::int32_t))));
}

// A byte model trains on anything, so a folder of binaries would train without complaint: refuse
// files with NUL bytes or more than 1% control characters (text has tabs, line ends and form
// feeds; the fortunes have under 0.2% of others, terminal escapes and backspaces). Counted as the
// file is read, so that a binary file is refused at its first NUL rather than after all of it
// (a 3 GB one took 40 s to be refused). The share is judged per file only from
// binary_check_min_bytes on, and over the whole corpus (CorpusControlCheck): a fortune of 79 bytes
// with two backspaces in it, alone in a file, is 2.5% control characters and was refused, where
// the same text in one file was taken.
constexpr std::size_t binary_check_min_bytes = 4096;

class BinaryCheck {
 public:
  explicit BinaryCheck(const fs::path& file) : file_(file) {}
  // The next bytes read: refused at once when they hold a NUL, or begin as a compressed or UTF-16
  // file does (said as such, with what to do).
  void add(std::string_view bytes) {
    if (seen_ == 0) refuse_known_format(bytes);
    for (const char ch : bytes) {
      const auto b = static_cast<unsigned char>(ch);
      nul_ += b == 0;
      control_ += (b < 32 && b != '\t' && b != '\n' && b != '\r' && b != '\f') || b == 127;
    }
    seen_ += bytes.size();
    if (nul_ != 0) refuse(" in the first");
  }
  // The whole file read: refused when control characters are more than 1% of a file large enough
  // to judge.
  void finish() const {
    if (seen_ >= binary_check_min_bytes && control_ * 100 > seen_) refuse(" in");
  }
  std::size_t control() const noexcept { return control_; }
  std::size_t seen() const noexcept { return seen_; }

 private:
  void refuse_known_format(std::string_view head) const {
    const auto starts = [&](std::initializer_list<unsigned char> magic) {
      if (head.size() < magic.size()) return false;
      std::size_t i = 0;
      for (const unsigned char m : magic) {
        if (static_cast<unsigned char>(head[i++]) != m) return false;
      }
      return true;
    };
    const char* what =
        starts({0x1f, 0x8b})                       ? "gzip-compressed: gunzip it"
        : starts({0x28, 0xb5, 0x2f, 0xfd})         ? "zstd-compressed: unzstd it"
        : starts({'B', 'Z', 'h'})                  ? "bzip2-compressed: bunzip2 it"
        : starts({0xfd, '7', 'z', 'X', 'Z', 0x00}) ? "xz-compressed: unxz it"
        : starts({0xff, 0xfe}) || starts({0xfe, 0xff})
            ? "UTF-16 text: convert it to UTF-8 (iconv -f UTF-16 -t UTF-8), the bytes ferry's model reads"
            : nullptr;
    if (what == nullptr) return;
    throw std::runtime_error(fmt::format("text corpus: {} is {}, or move it out of the folder", file_.string(), what));
  }
  [[noreturn]] void refuse(const char* in) const {
    throw std::runtime_error(fmt::format(
        "text corpus: {} looks binary, not text ({} NUL bytes, {:.1f}% control characters{} {} bytes): train on a "
        "folder of text files, or move this file out of it",
        file_.string(), nul_, 100.0 * static_cast<double>(control_) / static_cast<double>(seen_), in, seen_));
  }
  const fs::path& file_;
  std::size_t nul_ = 0, control_ = 0, seen_ = 0;
};

// The 1% over the whole corpus, naming the file with the most control characters.
class CorpusControlCheck {
 public:
  void add(const fs::path& file, const BinaryCheck& b) {
    control_ += b.control();
    seen_ += b.seen();
    if (b.control() > worst_control_) worst_ = file, worst_control_ = b.control(), worst_seen_ = b.seen();
  }
  void finish() const {
    if (control_ * 100 <= seen_) return;
    throw std::runtime_error(fmt::format(
        "text corpus: {:.1f}% of its {} bytes are control characters, more than text has (the most in {}: {} in {} "
        "bytes): train on a folder of text files, or move the binary ones out of it",
        100.0 * static_cast<double>(control_) / static_cast<double>(seen_), seen_, worst_.string(), worst_control_,
        worst_seen_));
  }

 private:
  std::size_t control_ = 0, seen_ = 0, worst_control_ = 0, worst_seen_ = 0;
  fs::path worst_;
};

}  // namespace

TextCorpus load_text_corpus(const std::vector<fs::path>& files, double holdout) {
  if (!(holdout > 0.0 && holdout < 1.0)) {
    throw std::invalid_argument(fmt::format("held-out fraction must be in (0, 1), got {}", holdout));
  }
  if (files.empty()) throw std::runtime_error("text corpus: no files given");
  TextCorpus c;
  c.files = files.size();
  c.ids.reserve(text_bytes_within_memory(files));  // no doubling growth: that would be 8 bytes a character
  // Bytes go straight into `ids`, widened, and are mapped to token ids in place once the
  // vocabulary is known: no second copy of the text (4 bytes a character at the peak, not 5).
  std::vector<char> chunk(std::size_t{1} << 20);
  CorpusControlCheck control;
  for (const auto& f : files) {
    errno = 0;
    std::ifstream in(f, std::ios::binary);
    if (!in) {
      const std::error_code ec(errno ? errno : EIO, std::generic_category());
      throw std::runtime_error(
          fmt::format("text corpus: cannot open {}: {}: {}", f.string(), ec.message(), reach_fix(ec, f, false)));
    }
    const std::size_t before = c.ids.size();
    BinaryCheck binary(f);
    while (in) {
      in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
      const auto got = static_cast<std::size_t>(in.gcount());
      binary.add(std::string_view(chunk.data(), got));
      const auto* bytes = reinterpret_cast<const unsigned char*>(chunk.data());
      c.ids.insert(c.ids.end(), bytes, bytes + got);
    }
    if (in.bad()) {
      const std::error_code ec(errno ? errno : EIO, std::generic_category());
      throw std::runtime_error(fmt::format("text corpus: error reading {}: {}: move it out of the folder, or mend it",
                                           f.string(), ec.message()));
    }
    if (c.ids.size() == before) {
      throw std::runtime_error(
          fmt::format("text corpus: {} is empty: remove it from the folder, or train on another", f.string()));
    }
    binary.finish();
    control.add(f, binary);
  }
  control.finish();
  refuse_one_character(files, c.ids);
  std::array<bool, 256> present{};
  for (const std::int32_t b : c.ids) present[b] = true;
  c.id_of.fill(-1);
  for (int b = 0; b < 256; ++b) {
    if (!present[b]) continue;
    c.id_of[b] = static_cast<std::int16_t>(c.vocab.size());
    c.vocab.push_back(static_cast<std::uint8_t>(b));
  }
  for (std::int32_t& id : c.ids) id = c.id_of[id];
  const std::size_t n = c.ids.size();
  // Integer arithmetic for the usual tenths, so the split does not depend on rounding.
  const auto tenths = static_cast<std::size_t>(holdout * 10.0 + 0.5);
  c.train_end = std::abs(holdout * 10.0 - static_cast<double>(tenths)) < 1e-9
                    ? n * (10 - tenths) / 10
                    : static_cast<std::size_t>(static_cast<double>(n) * (1.0 - holdout));
  return c;
}

std::string TextCorpus::decode(std::span<const std::int32_t> tokens) const {
  std::string out;
  out.reserve(tokens.size());
  for (std::int32_t t : tokens) {
    if (t < 0 || static_cast<std::size_t>(t) >= vocab.size()) {
      throw std::invalid_argument(fmt::format("token id {} is outside the vocabulary of {}", t, vocab.size()));
    }
    out.push_back(static_cast<char>(vocab[t]));
  }
  return out;
}

std::vector<std::int32_t> TextCorpus::encode(std::string_view text) const {
  std::vector<std::int32_t> out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    const std::int16_t id = id_of[static_cast<unsigned char>(text[i])];
    if (id < 0) {
      throw std::invalid_argument(
          fmt::format("character {} (byte 0x{:02x}) at position {} of the text is not in the "
                      "corpus's vocabulary of {} characters",
                      i, static_cast<unsigned char>(text[i]), i, vocab.size()));
    }
    out.push_back(id);
  }
  return out;
}

TextWindows::TextWindows(const TextCorpus& corpus, std::uint32_t context, std::vector<std::size_t> starts)
    : corpus_(corpus), context_(context), starts_(std::move(starts)) {
  if (context == 0) throw std::invalid_argument("text windows: context must be at least 1");
  for (std::size_t s : starts_) {
    if (s + context + 1 > corpus.ids.size()) {
      throw std::invalid_argument(fmt::format("text window at {} (+{} tokens) runs past the corpus's {} tokens", s,
                                              context + 1, corpus.ids.size()));
    }
  }
}

TextWindows TextWindows::held_out(const TextCorpus& corpus, std::uint32_t context, std::size_t max_windows) {
  const std::size_t tail = corpus.ids.size() - corpus.train_end;
  if (tail < context + 1u) {
    throw std::invalid_argument(fmt::format(
        "the held-out text has {} characters, fewer than one window of {} + 1: use a shorter context or more text",
        tail, context));
  }
  const std::size_t all = (tail - 1) / context;  // windows with start + context + 1 <= tail
  const std::size_t n = max_windows ? std::min(all, max_windows) : all;
  std::vector<std::size_t> starts(n);
  for (std::size_t i = 0; i < n; ++i) starts[i] = corpus.train_end + (i * all / n) * context;
  return TextWindows(corpus, context, std::move(starts));
}

void TextWindows::read(std::string_view name, std::size_t first, std::size_t count, std::span<std::byte> out) const {
  const std::size_t shift = name == "tokens" ? 0 : name == "next" ? 1 : 2;
  if (shift == 2) {
    throw std::invalid_argument(fmt::format("text windows provide 'tokens' and 'next', not '{}'", name));
  }
  if (first + count > starts_.size() || out.size() != count * context_ * sizeof(std::int32_t)) {
    throw std::invalid_argument(fmt::format("text windows: samples [{}, {}) of {} into {} bytes (windows of {})", first,
                                            first + count, starts_.size(), out.size(), context_));
  }
  auto* dst = reinterpret_cast<std::int32_t*>(out.data());
  for (std::size_t i = 0; i < count; ++i) {
    std::memcpy(dst + i * context_, corpus_.ids.data() + starts_[first + i] + shift, context_ * sizeof(std::int32_t));
  }
}

RandomWindows::RandomWindows(const TextCorpus& corpus, std::uint32_t context, std::uint32_t batch, std::uint64_t seed,
                             Shard shard)
    : corpus_(corpus),
      context_(context),
      batch_(batch),
      shard_(shard.count == 0 ? Shard{0, batch} : shard),
      tokens_(std::size_t(shard_.count) * context),
      next_(tokens_.size()),
      rng_(seed) {
  if (context == 0 || batch == 0) throw std::invalid_argument("random windows: context and batch must be at least 1");
  if (std::uint64_t(shard_.first) + shard_.count > batch) {
    throw std::invalid_argument(fmt::format("random windows: rows {}..{} are not in a batch of {}", shard_.first,
                                            shard_.first + shard_.count, batch));
  }
  if (corpus.train_end < context + 1u) {
    throw std::invalid_argument(
        fmt::format("the training text has {} characters, fewer than one window of {} + 1", corpus.train_end, context));
  }
  start_ = std::uniform_int_distribution<std::size_t>(0, corpus.train_end - context - 1);
  views_ = Batch{{"tokens", HostView(std::span<const std::int32_t>(tokens_))},
                 {"next", HostView(std::span<const std::int32_t>(next_))}};
}

const Batch& RandomWindows::next() {
  for (std::uint32_t i = 0; i < batch_; ++i) {
    const std::size_t s = start_(rng_);  // every window is drawn, so the ranks' draws stay in step
    if (i < shard_.first || i >= shard_.first + shard_.count) continue;
    const std::size_t row = i - shard_.first;
    std::copy_n(corpus_.ids.data() + s, context_, tokens_.data() + row * context_);
    std::copy_n(corpus_.ids.data() + s + 1, context_, next_.data() + row * context_);
  }
  return views_;
}

std::string RandomWindows::state() const {
  std::ostringstream out;
  out << rng_;
  return out.str();
}

void RandomWindows::restore(const std::string& state) {
  std::istringstream in(state);
  std::mt19937_64 rng;
  in >> rng;
  if (!in) throw std::invalid_argument("random windows: the saved state of the window draw does not parse");
  rng_ = rng;
}

}  // namespace ferry
