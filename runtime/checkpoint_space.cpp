// Checkpoints' free space, checked before training (see checkpoint_space.hpp).
#include "checkpoint_space.hpp"

#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <limits>
#include <stdexcept>
#include <vector>

#include "ferry/runtime/units.hpp"

namespace ferry {
namespace {

// FNV-1a, continued from `h`.
std::uint64_t fnv1a(const void* data, std::size_t n, std::uint64_t h = 14695981039346656037ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

std::string rank_list(const std::vector<std::size_t>& ranks) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += i + 1 == ranks.size() ? " and " : ", ";
    s += fmt::format("{}", ranks[i]);
  }
  return s;
}

}  // namespace

std::optional<CheckpointSpace> checkpoint_space_at(const std::filesystem::path& path, std::uint64_t need) {
  const std::filesystem::path folder = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  struct statvfs fs {};
  struct stat st {};
  if (::statvfs(folder.c_str(), &fs) != 0 || ::stat(folder.c_str(), &st) != 0) return std::nullopt;
  // A file system is the device it is mounted from, on this host: ranks on other hosts never share
  // one, even where their folders have the same device number.
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  const std::uint64_t device = st.st_dev;
  CheckpointSpace space;
  space.need = need;
  space.free = static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
  space.file_system = fnv1a(&device, sizeof device, fnv1a(host, std::char_traits<char>::length(host)));
  return space;
}

std::optional<std::string> checkpoint_space_shortage(std::span<const CheckpointSpace> ranks) {
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r].need == 0) continue;
    // The first rank of each file system speaks for it.
    bool seen = false;
    for (std::size_t e = 0; e < r && !seen; ++e)
      seen = ranks[e].need != 0 && ranks[e].file_system == ranks[r].file_system;
    if (seen) continue;
    std::vector<std::size_t> sharing;
    std::uint64_t need = 0;
    for (std::size_t o = r; o < ranks.size(); ++o) {
      if (ranks[o].need == 0 || ranks[o].file_system != ranks[r].file_system) continue;
      sharing.push_back(o);
      need += ranks[o].need;
    }
    if (need <= ranks[r].free) continue;
    if (ranks.size() == 1) {
      return fmt::format("this run's checkpoints need {}, and its folder has {} free", format_bytes_up(need),
                         format_bytes(ranks[r].free));
    }
    return fmt::format("the checkpoints of rank{} {} need {} on a file system with {} free",
                       sharing.size() > 1 ? "s" : "", rank_list(sharing), format_bytes_up(need),
                       format_bytes(ranks[r].free));
  }
  return std::nullopt;
}

void check_checkpoint_space(const std::filesystem::path& path, std::uint64_t need, ops::Communicator* control) {
  // A folder that cannot be asked is no file system of another rank's and never short: the write
  // reports what is wrong with it.
  const CheckpointSpace unknown{need, std::numeric_limits<std::uint64_t>::max(), 0};
  CheckpointSpace here = need != 0 ? checkpoint_space_at(path, need).value_or(unknown) : CheckpointSpace{};
  std::vector<CheckpointSpace> ranks{here};
  if (control && control->size() > 1) {
    // Every rank gathers all three, whatever it writes: the same collectives on each.
    const std::vector<std::uint64_t> needs = control->allgather(here.need);
    const std::vector<std::uint64_t> frees = control->allgather(here.free);
    const std::vector<std::uint64_t> systems = control->allgather(here.file_system);
    ranks.assign(needs.size(), {});
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      ranks[r] = {needs[r], frees[r], systems[r] != 0 ? systems[r] : fnv1a(&r, sizeof r)};
    }
  } else if (here.file_system == 0) {
    return;
  }
  const std::optional<std::string> shortage = checkpoint_space_shortage(ranks);
  if (!shortage) return;
  throw std::runtime_error(fmt::format(
      "checkpoint '{}': {}; a checkpoint is written whole beside the one it replaces, so a run that writes more than "
      "one needs room for two, less a checkpoint already at the path. Nothing was trained: free space there, or "
      "write the checkpoint to another folder (ferry train --checkpoint)",
      path.string(), *shortage));
}

}  // namespace ferry
