// The rows of int8 quantization of a weight with one fp32 scale per output channel, and back
// (ferry/ops/cast.hpp has the kernels and the layout; the Predict phase's int8 weights).
#include <fmt/format.h>

#include <cmath>

#include "ferry/ops/cast.hpp"
#include "ops/attrs.hpp"
#include "ops/quantize_host.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

QuantLayout layout_of(const NodeAttrs& a) {
  return QuantAttrs::of(a).layout;
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
  // the same bits as the kernel and ref::quantize_i8, on all cores.
  r.host = [](const HostContext& c) {
    const QuantLayout l = layout_of(c.attrs());
    quantize_i8_host({reinterpret_cast<const float*>(c.in(0)), l.elems()}, l,
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

void register_quantize_rows(const AddRow& add) {
  add(quantize_row(), builtin::quantize_i8);
  add(dequantize_row(), builtin::dequantize_i8);
}

}  // namespace ferry::ops::table
