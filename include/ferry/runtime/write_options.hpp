// How ferry's writers (checkpoints, traces, memory profiles) treat a file already at their path.
#pragma once

namespace ferry {

// A writer replaces its file whole (a new file renamed over it), so it never writes to a symbolic
// link, a folder or a device, and replaces a regular file only when that is a file of the same
// kind ferry wrote (or empty), unless `replace_foreign_file` says to (ferry train --force).
struct WriteOptions {
  bool replace_foreign_file = false;
};

}  // namespace ferry
