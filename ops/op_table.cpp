// The op table's registry: the built-in rows under their ops::builtin ids, then users' rows.
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
// the built-in rows in the slots of their ops::builtin ids, then users' rows in order, published
// by the count.
constexpr std::size_t max_ops = 1024;

struct Registry {
  std::array<std::unique_ptr<OpInfo>, max_ops> rows;
  std::atomic<std::size_t> count{0};
  std::mutex add;

  // Checks a row before it is added: a name, a way to run, a name not taken.
  void check(const OpInfo& row, std::size_t n) const {
    if (row.name.empty()) throw std::invalid_argument("register_op: the row has no name");
    if (!row.bind && !row.host) {
      throw std::invalid_argument(fmt::format(
          "register_op: op '{}' has neither a bind nor a host function, so nothing could run it", row.name));
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (rows[i] && rows[i]->name == row.name) {
        throw std::invalid_argument(fmt::format("register_op: an op named '{}' exists already", row.name));
      }
    }
  }

  OpId push(OpInfo row) {
    std::lock_guard lock(add);
    const std::size_t n = count.load(std::memory_order_relaxed);
    check(row, n);
    if (n == max_ops) throw std::length_error(fmt::format("register_op: more than {} ops", max_ops));
    rows[n] = std::make_unique<OpInfo>(std::move(row));
    count.store(n + 1, std::memory_order_release);
    return static_cast<OpId>(n);
  }

  // The built-in rows, each into the slot of its ops::builtin id, before any reader exists.
  void add_builtin(OpInfo row, OpId id) {
    if (id >= builtin::builtin_count || rows[id]) {
      throw std::logic_error(fmt::format("op table: built-in row '{}' registered under id {}, which is {}", row.name,
                                         id, id >= builtin::builtin_count ? "not a built-in id" : "taken"));
    }
    check(row, builtin::builtin_count);
    rows[id] = std::make_unique<OpInfo>(std::move(row));
  }
};

Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;  // never destroyed: rows may be read during static destruction
    table::register_builtin_rows([reg](OpInfo row, OpId id) { reg->add_builtin(std::move(row), id); });
    for (OpId id = 0; id < builtin::builtin_count; ++id) {
      if (!reg->rows[id]) throw std::logic_error(fmt::format("op table: no row registered for built-in id {}", id));
    }
    reg->count.store(builtin::builtin_count, std::memory_order_release);
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

OpId update_row(OptimizerConfig::Kind k) {
  switch (k) {
    case OptimizerConfig::Kind::sgd:
      return builtin::sgd_update;
    case OptimizerConfig::Kind::adam:
    case OptimizerConfig::Kind::adamw:
      return builtin::adam_update;
    case OptimizerConfig::Kind::adamw8bit:
      return builtin::adam8bit_update;
  }
  throw std::invalid_argument(fmt::format("ops::update_row: optimizer kind {} is unknown", static_cast<int>(k)));
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
