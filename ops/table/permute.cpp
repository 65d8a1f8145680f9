// The row of permute, a materialised transpose of rank 2 to 4 (kernel and binding:
// ops/layout.hpp). Its backward rule is a permute by the inverse permutation.
#include <fmt/format.h>

#include <array>

#include "ops/layout.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

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

}  // namespace

void register_permute_rows(const AddRow& add) {
  add(permute_row(), builtin::permute);
}

}  // namespace ferry::ops::table
