// ferry-bench staging: what does each leg of a copy between pageable host memory and the device
// cost, and what does a pipeline of pinned staging chunks reach?
//
// Streamed training keeps its homes in pageable memory where pinned buffers would take device
// memory (NVIDIA); then a copy either leaves from pageable memory (the driver stages it itself) or
// goes through ferry's pinned staging (--host-memory staged: a host copy into pinned memory, then
// the link). This measures the legs one by one, in one run, host-timed, median of --repeat:
//   pageable_h2d_gbps / pageable_d2h_gbps   a blocking copy of --bytes from / to pageable memory
//   pinned_h2d_gbps / pinned_d2h_gbps       the same from / to a pinned buffer (mapped
//                                           CL_MEM_ALLOC_HOST_PTR, as ferry allocates it)
//   pageable_both_gbps / pinned_both_gbps   half of --bytes each way at once (to the device on
//                                           its queue from this thread, back on the other queue
//                                           from a second thread, as a step's copy lanes run), both
//                                           directions' bytes over the time: near h2d + d2h on a
//                                           full-duplex link, near either where one direction
//                                           waits for the other (ferry plan's link_both_gbps)
//   host_in_gbps, host_in_1t_gbps           pageable -> pinned on the host, all cores (TBB, as
//                                           ferry's unpack) and one thread (memcpy)
//   host_out_gbps, host_out_1t_gbps         pinned -> pageable (a slow one means the driver maps
//                                           pinned memory uncached or write-combined)
//   host_pageable_gbps                      pageable -> pageable, all cores: the host's copy rate
//   device_buffer_driver_bytes_per_byte, pinned_driver_bytes_per_byte, registered_driver_bytes_per_byte
//                                           how much the driver's count of device memory in use
//                                           (driver_memory_source: NVML, AMD's query; null on a CPU)
//                                           rose per byte of a device buffer, a pinned buffer and
//                                           registered pages of --bytes, each alone: whether this
//                                           driver backs host buffers with device memory too
//   registered_h2d_gbps, registered_d2h_gbps, host_in_registered_gbps, host_out_registered_gbps
//                                           the same with the process's own pages handed to the
//                                           driver (CL_MEM_USE_HOST_PTR, mapped): where a driver
//                                           pins them in place they stay cached for the host's
//                                           copies, which ALLOC_HOST_PTR memory may not be (null,
//                                           with registered_error, where the driver refuses)
// and per --chunks size, a line with the pipelined staged copy of --bytes through --slots pinned
// chunks (the host fills chunk i + 1 while the link copies chunk i; each direction alone; to the
// device through offload::FetchRing, what a chunked fetch runs):
//   staged_h2d_gbps, staged_d2h_gbps, and each over its pinned rate;
//   staged_handoff_h2d_gbps                 the same pipeline driven as a compiled step's staged
//                                           fetches are: each chunk's host copy runs on a TBB worker
//                                           that the completion callback of the copy which last used
//                                           its slot starts, and that worker enqueues the chunk's copy
//                                           to the device (two hand-offs per chunk); far below
//                                           staged_h2d_gbps means the hand-offs, not the copies, cost
// The first line tells which leg limits a staged copy; the chunk lines what such a pipeline can
// reach on this host and link, beside what a step measured (ferry-bench overlap, trace).
#include <fmt/format.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "bench.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/graph/residency.hpp"
#include "ferry/offload/host_memory.hpp"
#include "ferry/runtime/runtime.hpp"
#include "ferry/runtime/units.hpp"
#include "offload/both_ways.hpp"
#include "offload/fetch_ring.hpp"

namespace ferry::bench {
namespace {

struct StagingOptions {
  std::string bytes = "256MiB";
  std::vector<std::string> chunks = {"1MiB", "4MiB", "16MiB", "64MiB"};
  int slots = 2;
};

double gbps(std::size_t bytes, double ms) {
  return ms > 0 ? double(bytes) / (ms * 1e6) : 0.0;
}

// Median milliseconds of `repeat` runs of fn, after one untimed run (first touch, driver set-up).
template <class F>
double median_ms(int repeat, F&& fn) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < repeat; ++r) t.push_back(time_ms(fn));
  return median(t);
}

// The process's own pages, written once, handed to the driver (CL_MEM_USE_HOST_PTR).
offload::HostBuffer register_pages(const cl::Context& ctx, std::size_t bytes) {
  offload::HostBuffer pages = offload::HostBuffer::pageable(bytes, "staging bench registered pages");
  std::memset(pages.data(), 5, bytes);
  return offload::HostBuffer::registered(ctx, std::move(pages), "staging bench registered pages");
}

