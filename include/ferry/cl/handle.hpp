// Reference-counted RAII owners for OpenCL objects.
#pragma once

#include <CL/cl.h>

#include <utility>

namespace ferry::cl {

template <class T, cl_int (*Retain)(T), cl_int (*Release)(T)>
class Handle {
 public:
  Handle() = default;
  // Takes ownership of one reference (as returned by a clCreate* call).
  explicit Handle(T raw) noexcept : raw_(raw) {}
  Handle(const Handle& other) noexcept : raw_(other.raw_) {
    if (raw_) Retain(raw_);
  }
  Handle(Handle&& other) noexcept : raw_(std::exchange(other.raw_, nullptr)) {}
  Handle& operator=(Handle other) noexcept {
    std::swap(raw_, other.raw_);
    return *this;
  }
  ~Handle() {
    if (raw_) Release(raw_);
  }
  // Adds a reference to a raw object owned elsewhere.
  static Handle retain(T raw) noexcept {
    if (raw) Retain(raw);
    return Handle(raw);
  }
  T get() const noexcept { return raw_; }
  // For APIs that write a new object. Drops the reference the handle held first, so a handle
  // reused step after step (a gate's read, a ring's slot) keeps only its newest object; the old
  // one must therefore not be in the same call's wait list.
  T* out() noexcept {
    if (raw_) Release(std::exchange(raw_, nullptr));
    return &raw_;
  }
  explicit operator bool() const noexcept { return raw_ != nullptr; }

 private:
  T raw_ = nullptr;
};

using ContextHandle = Handle<cl_context, clRetainContext, clReleaseContext>;
using QueueHandle = Handle<cl_command_queue, clRetainCommandQueue, clReleaseCommandQueue>;
using Mem = Handle<cl_mem, clRetainMemObject, clReleaseMemObject>;
using Program = Handle<cl_program, clRetainProgram, clReleaseProgram>;
using Kernel = Handle<cl_kernel, clRetainKernel, clReleaseKernel>;
using Event = Handle<cl_event, clRetainEvent, clReleaseEvent>;

}  // namespace ferry::cl
