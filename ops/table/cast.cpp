// Rows of the precision changes: casts among f32, f16 and bf16, and int8 quantization with one
// fp32 scale per output channel (ferry/ops/cast.hpp has the kernels and the layout).
#include "ferry/ops/cast.hpp"

#include <fmt/format.h>

#include <cmath>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

QuantLayout layout_of(const NodeAttrs& a) {
  return QuantAttrs::of(a).layout;
}

CastScale scale_of(const NodeAttrs& a) {
  return CastAttrs::of(a).scale;
}

// Double values through a float store of dtype t and back: what the device's cast keeps.
double through(DType t, double v) {
  std::uint32_t storage = 0;
  ref::store_float(t, static_cast<float>(v), &storage, 0);
  return ref::load_float(t, &storage, 0);
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
  r.host = [](const HostContext& c) {
    ref::cast(c.input(0).dtype, c.output(0).dtype, c.in(0), c.out(0), c.input(0).shape.elems(),
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
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = through(to, x[i] * factor);
  };
  return r;
}

void check_layout(const ShapeView& v, std::size_t elems) {
  const QuantLayout l = layout_of(v.attrs());
  if (l.outer == 0 || l.channels == 0 || l.inner == 0 || l.elems() != elems) {
    shape_error(v, fmt::format("quantization layout {}x{}x{} does not cover the tensor's {} elements", l.outer,
                               l.channels, l.inner, elems));
  }
}

OpInfo quantize_row() {  // in: x (f32)  out: q (i8), scales (f32, one per channel)
  OpInfo r;
  r.name = "quantize_i8";
  r.narrows_on_host = true;
  r.op_class = OpClass::cast;
  r.infer = [](const ShapeView& v) {
    if (v.input(0).dtype != DType::f32) shape_error(v, "quantize_i8 takes an f32 tensor");
    check_layout(v, v.input(0).shape.elems());
    const auto channels = static_cast<std::uint32_t>(layout_of(v.attrs()).channels);
    return std::vector<TensorDesc>{{v.input(0).shape, DType::i8}, {Shape{channels}, DType::f32}};
  };
  r.bind = [](const BindContext& c) { return quantize_i8(c.env(), c.in(0), c.out(0), c.out(1), layout_of(c.attrs())); };
  // On the host lane (a streamed weight quantized in host memory before it crosses the link):
  // the same bits as the kernel (ref::quantize_i8 is its bit-exact twin).
  r.host = [](const HostContext& c) {
    const QuantLayout l = layout_of(c.attrs());
    ref::quantize_i8({reinterpret_cast<const float*>(c.in(0)), l.elems()}, l,
                     {reinterpret_cast<std::int8_t*>(c.out(0)), l.elems()},
                     {reinterpret_cast<float*>(c.out(1)), l.channels});
  };
  r.reference = [](RefContext& c) {
    auto x = c.real(c.inputs()[0]);
    std::vector<float> xf(x.begin(), x.end()), scales(layout_of(c.attrs()).channels);
    std::vector<std::int8_t> q(x.size());
    ref::quantize_i8(xf, layout_of(c.attrs()), q, scales);
    std::copy(q.begin(), q.end(), c.real(c.outputs()[0]).begin());
    std::copy(scales.begin(), scales.end(), c.real(c.outputs()[1]).begin());
  };
  return r;
}

OpInfo dequantize_row() {  // in: q (i8), scales  out: x (f32)
  OpInfo r;
  r.name = "dequantize_i8";
  r.op_class = OpClass::cast;
  r.infer = [](const ShapeView& v) {
    if (v.input(0).dtype != DType::i8 || v.input(1).dtype != DType::f32) {
      shape_error(v, "dequantize_i8 takes an i8 tensor and its f32 scales");
    }
    check_layout(v, v.input(0).shape.elems());
    return std::vector<TensorDesc>{{v.input(0).shape, DType::f32}};
  };
  r.bind = [](const BindContext& c) {
    return dequantize_i8(c.env(), c.in(0), c.in(1), c.out(0), layout_of(c.attrs()));
  };
  r.reference = [](RefContext& c) {
    auto qd = c.real(c.inputs()[0]);
    auto sd = c.real(c.inputs()[1]);
    std::vector<std::int8_t> q(qd.begin(), qd.end());
    std::vector<float> scales(sd.begin(), sd.end()), x(q.size());
    ref::dequantize_i8(q, scales, layout_of(c.attrs()), x);
    std::copy(x.begin(), x.end(), c.real(c.outputs()[0]).begin());
  };
  return r;
}

}  // namespace

void register_cast_rows(const AddRow& add) {
  add(cast_row(), builtin::cast);
  add(quantize_row(), builtin::quantize_i8);
  add(dequantize_row(), builtin::dequantize_i8);
}

}  // namespace ferry::ops::table