// How much the device memory the driver counts in use rises per byte of a device buffer, a pinned
// host buffer and registered pages, each made alone, written and copied from once (a driver may
// back a buffer at its first use), then freed: near 1 for the device buffer; above 0 for host
// memory the driver also backs with device memory (NVIDIA's pinned buffers, measured so far only
// through nvidia-smi). Null where the driver keeps no count (cl::DriverMemory); the count is the
// whole device's, so another process's allocations meanwhile would show here too.
nlohmann::json driver_bytes_per_byte(const Runtime& runtime, std::size_t bytes) {
  const cl::DriverMemory& count = runtime.driver_memory().source();
  nlohmann::json j = {{"driver_memory_source", count.available() ? nlohmann::json(count.source()) : nullptr},
                      {"device_buffer_driver_bytes_per_byte", nullptr},
                      {"pinned_driver_bytes_per_byte", nullptr},
                      {"registered_driver_bytes_per_byte", nullptr}};
  if (!count.available()) return j;
  const cl::Context& ctx = runtime.context();
  const std::size_t probe = std::min<std::size_t>(bytes, 4096);
  cl::Mem target = ctx.create_buffer(probe, "staging bench driver-count target");
  cl_command_queue q = ctx.queue(cl::QueueKind::h2d);
  // The rise of the count while `make` holds what it made (it writes and copies from it itself).
  const auto rise = [&](const char* key, auto make) {
    const auto before = count.read();
    const auto held = make();
    const auto after = count.read();
    if (before && after) {
      j[key] = (static_cast<double>(after->used_bytes) - static_cast<double>(before->used_bytes)) /
               static_cast<double>(bytes);
    }
  };
  const auto copy_from_host = [&](const void* host) {
    FERRY_CL(clEnqueueWriteBuffer(q, target.get(), CL_TRUE, 0, probe, host, 0, nullptr, nullptr));
  };
  rise("device_buffer_driver_bytes_per_byte", [&] {
    cl::Mem m = ctx.create_buffer(bytes, "staging bench driver-count device buffer");
    const cl_uchar zero = 0;
    FERRY_CL(clEnqueueFillBuffer(q, m.get(), &zero, 1, 0, bytes, 0, nullptr, nullptr));
    FERRY_CL(clFinish(q));
    return m;
  });
  rise("pinned_driver_bytes_per_byte", [&] {
    cl::PinnedBuffer p = offload::allocate_pinned_host(ctx, bytes, "staging bench driver-count pinned buffer");
    std::memset(p.data(), 6, bytes);
    copy_from_host(p.data());
    return p;
  });
  try {
    rise("registered_driver_bytes_per_byte", [&] {
      offload::HostBuffer r = register_pages(ctx, bytes);
      copy_from_host(r.data());
      return r;
    });
  } catch (const std::exception&) {
    // A driver that refuses registered pages: registered_error on the same line says so.
  }
  return j;
}

class StagingBench {
 public:
  StagingBench(const cl::Context& ctx, std::size_t bytes, std::size_t largest_chunk, int slots)
      : ctx_(ctx),
        bytes_(bytes),
        h2d_(ctx.queue(cl::QueueKind::h2d)),
        d2h_(ctx.queue(cl::QueueKind::d2h)),
        pageable_(offload::HostBuffer::pageable(bytes, "staging bench pageable source")),
        pageable2_(offload::HostBuffer::pageable(bytes, "staging bench pageable destination")),
        pinned_(offload::allocate_pinned_host(ctx, bytes, "staging bench pinned buffer")),
        slots_(offload::allocate_pinned_host(ctx, largest_chunk * slots, "staging bench pinned chunks")),
        device_(ctx.create_buffer(bytes, "staging bench device buffer")),
        slot_count_(slots) {
    // Every page written once, so no measurement pays first-touch faults.
    std::memset(pageable_.data(), 1, bytes);
    std::memset(pageable2_.data(), 2, bytes);
    std::memset(pinned_.data(), 3, bytes);
    std::memset(slots_.data(), 4, slots_.bytes());
    try {
      registered_ = register_pages(ctx, bytes);
    } catch (const std::exception& e) {
      registered_error_ = e.what();
    }
  }

