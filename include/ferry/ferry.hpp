// ferry: train neural networks on any OpenCL device. The one header a trainer includes.
#pragma once

#include "ferry/cl/context.hpp"
#include "ferry/cl/device.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/graph/autodiff.hpp"
#include "ferry/graph/builder.hpp"
#include "ferry/graph/compiled_step.hpp"
#include "ferry/graph/residency.hpp"
#include "ferry/runtime/fashion_mnist.hpp"
#include "ferry/runtime/memory_profile.hpp"
#include "ferry/runtime/model.hpp"
#include "ferry/runtime/runtime.hpp"
#include "ferry/runtime/trace.hpp"
#include "ferry/runtime/trainer.hpp"
#include "ferry/runtime/units.hpp"
