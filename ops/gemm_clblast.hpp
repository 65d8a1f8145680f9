// GEMM through CLBlast, bound as a deferred call. Private to ops/gemm*.cpp.
#pragma once

#include "ops/gemm.hpp"

namespace ferry::ops {

// Launches that run clblast::Gemm (row-major) on the spans, then add the bias if there is one.
// Throws if this build has no CLBlast (gemm_have_clblast() is false).
LaunchList bind_clblast_gemm(OpEnv& env, const GemmShape& s, float alpha, DeviceSpan a, DeviceSpan b, float beta,
                             DeviceSpan c, DeviceSpan bias);

}  // namespace ferry::ops
