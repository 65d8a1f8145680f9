// ferry-bench overlap: how well do streamed transfers hide behind compute?
//
// For each configuration (a model, a batch and a device budget) it measures, in one run and
// interleaved repetition by repetition so that the machine's load hits every variant alike:
//   compute_ms   the step with everything resident (no transfers at all);
//   transfer_ms  the streamed step run with RunMode::transfers_only (its copies, no kernels);
//   serial_ms    the streamed step compiled with a serial schedule (each node waits for the
//                previous one: the copies and the kernels never overlap);
//   streamed_ms  the streamed step as it normally runs;
//   mapped_ms    the same step with residency `mapped` (zero-copy), on host-unified devices.
// and reports
//   overlap_efficiency = (serial - streamed) / min(compute, transfer)   1: the shorter side is hidden
//                      (negative: streaming was slower than serial; above 1 only through noise;
//                      null when min(compute, transfer) is under 5% of serial: see below)
//   streamed_over_max  = streamed / max(compute, transfer)              1: perfect overlap
//   link_gbps          bytes of the streamed step's fetch and write-back nodes over the sum of
//                      their device durations (profiling timeline): the rate the copies achieved
//                      while competing with compute;
//   link_gbps_transfers_only  the same bytes over transfer_ms (wall time, copies alone);
//   link_peak_gbps     the same byte mix at the peak copy rates: a host buffer of the streamed
//                      homes' kind (--host-memory: pinned, or pageable as NVIDIA gets by default;
//                      offload::allocate_host) to a device buffer and back on the context's
//                      h2d / d2h queues (--link-bytes each), device-timed, sampled once per repetition
//                      in the same rotation as the steps (a line of its own up front, too).
// Every variant is its own Trainer (same model, seed and batches), so the resident, streamed,
// serial and mapped trainers must end bit-identical; each line says whether they did. The
// transfers-only trainer is separate because its runs leave no meaningful state.
//
// The Runtime always has profiling on (link_gbps needs device timestamps); every variant pays the
// same cost. On PoCL (a CPU device) copies are memcpy's on the same cores as the kernels, so
// overlap is bounded by the cores; each line's "note" says so with the device type and compute
// units. --trace FILE writes a Chrome trace of three streamed steps per configuration.
#include <fmt/format.h>

#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include "bench.hpp"
#include "ferry/ferry.hpp"
#include "ferry/offload/pinned_host.hpp"
#include "runtime/cli/validators.hpp"
#include "runtime/trainer_internals.hpp"

