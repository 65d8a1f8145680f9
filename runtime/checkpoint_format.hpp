// The checkpoint file format (docs/checkpoints.md), apart from any Trainer: the atomic writer,
// the positional reader, sections with their checksums, and the records the sections hold.
// Trainer::save_checkpoint / load_checkpoint (runtime/checkpoint.cpp) build on it, and the
// checkpoint fuzzer (fuzz/checkpoint.cpp) runs read_contents on arbitrary bytes.
//
// Layout (little-endian): a 40-byte header (magic, format version, reserved, the ferry version in
// 16 NUL-padded bytes, the checksum of the 32 bytes before it), then sections, each
//   tag (4 ASCII bytes) | reserved u32 | payload length u64 | payload | checksum u64
// whose checksum covers the tag, the reserved word, the length and the payload. The sections, in
// order: MODL (the model's fingerprint), SETS (from format version 2: the training settings a
// resume keeps, ferry/runtime/training_setting.hpp), TRNR (the trainer's counters, learning rate, loss scaler,
// predictor gains), PHAS (the phase controller), CALR (the caller's bytes), one TENS per
// persistent tensor (its name, then its bytes), one RSTP per weight when saved inside a Predict
// run (the weights to put back), and END! (the count of sections before it and its own offset).
// Nothing follows END!. Every byte of a valid file is under a checksum.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/graph/ir.hpp"
#include "ferry/ops/types.hpp"
#include "ferry/runtime/checkpoint.hpp"
#include "ferry/runtime/phases.hpp"
#include "ferry/runtime/training_setting.hpp"

namespace ferry::ckpt {

inline constexpr std::size_t header_bytes = 40;
inline constexpr std::size_t section_head_bytes = 16;
inline constexpr std::size_t io_chunk = std::size_t{1} << 20;

constexpr std::uint32_t tag(const char (&s)[5]) {
  return static_cast<std::uint32_t>(static_cast<unsigned char>(s[0])) |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[1])) << 8 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[2])) << 16 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[3])) << 24;
}
inline constexpr std::uint32_t tag_model = tag("MODL"), tag_trainer = tag("TRNR"), tag_phases = tag("PHAS"),
                               tag_caller = tag("CALR"), tag_tensor = tag("TENS"), tag_restore = tag("RSTP"),
                               tag_end = tag("END!"), tag_settings = tag("SETS");
// The tag as text, '?' for bytes that are not printable.
std::string tag_text(std::uint32_t t);

// A streamed checksum of words split across calls: up to 7 bytes wait for the rest of their word.
class Checksum {
 public:
  void add(const void* data, std::size_t n);
  std::uint64_t value() const { return checkpoint_checksum(pending_, pending_n_, h_); }

 private:
  std::uint64_t h_ = checkpoint_checksum_basis;
  unsigned char pending_[8] = {};
  std::size_t pending_n_ = 0;
};

// Throws std::runtime_error unless `path` names a file ("", "dir/" and "." do not).
void check_names_a_file(const std::filesystem::path& path);

// The file being written: a new file with a unique name beside `path`, buffered, synced and
// renamed over `path` by commit(); removed if commit() is never reached.
class AtomicFile {
 public:
  explicit AtomicFile(const std::filesystem::path& path);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();
  void write(const void* data, std::size_t n);
  template <class T>
  void put(T v) {
    write(&v, sizeof v);
  }
  std::uint64_t offset() const { return offset_; }
  // Writes what is buffered and syncs the temporary file; then only commit's rename is left.
  void finish();
  // finish(), then renames the temporary file over the path and syncs the folder.
  void commit();

 private:
  void flush();
  void write_all(const std::byte* p, std::size_t n);
  [[noreturn]] void fail(const std::string& doing) const;

  std::filesystem::path path_, temp_;
  int fd_ = -1;
  bool committed_ = false;
  std::vector<std::byte> buffer_;
  std::uint64_t offset_ = 0;
};

// The file being read, by position; every failure names the file.
class Reader {
 public:
  // `unchanged`: what every error says was left as it was (a reader that loads nothing says so).
  explicit Reader(const std::filesystem::path& path, std::string unchanged = "the trainer was not changed");
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;
  ~Reader();
  std::uint64_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }
  const std::string& unchanged() const { return unchanged_; }
  void read(std::uint64_t offset, void* dst, std::size_t n) const;
  // "checkpoint '<path>' is corrupt: <what>; the trainer was not changed: ..."
  std::runtime_error corrupt(const std::string& what) const;
  // The file ends before byte `end`, which `where` needs.
  std::runtime_error truncated(std::uint64_t end, const std::string& where) const;

 private:
  std::filesystem::path path_;
  std::string unchanged_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

// A section found in a file: where it is, how long, and the checksum it was verified against.
struct Section {
  std::uint32_t tag = 0;
  std::uint64_t offset = 0;  // of the head
  std::uint64_t length = 0;  // of the payload
  std::uint64_t checksum = 0;
  std::uint64_t payload() const { return offset + section_head_bytes; }
  std::uint64_t end() const { return payload() + length + 8; }
};

// The model fingerprint: what a trainer must share with the one that saved.
struct Fingerprint {
  std::string model, optimizer;
  std::uint32_t batch = 0, accumulate = 1;
  std::uint8_t precision = 0, scaled = 0, hybrid = 0;
  struct Tensor {
    std::string name;
    std::uint8_t dtype = 0;
    ops::Shape shape;
    std::uint64_t bytes = 0;
  };
  std::vector<Tensor> tensors;
  // Section SETS: the settings a resume keeps (TrainingSetting::resume), by name, flag and value;
  // none in a file of format version 1.
  std::optional<std::vector<TrainingSetting>> settings;

