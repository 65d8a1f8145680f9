// Storage dtypes, shapes and lanes: names, sizes, parsing.
#include "ferry/ops/types.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace ferry::ops {

std::size_t dtype_bytes(DType t) {
  switch (t) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::i8:
    case DType::u8:
      return 1;
  }
  throw std::logic_error("dtype_bytes: unknown dtype");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
    case DType::i8:
      return "i8";
    case DType::u8:
      return "u8";
    case DType::i32:
      return "i32";
  }
  return "?";
}

DType parse_dtype(std::string_view s) {
  for (DType t : all_dtypes) {
    if (s == dtype_name(t)) return t;
  }
  throw std::invalid_argument(fmt::format("unknown dtype '{}': use f32, f16, bf16, i8, u8 or i32", s));
}

bool dtype_is_float(DType t) {
  return t == DType::f32 || t == DType::f16 || t == DType::bf16;
}

std::string dtype_define(DType t, std::string_view macro) {
  std::string upper = dtype_name(t);
  for (char& c : upper) c = static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
  return fmt::format("-D{}_{}", macro, upper);
}

std::string DTypeSet::str() const {
  std::string s;
  for (DType t : all_dtypes) {
    if (contains(t)) s += fmt::format("{}{}", s.empty() ? "" : ", ", dtype_name(t));
  }
  return s.empty() ? "none" : s;
}

Shape::Shape(std::initializer_list<std::uint32_t> d) {
  if (d.size() > dims.size()) throw std::invalid_argument("tensor rank above 4 is not supported");
  rank = static_cast<std::uint8_t>(d.size());
  std::size_t i = 0;
  for (auto v : d) dims[i++] = v;
}

std::size_t Shape::elems() const {
  if (rank > dims.size()) return 0;  // not a shape (a user's shape rule can make one): no elements
  std::size_t n = 1;
  for (std::size_t i = 0; i < rank; ++i) n *= dims[i];
  return n;
}

std::string Shape::str() const {
  if (rank > dims.size()) return fmt::format("[rank {}: more than {} dimensions]", rank, dims.size());
  std::string s = "[";
  for (std::size_t i = 0; i < rank; ++i) s += fmt::format("{}{}", i ? ", " : "", dims[i]);
  return s + "]";
}

const char* lane_name(Lane l) {
  switch (l) {
    case Lane::compute:
      return "compute";
    case Lane::h2d:
      return "copy in";
    case Lane::d2h:
      return "copy out";
    case Lane::host:
      return "host";
    case Lane::unpack:
      return "host unpack";
    case Lane::comm:
      return "communication";
  }
  return "?";
}

}  // namespace ferry::ops
