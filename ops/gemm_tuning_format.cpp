// GEMM tuning data: the file format (ops/tuning/gemm.tsv, FERRY_GEMM_TUNING, the tuner's cache rows),
// its validation and the device match. No OpenCL calls and no state: the fuzz target `tuning`
// (fuzz/tuning.cpp) builds this file alone.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <stdexcept>
#include <string>
#include <vector>

#include "gemm_tuning.hpp"

namespace ferry::ops {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Splits on `sep`, dropping empty fields (so runs of separators count as one).
std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    std::size_t end = s.find(sep, pos);
    if (end == std::string_view::npos) end = s.size();
    std::string_view field = trim(s.substr(pos, end - pos));
    if (!field.empty()) out.push_back(field);
    pos = end + 1;
  }
  return out;
}

bool contains_ci(std::string_view haystack, std::string_view needle) {
  return needle == "*" || lower(haystack).find(lower(needle)) != std::string::npos;
}

struct ParamRule {
  const char* key;
  int lo, hi;
  int fallback = -1;  // the value when the parameter is not given; -1: it must be given
};

// The parameters each kernel takes and their sane ranges.
const std::vector<ParamRule>& rules(GemmKernel k) {
  static const std::vector<ParamRule> packed{
      {"RB", 1, 16}, {"NV", 1, 4}, {"PA", 0, 1, 0}, {"KU", 1, 8, 1}, {"WB", 1, 64, 1}};
  static const std::vector<ParamRule> tiled{{"TSM", 1, 256}, {"TSN", 1, 256}, {"TSK", 1, 64},
                                            {"WPTM", 1, 16}, {"WPTN", 1, 16}, {"VW", 1, 4, 1},
                                            {"SK", 0, 1, 0}, {"VG", 1, 4, 1}, {"RR", 0, 255, 0}};
  static const std::vector<ParamRule> none;
  switch (k) {
    case GemmKernel::packed:
      return packed;
    case GemmKernel::tiled:
      return tiled;
    case GemmKernel::naive:
      return none;
  }
  return none;
}

const char* kernel_name(GemmKernel k) {
  switch (k) {
    case GemmKernel::packed:
      return "packed";
    case GemmKernel::tiled:
      return "tiled";
    case GemmKernel::naive:
      return "naive";
  }
  return "?";
}

}  // namespace

int GemmKernelConfig::param(std::string_view key) const {
  for (const auto& [k, v] : params) {
    if (k == key) return v;
  }
  throw std::logic_error(fmt::format("gemm kernel '{}' has no parameter {}", text(), key));
}

std::string GemmKernelConfig::defines() const {
  std::string out;
  for (const auto& [k, v] : params) out += fmt::format("{}-D{}={}", out.empty() ? "" : " ", k, v);
  return out;
}

std::string GemmKernelConfig::text() const {
  std::string out = kernel_name(kernel);
  for (const auto& [k, v] : params) out += fmt::format(" {}={}", k, v);
  return out;
}

GemmKernelConfig parse_gemm_kernel_spec(std::string_view spec, const std::string& where) {
  const std::size_t space = spec.find(' ');
  return parse_gemm_kernel_config(spec.substr(0, space),
                                  space == std::string_view::npos ? std::string_view{} : spec.substr(space + 1), where);
}

