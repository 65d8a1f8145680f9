// OpenCL errors as exceptions that name the call, the error and the op being run.
#pragma once

#include <CL/cl.h>

#include <stdexcept>
#include <string>
#include <string_view>

namespace ferry::cl {

// Symbolic name of an OpenCL status code, e.g. "CL_OUT_OF_RESOURCES".
const char* error_name(cl_int code);

class Error : public std::runtime_error {
 public:
  Error(std::string call, cl_int code, std::string op);
  cl_int code() const noexcept { return code_; }
  const std::string& call() const noexcept { return call_; }
  const std::string& op() const noexcept { return op_; }

 private:
  std::string call_;
  cl_int code_;
  std::string op_;
};

// The op the current thread works for; OpenCL errors raised meanwhile name it.
// Graph nodes and op launchers open one so that a failing clEnqueue says which op it served.
class OpScope {
 public:
  explicit OpScope(std::string_view op) noexcept;
  ~OpScope();
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;
  static std::string_view current() noexcept;

 private:
  std::string_view previous_;
};

inline void check(cl_int code, const char* call) {
  if (code != CL_SUCCESS) throw Error(call, code, std::string(OpScope::current()));
}

}  // namespace ferry::cl

// Runs an OpenCL call that returns a status and throws ferry::cl::Error if it failed.
#define FERRY_CL(call_expr) ::ferry::cl::check((call_expr), #call_expr)
