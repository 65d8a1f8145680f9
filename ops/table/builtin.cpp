// Registration of the built-in rows, in the order of ops::builtin, and helpers the rows share.
#include <fmt/format.h>

#include "rows.hpp"

namespace ferry::ops::table {

void shape_error(const ShapeView& v, const std::string& what) {
  throw ShapeError(fmt::format("{}: {}", v.name(), what));
}

void register_builtin_rows(const AddRow& add) {
  register_transfer_rows(add);
  register_linear_rows(add);
  register_activation_rows(add);
  register_add_row(add);
  register_layernorm_rows(add);
  register_conv2d_rows(add);
  register_pool_rows(add);
  register_softmax_xent_rows(add);
  register_optimizer_rows(add);
  register_cast_rows(add);
}

}  // namespace ferry::ops::table