  nlohmann::json legs(int repeat) {
    auto* pg = static_cast<std::byte*>(pageable_.data());
    auto* pg2 = static_cast<std::byte*>(pageable2_.data());
    auto* pn = static_cast<std::byte*>(pinned_.data());
    nlohmann::json j;
    j["pageable_h2d_gbps"] = gbps(bytes_, median_ms(repeat, [&] { write(pg, 0, bytes_, true); }));
    j["pageable_d2h_gbps"] = gbps(bytes_, median_ms(repeat, [&] { read(pg2, 0, bytes_, true); }));
    j["pinned_h2d_gbps"] = gbps(bytes_, median_ms(repeat, [&] { write(pn, 0, bytes_, true); }));
    j["pinned_d2h_gbps"] = gbps(bytes_, median_ms(repeat, [&] { read(pn, 0, bytes_, true); }));
    j["pageable_both_gbps"] = gbps(bytes_, median_ms(repeat, [&] { both_ways(pg, pg2); }));
    j["pinned_both_gbps"] = gbps(bytes_, median_ms(repeat, [&] { both_ways(pn, pn); }));
    j["host_in_gbps"] = gbps(bytes_, median_ms(repeat, [&] { offload::copy_in_parallel(pn, pg, bytes_); }));
    j["host_in_1t_gbps"] = gbps(bytes_, median_ms(repeat, [&] { std::memcpy(pn, pg, bytes_); }));
    j["host_out_gbps"] = gbps(bytes_, median_ms(repeat, [&] { offload::copy_in_parallel(pg2, pn, bytes_); }));
    j["host_out_1t_gbps"] = gbps(bytes_, median_ms(repeat, [&] { std::memcpy(pg2, pn, bytes_); }));
    j["host_pageable_gbps"] = gbps(bytes_, median_ms(repeat, [&] { offload::copy_in_parallel(pg2, pg, bytes_); }));
    if (!registered_.pinned()) {
      for (const char* k :
           {"registered_h2d_gbps", "registered_d2h_gbps", "host_in_registered_gbps", "host_out_registered_gbps"}) {
        j[k] = nullptr;
      }
      j["registered_error"] = registered_error_;
      return j;
    }
    auto* rg = static_cast<std::byte*>(registered_.data());
    j["registered_h2d_gbps"] = gbps(bytes_, median_ms(repeat, [&] { write(rg, 0, bytes_, true); }));
    j["registered_d2h_gbps"] = gbps(bytes_, median_ms(repeat, [&] { read(rg, 0, bytes_, true); }));
    j["host_in_registered_gbps"] = gbps(bytes_, median_ms(repeat, [&] { offload::copy_in_parallel(rg, pg, bytes_); }));
    j["host_out_registered_gbps"] =
        gbps(bytes_, median_ms(repeat, [&] { offload::copy_in_parallel(pg2, rg, bytes_); }));
    j["registered_error"] = nullptr;
    return j;
  }

  // Pageable -> device through the slots as a chunked fetch copies (offload::FetchRing, the
  // library's own): chunk i is copied into slot i % slots once the link has finished with that
  // slot's previous chunk, then its copy to the device is enqueued.
  void staged_h2d(std::size_t chunk) {
    offload::FetchRing ring(static_cast<std::byte*>(slots_.data()), chunk, slot_count_);
    ring.copy(h2d_, static_cast<const std::byte*>(pageable_.data()), device_.get(), 0, bytes_, {});
    FERRY_CL(clFinish(h2d_));
  }

