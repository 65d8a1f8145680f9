// Rows of the copies between host memory and the device: the batch upload and the results
// download (one node each, all pairs at once), a persistent tensor's fetch and write-back
// (streaming), and for staged homes the unpack and pack between the home and pinned staging.
// Each copies input i to output i; the host side comes from the tensor's home.
#include "ferry/cl/error.hpp"
#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {

// One launch that enqueues a copy per (input, output) pair on the node's queue: each pair whole,
// or with `runs` the element runs [first, first + count) of every pair (empty runs are skipped).
LaunchList transfer_copies(const BindContext& c, bool to_device, std::span<const ElementRun> runs) {
  if (c.input_count() != c.output_count()) shape_error(c, "a copy node needs as many outputs as inputs");
  struct Pair {
    DeviceSpan device;
    HostAddress host;
    std::size_t offset, bytes;
  };
  std::vector<Pair> pairs;
  for (std::size_t i = 0; i < c.input_count(); ++i) {
    const std::size_t elem = dtype_bytes(c.input(i).dtype), elems = c.input(i).shape.elems();
    const ElementRun whole{0, elems};
    for (const ElementRun& run : runs.empty() ? std::span(&whole, 1) : runs) {
      if (run.count == 0) continue;
      if (run.first + run.count > elems) shape_error(c, "a copy of elements past the tensor's end");
      const DeviceSpan d = (to_device ? c.out(i) : c.in(i)).advanced(run.first * elem);
      pairs.push_back({d, to_device ? c.host_in(i) : c.host_out(i), run.first * elem, run.count * elem});
    }
  }
  if (pairs.empty()) return {};  // nothing of this tensor to move (another rank's share)
  KernelLaunch l;
  l.custom = [pairs = std::move(pairs), to_device](cl_command_queue q, std::span<const cl_event> wait,
                                                   cl::Event* first) {
    cl::Event last;
    for (std::size_t i = 0; i < pairs.size(); ++i) {
      const Pair& p = pairs[i];
      const auto nwait = static_cast<cl_uint>(i == 0 ? wait.size() : 0);
      const cl_event* wl = i == 0 && !wait.empty() ? wait.data() : nullptr;
      cl::Event ev;
      std::byte* host = static_cast<std::byte*>(p.host()) + p.offset;
      if (to_device) {
        FERRY_CL(clEnqueueWriteBuffer(q, p.device.buffer, CL_FALSE, p.device.offset_bytes, p.bytes, host, nwait, wl,
                                      ev.out()));
      } else {
        FERRY_CL(clEnqueueReadBuffer(q, p.device.buffer, CL_FALSE, p.device.offset_bytes, p.bytes, host, nwait, wl,
                                     ev.out()));
      }
      if (i == 0 && first && pairs.size() > 1) *first = ev;
      last = std::move(ev);
    }
    return last;
  };
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

// A chunked fetch (FetchAttrs::chunk_kib, staged host memory): the step's copier reads the host
// side when the node is enqueued, through its ring of pinned chunks.
LaunchList chunked_fetch(const BindContext& c) {
  if (c.input_count() != 1 || c.output_count() != 1) shape_error(c, "a chunked fetch copies one tensor");
  StagedCopier* copier = c.staged_copier();
  if (!copier) {
    throw std::logic_error(
        "a chunked fetch was bound without the step's ring of pinned chunks (the memory plan "
        "gives one to every step with chunked fetches)");
  }
  const DeviceSpan d = c.out(0);
  const HostAddress host = c.host_in(0);
  const std::size_t bytes = dtype_bytes(c.input(0).dtype) * c.input(0).shape.elems();
  KernelLaunch l;
  l.custom = [copier, d, host, bytes](cl_command_queue q, std::span<const cl_event> wait, cl::Event* first) {
    return copier->copy(q, static_cast<const std::byte*>(host()), d.buffer, d.offset_bytes, bytes, wait, first);
  };
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

void copy_reference(RefContext& c) {
  const auto in = c.inputs();
  const auto out = c.outputs();
  for (std::size_t i = 0; i < in.size(); ++i) {
    if (c.input(i).dtype == DType::i32) {
      auto src = c.ints(in[i]);
      auto dst = c.ints(out[i]);
      std::copy(src.begin(), src.end(), dst.begin());
    } else {
      auto src = c.real(in[i]);
      auto dst = c.real(out[i]);
      std::copy(src.begin(), src.end(), dst.begin());
    }
  }
}

namespace {

OpInfo copy_row(const char* name, bool to_device, OpClass op_class) {
  OpInfo r;
  r.name = name;
  r.lane = to_device ? Lane::h2d : Lane::d2h;
  r.op_class = op_class;
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16, DType::i8, DType::u8};  // bytes are bytes
  r.bind = [to_device](const BindContext& c) {
    if (to_device && FetchAttrs::of(c.attrs()).chunk_kib > 0) return chunked_fetch(c);
    return transfer_copies(c, to_device);
  };
  r.reference = copy_reference;
  return r;
}

// Unpack and pack: a staged home (compressed, dropped) and pinned staging memory, on the host
// lanes; the work (decompressing, compressing) is the home store's, in parallel over chunks. In
// pageable host memory, also a pinned-home tensor or a host step tensor: a copy on all cores.
OpInfo home_row(const char* name, bool unpack) {
  OpInfo r;
  r.name = name;
  r.lane = unpack ? Lane::unpack : Lane::host;
  r.op_class = OpClass::state_transfer;
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16, DType::i8, DType::u8};
  r.host = [unpack](const HostContext& c) {
    if (unpack) {
      c.unpack_home(0, c.out(0));
    } else {
      c.pack_home(0, c.in(0));
    }
  };
  r.reference = copy_reference;
  return r;
}

}  // namespace

void register_transfer_rows(const AddRow& add) {
  add(copy_row("upload", true, OpClass::batch_transfer), builtin::upload);
  add(copy_row("download", false, OpClass::batch_transfer), builtin::download);
  add(copy_row("fetch", true, OpClass::state_transfer), builtin::fetch);
  add(copy_row("write_back", false, OpClass::state_transfer), builtin::write_back);
  add(home_row("unpack", true), builtin::unpack);
  add(home_row("pack", false), builtin::pack);
}

}  // namespace ferry::ops::table
