// Host side of the sm90 backward: builds the kernel parameters from BwdParams and launches
// preprocess, (the dq_accum clear of block-list calls), (d_sink), the main kernel and the
// postprocess kernels on one stream.
// Included by the generated instantiation files only (one head-dim / dtype pair each).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "api/params.hpp"
#include "cuflash/error.hpp"
#include "sm90/dq_accum_start_sm90.hpp"
#include "sm90/epilogue_bwd_sm90.hpp"
#include "sm90/flash_bwd_dq_clear_sm90.hpp"
#include "sm90/flash_bwd_kernel_sm90.hpp"
#include "sm90/flash_bwd_postprocess_sm90.hpp"
#include "sm90/flash_bwd_preprocess_sm90.hpp"
#include "sm90/mainloop_bwd_sm90.hpp"
#include "sm90/tile_size_bwd_sm90.hpp"
#include "sm90/varlen_block_list_sm90.hpp"

namespace cuflash::sm90::bwd {

inline void check_launch(char const* what) {
  cudaError_t const err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(Error::Kind::kCuda, "", std::string("cuflash backward: launching ") + what + " failed: " + cudaGetErrorString(err));
  }
}

// The sliced hdim256 kernels' dQ path with CUFLASH_BWD_DQ=auto (the default): bulk. Measured on
// the H200 against atomics at 2k-8k, bf16, in one call: +17-23% non-causal, +18-19% causal, with
// softcap 50 +16-20% (dq_out_sm90.hpp; bench/NOTES.md, "a ring of three dQ slots per
// warpgroup").
inline constexpr BwdDqPath kDqPathByDefault = BwdDqPath::kBulk;

template <class Element, int kHeadDim, int kHeadDimV, bool HasWindow, bool HasSoftcap,
          class Variant = variants::NoVariant>
