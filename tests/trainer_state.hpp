// A trainer's tensors as stored, for tests that compare two trainers' states bit for bit.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "ferry/runtime/trainer.hpp"

namespace ferry::test {

// Every weight, optimizer-state and predictor-state tensor by name: two states compare with ==.
using TensorBytes = std::map<std::string, std::vector<std::byte>>;
inline TensorBytes tensors_of(const Trainer& t) {
  TensorBytes s;
  for (const auto& name : t.tensor_names()) s[name] = t.read_tensor(name).bytes;
  return s;
}

// Every trained parameter by name, as floats.
using Parameters = std::map<std::string, std::vector<float>>;
inline Parameters parameters_of(const Trainer& t) {
  Parameters p;
  for (const auto& name : t.parameter_names()) p[name] = t.read_parameter(name);
  return p;
}

}  // namespace ferry::test
