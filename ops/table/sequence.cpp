// Rows of embedding lookup, the causal mask and dropout, and of their gradients.
//
//   embedding        in: ids (i32, rank 1-3) table [V, D]   out: y [ids..., D]
//   embedding_grad   in: ids dy                              out: dtable [V, D]
//   causal_mask      in: x [..., T, T]                       out: y (j > i set to -inf)
//   causal_mask_grad in: dy                                  out: dx (j > i set to 0)
//   dropout          DropoutAttrs: p, seed      in: x     out: y
//   dropout_grad     attrs as dropout              in: dy    out: dx
#include "ops/sequence.hpp"

#include <fmt/format.h>

#include <utility>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

// ----- embedding -----

// Positions of the ids tensor and the table's rows and columns.
struct EmbeddingDims {
  std::size_t positions, vocab, dim;
};
EmbeddingDims embedding_dims(const ShapeView& v, std::size_t ids, std::size_t table) {
  const Shape t = v.input(table).shape;
  return {v.input(ids).shape.elems(), t[0], t[1]};
}

OpInfo embedding_grad_row() {  // in: ids dy  out: dtable
  OpInfo r;
  r.name = "embedding_grad";
  r.op_class = OpClass::backward;
  r.bind = [](const BindContext& c) {
    const Shape t = c.output(0).shape;
    return embedding_backward(c.env(), c.in(0), c.in(1), c.out(0), in_elems(c, 0), t[0], t[1]);
  };
  r.reference = [](RefContext& c) {
    const Shape t = c.output(0).shape;
    ref::embedding_backward<double>(c.ints(c.inputs()[0]), c.real(c.inputs()[1]), c.real(c.outputs()[0]), t[0], t[1]);
  };
  return r;
}

OpInfo embedding_row(OpId grad_op) {  // in: ids table  out: y
  OpInfo r;
  r.name = "embedding";
  r.infer = [](const ShapeView& v) {
    if (v.input_count() != 2) {
      shape_error(v, fmt::format("embedding takes 2 inputs (ids, table), got {}", v.input_count()));
    }
    const TensorDesc ids = v.input(0), table = v.input(1);
    if (ids.dtype != DType::i32 || ids.shape.rank < 1 || ids.shape.rank > 3) {
      shape_error(v, fmt::format("ids must be i32 of rank 1 to 3, got {} {}", dtype_name(ids.dtype), ids.shape.str()));
    }
    if (table.shape.rank != 2 || table.shape[0] == 0 || table.shape[1] == 0) {
      shape_error(v, fmt::format("table has shape {}; embedding takes a table [vocab, dim]", table.shape.str()));
    }
    if (!dtype_is_float(table.dtype)) {
      shape_error(v, fmt::format("table must be a float tensor, got {}", dtype_name(table.dtype)));
    }
    Shape y = ids.shape;
    y.dims[y.rank] = table.shape[1];
    ++y.rank;
    return std::vector<TensorDesc>{{y, table.dtype}};
  };
  r.bind = [](const BindContext& c) {
    const EmbeddingDims d = embedding_dims(c, 0, 1);
    return embedding_forward(c.env(), c.in(0), c.in(1), c.out(0), d.positions, d.vocab, d.dim);
  };
  // The table's gradient; ids get none.
  r.backward = [grad_op](GradContext& g) {
    const TensorRef ids = g.inputs()[0], table = g.inputs()[1];
    const TensorRef dy = g.grad(g.outputs()[0]);
    if (dy == no_ref || !g.needs_grad(table)) return;
    const TensorRef dtable = g.new_grad(table);
    const TensorRef ins[] = {ids, dy};
    const TensorRef outs[] = {dtable};
    g.emit(grad_op, ".grad", ins, outs, g.attrs());
    g.contribute(table, dtable);
  };
  r.reference = [](RefContext& c) {
    const EmbeddingDims d = embedding_dims(c, 0, 1);
    ref::embedding_forward<double>(c.ints(c.inputs()[0]), c.real(c.inputs()[1]), c.real(c.outputs()[0]), d.vocab,
                                   d.dim);
  };
  return r;
}

// ----- causal mask -----

// [..., T, T] as (matrices, T).
std::pair<std::size_t, std::size_t> mask_dims(const Shape& s) {
  const std::size_t t = s[s.rank - 1u];
  return {t == 0 ? 0 : s.elems() / (t * t), t};
}