void run_bwd_config(BwdParams const& params, cudaStream_t stream) {
  using Mainloop = MainloopBwdSm90<Element, kHeadDim, kHeadDimV, HasWindow, HasSoftcap, Variant>;
  using Epilogue = EpilogueBwdSm90<Mainloop>;
  using Kernel = FlashBwdKernelSm90<Mainloop, Epilogue>;
  constexpr int kBlockM = Mainloop::kBlockM;
  constexpr int kBlockN = Mainloop::kBlockN;
  // The workspace rows and semaphores were counted for dispatch's tile (kernel_tile): a kernel
  // with more rows per step, or other column blocks, would run past them (or miss block lists).
  if (params.block_m != kBlockM || params.block_n != kBlockN) {
    throw Error(Error::Kind::kNotSupported, HasSoftcap ? "softcap" : "score_mod",
                "cuflash backward: the kernel's tile is " + std::to_string(kBlockM) + " x " +
                    std::to_string(kBlockN) + " but the workspace was laid out for " +
                    std::to_string(params.block_m) + " x " + std::to_string(params.block_n) +
                    " (a kernel module built from other headers than the library's)");
  }

  bool const varlen_q = params.cu_seqlens_q != nullptr;
  bool const varlen_k = params.cu_seqlens_k != nullptr;
  int const batch = params.batch;
  int const num_heads = params.num_heads;
  int const num_heads_kv = params.num_heads_kv;
  int const qhead_per_kvhead = num_heads / num_heads_kv;
  bool const gqa = qhead_per_kvhead > 1;
  int const q_rows_padded = int(padded_rows(params.total_q, batch, params.seqlen_q, kBlockM, varlen_q));
  int const k_rows_padded = int(padded_rows(params.total_k, batch, params.seqlen_k, kBlockN, varlen_k));
  // No sequences (batch 0): no block to launch (grid z would be 0); d_sink is still written.
  int const num_m_blocks = batch > 0 ? (params.seqlen_q + kBlockM - 1) / kBlockM : 0;
  int const num_n_blocks = batch > 0 ? (params.seqlen_k + kBlockN - 1) / kBlockN : 0;

  // The varlen block lists that dispatch gave workspace to (bwd_block_list_pays): the kernels
  // over row blocks (preprocess, dQ conversion) and over column blocks (main kernel, dK / dV
  // conversion) then launch one CTA per entry instead of batch x the longest sequence's blocks.
  // In the deterministic causal / local order a sequence's column blocks launch from the last
  // down, as column_block orders the rectangle's.
  // counts: each sequence's listed entries after the list, where wanted (the dQ conversion's
  // wait for a sequence's column blocks).
  auto build_list = [&](int* entries, int const* cu_seqlens, long long total, int block, int max_blocks,
                        bool descending, bool counts) -> VarlenBlockListParams {
    if (entries == nullptr || max_blocks == 0) return {};
    VarlenBlockListParams list = make_varlen_block_list(cu_seqlens, batch, 1, total, block, max_blocks, descending,
                                                        reinterpret_cast<int2*>(entries));
    if (counts) list.counts = entries + 2 * std::size_t(list.num_entries);
    launch_build_varlen_block_list(list, stream);
    check_launch("the varlen block list kernel");
    return list;
  };
  VarlenBlockListParams const row_built =
      build_list(params.row_block_list, params.cu_seqlens_q, params.total_q, kBlockM, num_m_blocks, false, false);
  VarlenBlockListParams const col_built = build_list(params.col_block_list, params.cu_seqlens_k, params.total_k,
                                                     kBlockN, num_n_blocks, HasWindow && params.deterministic, true);
  int const row_entries = row_built.num_entries;
  int const col_entries = col_built.num_entries;
  auto const* const row_list = row_entries > 0 ? reinterpret_cast<int2 const*>(params.row_block_list) : nullptr;
  auto const* const col_list = col_entries > 0 ? reinterpret_cast<int2 const*>(params.col_block_list) : nullptr;
  // The grids' column-block and batch extents of the kernels over row blocks and column blocks.
  int const row_grid_x = row_list != nullptr ? row_entries : num_m_blocks;
  int const row_grid_z = row_list != nullptr ? 1 : batch;
  int const col_grid_x = col_list != nullptr ? col_entries : num_n_blocks;
  int const col_grid_z = col_list != nullptr ? 1 : batch;

  // Workspace buffers that start as zeros (none where the call has no rows of them: a 0-byte
  // workspace has no pointer to clear).
  auto zero = [&](void* buffer, size_t bytes) {
    if (bytes == 0) return;
    cudaError_t const err = cudaMemsetAsync(buffer, 0, bytes, stream);
    if (err != cudaSuccess) {
      throw Error(Error::Kind::kCuda, "", std::string("cuflash backward: clearing the workspace failed: ") +
                                              cudaGetErrorString(err));
    }
  };
  // The dQ path of the sliced hdim256 kernels (dq_out_sm90.hpp). Bulk: each warpgroup's dQ
  // through a ring of shared-memory slots and bulk reduce-adds by a producer warp per warpgroup, which
  // also keep the deterministic order (kHasDqBulk). Elsewhere dQ goes by atomics.
  BwdDqPath const dq_path =
      BwdDqPath(params.dq_path) != BwdDqPath::kAuto ? BwdDqPath(params.dq_path) : kDqPathByDefault;
  bool const dq_bulk = Mainloop::kHasDqBulk && dq_path == BwdDqPath::kBulk;
  // dq_accum from the first writers' stores or cleared, and where the dQ walks start: the
  // measured rules of dq_accum_start_sm90.hpp.
  DqAccumCall dq_call;
  dq_call.dq_via_smem = Mainloop::kDqViaSmem;
  dq_call.dq_bulk = dq_bulk;
  dq_call.kernel_window = HasWindow;
  dq_call.flex = Mainloop::kIsFlex;
  dq_call.block_lists = params.block_sparse.enabled;
  dq_call.causal_or_local = params.is_causal || params.is_local;
  dq_call.causal = params.is_causal;
  dq_call.window_keys = dq_window_keys(params.is_local, params.window_left, params.window_right);
  dq_call.deterministic = params.deterministic;
  dq_call.head_dim = kHeadDim;
  dq_call.num_sm = params.num_sm;
  dq_call.batch = batch;
  dq_call.num_heads = num_heads;
  // The rules' lengths: a typical sequence's where the lengths are only bounded by the totals
  // (typical_seqlen_q); the CTA count bounds the rotation's arithmetic.
  dq_call.num_m_blocks = batch > 0 ? (typical_seqlen_q(params) + kBlockM - 1) / kBlockM : 0;
  dq_call.block_m = kBlockM;
  dq_call.num_n_blocks = batch > 0 ? (typical_seqlen_k(params) + kBlockN - 1) / kBlockN : 0;
  dq_call.main_ctas = std::int64_t(col_grid_x) * num_heads * col_grid_z;
  dq_call.clear = BwdDqClear(params.dq_clear);
  dq_call.det_walk = BwdDetWalk(params.det_walk);
  // Block lists outside deterministic mode: the device decides, from the lists' writers per row
  // block (flash_bwd_dq_clear_sm90 after the preprocess).
  int const list_max_writers = dq_list_max_writers(dq_call, params.block_sparse.block_n);
  int const* const list_writers = list_max_writers > 0 && params.dq_tickets != nullptr && num_m_blocks > 0
                                      ? params.block_sparse.max_row_writers
                                      : nullptr;
  int* const dq_tickets = list_writers != nullptr || dq_first_stores(dq_call) ? params.dq_tickets : nullptr;
  size_t const dq_accum_bytes = sizeof(float) * size_t(num_heads) * q_rows_padded * kHeadDim;
  if (dq_tickets == nullptr) { zero(params.dq_accum, dq_accum_bytes); }
  if (gqa) {
    zero(params.dk_accum, sizeof(float) * size_t(num_heads_kv) * k_rows_padded * kHeadDim);
    zero(params.dv_accum, sizeof(float) * size_t(num_heads_kv) * k_rows_padded * kHeadDimV);
  }
  // One semaphore per workspace row block of a head (dq_semaphore_stride ints apart), then one
  // per workspace column block of a kv head (workspace_row_block).
  size_t const num_dq_semaphores = size_t(num_heads) * (q_rows_padded / kBlockM) * size_t(params.dq_semaphore_stride);
  int* dkv_semaphore = params.deterministic ? params.dq_semaphore + num_dq_semaphores : nullptr;
  if (params.deterministic) {
    zero(params.dq_semaphore, sizeof(int) * (num_dq_semaphores + size_t(num_heads_kv) * (k_rows_padded / kBlockN)));
  }

  // Preprocess: dPsum and lse_log2.
  PreprocessParams pre{};
  pre.out = params.out;
  pre.dout = params.dout;
  pre.lse = params.lse;
  pre.o_batch_stride = params.o_batch_stride;
  pre.o_row_stride = params.o_row_stride;
  pre.o_head_stride = params.o_head_stride;
  pre.do_batch_stride = params.do_batch_stride;
  pre.do_row_stride = params.do_row_stride;
  pre.do_head_stride = params.do_head_stride;
  pre.lse_batch_stride = params.lse_batch_stride;
  pre.lse_head_stride = params.lse_head_stride;
  pre.dlse = params.dlse;
  pre.dlse_batch_stride = params.dlse_batch_stride;
  pre.dlse_head_stride = params.dlse_head_stride;
  pre.lse_log2 = params.lse_log2;
  pre.dpsum = params.dpsum;
  // The counters only where both the main kernel (column blocks) and the conversion (row
  // blocks) run.
  int* const dq_done = num_n_blocks > 0 && num_m_blocks > 0 ? params.dq_done : nullptr;
  pre.dq_done = dq_done;
  pre.dq_tickets = dq_tickets;
  pre.tickets_per_block = Mainloop::NumMmaWG;
  pre.q_rows_padded = q_rows_padded;
  pre.seqlen_q = params.seqlen_q;
  pre.head_dim_v = params.head_dim_v;
  pre.cu_seqlens_q = params.cu_seqlens_q;
  pre.seqused_q = params.seqused_q;
  pre.row_blocks = row_list;
  if (num_m_blocks > 0) {
    dim3 const grid(row_grid_x, num_heads, row_grid_z);
    if (row_list != nullptr) {
      flash_bwd_preprocess_sm90<Element, kBlockM, Mainloop::kHeadDimV, true><<<grid, 256, 0, stream>>>(pre);
    } else {
      flash_bwd_preprocess_sm90<Element, kBlockM, Mainloop::kHeadDimV, false><<<grid, 256, 0, stream>>>(pre);
    }
    check_launch("the backward preprocess kernel");
  }
  if (list_writers != nullptr) {
    DqClearParams clear{};
    clear.dq_accum = reinterpret_cast<float4*>(params.dq_accum);
    clear.num_float4 = std::int64_t(dq_accum_bytes / sizeof(float4));
    clear.tickets = dq_tickets;
    clear.num_tickets = std::int64_t(num_heads) * (q_rows_padded / kBlockM) * Mainloop::NumMmaWG;
    clear.max_row_writers = list_writers;
    clear.max_writers = list_max_writers;
    // 8 CTAs per SM, each looping: enough stores in flight for the memory.
    constexpr int kClearThreads = 256;
    std::int64_t const wanted = (clear.num_float4 + kClearThreads - 1) / kClearThreads;
    int const ctas = int(std::max<std::int64_t>(1, std::min<std::int64_t>(wanted, std::int64_t(std::max(params.num_sm, 1)) * 8)));
    flash_bwd_dq_clear_sm90<kClearThreads><<<ctas, kClearThreads, 0, stream>>>(clear);
    check_launch("the dq_accum clear kernel");
  }

  if (params.d_sink != nullptr) {
    DSinkParams sink{};
    sink.lse_log2 = params.lse_log2;
    sink.dpsum = params.dpsum;
    sink.sink = params.learnable_sink;
    sink.sink_dtype = params.sink_dtype;
    sink.d_sink = params.d_sink;
    sink.q_rows_padded = q_rows_padded;
    sink.batch = batch;
    sink.seqlen_q = params.seqlen_q;
    sink.cu_seqlens_q = params.cu_seqlens_q;
    sink.seqused_q = params.seqused_q;
    flash_bwd_dsink_sm90<kBlockM><<<num_heads, 256, 0, stream>>>(sink);
    check_launch("the learnable-sink gradient kernel");
  }

  // Main kernel.
  using ShapeQKV = typename Mainloop::ShapeQKV;
  using StrideQKV = typename Mainloop::StrideQKV;
  // TMA descriptors need non-empty extents; empty ones are never loaded from.
  int const rows_q = std::max(varlen_q ? params.total_q : params.seqlen_q, 1);
  int const rows_k = std::max(varlen_k ? params.total_k : params.seqlen_k, 1);
  int const batch_q = varlen_q ? 1 : std::max(batch, 1);
  int const batch_k = varlen_k ? 1 : std::max(batch, 1);
  typename Mainloop::Arguments args{
      static_cast<Element const*>(params.q),
      static_cast<Element const*>(params.k),
      static_cast<Element const*>(params.v),
      static_cast<Element const*>(params.dout),
      ShapeQKV{rows_q, params.head_dim, num_heads, batch_q},
      ShapeQKV{rows_q, params.head_dim_v, num_heads, batch_q},
      ShapeQKV{rows_k, params.head_dim, num_heads_kv, batch_k},
      ShapeQKV{rows_k, params.head_dim_v, num_heads_kv, batch_k},
      StrideQKV{params.q_row_stride, cute::_1{}, params.q_head_stride, varlen_q ? 0 : params.q_batch_stride},
      StrideQKV{params.do_row_stride, cute::_1{}, params.do_head_stride, varlen_q ? 0 : params.do_batch_stride},
      StrideQKV{params.k_row_stride, cute::_1{}, params.k_head_stride, varlen_k ? 0 : params.k_batch_stride},
      StrideQKV{params.v_row_stride, cute::_1{}, params.v_head_stride, varlen_k ? 0 : params.v_batch_stride},
  };
  typename Mainloop::Params ml{};
  ml.lse_log2 = params.lse_log2;
  ml.dpsum = params.dpsum;
  ml.dq_accum = params.dq_accum;
  ml.dq_semaphore = params.dq_semaphore;
  ml.dq_done = dq_done;
  ml.dq_semaphore_stride = params.dq_semaphore_stride;
  ml.q_rows_padded = q_rows_padded;
  ml.num_m_blocks = num_m_blocks;
  ml.seqlen_q = params.seqlen_q;
  ml.seqlen_k = params.seqlen_k;
  ml.num_heads = num_heads;
  // Unbounded window sides become a reach past any row or column.
  int const unbounded = params.seqlen_q + params.seqlen_k + kBlockM + kBlockN;
  bool const causal_or_local = params.is_causal || params.is_local;
  ml.window_left = !causal_or_local || params.window_left < 0 ? unbounded : std::min(params.window_left, unbounded);
  ml.window_right = params.is_causal ? 0
                    : (!causal_or_local || params.window_right < 0 ? unbounded : std::min(params.window_right, unbounded));
  // With softcap, tanh takes S * scale / softcap and the result is scaled back by softcap. The
  // flex variant turns S into final scores itself (scale or softcap, then score_mod); without
  // softcap or a score_mod nothing reads the scaled score, so the scale goes into the exponent
  // as in the plain kernel, one multiply per score fewer (the forward's flex_scale_in_exp).
  if constexpr (Mainloop::kIsFlex) {
    bool const scale_in_exp = !HasSoftcap && params.score_mod.kind == int(ScoreModKind::kNone);
    ml.softmax_scale_log2 = scale_in_exp ? exponent_scale(params.softmax_scale) * float(M_LOG2E) : float(M_LOG2E);
    ml.softcap_val = 0.f;
    ml.flex = Variant::to_params(params);
    if (scale_in_exp) { ml.flex.score_scale = 1.f; }
  } else {
    ml.softmax_scale_log2 =
        HasSoftcap ? params.softcap * float(M_LOG2E) : exponent_scale(params.softmax_scale) * float(M_LOG2E);
    ml.softcap_val = HasSoftcap ? params.softmax_scale / params.softcap : 0.f;
  }
  ml.deterministic = params.deterministic;
  ml.dq_bulk = dq_bulk;
  ml.dq_tickets = dq_tickets;
  ml.dq_list_writers = list_writers;
  ml.dq_list_max_writers = list_max_writers;
  // Deterministic dQ by atomics: the second producer warp waits for each row block's turn and
  // releases it (order_dq).
  ml.dq_order_warp = params.deterministic && !Mainloop::kDqViaSmem && !ml.dq_bulk;
  // Rotated walks (deterministic or first stores, no window; dq_rotate_window).
  ml.dq_rotate_window = dq_rotate_window(dq_call, dq_tickets != nullptr);
  // Heads inner (BwdLaunchOrder::kHeads): column blocks of unequal work launched longest first
  // across the heads of a batch. Measured on the H200 (bench/NOTES.md, "Backward launch order"):
  // hdim128 causal +2-3.5%; hdim256 causal with dQ by atomics +3.5% at 2k but -9% at 8k, where
  // the column order's L2 reuse (every running CTA streams the same head's Q / dO) hid the load
  // latency of its one dO stage, and with bulk dQ +4-5% at 2k-8k (bench/NOTES.md, "Run of
  // 2026-12-02 (sixth)"); so auto takes it at hdim128 and at hdim256 with bulk dQ, without mods
  // and without GQA (a group's heads would add their dK / dV into the same rows at once) until
  // the other cases are measured. It
  // applies to column blocks of unequal work: causal, local, a mask_mod or block lists (the flex
  // kernels have HasWindow for their mods, not because the call has a window). Deterministic
  // runs keep the column order their dQ ranks and rotations were laid out for.
  BwdLaunchOrder const order = BwdLaunchOrder(params.launch_order);
  bool const unequal_columns =
      params.is_causal || params.is_local || params.mask_mod.kind != 0 || params.block_sparse.enabled;
  bool const heads_wanted =
      order == BwdLaunchOrder::kHeads ||
      (order == BwdLaunchOrder::kAuto && (kHeadDim == 128 || (kHeadDim == 256 && ml.dq_bulk)) && !Mainloop::kIsFlex &&
       num_heads == num_heads_kv);
  int const head_group = params.launch_head_group > 0 ? std::min(params.launch_head_group, num_heads) : num_heads;
  int const num_head_groups = (num_heads + head_group - 1) / head_group;
  // Grid y holds the column blocks (or list entries) and z the head groups of every batch: both
  // at most 65535.
  bool const heads_inner = heads_wanted && HasWindow && unequal_columns && !params.deterministic &&
                           col_grid_x <= 65535 && std::int64_t(num_head_groups) * col_grid_z <= 65535;
  ml.head_group = heads_inner ? head_group : 0;
  ml.num_head_groups = heads_inner ? num_head_groups : 1;
  ml.col_blocks = col_list;
  ml.cu_seqlens_q = params.cu_seqlens_q;
  ml.cu_seqlens_k = params.cu_seqlens_k;
  ml.seqused_q = params.seqused_q;
  ml.seqused_k = params.seqused_k;
  ml.qhead_per_kvhead = cutlass::FastDivmod(qhead_per_kvhead);
  ml = Mainloop::to_params(args, ml);

  typename Epilogue::Params ep{};
  ep.dk = static_cast<Element*>(params.dk);
  ep.dv = static_cast<Element*>(params.dv);
  ep.dk_batch_stride = params.dk_batch_stride;
  ep.dk_row_stride = params.dk_row_stride;
  ep.dk_head_stride = params.dk_head_stride;
  ep.dv_batch_stride = params.dv_batch_stride;
  ep.dv_row_stride = params.dv_row_stride;
  ep.dv_head_stride = params.dv_head_stride;
  ep.dk_accum = gqa ? params.dk_accum : nullptr;
  ep.dv_accum = gqa ? params.dv_accum : nullptr;
  ep.dkv_semaphore = dkv_semaphore;
  ep.k_rows_padded = k_rows_padded;
  ep.num_heads_kv = num_heads_kv;
  ep.head_dim = params.head_dim;
  ep.head_dim_v = params.head_dim_v;
  ep.softmax_scale = params.softmax_scale;
  ep.qhead_per_kvhead = qhead_per_kvhead;
  ep.varlen_k = varlen_k;
  ep.deterministic = params.deterministic;

  // Postprocess: dQ, and dK / dV for GQA.
  PostprocessParams post_q{params.dq_accum, params.dq, params.dq_batch_stride, params.dq_row_stride, params.dq_head_stride,
                           q_rows_padded, params.seqlen_q, params.head_dim, params.softmax_scale,
                           params.cu_seqlens_q, dq_done, num_n_blocks, num_heads, dq_tickets, row_list,
                           // No CTA for the column blocks past a sequence's keys with the list.
                           col_list != nullptr ? col_built.counts : nullptr};
  typename Kernel::Params kernel_params{ml, ep};
  auto kernel = flash_bwd_kernel_sm90<Kernel>;
  constexpr int kSmem = Kernel::kSharedStorageSize;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) {
    throw Error(Error::Kind::kCuda, "", std::string("cuflash backward: cannot reserve ") + std::to_string(kSmem) +
                                            " bytes of shared memory: " + cudaGetErrorString(err));
  }
  // Column blocks that see no row (including every block when there are no queries) write
  // zero dK / dV, so the main kernel runs whenever there are keys.
  if (num_n_blocks > 0) {
    dim3 const grid = heads_inner ? dim3(head_group, col_grid_x, num_head_groups * col_grid_z)
                                  : dim3(col_grid_x, num_heads, col_grid_z);
    kernel<<<grid, Kernel::NumThreads, kSmem, stream>>>(kernel_params);
    check_launch("the backward main kernel");
#if CUFLASH_BWD_TRACE
    trace::dump_after_launch("bwdtrace", 0, int(std::min<long long>(
                                                (long long)grid.x * grid.y * grid.z, trace::kMaxCtas)),
                             stream);
#endif
  }

  if (num_m_blocks > 0) {
    auto postprocess_q = flash_bwd_postprocess_sm90<Element, typename Mainloop::TiledMmadQ, Mainloop::dQ_swapAB, kBlockM, kHeadDim>;
    // With the counters the dQ conversion is the main kernel's programmatic dependent: it starts
    // in the main kernel's last wave and converts each head once that head's sums have landed
    // (BwdDqConvert::kOverlap).
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(row_grid_x, num_heads, row_grid_z);
    config.blockDim = dim3(Mainloop::NumMmaThreads);
    config.dynamicSmemBytes = 0;
    config.stream = stream;
    cudaLaunchAttribute overlap[1];
    overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = overlap;
    config.numAttrs = dq_done != nullptr ? 1 : 0;
    cudaError_t const launched = cudaLaunchKernelEx(&config, postprocess_q, post_q);
    if (launched != cudaSuccess) {
      throw Error(Error::Kind::kCuda, "", std::string("cuflash backward: launching the dQ postprocess kernel failed: ") +
                                              cudaGetErrorString(launched));
    }
  }
  if (gqa && num_n_blocks > 0) {
    PostprocessParams post_k{params.dk_accum, params.dk, params.dk_batch_stride, params.dk_row_stride, params.dk_head_stride,
                             k_rows_padded, params.seqlen_k, params.head_dim, params.softmax_scale,
                             params.cu_seqlens_k, nullptr, 0, 0, nullptr, col_list, nullptr};
    flash_bwd_postprocess_sm90<Element, typename Mainloop::TiledMmadK, Mainloop::dKV_swapAB, kBlockN, kHeadDim>
        <<<dim3(col_grid_x, num_heads_kv, col_grid_z), Mainloop::NumMmaThreads, 0, stream>>>(post_k);
    check_launch("the dK postprocess kernel");
    PostprocessParams post_v{params.dv_accum, params.dv, params.dv_batch_stride, params.dv_row_stride, params.dv_head_stride,
                             k_rows_padded, params.seqlen_k, params.head_dim_v, 1.f,
                             params.cu_seqlens_k, nullptr, 0, 0, nullptr, col_list, nullptr};
    flash_bwd_postprocess_sm90<Element, typename Mainloop::TiledMmadV, Mainloop::dKV_swapAB, kBlockN, kHeadDimV>
        <<<dim3(col_grid_x, num_heads_kv, col_grid_z), Mainloop::NumMmaThreads, 0, stream>>>(post_v);
    check_launch("the dV postprocess kernel");
  }
}

