// The vocabulary every layer above cl/ shares: storage dtypes, shapes, node attributes, lanes.
//
// These live in ops/ (not graph/) because an op's row in the op table (ops/op_table.hpp) speaks
// them: its shape rule maps input shapes and dtypes to output ones, its launch reads them. The
// graph IR re-exports them (graph/ir.hpp).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

namespace ferry::ops {

// Storage types. Arithmetic is fp32 in every kernel: f16 and bf16 are 16-bit storage converted in
// the kernel (no cl_khr_fp16 needed), i8/u8 are quantized storage with fp32 scales kept beside them.
enum class DType : std::uint8_t { f32, f16, bf16, i8, u8, i32 };
inline constexpr DType all_dtypes[] = {DType::f32, DType::f16, DType::bf16, DType::i8, DType::u8, DType::i32};

std::size_t dtype_bytes(DType t);
const char* dtype_name(DType t);        // "f32", "f16", "bf16", "i8", "u8", "i32"
DType parse_dtype(std::string_view s);  // throws std::invalid_argument naming the choices
bool dtype_is_float(DType t);           // f32, f16, bf16: values a kernel computes with
// The -D option that specialises a kernel source for storage type `t` under the macro name
// `macro` ("-DT_F16" style: see ops/kernels/dtype.clh for what it selects).
std::string dtype_define(DType t, std::string_view macro = "T");

// A bit set of dtypes (what an op accepts for its float operands).
class DTypeSet {
 public:
  constexpr DTypeSet() = default;
  constexpr DTypeSet(std::initializer_list<DType> ts) {
    for (DType t : ts) bits_ |= bit(t);
  }
  constexpr bool contains(DType t) const { return (bits_ & bit(t)) != 0; }
  std::string str() const;  // "f32, f16"

 private:
  static constexpr std::uint8_t bit(DType t) { return static_cast<std::uint8_t>(1u << static_cast<unsigned>(t)); }
  std::uint8_t bits_ = 0;
};

struct Shape {
  std::array<std::uint32_t, 4> dims{};
  std::uint8_t rank = 0;
  Shape() = default;
  Shape(std::initializer_list<std::uint32_t> d);
  std::uint32_t operator[](std::size_t i) const { return dims[i]; }
  std::size_t elems() const;
  std::string str() const;  // "[256, 784]"
  bool operator==(const Shape&) const = default;
};

// An op's parameters that are not tensors (stride, padding, eps, activation kind...).
struct NodeAttrs {
  std::array<std::int32_t, 4> i{};
  std::array<float, 2> f{};
};

// Which engine runs a node. Device queues run in order; events order them against each other.
// Three host lanes run on TBB workers: `host` (optimizer updates on the host, packing written-back
// state into its home), `unpack` (unpacking state from its home into staging ahead of its fetch,
// so that unpacking the next layer never waits behind packing the last one) and `comm` (the
// collectives of data parallelism). A comm node's work starts a collective and the node completes
// when the collective does; the next comm node may start as soon as this one has started
// (collectives are matched by the order they start in), so several can be in flight.
enum class Lane : std::uint8_t { compute, h2d, d2h, host, unpack, comm };
inline constexpr int lane_count = 6;
const char* lane_name(Lane l);
// Whether nodes of `l` run on the host (TBB workers) rather than as device commands.
constexpr bool is_host_lane(Lane l) {
  return l == Lane::host || l == Lane::unpack || l == Lane::comm;
}

}  // namespace ferry::ops
