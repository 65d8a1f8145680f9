// Outputs written whole or not at all, and never over what they must not replace. Private to
// runtime/.
#pragma once

#include <chrono>
#include <filesystem>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/runtime/write_options.hpp"

namespace ferry {

// Why the existing regular file at `path` must not be replaced by an output (`what`: "checkpoint",
// "trace file"...) whose files begin with `signature`, or nothing where it may: a ferry checkpoint
// is replaced only by a checkpoint, whatever the caller allows (it is a run's training state), and,
// unless `replace_foreign_file`, a non-empty file that does not begin with `signature` is not one
// ferry wrote. (ferry train checks its outputs by this rule before training, as writes do.)
std::optional<std::string> content_refusal(const std::filesystem::path& path, std::string_view what,
                                           std::string_view signature, bool replace_foreign_file);

// Throws std::runtime_error, before anything is written, when `path` names what an output must not
// replace: a symbolic link, anything but a regular file, or a file content_refusal refuses.
void refuse_to_replace(const std::filesystem::path& path, std::string_view what, std::string_view signature,
                       bool replace_foreign_file);

// Text outputs (traces, CSV profiles): refuse_to_replace, then write(stream) into a temporary file
// beside `path`, flushed and checked, then renamed over it, so a failure (a full disk, say) leaves
// the previous file as it was. Throws std::runtime_error("<what> '<path>': <the OS's reason>")
// when the file cannot be created, written or renamed; the temporary file is removed and `path`
// untouched then. The text `write` produces must begin with `signature`.
void write_output_file(const std::filesystem::path& path, const char* what, std::string_view signature,
                       WriteOptions options, const std::function<void(std::ostream&)>& write);

// Why a file cannot be made in the folder `path` names (its parent; "." for a bare name), or
// nothing where that folder exists: "the folder 'D' does not exist: create it first (mkdir -p D)",
// or where a file has that name, "'D' is a file, not a folder: give a path in a folder".
std::optional<std::string> missing_folder(const std::filesystem::path& path);

// The advisory lock of the output at `path` (a checkpoint a run writes again and again): held by
// one process at a time, through flock(2) on a hidden file beside it (".<name>.lock", holding the
// holder's process and host for the message), released when the object goes (or the process
// ends, however it ends). Two runs given one checkpoint at once had both written it, each
// replacing the other's.
class OutputLock {
 public:
  // Throws std::runtime_error when another process holds it, naming that process, its host and
  // what to do; or when the lock file cannot be made (naming the reason).
  OutputLock(const std::filesystem::path& path, std::string_view what);
  ~OutputLock();
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;

 private:
  std::filesystem::path lock_path_;
  int fd_ = -1;
};

// Gives `temporary`, about to be renamed over `replaced`, the permission bits (and, where this
// process may, the owner and group) of the file at `replaced`: a private checkpoint stays private
// when it is rewritten. Nothing where no regular file is there; a failure leaves the new file's
// own (the replacement goes on: the file's contents matter more than its mode).
void keep_mode_of(const std::filesystem::path& replaced, const std::filesystem::path& temporary);

// A temporary file's path beside `path` (same folder, so a rename moves it into place): a hidden
// name made of `path`'s file name, `tag`, this host's name and the process id, with the file name
// shortened where the whole would be longer than the folder's file system allows (a legal name
// must not become an illegal temporary one).
std::filesystem::path temporary_beside(const std::filesystem::path& path, std::string_view tag);
// Removes `path`'s temporaries (temporary_beside, same `tag`) that a process of this host left
// when it was killed mid-write: its process no longer runs and the file is at least `min_age` old.
// A temporary of another host is kept (its writer cannot be asked), as is one that cannot be
// removed. Says each removal on stderr; returns the paths removed.
std::vector<std::filesystem::path> remove_stale_temporaries(const std::filesystem::path& path, std::string_view tag,
                                                            std::chrono::seconds min_age = std::chrono::seconds(60));
// The longest file name the folder of `path` takes (pathconf's _PC_NAME_MAX; 255 if it says none).
std::size_t longest_file_name(const std::filesystem::path& path);

// Why no file can be created in `folder` (the OS's reason), or nullopt when one can: a probe file
// of a name nobody uses is created and removed. Permission bits alone do not say it (root, a
// read-only mount, a full inode table).
std::optional<std::string> cannot_create_in(const std::filesystem::path& folder);

// What a path that is not a regular file is, for the messages that refuse it: "a folder", "a FIFO
// (named pipe)", "a character device", "a block device", "a socket", else "a special file".
const char* file_type_name(std::filesystem::file_type type);

// Standard output is where the programs print their results (JSON lines). At the start of main,
// reserve_standard_streams() opens a closed descriptor 0, 1 or 2 again (stdout on /dev/full, so
// that writing to it fails; the others on /dev/null), so no file opened later, a checkpoint say,
// takes its number and receives what was meant for the terminal. After the last result,
// standard_output_failure() flushes stdout and says why what was printed there was lost (closed,
// a full disk, a closed pipe), or nothing when it was written.
void reserve_standard_streams();
std::optional<std::string> standard_output_failure();

}  // namespace ferry