// Entry of one plain instantiation file: the feature switches of this head-dim / dtype pair.
template <class Element, int kHeadDim, int kHeadDimV>
void run_bwd(BwdParams const& params, cudaStream_t stream) {
  bool const window = params.is_causal || params.is_local;
  bool const softcap = params.softcap > 0.f;
  if (window) {
    if (softcap) {
      run_bwd_config<Element, kHeadDim, kHeadDimV, true, true>(params, stream);
    } else {
      run_bwd_config<Element, kHeadDim, kHeadDimV, true, false>(params, stream);
    }
  } else {
    if (softcap) {
      run_bwd_config<Element, kHeadDim, kHeadDimV, false, true>(params, stream);
    } else {
      run_bwd_config<Element, kHeadDim, kHeadDimV, false, false>(params, stream);
    }
  }
}

// Entry of one flex instantiation file (score_mod, mask_mod, block sparsity): causal / local are
// runtime choices inside its kernels; softcap is compiled in or not, so that the kernel without
// it holds no per-element derivative.
template <class Element, int kHeadDim, int kHeadDimV, class Variant>
void run_bwd_flex_softcap(BwdParams const& params, cudaStream_t stream) {
  if (params.softcap > 0.f) {
    run_bwd_config<Element, kHeadDim, kHeadDimV, /*HasWindow=*/true, /*HasSoftcap=*/true, Variant>(
        params, stream);
  } else {
    run_bwd_config<Element, kHeadDim, kHeadDimV, /*HasWindow=*/true, /*HasSoftcap=*/false, Variant>(
        params, stream);
  }
}

// Variant: the built-in mods, or functors generated from Python callables (compiled at run time).
template <class Element, int kHeadDim, int kHeadDimV, class Variant = variants::FlexVariant>
void run_bwd_flex(BwdParams const& params, cudaStream_t stream) {
  // Block lists at head dims where the default flex tile's column blocks do not divide 128 keys
  // run the kernel with the narrower tile (bwd_tile's block_lists; block_list_tile on the host).
  if constexpr (bwd_tile(kHeadDim, kHeadDimV, true, false, true, true).block_n !=
                bwd_tile(kHeadDim, kHeadDimV, true, false, true, false).block_n) {
    if (params.block_sparse.enabled) {
      run_bwd_flex_softcap<Element, kHeadDim, kHeadDimV, variants::BlockListTileOf<Variant>>(params, stream);
      return;
    }
  }
  run_bwd_flex_softcap<Element, kHeadDim, kHeadDimV, Variant>(params, stream);
}

}  // namespace cuflash::sm90::bwd
