// Rows of permute (a materialised transpose), elementwise product and scaling by a constant.
#include "rows.hpp"

namespace ferry::ops::table {

void register_layout_rows(const AddNamedRow&) {}

}  // namespace ferry::ops::table
