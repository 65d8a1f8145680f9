// PoCL's kernel cache folder, made usable before the first OpenCL call (cl/pocl_cache.cpp).
#pragma once

namespace ferry::cl {

// When POCL_CACHE_DIR is unset and PoCL's default folder cannot be created, sets POCL_CACHE_DIR
// to a private folder under FERRY_CACHE_DIR or the temp folder and says so on stderr; when the
// user set POCL_CACHE_DIR to a folder this process cannot create or write, warns on stderr and
// leaves it. Once per process; call before the OpenCL platforms are first listed.
void prepare_pocl_cache_folder();

}  // namespace ferry::cl
