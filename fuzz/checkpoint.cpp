// Fuzzes the checkpoint reader (ckpt::read_contents, runtime/checkpoint_format.cpp): the bytes
// are the whole file. The reader must either throw std::runtime_error or return contents that
// are consistent with the file; and when a file parses, every byte of it is under a checksum, so
// flipping any one bit must make it fail. Each input is tried as it is and with its checksums
// made right, so that mutations also reach the decoders behind the checksums.
//
// The seed corpus (fuzz/corpus/checkpoint/) is written by this harness:
//   FERRY_FUZZ_WRITE_SEEDS=fuzz/corpus/checkpoint build/fuzz/fuzz/fuzz_checkpoint
// and tests/test_checkpoint_format.cpp checks that every seed still parses.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../runtime/checkpoint_format.hpp"
#include "fuzz_support.hpp"

namespace {

using namespace ferry;

using ferry::fuzz::check;

// One in-memory file, rewritten for every input, read through its /proc path as a checkpoint.
fuzz::MemoryFile& file() {
  static fuzz::MemoryFile f("ferry-fuzz-checkpoint");
  return f;
}

// Parses the file's current bytes: the contents, or nothing when the reader refused them.
std::optional<ckpt::Contents> parse(std::uint64_t size) {
  try {
    const ckpt::Reader r(file().path());
    check(r.size() == size);
    ckpt::Contents c = ckpt::read_contents(r);
    // What a parse promises: one section per tensor, of the tensor's size, inside the file.
    check(c.tensors.size() == c.fingerprint.tensors.size());
    check(c.restores.size() == (c.trainer.in_predict_run ? c.trainer.gains.size() / 2 : 0));
    for (std::size_t i = 0; i < c.tensors.size(); ++i) {
      const auto& t = c.fingerprint.tensors[i];
      check(c.tensors[i].length == 4 + t.name.size() + t.bytes);
      check(c.tensors[i].end() <= size);
    }
    return c;
  } catch (const std::runtime_error&) {
    return std::nullopt;  // any other exception escapes: libFuzzer reports it
  }
}

// The input with its checksums made right: the header's, then each section's as far as the
// lengths lead. Mutations then reach the decoders behind the checksums (fingerprint, counters,
// phase record, tensor names, the END! section), which raw mutations almost never pass.
std::vector<std::uint8_t> with_checksums_fixed(const std::uint8_t* data, std::size_t size) {
  std::vector<std::uint8_t> b(data, data + size);
  if (size < ckpt::header_bytes) return b;
  const std::uint64_t header_sum = checkpoint_checksum(b.data(), 32);
  std::memcpy(b.data() + 32, &header_sum, 8);
  std::size_t at = ckpt::header_bytes;
  while (size - at >= ckpt::section_head_bytes + 8) {
    std::uint64_t length = 0;
    std::memcpy(&length, b.data() + at + 8, 8);
    if (length > size - at - ckpt::section_head_bytes - 8) break;
    ckpt::Checksum sum;
    sum.add(b.data() + at, ckpt::section_head_bytes + length);
    const std::uint64_t v = sum.value();
    at += ckpt::section_head_bytes + length;
    std::memcpy(b.data() + at, &v, 8);
    at += 8;
  }
  return b;
}

// A file that parses: one flipped bit anywhere must be caught.
void check_every_bit_counts(const std::uint8_t* data, std::size_t size) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i < size; ++i) h = (h ^ data[i]) * 0x100000001b3ull;
  std::vector<std::uint8_t> damaged(data, data + size);
  damaged[h % size] ^= static_cast<std::uint8_t>(1u << (h >> 61));
  file().set(damaged.data(), damaged.size());
  check(!parse(size));
}

// The seeds: small but complete checkpoints of each kind the writer makes (the corpus keeps
// format 1's too, as format1_*).
void write_seeds(const std::string& folder) {
  ckpt::Fingerprint fp;
  fp.model = "mlp-4-3";
  fp.optimizer = "adam";
  fp.batch = 8;
  fp.tensors = {{"fc.w", 0, ops::Shape{}, 48}, {"fc.b", 0, ops::Shape{}, 12}, {"fc.w.m", 0, ops::Shape{}, 48}};
  fp.tensors[0].shape.rank = 2;
  fp.tensors[0].shape.dims = {3, 4, 0, 0};
  fp.settings = {{"optimizer.adam.eps", "", "1e-08"}, {"gpt.dropout", "--dropout", "0.1"}};
  ckpt::TrainerRecord tr;
  tr.steps = 17;
  tr.lr = 1e-3f;
  tr.loss_scale = 65536;
  const auto fill = [](std::size_t i, std::vector<std::byte>& buf) {
    for (std::size_t k = 0; k < buf.size(); ++k) buf[k] = static_cast<std::byte>(i * 31 + k);
  };
  const std::byte caller[] = {std::byte{'r'}, std::byte{'u'}, std::byte{'n'}};
  ckpt::write_checkpoint(folder + "/plain", fp, tr, std::nullopt, {}, fill, {});
  ckpt::write_checkpoint(folder + "/caller", fp, tr, std::nullopt, caller, fill, {});
  // Hybrid phases, saved inside a Predict run: a phase record, gains, weights to put back.
  fp.hybrid = 1;
  tr.in_predict_run = true;
  tr.gains = {0.5f, 0.25f, 1.0f, 0.0f};
  PhaseController::State ps;
  ps.next = Phase::predict;
  ps.length = 4;
  ps.losses = {2.5, 2.25, 2.0};
  ps.qualities = {0.9, 0.95};
  const std::vector<std::vector<std::byte>> restores = {std::vector<std::byte>(48, std::byte{7}),
                                                        std::vector<std::byte>(12, std::byte{9})};
  ckpt::write_checkpoint(folder + "/hybrid_predict", fp, tr, ps, caller, fill, restores);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* seeds = std::getenv("FERRY_FUZZ_WRITE_SEEDS")) {
    write_seeds(seeds);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  file().set(data, size);
  if (parse(size)) check_every_bit_counts(data, size);
  const std::vector<std::uint8_t> fixed = with_checksums_fixed(data, size);
  file().set(fixed.data(), fixed.size());
  if (parse(size)) check_every_bit_counts(fixed.data(), fixed.size());
  return 0;
}