GemmKernelConfig parse_gemm_kernel_config(std::string_view kernel, std::string_view params, const std::string& where) {
  GemmKernelConfig c;
  if (kernel == "packed") {
    c.kernel = GemmKernel::packed;
  } else if (kernel == "tiled") {
    c.kernel = GemmKernel::tiled;
  } else if (kernel == "naive") {
    c.kernel = GemmKernel::naive;
  } else {
    throw std::runtime_error(fmt::format("{}: unknown gemm kernel '{}' (packed, tiled or naive)", where, kernel));
  }
  const auto& allowed = rules(c.kernel);
  for (std::string_view kv : split(params, ' ')) {
    if (kv == "-") continue;  // "no parameters"
    const std::size_t eq = kv.find('=');
    if (eq == std::string_view::npos) {
      throw std::runtime_error(fmt::format("{}: parameter '{}' is not KEY=VALUE", where, kv));
    }
    const std::string_view key = kv.substr(0, eq), value = kv.substr(eq + 1);
    auto rule = std::find_if(allowed.begin(), allowed.end(), [&](const ParamRule& r) { return key == r.key; });
    if (rule == allowed.end()) {
      throw std::runtime_error(fmt::format("{}: kernel {} has no parameter '{}'", where, kernel, key));
    }
    int v = 0;
    auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
    if (ec != std::errc() || end != value.data() + value.size() || v < rule->lo || v > rule->hi) {
      throw std::runtime_error(
          fmt::format("{}: {}={} is not an integer in [{}, {}]", where, key, value, rule->lo, rule->hi));
    }
    if (std::any_of(c.params.begin(), c.params.end(), [&](const auto& p) { return p.first == key; })) {
      throw std::runtime_error(fmt::format("{}: parameter {} given twice", where, key));
    }
    c.params.emplace_back(std::string(key), v);
  }
  for (const ParamRule& r : allowed) {
    if (std::none_of(c.params.begin(), c.params.end(), [&](const auto& p) { return p.first == r.key; })) {
      if (r.fallback < 0)
        throw std::runtime_error(fmt::format("{}: kernel {} needs parameter {}", where, kernel, r.key));
      c.params.emplace_back(r.key, r.fallback);
    }
  }
  if (c.kernel == GemmKernel::tiled) {
    if (c.param("TSM") % c.param("WPTM") != 0 || c.param("TSN") % c.param("WPTN") != 0) {
      throw std::runtime_error(fmt::format("{}: tiled needs TSM % WPTM == 0 and TSN % WPTN == 0", where));
    }
    const int vw = c.param("VW");
    if (vw == 3 || c.param("WPTM") % vw != 0 || c.param("WPTN") % vw != 0) {
      throw std::runtime_error(
          fmt::format("{}: tiled needs VW = 1, 2 or 4, dividing WPTM and WPTN (VW={}, WPTM={}, WPTN={})", where, vw,
                      c.param("WPTM"), c.param("WPTN")));
    }
    const int vg = c.param("VG");
    if (vg != 1 && vg != 4) throw std::runtime_error(fmt::format("{}: tiled needs VG = 1 or 4 (VG={})", where, vg));
    if (vg == 4 && (c.param("TSM") % 4 || c.param("TSN") % 4 || c.param("TSK") % 4)) {
      throw std::runtime_error(
          fmt::format("{}: tiled with VG=4 needs TSM, TSN and TSK multiples of 4 (TSM={}, TSN={}, "
                      "TSK={})",
                      where, c.param("TSM"), c.param("TSN"), c.param("TSK")));
    }
    const int rr = c.param("RR");
    if (rr != 0 && rr < 32) {
      throw std::runtime_error(
          fmt::format("{}: tiled's RR (registers per work-item) is 0 (the compiler's choice) or "
                      "32 to 255, not {}",
                      where, rr));
    }
  }
  return c;
}

bool GemmTuningRow::matches(const cl::DeviceInfo& d) const {
  const bool type_ok = type == "*" || (type == "cpu" && d.is_cpu()) || (type == "gpu" && d.is_gpu()) ||
                       (type == "accelerator" && (d.type & CL_DEVICE_TYPE_ACCELERATOR) != 0);
  return type_ok && contains_ci(d.vendor, vendor) && contains_ci(d.platform_name + " " + d.name, name);
}

std::vector<GemmTuningRow> parse_gemm_tuning(std::string_view text, const std::string& source) {
  std::vector<GemmTuningRow> rows;
  std::size_t line_no = 0, pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (const std::size_t hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    if (trim(line).empty()) continue;
    const std::string where = fmt::format("{}:{}", source, line_no);
    auto fields = split(line, '\t');
    if (fields.size() != 6) {
      throw std::runtime_error(
          fmt::format("{}: expected 6 tab-separated fields (type vendor name backend kernel params), got {}", where,
                      fields.size()));
    }
    GemmTuningRow row;
    row.source = source;
    row.line = line_no;
    row.type = lower(fields[0]);
    if (row.type != "cpu" && row.type != "gpu" && row.type != "accelerator" && row.type != "*") {
      throw std::runtime_error(fmt::format("{}: device type '{}' is not cpu, gpu, accelerator or *", where, fields[0]));
    }
    row.vendor = fields[1];
    row.name = fields[2];
    if (fields[3] == "ferry") {
      row.backend = GemmBackend::ferry;
    } else if (fields[3] == "clblast") {
      row.backend = GemmBackend::clblast;
    } else {
      throw std::runtime_error(fmt::format("{}: backend '{}' is not ferry or clblast", where, fields[3]));
    }
    row.config = parse_gemm_kernel_config(fields[4], fields[5], where);
    rows.push_back(std::move(row));
  }
  return rows;
}

bool GemmTuningRow::names_device() const {
  return name != "*";
}

}  // namespace ferry::ops
