// `ferry train`'s output paths, checked before any work: an output is created, or replaces a file
// of the same kind that ferry wrote; it never replaces a device node, a folder, a symbolic link, a
// foreign file (unless --force), one of the run's inputs, or another output of the same run.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <vector>

#include "cli.hpp"
#include "ferry/runtime/checkpoint.hpp"
#include "ferry/runtime/fashion_mnist.hpp"
#include "ferry/runtime/memory_profile.hpp"
#include "ferry/runtime/trace.hpp"
#include "runtime/output_file.hpp"

namespace ferry::cli {
namespace {

namespace fs = std::filesystem;

struct Output {
  const char* flag;
  std::string path;
  const char* kind;       // what ferry writes there, for messages
  std::string signature;  // how such a file ferry wrote begins
};

std::invalid_argument refuse(const Output& o, const std::string& why) {
  return std::invalid_argument(
      fmt::format("{} {}: {} (checked before training, so nothing is lost)", o.flag, o.path, why));
}

// The path as it would be reached, for comparing outputs with each other and with inputs.
fs::path resolved(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(path, ec), ec);
  return ec ? fs::absolute(path) : p;
}

void check_one(const Output& o, bool force) {
  std::error_code ec;
  const fs::path p(o.path);
  const fs::file_status link = fs::symlink_status(p, ec);
  if (fs::is_symlink(link)) {
    throw refuse(o, fmt::format("it is a symbolic link (to {}); ferry replaces its outputs whole, which would replace "
                                "the link: give the file's own path",
                                fs::read_symlink(p, ec).string()));
  }
  if (fs::exists(link) && !fs::is_regular_file(link)) {
    throw refuse(o, fmt::format("it is {}; ferry writes its {} only to a regular file: give a file path{}",
                                ferry::file_type_name(link.type()), o.kind,
                                fs::is_directory(link) ? fmt::format(", e.g. '{}'", (p / "out").string()) : ""));
  }
  const fs::path folder = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  if (const auto why = ferry::missing_folder(p)) throw refuse(o, *why);
  if (const std::size_t longest = ferry::longest_file_name(p); p.filename().string().size() > longest) {
    throw refuse(o, fmt::format("its file name is {} bytes long, longer than the {} the file system of '{}' takes: "
                                "give a shorter name",
                                p.filename().string().size(), longest, folder.string()));
  }
  if (fs::exists(link)) {
    if (access(p.c_str(), W_OK) != 0) {
      throw refuse(o, fmt::format("the file exists and cannot be written: {}", std::strerror(errno)));
    }
    if (const auto why = ferry::content_refusal(p, o.kind, o.signature, force)) throw refuse(o, *why);
  }
  // Creating a file there must work.
  if (const auto why = ferry::cannot_create_in(folder)) {
    throw refuse(o, fmt::format("cannot create a file in '{}': {}", folder.string(), *why));
  }
}

}  // namespace

std::string head_of(const std::filesystem::path& p, std::size_t n) {
  std::ifstream in(p, std::ios::binary);
  std::string s(n, '\0');
  in.read(s.data(), static_cast<std::streamsize>(n));
  s.resize(static_cast<std::size_t>(in.gcount()));
  return s;
}

void check_outputs(const TrainArgs& a) {
  if (a.trace_steps == 0) {
    throw std::invalid_argument("--trace-steps 0 traces and profiles no step: give 1 or more (the default is 4)");
  }
  std::vector<Output> outputs;
  auto add = [&](const char* flag, const std::string& path, const char* kind, std::string signature) {
    if (!path.empty()) outputs.push_back({flag, path, kind, std::move(signature)});
  };
  add("--checkpoint", a.checkpoint_path, "checkpoint", std::string(ferry::checkpoint_magic, 8));
  add("--trace", a.trace_path, "trace", std::string(ferry::trace_signature));
  add("--profile", a.profile_path, "memory profile", std::string(ferry::profile_signature));
  add("--profile-phases", a.profile_phases_path, "phase memory profile", std::string(ferry::phase_profile_signature));
  for (const Output& o : outputs) check_one(o, a.force);
  // A checkpoint ferry wrote, but not the one this run resumes: another run's, or an earlier start
  // of this one, which the first checkpoint of this run would replace.
  const auto resumed = [&](const std::string& path) {  // one of the files this run goes on from
    const fs::path p = resolved(path);
    if (!a.resume_path.empty() && resolved(a.resume_path) == p) return true;
    return std::any_of(a.resume_files.begin(), a.resume_files.end(),
                       [&](const std::string& f) { return resolved(f) == p; });
  };
  if (!a.checkpoint_path.empty() && !a.force &&
      head_of(a.checkpoint_path, 8) == std::string_view(ferry::checkpoint_magic, 8) && !resumed(a.checkpoint_path)) {
    throw refuse(outputs.front(),
                 fmt::format("the file holds a checkpoint, of another run or of an earlier start of this one, which "
                             "this run's first checkpoint would replace: add --resume {} to go on from it, give "
                             "another path, or add --force to start over and replace it",
                             given_file(a, a.checkpoint_path)));
  }

  for (std::size_t i = 0; i < outputs.size(); ++i) {
    for (std::size_t j = i + 1; j < outputs.size(); ++j) {
      if (resolved(outputs[i].path) == resolved(outputs[j].path)) {
        throw std::invalid_argument(fmt::format("{} and {} name the same file '{}': give each output its own path",
                                                outputs[i].flag, outputs[j].flag, outputs[i].path));
      }
    }
  }
  // ZeRO stages 1 and 2: the other ranks write their checkpoint files beside rank 0's, which rank
  // 0's other outputs must not name.
  if (a.sharded_checkpoint && a.world && a.primary && !a.checkpoint_path.empty()) {
    for (int r = 1; r < a.world->size(); ++r) {
      const std::string shard = shard_file(a.checkpoint_path, r);
      for (const Output& o : outputs) {
        if (std::string(o.flag) != "--checkpoint" && resolved(o.path) == resolved(shard)) {
          throw refuse(o, fmt::format("rank {} writes its checkpoint file '{}' there (--zero {}): give the output "
                                      "another path",
                                      r, shard, a.zero));
        }
      }
    }
  }
  // The run's inputs are never written: the file --resume reads (unless --checkpoint continues it),
  // the data set's files, and the text folder (a new file there would become training text).
  std::vector<std::pair<std::string, fs::path>> inputs;
  if (!a.resume_path.empty()) inputs.emplace_back("--resume", resolved(a.resume_path));
  if (a.model == "gpt") {
    const char* env = std::getenv("FERRY_TEXT_DIR");
    const std::string dir = !a.text_dir.empty() ? a.text_dir : env && *env ? env : "/usr/share/games/fortunes";
    inputs.emplace_back("the text folder", resolved(dir));
  } else {
    const fs::path dir = a.data_dir.empty() ? ferry::default_fashion_mnist_dir() : fs::path(a.data_dir);
    for (const char* f : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                          "t10k-labels-idx1-ubyte.gz"}) {
      inputs.emplace_back("the data set", resolved((dir / f).string()));
    }
  }
  for (const Output& o : outputs) {
    const fs::path out = resolved(o.path);
    for (const auto& [what, in] : inputs) {
      const bool same = out == in;
      const bool inside = what == "the text folder" && out.parent_path() == in;
      if (what == "--resume" && same && std::string(o.flag) == "--checkpoint") continue;  // continuing a run
      if (same || inside) {
        throw refuse(o, fmt::format("it {} {} this run reads ({}): give the output another path",
                                    same ? "is a file of" : "is in", what, in.string()));
      }
    }
  }
}

}  // namespace ferry::cli