namespace ferry::bench {
namespace {

// overlap_efficiency is null when min(compute, transfer) is below this share of serial_ms.
constexpr double overlap_efficiency_min_share = 0.05;

struct OverlapConfig {
  std::string name;
  std::string model = "deep";  // deep: models::deep(width, depth); mlp: `depth` hidden layers of `width`
  std::uint32_t width = 1024, depth = 8, batch = 256;
  std::string budget = "64MiB";  // device budget of the streamed step
  std::uint32_t lookahead = 2;
  std::uint32_t slack = 4;         // ResidencyOptions::transfer_slack
  std::string optimizer = "adam";  // adam or sgd (plain, no momentum: the least state to stream)
};

struct OverlapOptions {
  std::vector<std::string> configs;  // "key=value,..." each; empty: the two defaults
  std::string link_bytes = "64MiB";
  bool mapped = true;
  std::string host_memory = "auto";
};

// Defaults, all Adam:
//   compute-bound     deep 1024x8 (17.6 M parameters, 282 MB of training state), batch 256, under a
//                     192 MiB budget (below the state, so it really streams);
//   transfer-bound    mlp with one hidden layer of 8192 (6.5 M parameters), batch 8: the big layer
//                     is the first one, which needs no input gradient, so per streamed byte the
//                     step does the least compute there is (forward, weight gradient, update);
//   deep-small-batch  the compute-bound model at batch 8 under a 40 MiB budget (weights fetched
//                     again for the backward pass): transfer-bound on a discrete GPU.
std::vector<OverlapConfig> default_configs() {
  return {
      {.name = "compute-bound", .model = "deep", .width = 1024, .depth = 8, .batch = 256, .budget = "192MiB"},
      {.name = "transfer-bound", .model = "mlp", .width = 8192, .depth = 1, .batch = 8, .budget = "128MiB"},
      {.name = "deep-small-batch", .model = "deep", .width = 1024, .depth = 8, .batch = 8, .budget = "40MiB"},
  };
}

// The largest width, depth and batch a configuration takes (as ferry-bench state's), and the largest
// lookahead and slack (compute nodes).
constexpr std::uint32_t max_size = 65536;
constexpr std::uint32_t max_nodes = 65536;

// "name=x,model=deep,width=1024,depth=8,batch=64,budget=64MiB,lookahead=2"; keys left out keep
// their defaults.
OverlapConfig parse_config(const std::string& text) {
  OverlapConfig c;
  std::istringstream parts(text);
  std::set<std::string> given;
  for (std::string kv; std::getline(parts, kv, ',');) {
    const std::size_t eq = kv.find('=');
    if (eq == std::string::npos) throw std::invalid_argument(fmt::format("--config: '{}' is not key=value", kv));
    const std::string key = kv.substr(0, eq), value = kv.substr(eq + 1);
    if (!given.insert(key).second) {
      throw std::invalid_argument(fmt::format("--config: {} is given twice in '{}': give each key once", key, text));
    }
    // A whole number in [1, most], digits only: no sign (stoul took "-1" as 4294967295), no
    // fraction, nothing past `most` (a value that wrapped, or a model of absurd size).
    auto number = [&](std::uint32_t most) -> std::uint32_t {
      std::uint64_t v = 0;
      const char* end = value.data() + value.size();
      const auto [ptr, ec] = std::from_chars(value.data(), end, v);
      const bool digits = !value.empty() && value.find_first_not_of("0123456789") == std::string::npos;
      if (!digits || ec != std::errc() || ptr != end || v < 1 || v > most) {
        throw std::invalid_argument(
            fmt::format("--config: {}={}: {} must be a whole number from 1 to {}", key, value, key, most));
      }
      return static_cast<std::uint32_t>(v);
    };
    if (key == "name")
      c.name = value;
    else if (key == "model")
      c.model = value;
    else if (key == "width")
      c.width = number(max_size);
    else if (key == "depth")
      c.depth = number(max_size);
    else if (key == "batch")
      c.batch = number(max_size);
    else if (key == "budget")
      c.budget = value;
    else if (key == "lookahead")
      c.lookahead = number(max_nodes);
    else if (key == "slack")
      c.slack = number(max_nodes);
    else if (key == "optimizer")
      c.optimizer = value;
    else
      throw std::invalid_argument(fmt::format(
          "--config: unknown key '{}' (name, model, width, depth, batch, budget, lookahead, slack, optimizer)", key));
  }
  if (c.model != "deep" && c.model != "mlp") {
    throw std::invalid_argument(fmt::format("--config: model must be deep or mlp, not '{}'", c.model));
  }
  if (c.optimizer != "adam" && c.optimizer != "sgd") {
    throw std::invalid_argument(fmt::format("--config: optimizer must be adam or sgd, not '{}'", c.optimizer));
  }
  // Checked now, not when the configuration's turn comes after the link peak and those before it.
  cli::budget_option("--config budget", c.budget, '=',
                     fmt::format("leave budget out for the default, {}", OverlapConfig{}.budget));
  if (c.name.empty()) c.name = fmt::format("{}-{}x{}-b{}", c.model, c.width, c.depth, c.batch);
  return c;
}

ModelSpec make_model(const OverlapConfig& c) {
  if (c.model == "mlp") return models::mlp(std::vector<std::uint32_t>(c.depth, c.width));
  return models::deep(c.width, c.depth);
}

std::string loadavg() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return in ? fmt::format("{} {} {}", a, b, c) : std::string("unknown");
}

std::string device_note(const cl::DeviceInfo& d) {
  if (d.is_cpu()) {
    return fmt::format(
        "{} device '{}' with {} compute units: copies are memcpy's on the same cores as the kernels (a copy beside "
        "a kernel takes about the serial sum), so overlap is bounded by the cores; the GPU targets (efficiency >= "
        "0.9, streamed <= 1.1 x max) do not apply here",
        d.type_name(), d.name, d.compute_units);
  }
  return fmt::format(
      "{} device '{}' with {} compute units; targets: overlap efficiency >= 0.9, streamed <= 1.1 x "
      "max(compute, transfer)",
      d.type_name(), d.name, d.compute_units);
}

double event_ms(const cl::Event& ev) {
  cl_ulong start = 0, end = 0;
  FERRY_CL(clGetEventProfilingInfo(ev.get(), CL_PROFILING_COMMAND_START, sizeof start, &start, nullptr));
  FERRY_CL(clGetEventProfilingInfo(ev.get(), CL_PROFILING_COMMAND_END, sizeof end, &end, nullptr));
  return double(end - start) * 1e-6;
}

// Copies between a host buffer (offload::allocate_host, of the homes' kind) and a device buffer on the
// context's h2d / d2h queues: the link's peak. Sampled once up front and once per repetition of
// every configuration (in its rotation, under the same machine load as the steps).
class LinkProbe {
 public:
  LinkProbe(const cl::Context& ctx, std::uint64_t bytes, offload::HostMemory memory)
      : ctx_(ctx),
        bytes_(bytes),
        host_(offload::allocate_host(ctx, bytes, memory, "overlap bench link-peak host buffer")),
        dev_(ctx.create_buffer(bytes, "overlap bench link-peak device buffer")) {
    std::memset(host_.data(), 1, bytes);
    sample();  // warm-up: first touch of the device buffer
    h2d_.clear(), d2h_.clear(), h2d_wall_.clear(), d2h_wall_.clear();
  }

