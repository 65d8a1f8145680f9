// GEMM binding: picks the backend and ferry's kernel from the per-device tuning data and binds
// the launches (B packing + register-blocked kernel on CPUs, local-memory tiles on GPUs, or CLBlast),
// for one product or a strided batch of them (GemmShape::batch) alike.
#include "ops/gemm.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <optional>
#include <stdexcept>

#include "ferry/cl/error.hpp"
#include "ferry/ops/cast.hpp"
#include "gemm_clblast.hpp"
#include "gemm_tiled.hpp"
#include "gemm_tuning.hpp"
#include "ops/layout.hpp"
#include "ops/overflow_guard.hpp"

namespace ferry::ops {
namespace {

struct GemmPlan {
  GemmBackend backend = GemmBackend::ferry;
  GemmKernelConfig config;
  std::string origin;  // where the choice came from, for the description
};

GemmBackend backend_from_env() {
  const char* v = std::getenv("FERRY_GEMM_BACKEND");
  if (!v || !*v) return GemmBackend::automatic;
  const std::string_view s(v);
  if (s == "ferry") return GemmBackend::ferry;
  if (s == "clblast") return GemmBackend::clblast;
  if (s == "auto" || s == "automatic") return GemmBackend::automatic;
  throw std::runtime_error(fmt::format("FERRY_GEMM_BACKEND='{}': expected ferry, clblast or automatic", s));
}

}  // namespace

GemmBackend gemm_backend_for(const GemmTuningRow& row) {
  GemmBackend b = backend_from_env();
  if (b == GemmBackend::automatic) {
    b = row.backend;
    // The tuning data may prefer CLBlast for a device; without it, ferry's kernel runs.
    if (b == GemmBackend::clblast && !gemm_have_clblast()) b = GemmBackend::ferry;
  }
  return b;
}

namespace {

GemmPlan plan(OpEnv& env, const GemmOptions& options) {
  GemmPlan p;
  if (!options.kernel.empty()) {
    p.config = parse_gemm_kernel_spec(options.kernel, "GemmOptions::kernel");
    p.origin = "GemmOptions::kernel";
    p.backend = options.backend == GemmBackend::clblast ? GemmBackend::clblast : GemmBackend::ferry;
  } else {
    GemmTuningRow row = gemm_tuning_for(env);
    p.config = std::move(row.config);
    p.origin = fmt::format("{}:{}", row.source, row.line);
    p.backend = options.backend == GemmBackend::automatic ? gemm_backend_for(row) : options.backend;
  }
  if (p.backend == GemmBackend::clblast && !gemm_have_clblast()) {
    throw std::runtime_error(
        "gemm: the CLBlast backend was asked for, but this ferry was built without CLBlast "
        "(install libclblast-dev and reconfigure with -DFERRY_WITH_CLBLAST=ON)");
  }
  return p;
}

std::size_t panel_width(const GemmKernelConfig& c) {
  return 16 * static_cast<std::size_t>(c.param("NV"));
}

// Sets parameter `key` of a parsed configuration (parsing gives every parameter of the kernel a value).
void set_param(GemmKernelConfig& c, std::string_view key, int value) {
  for (auto& [k, v] : c.params) {
    if (k == key) v = value;
  }
}

// A transposed f32 A whose rows are a multiple of 256 floats apart (at least 512), in a product
// with K of 768 or more: read in place, a row block's RB values of successive k steps fall in the
// same few L1 sets (a power of two: one set), so its long strip comes again from L2 or memory for
// every panel of B. Packed it is contiguous, for one pass over A, which N of 256 or more pays for.
// On the AVX-512 EPYC (row `RB=6 NV=4`, PA=0) packing took 2048^3 TN from 155-194 to 199-216
// GFLOPS and 2048 x 512 x 4096 TN from 130-148 to 187-191, where it was limited to powers of two
// and K >= 2048 (fifty-second session). With the transposed pack running along rows (gemm_packed.cl
// gemm_pack_a, twice as fast), the Zen 5 EPYC also gained at K = 768 and 1024 and for M = 768,
// 1536, 1792 and 3072: 4096 x 1024 x 1024 TN 251-273 -> 462-477 GFLOPS, 3072 x 768 x 2048 294-297
// -> 448-465, 1024 x 1024 x 768 401-418 -> 458-477; M = 1000 or 1152 and K = 512 stayed level, and
// N = 10 or 16 was 2-2.5x slower (bench/RESULTS.md, sixtieth session).
constexpr std::size_t a_alias_min_rows = 512, a_alias_row_multiple = 256, a_alias_min_k = 768, a_alias_min_n = 256;
bool a_rows_alias(const GemmShape& s) {
  return s.trans_a && s.M >= a_alias_min_rows && s.M % a_alias_row_multiple == 0 && s.K >= a_alias_min_k &&
         s.N >= a_alias_min_n;
}

// A transposed f32 A of few rows read in place, K in chunks (K_CHUNK in gemm_packed.cl, chosen at
// binding by k_chunk_rows), instead of packed: a chunk of its rows (K_CHUNK x M floats) stays in a
// core's L2 while every row block runs against it, and the pack's copy of A and its traffic go.
// The weight gradients of the default GPT (M = 192 or its vocabulary's 114, K = 4096 tokens) ran
// 1.25-1.4x faster so on the AVX2 EPYC with 16-wide panels, 192 x 768 x 4096 1.05x; with M = 256
// and more (rows 1 KiB apart and more) it lost (bench/RESULTS.md, "Weight gradients of few rows
// with K in chunks"). Measured with 16-wide panels only: wider ones keep their pack.
constexpr std::size_t direct_a_max_rows = 192, direct_a_panel_width = 16, k_chunk = 256;
bool direct_transposed_a(const GemmShape& s, const GemmKernelConfig& c) {
  return s.trans_a && s.a == DType::f32 && s.M <= direct_a_max_rows && s.K > k_chunk &&
         panel_width(c) == direct_a_panel_width;
}

// The packed parameters for this shape: PA only where A is packed (below); a panel no wider than N
// needs (rounded up to 16), with the register block's rows raised by as much as the panel
// narrowed (at most 16). N = 32 (the output channels of a small convolution) then runs 12 x 32
// blocks, not 6 x 64 of which half are padding. A row from the tuning data (`from_tuning_data`)
// also packs a transposed A whose rows alias (a_rows_alias); a kernel asked for by name keeps its PA.
GemmKernelConfig fit_packed(const GemmShape& s, GemmKernelConfig c, const GemmOptions& o, bool from_tuning_data) {
  if (c.kernel != GemmKernel::packed) return c;
  if (s.a == DType::f16 && o.a_gather_rows.buffer == nullptr) {
    // An f16 A is always packed, widened once: read in place, each of its values would be widened
    // once per panel of B (N / NB times) by dtype.clh's dozen integer and float operations, which
    // made f16 products about 1.7x slower than bf16 ones (a shift) on the AVX-512 EPYC.
    set_param(c, "PA", 1);
  } else if (!s.trans_a || s.a != DType::f32 || o.a_gather_rows.buffer != nullptr) {
    // Otherwise PA packs a transposed f32 A only, where it pays clearly: its RB values of a k step
    // lie M floats apart, and the weight gradients Xᵀ dY ran 1.2-2.4x faster packed on the AVX2
    // EPYC (768 x 768 x 2048: 70-78 -> 112-130 GFLOPS). A row-major A read in place was within
    // noise of packed, and the copy is scratch as large as A; a bf16 A packed in f32 would take
    // twice its own bytes, eating what bf16 activations save; a gathered A (a convolution's
    // implicit im2col) is read where it lies.
    set_param(c, "PA", 0);
  } else if (from_tuning_data && a_rows_alias(s)) {
    set_param(c, "PA", 1);
  } else if (from_tuning_data && direct_transposed_a(s, c)) {
    set_param(c, "PA", 0);
  }
  if (o.a_gather_run > 0) {
    set_param(c, "NV", static_cast<int>(std::clamp<std::size_t>((s.N + 15) / 16, 1, 4)));
    set_param(c, "RB", static_cast<int>(o.a_gather_run));
    return c;
  }
  const int nv = c.param("NV"), rb = c.param("RB");
  const int need = static_cast<int>(std::max<std::size_t>(1, (s.N + 15) / 16));
  if (need >= nv) return c;
  set_param(c, "NV", need);
  set_param(c, "RB", std::min(16, rb * nv / need));
  return c;
}

// The tiled parameters for this shape, when they come from the tuning data and do not split K
// (SK=0): while the product has fewer tiles than the device has compute units, halve the tile and the results per
// work-item (same group size), down to 2 x 2 per work-item and no fewer than VW. A row tuned on large squares (128 x
// 128 tiles: 1.5x the 64 x 64 tiles at n = 2048 on an H100) would leave most of the device idle on
// a training step's batch-sized products. Kernels asked for by name run as given.
GemmKernelConfig fit_tiled(const GemmShape& s, GemmKernelConfig c, std::uint32_t compute_units, bool from_tuning_data) {
  if (c.kernel != GemmKernel::tiled || !from_tuning_data) return c;
  auto tiles = [&](std::size_t tsm, std::size_t tsn) {
    return s.batch * ((s.M + tsm - 1) / tsm) * ((s.N + tsn - 1) / tsn);
  };
  // Whether a side's tile and results per work-item may halve, keeping at least `least` results,
  // whole vectors (VW) of them, and tiles of whole float4s under float4 loads (VG=4).
  const int vw = c.param("VW");
  const bool vector_loads = c.param("VG") == 4;
  auto can_halve = [&](const char* tile_key, const char* per_key, int least) {
    const int t = c.param(tile_key), w = c.param(per_key);
    return w >= least && w % 2 == 0 && (w / 2) % vw == 0 && t % 2 == 0 && !(vector_loads && (t / 2) % 4);
  };
  auto halve = [&](const char* tile_key, const char* per_key) {
    for (auto& [key, value] : c.params) {
      if (key == tile_key || key == per_key) value /= 2;
    }
  };
  // First a side of the product no longer than half the tile's halves along it (same group) while
  // it can, since the rest of every tile computed zeros: o = p v and the gradients of attention's
  // gemm family are [T, 64] products, which a 128 x 128 tile ran at half its work.
  while (s.N * 2 <= std::size_t(c.param("TSN")) && can_halve("TSN", "WPTN", 2)) halve("TSN", "WPTN");
  while (s.M * 2 <= std::size_t(c.param("TSM")) && can_halve("TSM", "WPTM", 2)) halve("TSM", "WPTM");
  if (c.param("SK") == 1) return c;  // short waves are split along K instead (tiled_splits)
  while (tiles(c.param("TSM"), c.param("TSN")) < compute_units && can_halve("TSM", "WPTM", 4) &&
         can_halve("TSN", "WPTN", 4)) {
    halve("TSM", "WPTM");
    halve("TSN", "WPTN");
  }
  return c;
}

std::size_t k_splits(const GemmShape& s, const GemmKernelConfig& c);

// gemm_packed's work-items for one row of work-items per panel: panels times products times K
// splits. A launch is given at least packed_items_per_unit work-items per compute unit where it
// can (own_panel, fit_row_blocks), so that no core sits idle while another finishes.
constexpr std::size_t packed_items_per_unit = 4;
std::size_t panel_items(const GemmShape& s, const GemmKernelConfig& c) {
  return (s.N + panel_width(c) - 1) / panel_width(c) * s.batch * k_splits(s, c);
}
std::size_t wanted_items(std::uint32_t compute_units) {
  return packed_items_per_unit * std::max<std::uint32_t>(1, compute_units);
}

// Row blocks per gemm_packed work-item (WB): the row's, lowered until the launch has the work-items
// it wants (wanted_items), 1 at least.
GemmKernelConfig fit_row_blocks(const GemmShape& s, GemmKernelConfig c, std::uint32_t compute_units) {
  if (c.kernel != GemmKernel::packed || c.param("WB") <= 1) return c;
  const std::size_t blocks = (s.M + c.param("RB") - 1) / c.param("RB");
  const std::size_t others = panel_items(s, c), wanted = wanted_items(compute_units);
  std::size_t wb = static_cast<std::size_t>(c.param("WB"));
  while (wb > 1 && (blocks + wb - 1) / wb * others < wanted) --wb;
  set_param(c, "WB", static_cast<int>(wb));
  return c;
}

// Whether the kernel comes from the tuning data (or is asked for as a row of it), and is fitted to
// each shape; a kernel asked for by name runs as given.
bool from_tuning_data(const GemmOptions& o) {
  return o.kernel.empty() || o.kernel_as_row;
}

// The plan's kernel parameters fitted to this shape (the fits leave the other kernel's alone).
GemmKernelConfig fitted(OpEnv& env, const GemmShape& s, const GemmPlan& p, const GemmOptions& o) {
  const bool as_row = from_tuning_data(o);
  const std::uint32_t units = env.device().compute_units;
  return fit_tiled(s, fit_row_blocks(s, fit_packed(s, p.config, o, as_row), units), units, as_row);
}

// K rows per split of a long-K product (see gemm_packed in gemm_packed.cl): at least a B sub-panel
// of 128 KiB, which stays in a core's L2 while the row blocks sweep over it, and at least 512 rows.
// With panels of 64 floats (AVX-512 rows) that is 512 rows: 256 wrote and re-read twice the partial
// products for no cache gain (the GPT's weight gradients, K = 4096, ran 380 -> 440 GFLOPS at 192 x
// 768 and 385 -> 445 at 192 x 192 with 512; bench/RESULTS.md, "Long-K splits of 512 rows"). With
// panels of 16 (the AVX2 row) it is 2048 rows, so K = 4096 runs unsplit: 512-row splits cost the
// partial products' sum and made those products 0.7-0.9x as fast on the AVX2 EPYC (bench/RESULTS.md,
// "Winograd on AVX2, and optimizer kernels 16 wide").
constexpr std::size_t min_split_rows = 512;
constexpr std::size_t min_split_panel_bytes = std::size_t{128} << 10;
// The partial products of all splits together: at most this many bytes. Past it the splits grow
// longer (fewer of them) rather than stop: a long K unsplit streams its whole B panel from memory
// for every row block.
constexpr std::size_t max_split_bytes = std::size_t{16} << 20;

// Splits wanted at most: enough work-items beside the row blocks and panels, and few partial
// products for gemm_sum_splits to read back (with 49 splits of a CNN weight gradient the sum took
// a fifth of the product's time; with 13, a twentieth).
constexpr std::size_t max_splits = 16;

// K rows per split: only where K is long next to M and N (weight gradients: K is the batch's
// rows); 0 means K runs unsplit. The rows double from the minimum until both limits hold.
std::size_t split_rows(const GemmShape& s, const GemmKernelConfig& c) {
  const std::size_t least = std::max(min_split_rows, min_split_panel_bytes / (panel_width(c) * sizeof(float)));
  if (s.K < 4 * least || s.K < 4 * std::max(s.M, s.N)) return 0;
  const std::size_t block = s.batch * s.M * s.N * sizeof(float);  // one split of every product
  std::size_t rows = least;
  auto splits = [&] { return (s.K + rows - 1) / rows; };
  while ((splits() > max_splits || splits() * block > max_split_bytes) && rows < s.K) rows *= 2;
  return splits() > 1 ? rows : 0;
}

std::size_t k_splits(const GemmShape& s, const GemmKernelConfig& c) {
  const std::size_t rows = split_rows(s, c);
  return rows == 0 ? 1 : (s.K + rows - 1) / rows;
}

// The packed panels of every product's B.
std::size_t packed_panel_elems(const GemmShape& s, const GemmKernelConfig& c) {
  const std::size_t nb = panel_width(c);
  return s.batch * ((s.N + nb - 1) / nb * nb) * s.K;
}

// A batch's B that is not transposed and at most this many floats per product is read in place:
// its rows stay in cache while a panel walks down them (attention's products, whose B is a head's
// keys or values). A single product's small B is packed, as it was before batches were folded in;
// reading it in place there is not measured.
constexpr std::size_t direct_batched_b_max_elems = 64 * 1024;

// B read in place instead of packed: a split product over a row-major B whose columns fill whole
// panels at least 64 wide (its panel rows are already contiguous, and packing a long B, the output
// gradient of a weight gradient, cost a copy of all of it per product), or a small B of a batch
// (above). A panel of 16 (NV = 1, 256-bit units) reads one cache line per k step, N floats apart:
// with N = 1024 every line falls in the same cache set, and 1024 x 1024 x 4096 ran at 73 GFLOPS in
// place against 131 packed on the AVX2 EPYC (1024 x 1000 x 4096, packed as N is no multiple of 16).
constexpr std::size_t direct_b_min_panel = 64;
// And only while a split's sub-panel (its rows of one panel) stays in a core's L2: read in place,
// its rows lie N floats apart, and with N a multiple of 1024 every row falls in the same cache sets,
// so a longer sub-panel is read from memory again by every row block. Splits grow past the
// minimum when their partial products would be too many or too large (max_splits,
// max_split_bytes): 256 x 4096 x 16384 (a 7B GPT's second MLP product at batch 1, 4 splits of 4096
// rows, 1 MiB sub-panels) ran at 118 GFLOPS in place against 180 packed on the AVX-512 EPYC,
// 2048 x 1024 x 8192 TN at 109 against 161; 1024 x 1024 x 4096 TN (1024-row splits, 256 KiB) at 179
// both ways (bench/RESULTS.md, "The GEMM rate at the step's own products").
constexpr std::size_t direct_b_max_subpanel_bytes = std::size_t{256} << 10;
bool direct_b(const GemmShape& s, const GemmKernelConfig& c, const GemmOptions& o) {
  if (s.b != DType::f32 || s.trans_b || o.b_planes != 0) return false;
  if (s.N % panel_width(c) == 0 && panel_width(c) >= direct_b_min_panel && k_splits(s, c) > 1 &&
      split_rows(s, c) * panel_width(c) * sizeof(float) <= direct_b_max_subpanel_bytes) {
    return true;
  }
  return s.batch > 1 && s.K * s.N <= direct_batched_b_max_elems;
}

// The packed row blocks of every product's A (PA = 1), RB rows each, the last one padded.
std::size_t packed_a_elems(const GemmShape& s, const GemmKernelConfig& c) {
  if (c.param("PA") == 0) return 0;
  const std::size_t rb = static_cast<std::size_t>(c.param("RB"));
  return s.batch * ((s.M + rb - 1) / rb * rb) * s.K;
}

// Packed B (unless read in place), packed A, then the splits' partial products when K is split.
std::size_t packed_elems(const GemmShape& s, const GemmKernelConfig& c, const GemmOptions& o) {
  const std::size_t splits = k_splits(s, c);
  return (direct_b(s, c, o) ? 0 : packed_panel_elems(s, c)) + packed_a_elems(s, c) +
         (splits > 1 ? s.batch * splits * s.M * s.N : 0);
}

// The block of a launch of its own for the last panel, where N leaves most of it empty: as many
// vectors as its columns need, with the rows raised by as much as the panel narrowed (as fit_packed
// does for a narrow N), reading the panel as packed (NB_LAYOUT in gemm_packed.cl). With panels of 64,
// N = 784 (the MLP's input, its first layer's dX and dW) ran its last 16 columns as 64, 6% of the
// product computing zeros: 256 x 784 x 1024 took as long as 256 x 832 x 1024 (bench/RESULTS.md, "The
// last panel at its own width"). None where B is read in place (its last panel reads column by
// column), where A is packed in blocks of RB rows or gathered (the block's rows are fixed), or
// where the last panel needs every vector anyway, and none where the zeros it would compute take less
// than a launch: the last 16 columns of 256 x 784 x 1024 took 0.041 ms in a launch of their own (RB
// = 16, NV = 1), where their padded panel of 64 added 0.07-0.14 ms to the product (0.889-0.959 ms
// against 0.799-0.816 for the other 12 panels), and a launch costs about 0.010 ms.
constexpr std::size_t min_tail_saving_flops = std::size_t{1} << 24;
std::optional<GemmKernelConfig> tail_panel(const GemmShape& s, const GemmKernelConfig& c, const GemmOptions& o,
                                           bool direct) {
  const std::size_t nb = panel_width(c), rest = s.N % nb;
  const int nv = c.param("NV"), need = static_cast<int>((rest + 15) / 16);
  if (direct || rest == 0 || s.N < nb || need >= nv || c.param("PA") != 0 || o.a_gather_rows.buffer != nullptr) {
    return std::nullopt;
  }
  const std::size_t zeros = nb - 16 * static_cast<std::size_t>(need);  // columns the full panel would waste
  if (2 * s.batch * s.M * s.K * zeros < min_tail_saving_flops) return std::nullopt;
  GemmKernelConfig t = c;
  set_param(t, "NV", need);
  set_param(t, "RB", std::min(16, c.param("RB") * nv / need));
  return t;
}

// Whether each gemm_packed work-item packs its own panel of B (OWN_PANEL in gemm_packed.cl) and
// runs every row block against it, instead of a gemm_pack_b launch over the whole of B before the
// product: the panel's rows are then in the core's cache when the row blocks read them, and the
// pack is not a launch of its own. For a batch-sized M the pack of the forward's transposed weight
// was 6-14% of the call (256 x 1024 x 784: 0.06-0.18 ms of 0.9-1.1). Only with enough panels to
// keep every compute unit busy (each work-item now runs all of M), at most own_panel_max_rows rows
// (past them the pack is a small part of the product and A is better walked in cached groups,
// gemm_traversal_group_blocks) and a split's rows of a panel small enough for a core's L2.
//
// A row-major B too, with panels 16 wide (the AVX2 row; measured there only), while A, which every
// work-item then reads whole, fits a quarter of the last-level cache: the pack of B was otherwise a
// pass over all of it, 192 x 768 x 4096 TN (a GPT weight gradient) ran 104-127 -> 144-147 GFLOPS on
// the AVX2 EPYC and 256 x 784 x 1024 NN 168 -> 187, where 768 x 192 x 4096 TN, 12 MiB of A, fell
// from 130 to 110 (bench/RESULTS.md, "Row blocks per work-item; a row-major B packed by the product").
constexpr std::size_t own_panel_max_rows = 1024;
constexpr std::size_t own_panel_max_bytes = std::size_t{256} << 10;
constexpr std::size_t own_panel_row_major_width = 16, own_panel_row_major_a_share = 4;
bool own_panel(const GemmShape& s, const GemmKernelConfig& c, const GemmOptions& o, const cl::DeviceInfo& device) {
  if (o.b_planes != 0 || s.K == 0 || s.M > own_panel_max_rows) return false;
  if (!s.trans_b && (direct_b(s, c, o) || panel_width(c) != own_panel_row_major_width ||
                     s.M * s.K * sizeof(float) > device.global_mem_cache_bytes / own_panel_row_major_a_share)) {
    return false;
  }
  const std::size_t rows = k_splits(s, c) > 1 ? split_rows(s, c) : s.K;
  return panel_items(s, c) >= wanted_items(device.compute_units) &&
         rows * panel_width(c) * sizeof(float) <= own_panel_max_bytes;
}

// C stored by non-temporal stores (C_STREAM in gemm_packed.cl) where it is at least half the
// last-level cache: so large a C is not kept there for its reader anyway, and an ordinary store
// first reads each line of it from memory. Short-K products are where that read shows: 4096 x 768 x
// 192 (the GPT's first MLP product and its second's input gradient, 12 MiB of C) ran 1.3x faster
// on the AVX2 EPYC (bench/RESULTS.md, "C written past the caches"); squares with K = 1024 and
// more, and 2048 x 3072 x 768, level: only short-K products stream C (the fewer the k steps, the
// larger a share of the time goes to storing C). An f32 C in rows, unsplit (splits write partial
// products to scratch), on a CPU.
//
// With K <= 256 (weight gradients over a batch: the quick start's deep MLP, batch 64; the MLP at
// 256) storing C is a large part of the product, and C is streamed from an eighth of the cache: the
// deep MLP's weight gradients, most of them 1024 x 1024 x 64 (4 MiB each, read next by the
// optimizer's pass over all of them, which no cache holds), went from 45-48 to 29 ms a step on the
// AVX2 EPYC, the MLP's two large ones at batch 256 from 6.2-6.6 to 5.5-5.9 ms, the GPT's step (its
// 4096 x 192 x 192 products) level or faster (bench/RESULTS.md, "Short-K weight gradients stream
// their C").
constexpr std::size_t stream_c_min_cache_share = 2, stream_c_max_k = 512;
constexpr std::size_t stream_c_short_k = 256, stream_c_short_k_cache_share = 8;
bool stream_c(const GemmShape& s, const GemmOptions& o, std::size_t splits, const cl::DeviceInfo& device) {
  const std::size_t share = s.K <= stream_c_short_k ? stream_c_short_k_cache_share : stream_c_min_cache_share;
  return device.is_cpu() && s.c == DType::f32 && o.c_planes == 0 && splits == 1 && device.global_mem_cache_bytes > 0 &&
         s.K <= stream_c_max_k && s.batch * s.M * s.N * sizeof(float) >= device.global_mem_cache_bytes / share;
}

// K_CHUNK for a product with a transposed A read in place (direct_transposed_a): its sums wait in
// C between chunks, so C must be f32 in rows, written whole by one split with beta = 0 (C is not
// read), in whole panels (a last panel past N would park sums in the next row's columns), by
// work-items that run their row blocks in turn. Elsewhere 0: the k loop unchunked, the same bits.
std::size_t k_chunk_rows(const GemmShape& s, const GemmKernelConfig& c, const GemmOptions& o, float beta,
                         bool own_launch) {
  const bool in_turn = own_launch || c.param("WB") > 1;
  const bool fits = c.param("PA") == 0 && o.a_gather_rows.buffer == nullptr && direct_transposed_a(s, c) &&
                    s.c == DType::f32 && o.c_planes == 0 && beta == 0.0f && k_splits(s, c) == 1 &&
                    s.N % panel_width(c) == 0 && in_turn;
  return fits ? k_chunk : 0;
}

// Panels per work-item of a launch that packs its own panels chunk by chunk (OWN_PANELS in
// gemm_packed.cl): as many as leave the launch the work-items it wants (wanted_items), at most
// own_panels_max. A row-major B's rows are then read several panels wide (192 x 768 x 4096 TN, whose
// B rows lie 3 KiB apart, waited for a page walk per row and panel) and each chunk of A serves them
// all from L2.
constexpr std::size_t own_panels_max = 4;
std::size_t own_panels(const GemmShape& s, const GemmKernelConfig& c, std::size_t k_chunk, bool own_launch,
                       std::uint32_t compute_units) {
  if (!own_launch || k_chunk == 0) return 1;
  const std::size_t panels = (s.N + panel_width(c) - 1) / panel_width(c), wanted = wanted_items(compute_units);
  std::size_t p = own_panels_max;
  while (p > 1 && (panels + p - 1) / p * s.batch < wanted) --p;
  return p;
}

// PREFETCH_B in gemm_packed.cl. 1: a launch packing its own panels of a row-major B in K chunks
// prefetches the next chunk's rows where they lie at least prefetch_b_min_row_bytes apart, beyond
// the hardware prefetcher's reach (a stride across pages). 192 x 768 x 4096 TN (3 KiB rows) ran
// 146-148 -> 157-163 GFLOPS so on the AVX2 EPYC; with 768-byte rows, which the hardware prefetcher
// follows, 114 x 192 x 4096 TN fell from 146-149 to 124-138 (bench/RESULTS.md, "Weight gradients'
// panels packed chunk by chunk").
// 2: a launch packing its own panels a whole one at a time, of at most prefetch_panel_max_rows
// rows, prefetches the next panel's part of B while it runs its row blocks. A weight read right
// after the optimizer's pass over all of them is in no cache, and each work-item's pack waited for
// memory with the FMA units idle, a share of the product that grows as M shrinks: the quick
// start's deep model (64 x 1024 x 1024 forward and input-gradient products) ran 129.6-131.3 ->
// 126.8-129.1 ms a step on the AVX2 EPYC, its forward products 1.14 -> 1.00 ms in a trace; warm
// products of 64-512 rows level or faster, 1000^3 and 1024^3 (past the bound) within -2% to +2%
// (bench/RESULTS.md, "The next panel prefetched").
constexpr std::size_t prefetch_b_min_row_bytes = 2048, prefetch_panel_max_rows = 512;
int prefetch_b_rows(const GemmShape& s, std::size_t k_chunk, std::size_t panels_per_item, bool own_launch) {
  if (!own_launch) return 0;
  if (k_chunk > 0) return !s.trans_b && s.N * dtype_bytes(s.b) >= prefetch_b_min_row_bytes ? 1 : 0;
  return panels_per_item == 1 && s.M <= prefetch_panel_max_rows ? 2 : 0;
}

std::string transpose_defines(const GemmShape& s) {
  return fmt::format("-DTRANS_A={} -DTRANS_B={}", int(s.trans_a), int(s.trans_b));
}

}  // namespace

std::string gemm_storage_defines(DType a, DType b, DType c) {
  auto one = [](char x, DType t) {
    return fmt::format("-D{0}_NAME={1} -D{0}_IS_F32={2}", x,
                       t == DType::f32   ? "F32"
                       : t == DType::f16 ? "F16"
                                         : "BF16",
                       int(t == DType::f32));
  };
  return fmt::format("{} {} {}", one('A', a), one('B', b), one('C', c));
}

void require_scratch(DeviceSpan scratch, const GemmShape& s, std::string_view what, std::size_t need) {
  if (need > 0 && scratch.buffer == nullptr) {
    throw std::invalid_argument(
        fmt::format("gemm {}x{}x{} {}: needs {} floats of scratch, got none", s.M, s.N, s.K, what, need));
  }
}

std::string gemm_epilogue_defines(const GemmOptions& o, std::size_t c_planes) {
  const bool dact = o.dact_input.buffer != nullptr;
  return fmt::format("-DC_PLANES={} -DC_RELU={} -DC_DACT={} -DC_GUARD={}", c_planes, int(o.relu),
                     dact ? 1 + int(o.dact == Activation::gelu) : 0, int(o.guard.buffer != nullptr));
}

namespace {

// The NCHW views and the gathered A describe one product's operands.
void check_batch(const GemmShape& s, const GemmOptions& o) {
  if (s.batch != 1 && (o.b_planes || o.c_planes || o.a_gather_rows.buffer || o.a_gather_cols.buffer)) {
    throw std::invalid_argument(fmt::format(
        "gemm {} x {}x{}x{}: NCHW planes and a gathered A take one product (batch 1)", s.batch, s.M, s.N, s.K));
  }
}

void check_dtypes(const GemmShape& s) {
  for (DType t : {s.a, s.b, s.c}) {
    if (!dtype_is_float(t)) {
      throw std::invalid_argument(fmt::format("gemm {}x{}x{}: operand dtype {} is not a float type (f32, f16, bf16)",
                                              s.M, s.N, s.K, dtype_name(t)));
    }
  }
}

// Kernels that take only f32 (naive, CLBlast) run narrow operands through f32 copies in
// scratch: A and B widened before the product, C (when narrow) computed in f32 and rounded after.
struct StagedLayout {
  std::size_t a = 0, b = 0, c = 0, total = 0;  // offsets in floats; a copy is absent when its operand is f32
};
StagedLayout staged_layout(const GemmShape& s) {
  StagedLayout l;
  std::size_t at = 0;
  auto take = [&](bool needed, std::size_t elems) {
    const std::size_t here = at;
    if (needed) at += elems;
    return here;
  };
  l.a = take(s.a != DType::f32, s.batch * s.M * s.K);
  l.b = take(s.b != DType::f32, s.batch * s.K * s.N);
  l.c = take(s.c != DType::f32, s.batch * s.M * s.N);
  l.total = at;
  return l;
}

// The packs' work-item sizes, given to gemm_packed.cl as defines (pack_defines) and used here to
// size their launches. gemm_pack_b: k rows of op(B) per work-item, more for NCHW planes, whose packs
// are long (an output gradient over a whole batch) and whose work-items are cheap next to PoCL's
// per-group cost. gemm_pack_a: k columns of a row-major A per work-item; k rows of a transposed A
// across about `a_group_values` values (group_values / RB row blocks) per work-item.
struct PackSizes {
  static constexpr std::size_t b_rows = 16, b_rows_planes = 128;
  static constexpr std::size_t a_cols = 128, a_tk = 8, a_group_values = 128;
};

std::string pack_defines(bool b_planes) {
  return fmt::format("-DPACK_ROWS={} -DPACK_A_COLS={} -DPACK_A_TK={} -DPACK_A_GROUP_VALUES={}",
                     b_planes ? PackSizes::b_rows_planes : PackSizes::b_rows, PackSizes::a_cols, PackSizes::a_tk,
                     PackSizes::a_group_values);
}

// The launch that packs op(B) into panels (gemm_pack_b).
KernelLaunch pack_b_launch(OpEnv& env, const GemmShape& s, std::size_t padded_columns, const std::string& defines,
                           DeviceSpan b, DeviceSpan scratch, const GemmOptions& options) {
  cl::Kernel pack = env.kernels.kernel("gemm_packed", "gemm_pack_b", defines);
  const std::size_t pack_rows = options.b_planes ? PackSizes::b_rows_planes : PackSizes::b_rows;
  cl::set_args(pack.get(), cl_uint(s.N), cl_uint(s.K), b.buffer, b.elem_offset(dtype_bytes(s.b)), scratch.buffer,
               scratch.elem_offset());
  KernelLaunch l;
  l.kernel = std::move(pack);
  l.dims = s.batch > 1 ? 3 : 2;
  // pack_rows k rows per work-item; transposed or NCHW B also splits the padded columns into
  // blocks of 16, one per work-item; the products of a batch on dimension 2.
  l.global = {(s.K + pack_rows - 1) / pack_rows, s.trans_b || options.b_planes ? padded_columns / 16 : 1, s.batch};
  l.local = {1, 1, 1};
  return l;
}

// The launch that packs A in blocks of RB rows (gemm_pack_a, PA = 1) at element a_panels_off of
// the scratch.
KernelLaunch pack_a_launch(OpEnv& env, const GemmShape& s, std::size_t rb, const std::string& defines, DeviceSpan a,
                           DeviceSpan scratch, std::uint64_t a_panels_off) {
  cl::Kernel pack = env.kernels.kernel("gemm_packed", "gemm_pack_a", defines);
  // Work-items: a row-major A's a_cols k columns of one row block; a transposed A's a_tk k rows of
  // a_group_values / RB row blocks (PackSizes).
  const std::size_t blocks = (s.M + rb - 1) / rb;
  const std::size_t pack_blocks = s.trans_a ? PackSizes::a_group_values / rb : 1,
                    pack_k = s.trans_a ? PackSizes::a_tk : PackSizes::a_cols;
  cl::set_args(pack.get(), cl_uint(s.M), cl_uint(s.K), a.buffer, a.elem_offset(dtype_bytes(s.a)), scratch.buffer,
               a_panels_off);
  KernelLaunch l;
  l.kernel = std::move(pack);
  l.dims = s.batch > 1 ? 3 : 2;
  l.global = {(blocks + pack_blocks - 1) / pack_blocks, (s.K + pack_k - 1) / pack_k, s.batch};
  l.local = {1, 1, 1};
  return l;
}

LaunchList bind_packed(OpEnv& env, const GemmShape& s, const GemmKernelConfig& cfg, float alpha, DeviceSpan a,
                       DeviceSpan b, float beta, DeviceSpan c, DeviceSpan scratch, const GemmOptions& options) {
  const std::size_t nb = panel_width(cfg);
  const std::size_t panels = (s.N + nb - 1) / nb;
  const bool direct = direct_b(s, cfg, options);
  const std::size_t splits = k_splits(s, cfg);
  const bool gather = options.a_gather_rows.buffer != nullptr;
  if (gather && (s.trans_a || s.a != DType::f32)) {
    throw std::invalid_argument(fmt::format("gemm {}x{}x{}: a gathered A is f32 and not transposed", s.M, s.N, s.K));
  }
  const bool runs = options.a_gather_run > 0;
  if (runs && (!gather || options.a_gather_run > 16 || s.M % options.a_gather_run != 0 || options.a_gather_step == 0)) {
    throw std::invalid_argument(
        fmt::format("gemm {}x{}x{}: a_gather_run {} (step {}) needs a gathered A, at most 16 rows, a step and M a "
                    "multiple of the run",
                    s.M, s.N, s.K, options.a_gather_run, options.a_gather_step));
  }
  // With K split, gemm_packed writes fp32 partial products and gemm_sum_splits stores C (in its
  // layout). `block` is the register block of the program (the last panel's may differ).
  const bool own = own_panel(s, cfg, options, env.device());
  // A last panel in a launch of its own (tail_panel) reads it packed: with OWN_PANEL the first
  // launch's work-items pack it (OWN_TAIL), and the tail's own launch runs one work-item per row
  // block as without OWN_PANEL (a single work-item for all of M left every other core idle).
  const std::optional<GemmKernelConfig> tail = tail_panel(s, cfg, options, direct);
  const bool stream = stream_c(s, options, splits, env.device());
  // How a program of register block `block` walks K and B: K_CHUNK, OWN_PANELS and PREFETCH_B.
  struct Chunking {
    std::size_t k_chunk, panels_per_item;
    int prefetch_b;
  };
  auto chunking = [&](const GemmKernelConfig& block, bool own_launch) {
    const std::size_t k = k_chunk_rows(s, block, options, beta, own_launch);
    const std::size_t per_item = own_panels(s, block, k, own_launch, env.device().compute_units);
    return Chunking{k, per_item, prefetch_b_rows(s, k, per_item, own_launch)};
  };
  auto program_defines = [&](const GemmKernelConfig& block, bool own_launch, const Chunking& chunks) {
    return fmt::format(
        "{} {} -DNB_LAYOUT={} -DOWN_PANEL={} -DOWN_TAIL={} -DOWN_PANELS={} -DDIRECT_B={} -DDIRECT_B_TAIL={} "
        "-DB_PLANES={} -DA_GATHER={} -DA_GATHER_STEP={} -DC_STREAM={} -DK_CHUNK={} -DPREFETCH_B={} {} {} {}",
        block.defines(), transpose_defines(s), nb, int(own_launch), int(own_launch && tail), chunks.panels_per_item,
        int(direct), int(direct && s.N % nb != 0), options.b_planes, int(gather), runs ? options.a_gather_step : 0,
        int(stream), chunks.k_chunk, chunks.prefetch_b, pack_defines(options.b_planes > 0),
        gemm_storage_defines(s.a, s.b, splits > 1 ? DType::f32 : s.c),
        splits > 1 ? "-DC_PLANES=0 -DC_RELU=0 -DC_DACT=0 -DC_GUARD=0"
                   : gemm_epilogue_defines(options, options.c_planes));
  };
  const Chunking chunks = chunking(cfg, own);
  const std::string defines = program_defines(cfg, own, chunks);
  const cl_mem rows = gather ? options.a_gather_rows.buffer : a.buffer,
               cols = gather ? options.a_gather_cols.buffer : a.buffer;
  const std::uint64_t rows_off = options.a_gather_rows.elem_offset(4), cols_off = options.a_gather_cols.elem_offset(4);
  const bool dact = options.dact_input.buffer != nullptr;
  const cl_mem dz = dact ? options.dact_input.buffer : c.buffer;  // not read without C_DACT
  const std::uint64_t dz_off = dact ? options.dact_input.elem_offset(dtype_bytes(s.c)) : 0;
  const std::uint64_t a_off = a.elem_offset(dtype_bytes(s.a)), c_off = c.elem_offset(dtype_bytes(s.c));
  const std::uint64_t panels_elems = direct ? 0 : packed_panel_elems(s, cfg);
  const std::uint64_t a_panels_off = scratch.elem_offset() + panels_elems;  // packed A, when PA = 1
  const std::uint64_t parts_off = a_panels_off + packed_a_elems(s, cfg);    // partial products of splits
  LaunchList list;
  if (s.K > 0) require_scratch(scratch, s, fmt::format("({})", cfg.text()), packed_elems(s, cfg, options));
  if (s.K > 0 && !direct && !own) list.push_back(pack_b_launch(env, s, panels * nb, defines, b, scratch, options));
  const bool pack_a = s.K > 0 && packed_a_elems(s, cfg) > 0;
  if (pack_a) {
    list.push_back(pack_a_launch(env, s, static_cast<std::size_t>(cfg.param("RB")), defines, a, scratch, a_panels_off));
  }
  const cl_mem apacked = pack_a ? scratch.buffer : a.buffer;  // not read without PA
  const std::uint64_t apacked_off = pack_a ? a_panels_off : 0;
  const cl_uint has_bias = options.bias.buffer != nullptr;
  cl_mem packed = s.K > 0 ? scratch.buffer : c.buffer;  // with K = 0 the panels are never read
  std::uint64_t packed_off = scratch.elem_offset();
  if (direct) {
    packed = b.buffer;
    packed_off = b.elem_offset();
  }
  const std::uint64_t b_off = b.elem_offset(dtype_bytes(s.b));  // B itself, read with OWN_PANEL only
  // The product over `count` panels from panel `first`, in register blocks of `block`.
  auto product = [&](const GemmKernelConfig& block, const std::string& block_defines, bool own_launch,
                     const Chunking& block_chunks, std::size_t first, std::size_t count) {
    const std::size_t rb = static_cast<std::size_t>(block.param("RB"));
    const std::size_t wb = static_cast<std::size_t>(block.param("WB"));
    const cl_uint group_blocks =
        own_launch ? 0 : static_cast<cl_uint>((gemm_traversal_group_blocks(env, s, rb) + wb - 1) / wb);
    cl::Kernel k = env.kernels.kernel("gemm_packed", "gemm_packed", block_defines);
    if (splits == 1) {
      cl::set_args(k.get(), cl_uint(s.M), cl_uint(s.N), cl_uint(s.K), alpha, a.buffer, a_off, packed, packed_off, beta,
                   c.buffer, c_off, has_bias ? options.bias.buffer : c.buffer, options.bias.elem_offset(), has_bias,
                   cl_uint(s.K), cl_uint(1), rows, rows_off, cols, cols_off, apacked, apacked_off, group_blocks, dz,
                   dz_off, guard_buffer(options, c), options.guard.elem_offset(), cl_uint(first), b.buffer, b_off);
    } else {
      // Raw partial products after the panels, then one pass applies alpha, beta and the bias.
      cl::set_args(k.get(), cl_uint(s.M), cl_uint(s.N), cl_uint(s.K), 1.0f, a.buffer, a_off, packed, packed_off, 0.0f,
                   scratch.buffer, parts_off, scratch.buffer, std::uint64_t{0}, cl_uint(0), cl_uint(split_rows(s, cfg)),
                   cl_uint(splits), rows, rows_off, cols, cols_off, apacked, apacked_off, group_blocks, scratch.buffer,
                   std::uint64_t{0}, scratch.buffer, std::uint64_t{0}, cl_uint(first), b.buffer, b_off);
    }
    KernelLaunch l;
    l.kernel = std::move(k);
    l.dims = s.batch * splits == 1 ? 2 : 3;
    // Row blocks on dimension 0 (one work-item for all of them with OWN_PANEL): neighbours share a
    // B panel. Products times splits on dimension 2.
    // Panels on dimension 1, panels_per_item to a work-item.
    const std::size_t per_item = block_chunks.panels_per_item;
    l.global = {own_launch ? 1 : ((s.M + rb - 1) / rb + wb - 1) / wb, (count + per_item - 1) / per_item,
                s.batch * splits};
    l.local = {1, 1, 1};
    return l;
  };
  list.push_back(product(cfg, defines, own, chunks, 0, tail ? panels - 1 : panels));
  if (tail) {
    const Chunking tail_chunks = chunking(*tail, false);
    list.push_back(product(*tail, program_defines(*tail, false, tail_chunks), false, tail_chunks, panels - 1, 1));
  }
  if (splits > 1) {
    list.push_back(sum_splits_launch(env, s, splits, {scratch.buffer, parts_off * sizeof(float)}, alpha, beta, c,
                                     options, options.c_planes));
  }
  return list;
}

LaunchList bind_naive(OpEnv& env, const GemmShape& s, float alpha, DeviceSpan a, DeviceSpan b, float beta, DeviceSpan c,
                      const GemmOptions& options) {
  cl::Kernel k = env.kernels.kernel("gemm_naive", "gemm_naive", transpose_defines(s));
  const cl_uint has_bias = options.bias.buffer != nullptr;
  cl::set_args(k.get(), cl_uint(s.M), cl_uint(s.N), cl_uint(s.K), alpha, a.buffer, a.elem_offset(), b.buffer,
               b.elem_offset(), beta, c.buffer, c.elem_offset(), has_bias ? options.bias.buffer : c.buffer,
               options.bias.elem_offset(), has_bias);
  KernelLaunch l;
  l.kernel = std::move(k);
  l.dims = s.batch > 1 ? 3 : 2;
  l.global = {round_up(s.N, 8), round_up(s.M, 8), s.batch};
  l.local = {8, 8, 1};
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

// The packed kernel alone takes NCHW planes, gathered rows and the ReLU epilogue.
bool packed_features(const GemmPlan& p) {
  return p.backend == GemmBackend::ferry && p.config.kernel == GemmKernel::packed;
}
// ferry's packed and tiled kernels read and write f16/bf16 themselves and have the epilogues
// (GemmOptions::relu, dact); the others take f32 only and have neither.
bool native_dtypes(const GemmPlan& p) {
  return p.backend == GemmBackend::ferry &&
         (p.config.kernel == GemmKernel::packed || p.config.kernel == GemmKernel::tiled);
}

// Whether the kernel's epilogue applies the activation's derivative: where it gives the bits the
// activation's backward kernel would (graph::fuse_activation_grads promises the unfused graph's
// results) and, for GELU on the packed kernel, where it pays. Always for ReLU's mask and, but for
// GELU beside many accumulators (below), a narrow C (element by element either way; the product rounded to
// C's type first). GELU over an f32 C: on a CPU device the activation kernel takes 16 consecutive
// elements as one vector (PoCL's vector exp differs from its scalar one in the last bit), which
// the packed kernel matches only unsplit with rows of whole vectors (N a multiple of 16); elsewhere
// it runs element by element, as the tiled kernel's epilogue does.
// GELU's derivative beside a packed block of more than 8 float16 accumulators (the AVX-512 row's
// 6 x 64: 24) made the default GPT's fc2 input gradient (4096 x 768 x 192) take 12-13 ms on the AVX-512
// EPYC, against 7.3-8.7 ms for the product and then the activation kernel, and 10 ms evaluated
// in a pass of its own after the block was stored (bench/RESULTS.md, fifty-second session); with
// the AVX2 row's 6 x 16 it was a gain there (fourteenth session).
constexpr int gelu_epilogue_max_accumulators = 8;
bool dact_in_epilogue(OpEnv& env, const GemmPlan& p, const GemmShape& s, const GemmOptions& o) {
  if (o.dact == Activation::relu) return true;
  const bool packed = p.config.kernel == GemmKernel::packed;
  const GemmKernelConfig f = fitted(env, s, p, o);
  if (packed && f.param("RB") * f.param("NV") > gelu_epilogue_max_accumulators) return false;
  if (s.c != DType::f32) return true;
  if (!env.device().is_cpu()) return p.config.kernel == GemmKernel::tiled;
  return packed && s.N % 16 == 0 && k_splits(s, f) == 1;
}

// A weight gradient Xᵀ dY with many rows and few columns (M > direct_a_max_rows >= N, K long) as its
// transpose: Cᵀ = dYᵀ X, a product of N rows whose transposed A (dY) is read in place in K chunks
// (direct_transposed_a), into scratch, then permuted into C. The default GPT's second MLP weight
// gradient (768 x 192 x 4096 TN) packed its 12 MiB A and ran at 128-133 GFLOPS; its transpose,
// 192 x 768 x 4096 TN, at 146-150 (bench/RESULTS.md, "Weight gradients of few rows with K in chunks").
// Each element sums the same products in the same order (x y = y x exactly), so the bits are C's.
// Only where C is nothing but the product (beta = 0, no bias, activation or layout option), in f32,
// one product, for a row from the tuning data that packs such an A (a kernel asked for by name runs
// as given; with A read in place the transpose's scratch would be new).
std::optional<GemmShape> transposed_product(OpEnv& env, const GemmShape& s, const GemmPlan& p, const GemmOptions& o) {
  const bool plain = o.bias.buffer == nullptr && !o.relu && o.dact_input.buffer == nullptr && o.b_planes == 0 &&
                     o.c_planes == 0 && o.a_gather_rows.buffer == nullptr;
  if (!packed_features(p) || !from_tuning_data(o) || !plain || !s.trans_a || s.trans_b || !s.all_f32() ||
      s.batch != 1 || s.M <= direct_a_max_rows || s.M % 16 != 0) {
    return std::nullopt;
  }
  // Only in place of packing A: the transpose's panels (of A, as its B) take as much scratch.
  if (fitted(env, s, p, o).param("PA") == 0) return std::nullopt;
  GemmShape t = s;
  t.M = s.N;
  t.N = s.M;
  if (!direct_transposed_a(t, fitted(env, t, p, o))) return std::nullopt;
  return t;
}

}  // namespace

KernelLaunch sum_splits_launch(OpEnv& env, const GemmShape& s, std::size_t splits, DeviceSpan parts, float alpha,
                               float beta, DeviceSpan c, const GemmOptions& options, std::size_t c_planes) {
  const bool dact = options.dact_input.buffer != nullptr;
  const std::string defines =
      fmt::format("{} {}", gemm_storage_defines(s.a, s.b, s.c), gemm_epilogue_defines(options, c_planes));
  // CPU devices sum 16 elements a work-item where a product's elements come in whole sixteens
  // (gemm_sum_splits16; C in planes takes the per-element kernel).
  const bool wide = env.device().is_cpu() && c_planes == 0 && (s.M * s.N) % 16 == 0;
  cl::Kernel sum = env.kernels.kernel("gemm_sum", wide ? "gemm_sum_splits16" : "gemm_sum_splits", defines);
  const cl_uint has_bias = options.bias.buffer != nullptr;
  cl::set_args(sum.get(), cl_uint(s.M), cl_uint(s.N), cl_uint(splits), cl_uint(s.batch), parts.buffer,
               parts.elem_offset(), alpha, beta, c.buffer, c.elem_offset(dtype_bytes(s.c)),
               has_bias ? options.bias.buffer : c.buffer, options.bias.elem_offset(), has_bias,
               dact ? options.dact_input.buffer : c.buffer,
               dact ? options.dact_input.elem_offset(dtype_bytes(s.c)) : std::uint64_t{0}, guard_buffer(options, c),
               options.guard.elem_offset());
  return elementwise_launch(std::move(sum), s.batch * s.M * s.N / (wide ? 16 : 1));
}

// Row blocks per group of gemm_packed's traversal (its group_blocks): as many as keep the group's
// rows of A within a sixteenth of the device's global memory cache (a CPU's last-level cache; 2
// MiB of 32 here), while the panels of B stream past them. 0, no grouping, when all of A fits.
// Measured on the AVX2 EPYC at 2048^3 (KU=4): 123-129 GFLOPS ungrouped, 134-166 with groups of
// 16-128 blocks, 101-104 with 4 (B re-read too often); squares of 1024, whose A fits, unchanged.
std::uint32_t gemm_traversal_group_blocks(OpEnv& env, const GemmShape& s, std::size_t rb) {
  const std::uint64_t cache = env.device().global_mem_cache_bytes;
  const std::uint64_t block_bytes = std::uint64_t{rb} * s.K * sizeof(float);
  const std::uint64_t blocks = (s.M + rb - 1) / rb;
  if (cache == 0 || block_bytes == 0) return 0;
  const std::uint64_t group = std::max<std::uint64_t>(1, cache / 16 / block_bytes);
  return group >= blocks ? 0 : static_cast<std::uint32_t>(group);
}

std::size_t gemm_scratch_elems(OpEnv& env, const GemmShape& s, const GemmOptions& options) {
  check_dtypes(s);
  check_batch(s, options);
  if (s.batch == 0) return 0;
  const GemmPlan p = plan(env, options);
  if (packed_features(p)) {
    const std::size_t own = packed_elems(s, fitted(env, s, p, options), options);
    // The transposed product's result and scratch, where gemm() may take it (beta = 0).
    const std::optional<GemmShape> t = transposed_product(env, s, p, options);
    return t ? std::max(own, s.M * s.N + packed_elems(*t, fitted(env, *t, p, options), options)) : own;
  }
  if (p.backend == GemmBackend::ferry && p.config.kernel == GemmKernel::tiled) {
    return tiled_scratch_elems(s, fitted(env, s, p, options), env.device().compute_units);
  }
  if (native_dtypes(p)) return 0;
  return staged_layout(s).total;
}

bool gemm_takes_planes(OpEnv& env) {
  return packed_features(plan(env, {}));
}

std::string gemm_kernel_description(OpEnv& env, const GemmShape& s, const GemmOptions& options) {
  const GemmPlan p = plan(env, options);
  const std::string trans = fmt::format("{}{}", s.trans_a ? "T" : "N", s.trans_b ? "T" : "N");
  if (p.backend == GemmBackend::clblast) return fmt::format("clblast {}", trans);
  if (const std::optional<GemmShape> t = transposed_product(env, s, p, options)) {
    return fmt::format("ferry {} {} ({}) as its transpose", fitted(env, *t, p, options).text(), trans, p.origin);
  }
  return fmt::format("ferry {} {} ({})", fitted(env, s, p, options).text(), trans, p.origin);
}

LaunchList gemm(OpEnv& env, const GemmShape& s, float alpha, DeviceSpan a, DeviceSpan b, float beta, DeviceSpan c,
                DeviceSpan scratch, const GemmOptions& options) {
  cl::OpScope scope("gemm");
  check_dtypes(s);
  check_batch(s, options);
  if (s.batch == 0 || s.M == 0 || s.N == 0) return {};
  const GemmPlan p = plan(env, options);
  if ((options.b_planes || options.c_planes || options.a_gather_rows.buffer) && !packed_features(p)) {
    throw std::invalid_argument(
        fmt::format("gemm {}x{}x{}: NCHW planes and a gathered A need ferry's packed kernel", s.M, s.N, s.K));
  }
  const bool dact = options.dact_input.buffer != nullptr;
  if (dact && (options.relu || options.c_planes)) {
    throw std::invalid_argument(fmt::format(
        "gemm {}x{}x{}: an activation's derivative (dact) does not combine with the ReLU or an NCHW C", s.M, s.N, s.K));
  }
  const bool guard = options.guard.buffer != nullptr;
  if (guard && (s.c != DType::f32 || options.c_planes)) {
    throw std::invalid_argument(fmt::format("gemm {}x{}x{}: the overflow guard over C needs an f32 C in rows, got {}{}",
                                            s.M, s.N, s.K, dtype_name(s.c), options.c_planes ? " planes" : ""));
  }
  const std::size_t c_elems = s.batch * s.M * s.N;
  const bool epilogue = native_dtypes(p);
  // Kernels without the epilogue, and products whose epilogue would not give the activation
  // kernel's bits, run the activation (or its backward) over C after the product.
  const bool activation_after =
      (dact && !(epilogue && dact_in_epilogue(env, p, s, options))) || (options.relu && !epilogue);
  if (guard && (activation_after || !epilogue)) {
    // The guard checks the C that all of that stored, after it (CLBlast and the naive kernel have no
    // epilogue to check it in).
    GemmOptions unguarded = options;
    unguarded.guard = {};
    LaunchList list = gemm(env, s, alpha, a, b, beta, c, scratch, unguarded);
    for (auto& l : overflow_guard_check(env, c, c_elems, options.guard)) list.push_back(std::move(l));
    return list;
  }
  if (activation_after) {
    // The product, then the activation over C in place, as the unfused ops would run it.
    GemmOptions plain = options;
    plain.dact_input = {};
    plain.relu = false;
    LaunchList list = gemm(env, s, alpha, a, b, beta, c, scratch, plain);
    LaunchList more = dact ? activation_backward(env, options.dact, options.dact_input, c, c, c_elems, s.c)
                           : activation_forward(env, Activation::relu, c, c, c_elems, s.c);
    for (auto& l : more) list.push_back(std::move(l));
    return list;
  }
  if (!s.all_f32() && !native_dtypes(p)) {
    // Widen A and B into scratch, multiply in f32, round C back.
    const StagedLayout l = staged_layout(s);
    require_scratch(scratch, s, fmt::format("with {} x {} -> {}", dtype_name(s.a), dtype_name(s.b), dtype_name(s.c)),
                    l.total);
    auto at = [&](std::size_t elems) { return scratch.advanced(elems * sizeof(float)); };
    GemmShape f = s;
    f.a = f.b = f.c = DType::f32;
    LaunchList list;
    auto add = [&](LaunchList more) {
      for (auto& x : more) list.push_back(std::move(x));
    };
    const DeviceSpan a32 = s.a == DType::f32 ? a : at(l.a), b32 = s.b == DType::f32 ? b : at(l.b),
                     c32 = s.c == DType::f32 ? c : at(l.c);
    if (s.a != DType::f32) add(cast(env, s.a, DType::f32, a, a32, s.batch * s.M * s.K));
    if (s.b != DType::f32) add(cast(env, s.b, DType::f32, b, b32, s.batch * s.K * s.N));
    if (s.c != DType::f32 && beta != 0.0f) add(cast(env, s.c, DType::f32, c, c32, s.batch * s.M * s.N));
    add(gemm(env, f, alpha, a32, b32, beta, c32, {}, options));
    if (s.c != DType::f32) add(cast(env, DType::f32, s.c, c32, c, s.batch * s.M * s.N));
    return list;
  }
  // CLBlast rejects K = 0 (C = beta * C + bias): ferry's kernel handles that edge.
  if (p.backend == GemmBackend::clblast && s.K > 0)
    return bind_clblast_gemm(env, s, alpha, a, b, beta, c, options.bias);
  switch (p.config.kernel) {
    case GemmKernel::packed:
      if (const std::optional<GemmShape> t = transposed_product(env, s, p, options); t && beta == 0.0f) {
        // Cᵀ = op(B)ᵀ op(A) into scratch (B stored [K, N] is the transposed A of the product of N
        // rows, A stored [K, M] its row-major B), then C = (Cᵀ)ᵀ.
        require_scratch(scratch, s, "as its transpose", gemm_scratch_elems(env, s, options));
        const DeviceSpan ct = scratch;
        LaunchList list = gemm(env, *t, alpha, b, a, 0.0f, ct, scratch.advanced(s.M * s.N * sizeof(float)), options);
        const std::int32_t swap_axes[2] = {1, 0};
        for (auto& l :
             permute(env, ct, c, Shape{static_cast<std::uint32_t>(s.N), static_cast<std::uint32_t>(s.M)}, swap_axes))
          list.push_back(std::move(l));
        return list;
      }
      return bind_packed(env, s, fitted(env, s, p, options), alpha, a, b, beta, c, scratch, options);
    case GemmKernel::tiled:
      return bind_tiled(env, s, fitted(env, s, p, options), alpha, a, b, beta, c, scratch, options);
    case GemmKernel::naive:
      return bind_naive(env, s, alpha, a, b, beta, c, options);
  }
  return {};
}

}  // namespace ferry::ops