  // staged_h2d's pipeline with a compiled step's hand-offs: chunk i's host copy and enqueue run on
  // a worker thread that the completion callback of chunk i - slots's copy to the device wakes (a
  // compiled step hands the callback to a TBB worker the same way).
  void staged_handoff_h2d(std::size_t chunk) {
    struct Run {
      StagingBench* bench;
      std::size_t chunk, count;
      std::vector<cl::Event> events;                        // chunk i's copy to the device
      std::vector<std::pair<Run*, std::size_t>> callbacks;  // chunk i's callback's argument
      std::mutex m;
      std::condition_variable cv;
      std::deque<std::size_t> ready;      // chunks whose slot is free, for the worker
      std::size_t started = 0, done = 0;  // chunks whose copy began; whose callback ran (or failed to be set)
      cl_int status = CL_COMPLETE;
      // Every callback set has run: `this` may go.
      bool settled() const { return done == started && (started == count || status < 0); }
      void copy(std::size_t i) {
        {
          std::lock_guard lock(m);
          ++started;
        }
        const std::size_t off = i * chunk, len = std::min(chunk, bench->bytes_ - off);
        std::byte* slot = bench->slot_at(i, chunk);
        offload::copy_in_parallel(slot, static_cast<const std::byte*>(bench->pageable_.data()) + off, len);
        cl_int rc = clEnqueueWriteBuffer(bench->h2d_, bench->device_.get(), CL_FALSE, off, len, slot, 0, nullptr,
                                         events[i].out());
        if (rc == CL_SUCCESS) rc = clFlush(bench->h2d_);
        if (rc == CL_SUCCESS) rc = clSetEventCallback(events[i].get(), CL_COMPLETE, &Run::on_complete, &callbacks[i]);
        if (rc != CL_SUCCESS) finish_one(rc, count);
      }
      static void CL_CALLBACK on_complete(cl_event, cl_int status, void* user) {
        const auto [r, i] = *static_cast<std::pair<Run*, std::size_t>*>(user);
        const std::size_t next = i + r->bench->slot_count_;
        r->finish_one(status, next < r->count && status >= 0 ? next : r->count);
      }
      // One chunk done (or failed); `next` (< count) is the chunk its slot now takes.
      void finish_one(cl_int rc, std::size_t next) {
        std::lock_guard lock(m);
        if (rc < 0) status = rc;
        ++done;
        if (next < count) ready.push_back(next);
        cv.notify_all();
      }
    };
    Run r{this, chunk, (bytes_ + chunk - 1) / chunk};
    r.events.resize(r.count);
    for (std::size_t i = 0; i < r.count; ++i) r.callbacks.emplace_back(&r, i);
    const std::size_t first = std::min<std::size_t>(r.count, slot_count_);
    std::thread worker([&r] {
      std::unique_lock lock(r.m);
      for (;;) {
        r.cv.wait(lock, [&] { return !r.ready.empty() || r.settled(); });
        if (r.ready.empty()) return;
        const std::size_t i = r.ready.front();
        r.ready.pop_front();
        if (r.status < 0) continue;  // a failed chunk: start no more, let those in flight settle
        lock.unlock();
        r.copy(i);
        lock.lock();
      }
    });
    for (std::size_t i = 0; i < first; ++i) r.copy(i);
    {
      std::lock_guard lock(r.m);
      r.cv.notify_all();  // settled() may have become true before the worker first waited
    }
    worker.join();
    FERRY_CL(clFinish(h2d_));
    cl::check(r.status, "a staged copy of the hand-off chain");
  }

  // Device -> pageable: the first `slots` reads enqueued, then each chunk copied out of its slot
  // once read, and the slot's next read enqueued.
  void staged_d2h(std::size_t chunk) {
    auto* dst = static_cast<std::byte*>(pageable2_.data());
    const std::size_t count = (bytes_ + chunk - 1) / chunk;
    std::vector<cl::Event> read_done(slot_count_);
    auto enqueue_read = [&](std::size_t i) {
      const std::size_t off = i * chunk, len = std::min(chunk, bytes_ - off);
      FERRY_CL(clEnqueueReadBuffer(d2h_, device_.get(), CL_FALSE, off, len, slot_at(i, chunk), 0, nullptr,
                                   read_done[i % slot_count_].out()));
      FERRY_CL(clFlush(d2h_));
    };
    for (std::size_t i = 0; i < std::min<std::size_t>(count, slot_count_); ++i) enqueue_read(i);
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t off = i * chunk, len = std::min(chunk, bytes_ - off);
      wait(read_done[i % slot_count_]);
      offload::copy_in_parallel(dst + off, slot_at(i, chunk), len);
      if (i + slot_count_ < count) enqueue_read(i + slot_count_);
    }
  }

 private:
  // Pageable pages (written once) registered with the driver, as --host-memory registered's homes.
  static void wait(const cl::Event& e) {
    cl_event raw = e.get();
    FERRY_CL(clWaitForEvents(1, &raw));
  }
  std::byte* slot_at(std::size_t i, std::size_t chunk) const {
    return static_cast<std::byte*>(slots_.data()) + (i % slot_count_) * chunk;
  }
  void write(const std::byte* host, std::size_t off, std::size_t len, bool blocking) {
    FERRY_CL(
        clEnqueueWriteBuffer(h2d_, device_.get(), blocking ? CL_TRUE : CL_FALSE, off, len, host, 0, nullptr, nullptr));
  }
  void read(std::byte* host, std::size_t off, std::size_t len, bool blocking) {
    FERRY_CL(
        clEnqueueReadBuffer(d2h_, device_.get(), blocking ? CL_TRUE : CL_FALSE, off, len, host, 0, nullptr, nullptr));
  }
  // The first half of `up` to the device's first half while the device's second half comes back
  // into `down`'s second half, each on a thread of its own.
  void both_ways(const std::byte* up, std::byte* down) {
    const std::size_t half = bytes_ / 2;
    offload::copy_both_ways([&] { write(up, 0, half, true); }, [&] { read(down + half, half, bytes_ - half, true); });
  }

  const cl::Context& ctx_;
  std::size_t bytes_;
  cl_command_queue h2d_, d2h_;
  offload::HostBuffer pageable_, pageable2_;
  cl::PinnedBuffer pinned_, slots_;
  cl::Mem device_;
  int slot_count_;
  offload::HostBuffer registered_;  // empty where the driver refused
  std::string registered_error_;
};