  // One copy each way; returns the wall time of both.
  double sample() {
    double total = 0;
    for (int dir = 0; dir < 2; ++dir) {
      const cl_command_queue q = ctx_.queue(dir == 0 ? cl::QueueKind::h2d : cl::QueueKind::d2h);
      cl::Event ev;
      const double wall = time_ms([&] {
        if (dir == 0) {
          FERRY_CL(clEnqueueWriteBuffer(q, dev_.get(), CL_FALSE, 0, bytes_, host_.data(), 0, nullptr, ev.out()));
        } else {
          FERRY_CL(clEnqueueReadBuffer(q, dev_.get(), CL_FALSE, 0, bytes_, host_.data(), 0, nullptr, ev.out()));
        }
        FERRY_CL(clFinish(q));
      });
      total += wall;
      const double gbps_wall = double(bytes_) / (wall * 1e6);
      // Device-timed (the same clock as the step timelines) when profiling is on.
      const double gbps = ctx_.profiling() ? double(bytes_) / (event_ms(ev) * 1e6) : gbps_wall;
      (dir == 0 ? h2d_ : d2h_).push_back(gbps);
      (dir == 0 ? h2d_wall_ : d2h_wall_).push_back(gbps_wall);
    }
    return total;
  }
  void reset() { h2d_.clear(), d2h_.clear(), h2d_wall_.clear(), d2h_wall_.clear(); }
  std::uint64_t bytes() const { return bytes_; }
  double h2d_gbps() const { return median(h2d_); }
  double d2h_gbps() const { return median(d2h_); }
  double h2d_wall_gbps() const { return median(h2d_wall_); }
  double d2h_wall_gbps() const { return median(d2h_wall_); }

