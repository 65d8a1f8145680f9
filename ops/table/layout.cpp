// Rows of permute (a materialised transpose), elementwise product and scaling by a constant.
// Each row's backward rule reuses its own row: permute by the inverse permutation, mul by the
// other factor, scale by the same factor.
#include "ops/layout.hpp"

#include <fmt/format.h>

#include <cmath>
#include <memory>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

// A row's own id, known once `add` returns; its backward rule emits nodes of the same row.

void expect_inputs(const ShapeView& v, std::size_t n, const char* op) {
  if (v.input_count() != n) shape_error(v, fmt::format("{} takes {} input(s), got {}", op, n, v.input_count()));
}

std::span<const std::int32_t> perm_of(const NodeAttrs& a) {
  return a.i;
}

// The longest prefix of attrs.i (4, 3 or 2 entries) that is a permutation of its indices. A
// backward rule sees no shapes, but for a valid permutation of rank r this prefix has r or more
// entries, and the inverse over it has the inverse of the first r entries in its first r entries
// (any longer prefix permutes the axes r.. among themselves).
std::size_t permuted_prefix(const NodeAttrs& a) {
  for (std::size_t m = 4; m > 2; --m) {
    std::array<bool, 4> seen{};
    bool ok = true;
    for (std::size_t k = 0; k < m && ok; ++k) {
      const std::int32_t v = a.i[k];
      ok = v >= 0 && static_cast<std::size_t>(v) < m && !seen[static_cast<std::size_t>(v)];
      if (ok) seen[static_cast<std::size_t>(v)] = true;
    }
    if (ok) return m;
  }
  return 2;
}

OpInfo permute_row() {  // attrs.i[0..rank-1] = perm   in: x  out: y
  OpInfo r;
  r.name = "permute";
  r.float_dtypes = permute_dtypes;
  r.infer = [](const ShapeView& v) {
    expect_inputs(v, 1, "permute");
    const TensorDesc x = v.input(0);
    if (std::string e = permutation_error(x.shape, perm_of(v.attrs())); !e.empty()) shape_error(v, e);
    return std::vector<TensorDesc>{{permuted_shape(x.shape, perm_of(v.attrs())), x.dtype}};
  };
  r.bind = [](const BindContext& c) {
    return permute(c.env(), c.in(0), c.out(0), c.input(0).shape, perm_of(c.attrs()), c.input(0).dtype);
  };
  r.backward = [](GradContext& g) {
    NodeAttrs inv;
    inv.i = inverse_permutation(perm_of(g.attrs()), permuted_prefix(g.attrs()));
    unary_backward(g, builtin::permute, no_ref, inv);
  };
  r.reference = [](RefContext& c) {
    ref::permute<double>(c.real(c.inputs()[0]), c.real(c.outputs()[0]), c.input(0).shape, perm_of(c.attrs()));
  };
  return r;
}

OpInfo mul_row() {  // in: a b  out: y = a * b
  OpInfo r;
  r.name = "mul";
  r.infer = [](const ShapeView& v) {
    expect_inputs(v, 2, "mul");
    const TensorDesc a = v.input(0), b = v.input(1);
    if (!(a.shape == b.shape)) {
      shape_error(v,
                  fmt::format("mul takes two tensors of the same shape, got {} and {}", a.shape.str(), b.shape.str()));
    }
    if (a.dtype != b.dtype)
      shape_error(v, fmt::format("dtypes differ: {} and {}", dtype_name(a.dtype), dtype_name(b.dtype)));
    return std::vector<TensorDesc>{a};
  };
  r.bind = [](const BindContext& c) { return mul(c.env(), c.in(0), c.in(1), c.out(0), out_elems(c, 0)); };
  r.backward = [](GradContext& g) {
    const auto in = g.inputs();
    const TensorRef dy = g.grad(g.outputs()[0]);
    if (dy == no_ref) return;
    // da = dy * b, db = dy * a: each a node of this row, only for an input that needs it.
    const char* suffixes[] = {".grad_a", ".grad_b"};
    for (std::size_t i = 0; i < 2; ++i) {
      if (!g.needs_grad(in[i])) continue;
      const TensorRef d = g.new_grad(in[i]);
      const TensorRef ins[] = {dy, in[1 - i]};
      const TensorRef outs[] = {d};
      g.emit(builtin::mul, suffixes[i], ins, outs, {});
      g.contribute(in[i], d);
    }
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::mul<double>(c.real(in[0]), c.real(in[1]), c.real(c.outputs()[0]));
  };
  return r;
}

OpInfo scale_row() {  // FactorAttrs   in: x  out: y = x * factor
  OpInfo r;
  r.name = "scale";
  r.infer = [](const ShapeView& v) {
    expect_inputs(v, 1, "scale");
    if (!std::isfinite(FactorAttrs::of(v.attrs()).factor))
      shape_error(v, fmt::format("scale factor must be finite, got {}", FactorAttrs::of(v.attrs()).factor));
    return std::vector<TensorDesc>{v.input(0)};
  };
  r.bind = [](const BindContext& c) {
    return scale(c.env(), c.in(0), c.out(0), FactorAttrs::of(c.attrs()).factor, out_elems(c, 0));
  };
  r.backward = [](GradContext& g) { unary_backward(g, builtin::scale); };
  r.reference = [](RefContext& c) {
    ref::scale<double>(c.real(c.inputs()[0]), double(FactorAttrs::of(c.attrs()).factor), c.real(c.outputs()[0]));
  };
  return r;
}

}  // namespace

void register_layout_rows(const AddRow& add) {
  add(permute_row(), builtin::permute);
  add(mul_row(), builtin::mul);
  add(scale_row(), builtin::scale);
}

}  // namespace ferry::ops::table