int run_staging(const BenchCommon& common, const StagingOptions& o) {
  const std::uint64_t bytes = parse_bytes(o.bytes);
  std::vector<std::uint64_t> chunks;
  for (const std::string& c : o.chunks) chunks.push_back(parse_bytes(c));
  if (bytes == 0) throw std::invalid_argument("--bytes must be above 0");
  if (o.slots < 1 || o.slots > 64) throw std::invalid_argument(fmt::format("--slots {}: use 1 to 64", o.slots));
  // The smallest chunk is ferry train's (--staging-chunk): below it the per-chunk hand-offs, not
  // the copies, are what is timed, and 1-byte chunks of the default --bytes take minutes.
  const std::uint64_t smallest = graph::ResidencyOptions::min_staging_chunk_bytes;
  if (bytes < smallest) {
    throw std::invalid_argument(
        fmt::format("--bytes {}: the copies go through chunks of at least {} (as ferry "
                    "train's --staging-chunk): give --bytes {} or more",
                    format_bytes(bytes), format_bytes(smallest), format_bytes(smallest)));
  }
  std::uint64_t largest = 0;
  for (std::uint64_t c : chunks) {
    if (c < smallest || c > bytes) {
      throw std::invalid_argument(fmt::format(
          "--chunks: {} is not between the smallest staging chunk, {} (as ferry train's --staging-chunk), and "
          "--bytes ({}): give chunk sizes in that range",
          format_bytes(c), format_bytes(smallest), format_bytes(bytes)));
    }
    largest = std::max(largest, c);
  }
  Runtime runtime({.device = common.device});
  const cl::Context& ctx = runtime.context();
  const cl::DeviceInfo& dev = ctx.device();
  std::fprintf(stderr, "staging: %s through %d pinned chunks on %s\n", format_bytes(bytes).c_str(), o.slots,
               dev.name.c_str());
  // Before the bench's own buffers exist, so the count rises by what each probe makes alone.
  const nlohmann::json driver_counts = driver_bytes_per_byte(runtime, bytes);
  StagingBench bench(ctx, bytes, largest, o.slots);
  nlohmann::json base = {{"bench", "staging"}, {"device", dev.name},      {"device_type", dev.type_name()},
                         {"bytes", bytes},     {"repeat", common.repeat}, {"slots", o.slots}};
  nlohmann::json legs = base;
  legs.update(bench.legs(common.repeat));
  legs.update(driver_counts);
  legs["chunk_bytes"] = nullptr;
  emit_json(legs);
  for (std::uint64_t chunk : chunks) {
    nlohmann::json j = base;
    j["chunk_bytes"] = chunk;
    const double h2d = gbps(bytes, median_ms(common.repeat, [&] { bench.staged_h2d(chunk); }));
    const double d2h = gbps(bytes, median_ms(common.repeat, [&] { bench.staged_d2h(chunk); }));
    j["staged_h2d_gbps"] = h2d;
    j["staged_handoff_h2d_gbps"] = gbps(bytes, median_ms(common.repeat, [&] { bench.staged_handoff_h2d(chunk); }));
    j["staged_d2h_gbps"] = d2h;
    j["staged_h2d_over_pinned"] = h2d / legs["pinned_h2d_gbps"].get<double>();
    j["staged_d2h_over_pinned"] = d2h / legs["pinned_d2h_gbps"].get<double>();
    emit_json(j);
  }
  return 0;
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<StagingOptions>();
  sub.add_option("--bytes", o->bytes, "bytes copied each way")->capture_default_str();
  sub.add_option("--chunks", o->chunks, "staging chunk sizes, a line each")->delimiter(',')->capture_default_str();
  sub.add_option("--slots", o->slots, "pinned chunks in flight")->capture_default_str();
  return [o, &common] { return run_staging(common, *o); };
}

FERRY_BENCH("staging",
            "each leg of a copy between pageable host memory and the device (pageable, pinned, the host's copies "
            "into and out of pinned memory) and a pipeline of pinned staging chunks (GB/s)",
            setup);

}  // namespace
}  // namespace ferry::bench