 private:
  const cl::Context& ctx_;
  std::uint64_t bytes_;
  offload::HostBuffer host_;
  cl::Mem dev_;
  std::vector<double> h2d_, d2h_, h2d_wall_, d2h_wall_;
};

// What one step did on the device (from its profiling timeline).
struct TimelineStats {
  std::uint64_t copy_bytes = 0;      // fetch + write-back bytes
  double copy_ms = 0;                // summed device durations of fetch and write-back nodes
  double lane_ms[4] = {0, 0, 0, 0};  // summed device durations per lane (compute, copy in, copy out, host)
  double span_ms = 0;                // first start to last end
};

TimelineStats timeline_stats(const graph::CompiledStep& step) {
  const graph::Graph& g = step.graph();
  std::map<std::string, std::uint64_t> copy_bytes;  // fetch / write-back node name -> bytes
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    if (ops::op_info(g.nodes.op[n]).op_class != ops::OpClass::state_transfer) continue;
    // The link's copies only: staged and pageable host memory add host-lane unpack / pack nodes
    // (a host copy into or out of the pinned staging), which are state transfers too but neither
    // cross the link nor count in the plan's fetch and write-back bytes.
    if (g.nodes.lane[n] != graph::Lane::h2d && g.nodes.lane[n] != graph::Lane::d2h) continue;
    copy_bytes[g.nodes.name[n]] = g.tensors.bytes(g.nodes.inputs(n)[0]);
  }
  TimelineStats s;
  std::uint64_t first = UINT64_MAX, last = 0;
  for (const auto& e : step.timeline()) {
    if (e.start_ns == 0 || e.end_ns < e.start_ns) continue;  // a command the driver did not time
    const double ms = double(e.end_ns - e.start_ns) * 1e-6;
    first = std::min(first, e.start_ns);
    last = std::max(last, e.end_ns);
    s.lane_ms[static_cast<int>(e.lane)] += ms;
    auto it = copy_bytes.find(e.name);
    if (it != copy_bytes.end()) {
      s.copy_bytes += it->second;
      s.copy_ms += ms;
    }
  }
  if (last > first) s.span_ms = double(last - first) * 1e-6;
  return s;
}

// The batches every trainer of a configuration sees, in the same order.
struct Batches {
  std::vector<std::vector<float>> images;
  std::vector<std::vector<std::int32_t>> labels;
  Batches(const ModelSpec& m, std::uint32_t batch, int count, unsigned seed) {
    const std::size_t sample = m.inputs.at(0).sample.elems();
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);  // standardized inputs
    std::uniform_int_distribution<std::int32_t> label(0, static_cast<std::int32_t>(m.targets.at(0).id_limit) - 1);
    for (int b = 0; b < count; ++b) {
      images.emplace_back(std::size_t(batch) * sample);
      labels.emplace_back(batch);
      for (float& v : images.back()) v = normal(rng);
      for (auto& l : labels.back()) l = label(rng);
    }
  }
};

// A trainer that steps through the shared batches.
struct Variant {
  std::string name;
  std::unique_ptr<Trainer> trainer;
  std::vector<double> ms;
  std::vector<TimelineStats> device;  // per timed repetition
  std::uint64_t next = 0;
  double step(const Batches& b) {
    const std::size_t i = next++ % b.images.size();
    return trainer->step(b.images[i], b.labels[i]).step_ms;
  }
};

bool same_parameters(const Trainer& a, const Trainer& b) {
  for (const std::string& name : a.parameter_names()) {
    if (a.read_parameter(name) != b.read_parameter(name)) return false;
  }
  return true;
}

// Steps in the trace are numbered across configurations, so each "#n" names one step.
std::uint64_t trace_steps = 0;