  std::vector<std::byte> encode() const;           // MODL
  std::vector<std::byte> encode_settings() const;  // SETS
  static Fingerprint decode(const std::vector<std::byte>& bytes, const Reader& r);
  static std::vector<TrainingSetting> decode_settings(const std::vector<std::byte>& bytes, const Reader& r);
};

// The trainer's own counters (section TRNR).
struct TrainerRecord {
  std::uint64_t steps = 0;
  std::uint32_t micro = 0;
  float lr = 0;
  double phase_ms[phase_count] = {};
  std::uint64_t phase_steps[phase_count] = {};
  float loss_scale = 1;
  std::uint32_t clean_steps = 0;
  std::uint64_t overflows = 0;
  bool in_predict_run = false;
  std::vector<float> gains;  // two per weight while hybrid phases run (ops/predictor.hpp)
};

// Everything of a checkpoint but its tensors' bytes: the header and every section verified
// against its checksum, the small sections decoded, the tensor sections located.
struct Contents {
  std::uint32_t format_version = 0;
  std::string writer;  // the ferry release that wrote it (the header's)
  Fingerprint fingerprint;
  TrainerRecord trainer;
  std::optional<PhaseController::State> phases;  // with hybrid phases
  std::vector<std::byte> caller;
  std::vector<Section> tensors;   // one per fingerprint tensor, in its order
  std::vector<Section> restores;  // inside a Predict run: one per weight (the first tensors)
  // The first value that is not a finite number in each f32, f16 or bf16 tensor section holding
  // one, found while its checksum is verified. What a tensor may hold is the loader's to decide
  // (Trainer::load_checkpoint refuses them in weights: runtime/checkpoint.cpp).
  struct NonFinite {
    std::size_t tensor = 0;  // in fingerprint.tensors
    bool restore = false;    // in the restore point (the weight before a Predict run)
    std::uint64_t element = 0;
    bool nan = false;  // else an infinity
    bool negative = false;
    std::string value_text() const;  // "nan", "inf" or "-inf"
  };
  std::vector<NonFinite> non_finite;
};

// Trainer::load_checkpoint's rule for a value that is not a finite number (runtime/checkpoint.cpp):
// refused in a weight, its restore point and the predictor's state, and as NaN in optimizer state
// (an infinity there is what Adam's second moment becomes from a finite gradient whose square
// overflows, and a run trains on with it); taken in gradient sums, which may hold either under
// loss scaling inside a group of micro-batches (the update then skips).
bool load_refuses(graph::Role role, const Contents::NonFinite& bad);
// "weight", "optimizer state"...: how load errors name a tensor of `role` holding `bad`.
std::string role_text(graph::Role role, const Contents::NonFinite& bad);
// The role of tensor `i` judged by the names alone, for ferry checkpoint, which has no trainer:
// "<another tensor's name>.grad_sum" is a gradient sum, "<another's>.pred_..." predictor state,
// any other "<another's>.<suffix>" optimizer state, the rest weights. A load uses the trainer's
// own roles; test_checkpoint checks that these agree with them for ferry's models.
graph::Role role_by_name(const Fingerprint& f, std::size_t i);
// The first value of `c` a resume refuses, the roles judged by role_by_name, said as "element E of
// weight 'W' is nan"; none where a resume takes every value (ferry checkpoint's exit status).
std::optional<std::string> resume_refusal(const Contents& c);

// Reads and verifies the whole file (every byte, through the checksums) without keeping the
// tensors. Throws std::runtime_error naming the file, the section and the byte for a file that is
// foreign, newer, truncated or damaged; nothing else.
Contents read_contents(const Reader& r);

// Reads tensor section `s` (found by read_contents) into `buf` again and checks it against the
// checksum read_contents verified; false when the file changed since. Returns the tensor's bytes
// (after its name).
std::optional<std::span<const std::byte>> read_tensor(const Reader& r, const Section& s, std::size_t name_bytes,
                                                      std::vector<std::byte>& buf);

// Writes a whole checkpoint atomically at `path`: the tensors' bytes come one at a time from
// `tensor(i, buf)` (buf resized to fingerprint.tensors[i].bytes), then `restores[i]` as the
// weights to put back (named after the first tensors). What `path` names now is checked first
// (refuse_to_replace, output_file.hpp). `agree`, where given, is called once whatever happens:
// with whether the whole file is written and synced, before it replaces `path`; it returns whether
// the file may replace it (the ranks' files of one checkpoint replace theirs only when every rank
// wrote its own), else the temporary file is removed and the write throws. `lock`: take the path's
// OutputLock (output_file.hpp) for the write, so that a write never replaces the checkpoint another
// run is writing there; false where the caller holds it already (a TrainingLoop, for its run).
void write_checkpoint(const std::filesystem::path& path, const Fingerprint& fingerprint, const TrainerRecord& trainer,
                      const std::optional<PhaseController::State>& phases, std::span<const std::byte> caller,
                      const std::function<void(std::size_t, std::vector<std::byte>&)>& tensor,
                      std::span<const std::vector<std::byte>> restores, bool replace_foreign_file = false,
                      const std::function<bool(bool written)>& agree = {}, bool lock = true);

// The bytes write_checkpoint writes for these arguments: `caller_bytes` of the caller's section,
// and the first `restored` tensors' bytes again as the weights to put back.
std::uint64_t checkpoint_file_bytes(const Fingerprint& fingerprint, const TrainerRecord& trainer,
                                    const std::optional<PhaseController::State>& phases, std::size_t caller_bytes,
                                    std::size_t restored);

}  // namespace ferry::ckpt
