// Rows of embedding lookup, the causal mask and dropout.
#include "rows.hpp"

namespace ferry::ops::table {

void register_sequence_rows(const AddNamedRow&) {}

}  // namespace ferry::ops::table