nlohmann::json run_config(Runtime& runtime, const BenchCommon& common, const OverlapOptions& o, const OverlapConfig& c,
                          LinkProbe& peak, ChromeTrace* trace) {
  const cl::DeviceInfo& dev = runtime.device();
  nlohmann::json j{{"bench", "overlap"},
                   {"config", c.name},
                   {"model", c.model},
                   {"width", c.width},
                   {"depth", c.depth},
                   {"batch", c.batch},
                   {"lookahead", c.lookahead},
                   {"slack", c.slack},
                   {"optimizer", c.optimizer},
                   {"repeat", common.repeat},
                   {"device", dev.name},
                   {"device_type", dev.type_name()},
                   {"compute_units", dev.compute_units},
                   {"note", device_note(dev)},
                   {"host_memory", offload::host_memory_name(
                                       offload::resolve_host_memory(offload::parse_host_memory(o.host_memory), dev))},
                   {"loadavg_start", loadavg()}};
  const ModelSpec model = make_model(c);
  const Batches batches(model, c.batch, 2, 7);

  TrainerOptions base;
  base.batch = c.batch;
  base.seed = 1;
  base.residency.lookahead = c.lookahead;
  base.residency.transfer_slack = c.slack;
  base.residency.homes.host_memory = offload::parse_host_memory(o.host_memory);
  if (c.optimizer == "sgd") {
    base.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
    base.optimizer.sgd.momentum = 0.0f;
    base.lr = 0.01f;
  }
  auto make = [&](graph::ResidencyMode mode, bool serial) {
    TrainerOptions t = base;
    t.residency.mode = mode;
    t.residency.budget_bytes = mode == graph::ResidencyMode::resident ? 0 : parse_bytes(c.budget);
    t.serial_schedule = serial;
    return std::make_unique<Trainer>(runtime, model, t);
  };
  const bool want_mapped = o.mapped && dev.host_unified_memory;
  std::vector<Variant> v;
  v.push_back({"compute", make(graph::ResidencyMode::resident, false)});
  v.push_back({"transfer", make(graph::ResidencyMode::stream, false)});
  v.push_back({"serial", make(graph::ResidencyMode::stream, true)});
  v.push_back({"streamed", make(graph::ResidencyMode::stream, false)});
  if (want_mapped) v.push_back({"mapped", make(graph::ResidencyMode::mapped, false)});
  Variant& compute = v[0];
  Variant& transfer = v[1];
  Variant& serial = v[2];
  Variant& streamed = v[3];

  std::uint64_t xfer_runs = 0;
  auto run_transfers = [&] {
    graph::CompiledStep& s = compiled_train_step(*transfer.trainer);
    return time_ms([&] { s.run(ops::StepInfo{++xfer_runs, transfer.trainer->lr()}, graph::RunMode::transfers_only); });
  };
  auto run_one = [&](Variant& x) { return &x == &transfer ? run_transfers() : x.step(batches); };
  peak.reset();

  // Warm-up: one step of each (first launches, first touch of every buffer).
  for (Variant& x : v) run_one(x);
  for (int r = 0; r < common.repeat; ++r) {
    // Rotate the order so that no variant always runs right after the same neighbour.
    for (std::size_t k = 0; k <= v.size(); ++k) {
      const std::size_t slot = (k + r) % (v.size() + 1);
      if (slot == v.size()) {  // the link peak, in the same rotation
        peak.sample();
        continue;
      }
      Variant& x = v[slot];
      x.ms.push_back(run_one(x));
      if (runtime.context().profiling()) x.device.push_back(timeline_stats(compiled_train_step(*x.trainer)));
    }
  }

  const double compute_ms = median(compute.ms), transfer_ms = median(transfer.ms), serial_ms = median(serial.ms),
               streamed_ms = median(streamed.ms);
  const auto& rr = streamed.trainer->residency();
  const std::uint64_t copy_bytes = rr.fetch_bytes + rr.write_back_bytes;
  j["budget_bytes"] = streamed.trainer->device_budget_bytes();
  j["device_peak_bytes"] = streamed.trainer->device_peak_bytes();
  j["resident_device_peak_bytes"] = compute.trainer->device_peak_bytes();
  j["training_state_bytes"] = streamed.trainer->training_state_bytes();
  j["parameters"] = streamed.trainer->parameter_count();
  j["fetches"] = rr.fetches;
  j["write_backs"] = rr.write_backs;
  j["fetch_bytes"] = rr.fetch_bytes;
  j["write_back_bytes"] = rr.write_back_bytes;
  j["compute_ms"] = compute_ms;
  j["transfer_ms"] = transfer_ms;
  j["serial_ms"] = serial_ms;
  j["streamed_ms"] = streamed_ms;
  j["bound"] = compute_ms >= transfer_ms ? "compute" : "transfer";
  // A smaller side under 5% of the serial step leaves less to hide than the run-to-run noise of
  // the step times (a few percent): the ratio would be that noise over a small number.
  const double hideable_ms = std::min(compute_ms, transfer_ms);
  j["overlap_efficiency"] = hideable_ms >= overlap_efficiency_min_share * serial_ms
                                ? nlohmann::json((serial_ms - streamed_ms) / hideable_ms)
                                : nlohmann::json(nullptr);
  j["streamed_over_max"] = streamed_ms / std::max(compute_ms, transfer_ms);
  j["streamed_over_sum"] = streamed_ms / (compute_ms + transfer_ms);
  j["serial_over_sum"] = serial_ms / (compute_ms + transfer_ms);
  // The same byte mix at the measured peak rates, one copy after another.
  const double peak_ms =
      double(rr.fetch_bytes) / (peak.h2d_gbps() * 1e6) + double(rr.write_back_bytes) / (peak.d2h_gbps() * 1e6);
  j["link_peak_gbps"] = peak_ms > 0 ? double(copy_bytes) / (peak_ms * 1e6) : 0.0;
  j["link_peak_h2d_gbps"] = peak.h2d_gbps();
  j["link_peak_d2h_gbps"] = peak.d2h_gbps();
  j["link_peak_bytes"] = peak.bytes();
  std::vector<double> link_gbps;
  bool bytes_match = true;  // the timeline's fetch / write-back nodes carry the bytes the residency plan reports
  for (const TimelineStats& t : streamed.device) {
    if (t.copy_ms > 0) link_gbps.push_back(double(t.copy_bytes) / (t.copy_ms * 1e6));
    bytes_match = bytes_match && t.copy_bytes == copy_bytes;
  }
  if (!streamed.device.empty()) j["timeline_bytes_match_plan"] = bytes_match;
  j["link_gbps"] = link_gbps.empty() ? nlohmann::json(nullptr) : nlohmann::json(median(link_gbps));
  j["link_gbps_transfers_only"] = double(copy_bytes) / (transfer_ms * 1e6);
  // Device-side view per variant (medians): summed command durations per lane and the span.
  nlohmann::json device_ms = nlohmann::json::object();
  for (const Variant& x : v) {
    if (x.device.empty()) continue;
    auto med = [&](auto field) {
      std::vector<double> xs;
      for (const TimelineStats& t : x.device) xs.push_back(field(t));
      return median(xs);
    };
    device_ms[x.name] = {{"compute", med([](const TimelineStats& t) { return t.lane_ms[0]; })},
                         {"copy_in", med([](const TimelineStats& t) { return t.lane_ms[1]; })},
                         {"copy_out", med([](const TimelineStats& t) { return t.lane_ms[2]; })},
                         {"fetch_write_back", med([](const TimelineStats& t) { return t.copy_ms; })},
                         {"span", med([](const TimelineStats& t) { return t.span_ms; })}};
  }
  j["device_ms"] = device_ms;
  j["ms"] = {{"compute", compute.ms}, {"transfer", transfer.ms}, {"serial", serial.ms}, {"streamed", streamed.ms}};
  if (want_mapped) {
    Variant& mapped = v[4];
    const double mapped_ms = median(mapped.ms);
    j["mapped_ms"] = mapped_ms;
    j["mapped_over_stream"] = mapped_ms / streamed_ms;
    j["mapped_over_compute"] = mapped_ms / compute_ms;
    j["mapped_device_peak_bytes"] = mapped.trainer->device_peak_bytes();
    j["ms"]["mapped"] = mapped.ms;
  } else {
    j["mapped_ms"] = nullptr;
    j["mapped_skipped"] =
        o.mapped ? "device memory is not the host's (CL_DEVICE_HOST_UNIFIED_MEMORY false)" : "--no-mapped";
  }
  // Same seed, same batches, same number of steps: the training state must be identical.
  j["streamed_matches_resident"] = same_parameters(*compute.trainer, *streamed.trainer);
  j["serial_matches_resident"] = same_parameters(*compute.trainer, *serial.trainer);
  if (want_mapped) j["mapped_matches_resident"] = same_parameters(*compute.trainer, *v[4].trainer);
  j["loadavg_end"] = loadavg();

  if (trace) {
    for (int s = 0; s < 3; ++s) {
      streamed.step(batches);
      trace->add_step(compiled_train_step(*streamed.trainer).timeline(), ++trace_steps,
                      compiled_train_step(*streamed.trainer).host_activity());
    }
  }
  return j;
}

