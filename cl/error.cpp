// OpenCL status names and the thread-local op scope used in error messages.
#include "ferry/cl/error.hpp"

#include <fmt/format.h>

namespace ferry::cl {
namespace {
thread_local std::string_view current_op;

std::string describe(const std::string& call, cl_int code, const std::string& op) {
  if (op.empty()) return fmt::format("OpenCL call {} failed: {} ({})", call, error_name(code), code);
  return fmt::format("op '{}': OpenCL call {} failed: {} ({})", op, call, error_name(code), code);
}
}  // namespace

Error::Error(std::string call, cl_int code, std::string op)
    : std::runtime_error(describe(call, code, op)), call_(std::move(call)), code_(code), op_(std::move(op)) {}

OpScope::OpScope(std::string_view op) noexcept : previous_(current_op) {
  current_op = op;
}
OpScope::~OpScope() {
  current_op = previous_;
}
std::string_view OpScope::current() noexcept {
  return current_op;
}

const char* error_name(cl_int code) {
  switch (code) {
#define FERRY_CASE(x) \
  case x:             \
    return #x;
    FERRY_CASE(CL_SUCCESS)
    FERRY_CASE(CL_DEVICE_NOT_FOUND)
    FERRY_CASE(CL_DEVICE_NOT_AVAILABLE)
    FERRY_CASE(CL_COMPILER_NOT_AVAILABLE)
    FERRY_CASE(CL_MEM_OBJECT_ALLOCATION_FAILURE)
    FERRY_CASE(CL_OUT_OF_RESOURCES)
    FERRY_CASE(CL_OUT_OF_HOST_MEMORY)
    FERRY_CASE(CL_PROFILING_INFO_NOT_AVAILABLE)
    FERRY_CASE(CL_MEM_COPY_OVERLAP)
    FERRY_CASE(CL_IMAGE_FORMAT_MISMATCH)
    FERRY_CASE(CL_IMAGE_FORMAT_NOT_SUPPORTED)
    FERRY_CASE(CL_BUILD_PROGRAM_FAILURE)
    FERRY_CASE(CL_MAP_FAILURE)
    FERRY_CASE(CL_MISALIGNED_SUB_BUFFER_OFFSET)
    FERRY_CASE(CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST)
    FERRY_CASE(CL_COMPILE_PROGRAM_FAILURE)
    FERRY_CASE(CL_LINKER_NOT_AVAILABLE)
    FERRY_CASE(CL_LINK_PROGRAM_FAILURE)
    FERRY_CASE(CL_DEVICE_PARTITION_FAILED)
    FERRY_CASE(CL_KERNEL_ARG_INFO_NOT_AVAILABLE)
    FERRY_CASE(CL_INVALID_VALUE)
    FERRY_CASE(CL_INVALID_DEVICE_TYPE)
    FERRY_CASE(CL_INVALID_PLATFORM)
    FERRY_CASE(CL_INVALID_DEVICE)
    FERRY_CASE(CL_INVALID_CONTEXT)
    FERRY_CASE(CL_INVALID_QUEUE_PROPERTIES)
    FERRY_CASE(CL_INVALID_COMMAND_QUEUE)
    FERRY_CASE(CL_INVALID_HOST_PTR)
    FERRY_CASE(CL_INVALID_MEM_OBJECT)
    FERRY_CASE(CL_INVALID_IMAGE_FORMAT_DESCRIPTOR)
    FERRY_CASE(CL_INVALID_IMAGE_SIZE)
    FERRY_CASE(CL_INVALID_SAMPLER)
    FERRY_CASE(CL_INVALID_BINARY)
    FERRY_CASE(CL_INVALID_BUILD_OPTIONS)
    FERRY_CASE(CL_INVALID_PROGRAM)
    FERRY_CASE(CL_INVALID_PROGRAM_EXECUTABLE)
    FERRY_CASE(CL_INVALID_KERNEL_NAME)
    FERRY_CASE(CL_INVALID_KERNEL_DEFINITION)
    FERRY_CASE(CL_INVALID_KERNEL)
    FERRY_CASE(CL_INVALID_ARG_INDEX)
    FERRY_CASE(CL_INVALID_ARG_VALUE)
    FERRY_CASE(CL_INVALID_ARG_SIZE)
    FERRY_CASE(CL_INVALID_KERNEL_ARGS)
    FERRY_CASE(CL_INVALID_WORK_DIMENSION)
    FERRY_CASE(CL_INVALID_WORK_GROUP_SIZE)
    FERRY_CASE(CL_INVALID_WORK_ITEM_SIZE)
    FERRY_CASE(CL_INVALID_GLOBAL_OFFSET)
    FERRY_CASE(CL_INVALID_EVENT_WAIT_LIST)
    FERRY_CASE(CL_INVALID_EVENT)
    FERRY_CASE(CL_INVALID_OPERATION)
    FERRY_CASE(CL_INVALID_GL_OBJECT)
    FERRY_CASE(CL_INVALID_BUFFER_SIZE)
    FERRY_CASE(CL_INVALID_MIP_LEVEL)
    FERRY_CASE(CL_INVALID_GLOBAL_WORK_SIZE)
    FERRY_CASE(CL_INVALID_PROPERTY)
    FERRY_CASE(CL_INVALID_IMAGE_DESCRIPTOR)
    FERRY_CASE(CL_INVALID_COMPILER_OPTIONS)
    FERRY_CASE(CL_INVALID_LINKER_OPTIONS)
    FERRY_CASE(CL_INVALID_DEVICE_PARTITION_COUNT)
#undef FERRY_CASE
    case -1001:
      return "CL_PLATFORM_NOT_FOUND_KHR (no OpenCL platform: is an ICD such as pocl-opencl-icd installed?)";
    default:
      return "unknown OpenCL error";
  }
}

}  // namespace ferry::cl
