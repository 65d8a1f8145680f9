// `ferry checkpoint FILE`: what a checkpoint holds and what it was trained with, read and verified
// whole (every checksum) without a device or a trainer, so a run can be resumed with the right
// options or a file checked before a long job starts.
#include <fmt/format.h>

#include <cstdint>
#include <iostream>
#include <optional>
#include <string>

#include "cli.hpp"
#include "ferry/runtime/units.hpp"
#include "runtime/checkpoint_format.hpp"

namespace ferry::cli {
namespace {

std::uint64_t tensor_bytes(const ckpt::Contents& c) {
  std::uint64_t bytes = 0;
  for (const auto& t : c.fingerprint.tensors) bytes += t.bytes;
  return bytes;
}

// The caller section's kind when it is one of ferry's commands' (CBOR with a "kind"), else empty.
std::string caller_kind(const ckpt::Contents& c) {
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(c.caller.data());
  const nlohmann::json j = nlohmann::json::from_cbor(bytes, bytes + c.caller.size(), true, false);
  if (j.is_discarded() || !j.is_object()) return "";
  const auto kind = j.find("kind");
  return kind != j.end() && kind->is_string() ? kind->get<std::string>() : "";
}

// `refusal`: ckpt::resume_refusal of `c`.
nlohmann::json info_json(const std::string& path, std::uint64_t file_bytes, const ckpt::Contents& c,
                         const std::optional<std::string>& refusal) {
  const ckpt::Fingerprint& f = c.fingerprint;
  nlohmann::json settings = nullptr;  // a file of format 1 records none
  if (f.settings) {
    settings = nlohmann::json::array();
    for (const TrainingSetting& s : *f.settings)
      settings.push_back({{"name", s.name}, {"flag", s.flag}, {"value", s.value}});
  }
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& t : f.tensors) {
    tensors.push_back({{"name", t.name},
                       {"dtype", graph::dtype_name(static_cast<graph::DType>(t.dtype))},
                       {"shape", t.shape.str()},
                       {"bytes", t.bytes}});
  }
  nlohmann::json non_finite = nlohmann::json::array();
  for (const auto& n : c.non_finite) {
    non_finite.push_back({{"tensor", f.tensors[n.tensor].name},
                          {"restore_point", n.restore},
                          {"element", n.element},
                          {"value", n.value_text()}});
  }
  const ckpt::TrainerRecord& tr = c.trainer;
  return {{"schema", 1},
          {"path", path},
          {"bytes", file_bytes},
          {"format_version", c.format_version},
          {"written_by", c.writer},
          {"model", f.model},
          {"optimizer", f.optimizer},
          {"batch", f.batch},
          {"accumulate", f.accumulate},
          {"precision", precision_name(static_cast<graph::DType>(f.precision))},
          {"loss_scaling", f.scaled != 0},
          {"phases", phases_name(f.hybrid != 0)},
          {"optimizer_updates", tr.steps},
          {"micro_batches", tr.micro},
          {"lr", shortest(tr.lr)},  // the learning rate of the next update, as a float prints it
          {"loss_scale", tr.loss_scale},
          {"in_predict_run", tr.in_predict_run},
          {"settings", settings},
          {"tensor_bytes", tensor_bytes(c)},
          {"tensors", tensors},
          {"non_finite", non_finite},
          {"resumable", !refusal.has_value()},
          {"caller_bytes", c.caller.size()},
          {"caller_kind", caller_kind(c)}};
}

void print_info(const std::string& path, std::uint64_t file_bytes, const ckpt::Contents& c) {
  const ckpt::Fingerprint& f = c.fingerprint;
  const ckpt::TrainerRecord& tr = c.trainer;
  std::cout << fmt::format("checkpoint {}: {}, format version {}, written by ferry {}; every checksum holds\n", path,
                           format_bytes(file_bytes), c.format_version, c.writer);
  std::cout << fmt::format("  model {}, {}, batch {}{}, {}{}, phases {}\n", f.model, f.optimizer, f.batch,
                           f.accumulate > 1 ? fmt::format(" x {} micro-batches", f.accumulate) : "",
                           precision_name(static_cast<graph::DType>(f.precision)), f.scaled ? " with loss scaling" : "",
                           phases_name(f.hybrid != 0));
  std::cout << fmt::format("  after {} optimizer updates{}; learning rate {:.6g}{}{}\n", tr.steps,
                           tr.micro ? fmt::format(" and {} micro-batches", tr.micro) : "", tr.lr,
                           f.scaled ? fmt::format(", loss scale {}", tr.loss_scale) : "",
                           tr.in_predict_run ? ", inside a Predict run" : "");
  if (!f.settings) {
    std::cout << "  settings: not recorded (format version 1)\n";
  } else {
    std::string line;
    for (const TrainingSetting& s : *f.settings) line += (line.empty() ? "" : ", ") + setting_text(s, s.value);
    std::cout << "  settings: " << line << "\n";
  }
  std::cout << fmt::format("  {} tensors, {}; caller section {}{}\n", f.tensors.size(), format_bytes(tensor_bytes(c)),
                           format_bytes(c.caller.size()),
                           caller_kind(c).empty() ? "" : fmt::format(" ({})", caller_kind(c)));
  // What a load refuses in weights (runtime/checkpoint.cpp): the first such value of each tensor.
  for (const auto& n : c.non_finite) {
    std::cout << fmt::format("  not finite: element {} of '{}'{} is {}\n", n.element, f.tensors[n.tensor].name,
                             n.restore ? " (its restore point)" : "", n.value_text());
  }
}

}  // namespace

int cmd_checkpoint(const CheckpointArgs& a) {
  const ckpt::Reader reader(a.path, "nothing was loaded");
  const ckpt::Contents contents = ckpt::read_contents(reader);
  const std::optional<std::string> refused = ckpt::resume_refusal(contents);
  if (a.json) {
    // Names come from the file: bytes that are not UTF-8 print replaced, not as an exception.
    std::cout << info_json(a.path, reader.size(), contents, refused)
                     .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
              << std::endl;
  } else {
    print_info(a.path, reader.size(), contents);
  }
  // A file read whole that a resume still refuses fails the check: a script that checks a file
  // before a long job starts reads the exit status.
  if (refused) {
    std::cout.flush();
    std::cerr << fmt::format(
        "ferry: error: checkpoint '{}' holds a value that is not a finite number where a resume refuses one: {}; the "
        "run that wrote it had diverged before it saved: resume from an earlier checkpoint\n",
        a.path, *refused);
    return 1;
  }
  return 0;
}

}  // namespace ferry::cli