int run_overlap(const BenchCommon& common, const OverlapOptions& o) {
  std::vector<OverlapConfig> configs;
  for (const std::string& s : o.configs) configs.push_back(parse_config(s));
  if (configs.empty()) configs = default_configs();
  const std::uint64_t link_bytes = parse_bytes(o.link_bytes);
  if (link_bytes == 0)
    throw std::invalid_argument("--link-bytes must be above 0 (the link peak is timed copying them)");

  Runtime runtime({.device = common.device, .profiling = true});
  const cl::DeviceInfo& dev = runtime.device();
  if (link_bytes > dev.max_alloc_bytes) {
    throw std::invalid_argument(
        fmt::format("--link-bytes {}: the link-peak copies go to one device buffer, and {} "
                    "takes at most {} in one: give {} or less",
                    o.link_bytes, dev.name, format_bytes(dev.max_alloc_bytes), format_bytes(dev.max_alloc_bytes)));
  }
  const offload::HostMemory memory =
      offload::resolve_host_memory(offload::parse_host_memory(o.host_memory), runtime.device());
  LinkProbe peak(runtime.context(), link_bytes, offload::link_source_memory(memory));
  for (int r = 0; r < std::max(common.repeat, 5); ++r) peak.sample();
  emit_json({{"bench", "overlap"},
             {"result", "link_peak"},
             {"bytes", peak.bytes()},
             {"h2d_gbps", peak.h2d_gbps()},
             {"d2h_gbps", peak.d2h_gbps()},
             {"h2d_wall_gbps", peak.h2d_wall_gbps()},
             {"d2h_wall_gbps", peak.d2h_wall_gbps()},
             {"host_memory", offload::host_memory_name(memory)},
             {"device", dev.name},
             {"device_type", dev.type_name()},
             {"compute_units", dev.compute_units},
             {"host_unified_memory", dev.host_unified_memory},
             {"note", device_note(dev)}});

  std::optional<ChromeTrace> trace;
  if (!common.trace.empty()) trace.emplace();
  int status = 0;
  std::size_t traced = 0;  // configurations whose steps are in the trace
  for (const OverlapConfig& c : configs) {
    fmt::print(stderr, "overlap: {} ({} {}x{}, batch {}, budget {})\n", c.name, c.model, c.width, c.depth, c.batch,
               c.budget);
    try {
      emit_json(run_config(runtime, common, o, c, peak, trace ? &*trace : nullptr));
      ++traced;
    } catch (const graph::BudgetError& e) {
      emit_json({{"bench", "overlap"}, {"config", c.name}, {"error", e.what()}, {"min_budget_bytes", e.min_budget()}});
      status = 1;
    }
  }
  // A failed configuration adds no steps; with none traced, no file is written.
  if (trace && trace->steps() > 0) {
    trace->write(common.trace);
    fmt::print(stderr, "wrote a trace of {} streamed steps ({} of {} configurations) to {}\n", trace->steps(), traced,
               configs.size(), common.trace);
  } else if (trace) {
    fmt::print(stderr, "no trace written: no configuration ran\n");
  }
  return status;
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<OverlapOptions>();
  sub.add_option("--config", o->configs,
                 "a configuration, repeatable: name=..,model=deep|mlp,width=..,depth=..,batch=..,budget=64MiB,"
                 "lookahead=2,slack=4,optimizer=adam|sgd (default: compute-bound deep 1024x8 batch 256 budget "
                 "192MiB; transfer-bound mlp 8192x1 batch 8 budget 128MiB; deep-small-batch deep 1024x8 batch 8 "
                 "budget 40MiB)");
  sub.add_option("--link-bytes", o->link_bytes, "size of the link-peak copies")->capture_default_str();
  sub.add_flag("!--no-mapped", o->mapped, "skip the mapped (zero-copy) variant");
  sub.add_option("--host-memory", o->host_memory,
                 "memory of the streamed homes and the link-peak buffer: auto (pageable on NVIDIA), pinned, pageable, "
                 "staged (the link peak from pinned memory), registered")
      ->check(CLI::IsMember(offload::host_memory_names()))
      ->capture_default_str();
  return [o, &common] { return run_overlap(common, *o); };
}

FERRY_BENCH("overlap",
            "streaming: compute-only, transfer-only, serial and overlapped step times, overlap efficiency, link "
            "bandwidth vs peak, mapped vs stream",
            setup);

}  // namespace
}  // namespace ferry::bench
