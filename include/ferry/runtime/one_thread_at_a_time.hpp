// OneThreadAtATime: catches an object used by two threads at once (a Trainer is one thread's at a
// time) with a clear error, where the race would have crashed inside the OpenCL driver.
#pragma once

#include <atomic>
#include <thread>

namespace ferry {

class OneThreadAtATime {
 public:
  // Held for one call of the object (`call` names it, "Trainer::step"). A call from another thread
  // while it is held throws std::logic_error naming both calls and what to do; a call nested on the
  // holding thread (step() is result(submit())) passes.
  class Call {
   public:
    Call(const OneThreadAtATime& use, const char* call);
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

   private:
    const OneThreadAtATime& use_;
  };

 private:
  mutable std::atomic<std::thread::id> holder_{};
  mutable std::atomic<const char*> call_{nullptr};  // the holder's outermost call
  mutable int depth_ = 0;                           // the holder's nesting; only the holder touches it
};

}  // namespace ferry