OpInfo causal_mask_grad_row() {  // in: dy  out: dx
  OpInfo r;
  r.name = "causal_mask_grad";
  r.op_class = OpClass::backward;
  r.bind = [](const BindContext& c) {
    const auto [m, t] = mask_dims(c.input(0).shape);
    return causal_mask_backward(c.env(), c.in(0), c.out(0), m, t);
  };
  r.reference = [](RefContext& c) {
    ref::causal_mask_backward<double>(c.real(c.inputs()[0]), c.real(c.outputs()[0]),
                                      c.input(0).shape[c.input(0).shape.rank - 1u]);
  };
  return r;
}

OpInfo causal_mask_row(OpId grad_op) {  // in: x  out: y
  OpInfo r;
  r.name = "causal_mask";
  r.infer = [](const ShapeView& v) {
    if (v.input_count() != 1) shape_error(v, fmt::format("causal_mask takes 1 input, got {}", v.input_count()));
    const Shape s = v.input(0).shape;
    if (s.rank < 2 || s[s.rank - 1u] != s[s.rank - 2u] || s[s.rank - 1u] == 0) {
      shape_error(v, fmt::format("scores have shape {}; the causal mask takes [..., T, T] with T >= 1", s.str()));
    }
    return std::vector<TensorDesc>{v.input(0)};
  };
  r.bind = [](const BindContext& c) {
    const auto [m, t] = mask_dims(c.input(0).shape);
    return causal_mask_forward(c.env(), c.in(0), c.out(0), m, t);
  };
  r.backward = [grad_op](GradContext& g) { unary_backward(g, grad_op); };
  r.reference = [](RefContext& c) {
    ref::causal_mask_forward<double>(c.real(c.inputs()[0]), c.real(c.outputs()[0]),
                                     c.input(0).shape[c.input(0).shape.rank - 1u]);
  };
  return r;
}

// ----- dropout -----

float dropout_p(const NodeAttrs& a) {
  return DropoutAttrs::of(a).p;
}
std::uint32_t dropout_seed(const NodeAttrs& a) {
  return DropoutAttrs::of(a).seed;
}

OpInfo dropout_grad_row() {  // in: dy  out: dx
  OpInfo r;
  r.name = "dropout_grad";
  r.op_class = OpClass::backward;
  r.bind = [](const BindContext& c) {
    return dropout_backward(c.env(), c.in(0), c.out(0), in_elems(c, 0), dropout_p(c.attrs()), dropout_seed(c.attrs()));
  };
  r.reference = [](RefContext& c) {
    ref::dropout_backward<double>(c.real(c.inputs()[0]), c.real(c.outputs()[0]), dropout_p(c.attrs()),
                                  dropout_seed(c.attrs()), c.step().step);
  };
  return r;
}

OpInfo dropout_row(OpId grad_op) {  // in: x  out: y
  OpInfo r;
  r.name = "dropout";
  r.infer = [](const ShapeView& v) {
    if (v.input_count() != 1) shape_error(v, fmt::format("dropout takes 1 input, got {}", v.input_count()));
    const float p = dropout_p(v.attrs());
    if (!(p >= 0.0f && p < 1.0f)) shape_error(v, fmt::format("dropout probability p must be in [0, 1), got {}", p));
    return std::vector<TensorDesc>{v.input(0)};
  };
  r.bind = [](const BindContext& c) {
    return dropout_forward(c.env(), c.in(0), c.out(0), in_elems(c, 0), dropout_p(c.attrs()), dropout_seed(c.attrs()));
  };
  r.backward = [grad_op](GradContext& g) { unary_backward(g, grad_op); };
  r.reference = [](RefContext& c) {
    ref::dropout_forward<double>(c.real(c.inputs()[0]), c.real(c.outputs()[0]), dropout_p(c.attrs()),
                                 dropout_seed(c.attrs()), c.step().step);
  };
  return r;
}

}  // namespace

void register_sequence_rows(const AddRow& add) {
  add(embedding_row(builtin::embedding_grad), builtin::embedding);
  add(embedding_grad_row(), builtin::embedding_grad);
  add(causal_mask_row(builtin::causal_mask_grad), builtin::causal_mask);
  add(causal_mask_grad_row(), builtin::causal_mask_grad);
  add(dropout_row(builtin::dropout_grad), builtin::dropout);
  add(dropout_grad_row(), builtin::dropout_grad);
}

}  // namespace ferry::ops::table
