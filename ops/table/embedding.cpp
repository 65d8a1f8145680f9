// The rows of embedding lookup and its gradient (kernels and bindings: ops/sequence.hpp).
//
//   embedding        in: ids (i32, rank 1-3) table [V, D]   out: y [ids..., D]
//   embedding_grad   in: ids dy                              out: dtable [V, D]
#include <fmt/format.h>

#include <utility>

#include "ops/attrs.hpp"
#include "ops/sequence.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

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

}  // namespace

void register_embedding_rows(const AddRow& add) {
  add(embedding_row(builtin::embedding_grad), builtin::embedding);
  add(embedding_grad_row(), builtin::embedding_grad);
}

}  // namespace ferry::ops::table
