// The op table's registry: built-in rows first, in the order of ops::builtin, then users' rows.
#include "ferry/ops/op_table.hpp"

#include <fmt/format.h>

#include <array>
#include <atomic>
#include <memory>
#include <mutex>

#include "ferry/ops/communicator.hpp"
#include "table/rows.hpp"

namespace ferry::ops {
namespace {

// Rows never move once added (readers hold references without a lock): a fixed array of slots
// filled in order, published by the count.
constexpr std::size_t max_ops = 1024;

struct Registry {
  std::array<std::unique_ptr<OpInfo>, max_ops> rows;
  std::atomic<std::size_t> count{0};
  std::mutex add;

  OpId push(OpInfo row) {
    std::lock_guard lock(add);
    if (row.name.empty()) throw std::invalid_argument("register_op: the row has no name");
    if (!row.bind && !row.host) {
      throw std::invalid_argument(fmt::format(
          "register_op: op '{}' has neither a bind nor a host function, so nothing could run it", row.name));
    }
    const std::size_t n = count.load(std::memory_order_relaxed);
    for (std::size_t i = 0; i < n; ++i) {
      if (rows[i]->name == row.name) {
        throw std::invalid_argument(fmt::format("register_op: an op named '{}' exists already", row.name));
      }
    }
    if (n == max_ops) throw std::length_error(fmt::format("register_op: more than {} ops", max_ops));
    rows[n] = std::make_unique<OpInfo>(std::move(row));
    count.store(n + 1, std::memory_order_release);
    return static_cast<OpId>(n);
  }
};

Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;  // never destroyed: rows may be read during static destruction
    table::register_builtin_rows([reg](OpInfo row, OpId expected) {
      const OpId id = reg->push(std::move(row));
      if (id != expected) throw std::logic_error("op table: built-in rows registered out of order");
    });
    const table::AddNamedRow named = [reg](OpInfo row) { return reg->push(std::move(row)); };
    table::register_matmul_rows(named);
    table::register_softmax_rows(named);
    table::register_layout_rows(named);
    table::register_sequence_rows(named);
    table::register_add_bias_rows(named);
    table::register_mse_rows(named);
    table::register_loss_sum_rows(named);
    table::register_optimizer8bit_rows(named);
    table::register_predictor_rows(named);
    table::register_accumulate_rows(named);
    table::register_overflow_guard_rows(named);
    table::register_attention_rows(named);
    table::register_add_layernorm_rows(named);
    table::register_collective_rows(named);
    return reg;
  }();
  return *r;
}

}  // namespace

const char* op_class_name(OpClass c) {
  switch (c) {
    case OpClass::batch_transfer:
      return "batch transfer";
    case OpClass::state_transfer:
      return "state transfer";
    case OpClass::forward:
      return "forward";
    case OpClass::loss:
      return "loss";
    case OpClass::backward:
      return "backward";
    case OpClass::update:
      return "update";
    case OpClass::cast:
      return "cast";
    case OpClass::state_update:
      return "state update";
    case OpClass::communication:
      return "communication";
  }
  return "?";
}

OpId register_op(OpInfo row) {
  return registry().push(std::move(row));
}

const OpInfo& op_info(OpId id) {
  Registry& r = registry();
  if (id >= r.count.load(std::memory_order_acquire)) throw std::out_of_range(fmt::format("no op with id {}", id));
  return *r.rows[id];
}

OpId find_op(std::string_view name) {
  Registry& r = registry();
  const std::size_t n = r.count.load(std::memory_order_acquire);
  std::string known;
  for (std::size_t i = 0; i < n; ++i) {
    if (r.rows[i]->name == name) return static_cast<OpId>(i);
    known += fmt::format("{}{}", i ? ", " : "", r.rows[i]->name);
  }
  throw std::invalid_argument(fmt::format("no op named '{}' (known: {})", name, known));
}

void HostContext::complete_when(std::unique_ptr<CommRequest> request) const {
  wait(*request);
}

std::size_t op_count() {
  return registry().count.load(std::memory_order_acquire);
}

}  // namespace ferry::ops
