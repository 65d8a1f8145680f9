// The row of casts among f32, f16 and bf16, optionally scaled (ferry/ops/cast.hpp has the
// kernels). int8 quantization has its own rows (ops/table/quantize.cpp).
#include "ferry/ops/cast.hpp"

#include <fmt/format.h>

#include <cmath>

#include "ops/attrs.hpp"
#include "ops/quantize_host.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

CastScale scale_of(const NodeAttrs& a) {
  return CastAttrs::of(a).scale;
}

OpInfo cast_row() {  // in: x  out: y
  OpInfo r;
  r.name = "cast";
  r.narrows_on_host = true;
  r.op_class = OpClass::cast;
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};
  r.infer = [](const ShapeView& v) {
    const std::int32_t to_code = CastAttrs::to_code(v.attrs()), scale_code = CastAttrs::scale_code(v.attrs());
    const DType to = CastAttrs::of(v.attrs()).to;
    if (to_code < 0 || to_code > static_cast<int>(DType::i32) || !cast_supported(v.input(0).dtype, to)) {
      shape_error(v, fmt::format("no cast kernel from {} to dtype #{}: casts convert between f32, f16 and bf16",
                                 dtype_name(v.input(0).dtype), to_code));
    }
    if (scale_code < 0 || scale_code > static_cast<int>(CastScale::inverse_loss_scale)) {
      shape_error(v,
                  fmt::format("cast scale mode #{} is not one of none (0), loss scale (1), inverse (2)", scale_code));
    }
    return std::vector<TensorDesc>{{v.input(0).shape, to}};
  };
  r.bind = [](const BindContext& c) {
    return cast(c.env(), c.input(0).dtype, c.output(0).dtype, c.in(0), c.out(0), in_elems(c, 0), scale_of(c.attrs()));
  };
  r.host = [](const HostContext& c) {  // the reference's bits, on all cores
    cast_host(c.input(0).dtype, c.output(0).dtype, c.in(0), c.out(0), c.input(0).shape.elems(),
              cast_factor(scale_of(c.attrs()), c.step()));
  };
  // The gradient of a cast is the output's gradient cast back to the input's dtype (a tensor's
  // gradient has its dtype). Gradients in a narrow type are loss-scaled (StepInfo::loss_scale):
  // the cast into one multiplies by the scale, the cast back to f32 divides by it, so f32
  // gradients (the loss's, the master weights') are always the true ones.
  r.backward = [](GradContext& g) {
    const TensorRef x = g.inputs()[0], dy = g.grad(g.outputs()[0]);
    if (dy == no_ref || !g.needs_grad(x)) return;
    const DType to = g.dtype(x), from = g.dtype(dy);
    if (to == from) {
      g.contribute(x, dy);
      return;
    }
    const CastScale scale = from == DType::f32 ? CastScale::loss_scale
                            : to == DType::f32 ? CastScale::inverse_loss_scale
                                               : CastScale::none;
    const TensorRef dx = g.new_grad(x);
    const TensorRef in[] = {dy}, out[] = {dx};
    g.emit(builtin::cast, ".grad", in, out, CastAttrs{.to = to, .scale = scale}.pack());
    g.contribute(x, dx);
  };
  r.reference = [](RefContext& c) {
    const DType to = c.output(0).dtype;
    const double factor = cast_factor(scale_of(c.attrs()), c.step());
    auto x = c.real(c.inputs()[0]);
    auto y = c.real(c.outputs()[0]);
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = through_storage(to, x[i] * factor);
  };
  return r;
}

}  // namespace

void register_cast_rows(const AddRow& add) {
  add(cast_row(), builtin::cast);
}

}  // namespace ferry::ops::table
