// Forward mainloop for Hopper.
// Producer (one thread): TMA loads of the Q tile once, then K and V tiles from the last
// n-block down into a kStages-deep shared-memory pipeline (cutlass::PipelineTmaAsync, one
// pipeline for K and one for V so that S = Q K^T can start before V has landed).
// Consumers (the MMA warpgroups, 64 rows of Q each): S = Q K^T by SS WGMMA, online softmax in
// registers, O += P V by RS WGMMA with P converted in registers. The QK^T of block n is issued
// together with the PV of block n+1 so the softmax of one overlaps the GEMM of the other, and
// warpgroups take turns issuing GEMMs (pingpong on named barriers) so one warpgroup's softmax
// runs under the other's GEMMs.
// Paged K/V (Config::kIsPaged, k/v as (pages, page_size, H_kv, D) with a page table): when a page
// holds whole n-blocks, the producer thread looks the page of each n-block up and TMA-loads it from
// a descriptor over the pages; otherwise the whole producer warpgroup gathers the rows with
// 16-byte cp.async into the same swizzled stages, each thread arriving on the stage's barrier
// when its copies land (load_paged).
// Packed GQA tiles (pack_gqa_sm90.hpp) have no Q TMA: each MMA warpgroup gathers its own rows
// (load_q_packed) at the start of the tile.
// Two Q buffers (kQStages, where shared memory allows): the next tile's Q lands during this
// tile, and each warpgroup issues the next tile's first Q K^T right after its last P V here, so
// that the GEMM runs under this tile's finalize and epilogue (issue_first_qk, the kernel's tile
// loop).
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>

#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include "api/params.hpp"
#include "sm90/mask.hpp"
#include "sm90/pack_gqa_sm90.hpp"
#include "sm90/seqlen_info.hpp"
#include "sm90/softmax.hpp"
#include "sm90/trace_sm90.hpp"
#include "sm90/utils_sm90.hpp"

// Build switch for A/Bs of where the loop rescales O (MainloopFwdSm90::kRescaleAfterPv): -1 where
// measured to pay, 0 nowhere, 1 in every kernel with head dim V up to 128.
#ifndef CUFLASH_FWD_RESCALE_AFTER_PV
#define CUFLASH_FWD_RESCALE_AFTER_PV -1
#endif

namespace cuflash::sm90 {

// Named barriers (ids past CUTLASS's reserved ones).
enum class FwdNamedBarrier : int {
  kEpilogue = 0,
  kWarpSchedulerWG0 = 1,  // one per MMA warpgroup, up to 3
  // One per MMA warpgroup (up to 3), for work a warpgroup does alone: the packed GQA Q gather
  // and the epilogue's TMA store of its rows.
  kWarpGroupLocalWG0 = 4,
  kStreamK = 7,  // the MMA warpgroups at a stream-K piece's end (stream_k_sm90.hpp)
};

template <class Config>
struct MainloopFwdSm90 {
  using Element = typename Config::Element;
  using ElementAccum = float;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kHeadDimV = Config::kHeadDimV;
  static constexpr int kStages = Config::kStages;
  static constexpr int kNumMmaWarpGroups = Config::kNumMmaWarpGroups;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr bool kHasSoftcap = Config::kHasSoftcap;
  static constexpr bool kIsFlex = Config::Variant::kIsFlex;
  static constexpr bool kIsPaged = Config::kIsPaged;
  // Gathered paged loads: every thread of the producer warpgroup copies 16-byte chunks.
  static constexpr int kNumGatherThreads = cutlass::NumThreadsPerWarpGroup;
  // Registers per producer thread (the kernel gives the rest to the MMA warpgroups): the TMA
  // producer needs few; gathering needs more, but the hdim 256 consumers cannot spare them,
  // nor can three MMA warpgroups (kBlockM 192) spare more than 32, so there the gather works
  // in smaller batches.
  static constexpr int kLoadRegisters =
      !kIsPaged ? 24 : (kHeadDim >= 256 ? 24 : (kNumMmaWarpGroups == 3 ? 32 : 40));
  static constexpr int kGatherBatch = kLoadRegisters >= 40 ? 4 : 2;
  // Where the loop rescales O by the move of the running max: between the warpgroup's Q K^T
  // and P V issues, inside its turn (the other warpgroup waits for both issues), or at the end
  // of the iteration, once P V is done and outside the turn, as FlashAttention-3 does at head
  // dims up to 128. Measured on the H200 (bf16, 2k-8k, bench/NOTES.md "Where the forward
  // rescales O"): after the P V gains 0.3-1.7% at head dim 64 and 1.1-2.0% at 96, moves hdim128
  // by -0.3 to +0.3% (its lazy rescale skips most rescales), and loses 2-4% in the hdim128 flex
  // kernel on block lists, which rescales every block. So: the plain kernels (and their softcap,
  // split, paged and packed variants) at head dims V up to 96.
  static constexpr bool kRescaleAfterPv =
      CUFLASH_FWD_RESCALE_AFTER_PV < 0 ? !kIsFlex && kHeadDimV <= 96
                                       : CUFLASH_FWD_RESCALE_AFTER_PV > 0 && kHeadDimV <= 128;

  using TileShapeQK = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using TileShapePV = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDimV>, cute::Int<kBlockN>>;
  using AtomLayoutMma = cute::Layout<cute::Shape<cute::Int<kNumMmaWarpGroups>, cute::_1, cute::_1>>;
  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, ElementAccum, TileShapeQK>(), AtomLayoutMma{}));
  // V is stored (kBlockN, Dv) with Dv contiguous: as the B operand (Dv x kBlockN) it is MN-major.
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, ElementAccum, TileShapePV, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      AtomLayoutMma{}));
  // One WGMMA spans the whole n-block: N extents such as 80, 112 and 160 exist only with
  // CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (cmake/CuflashKernels.cmake sets it); without it the
  // selector silently splits S = Q K^T into 64x16 or 64x32 atoms.
  static_assert(cute::size<1>(typename TiledMmaQK::AtomShape_MNK{}) == kBlockN,
                "S = Q K^T must be one WGMMA wide: compile with -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED");

  using SmemLayoutAtomQ =
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<
               cute::GMMA::Major::K, Element, cute::Int<kBlockM>, cute::Int<kHeadDim>>());
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemLayoutAtomQ{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutAtomK =
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<
               cute::GMMA::Major::K, Element, cute::Int<kBlockN>, cute::Int<kHeadDim>>());
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemLayoutAtomK{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  using SmemLayoutAtomV =
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<
               cute::GMMA::Major::K, Element, cute::Int<kBlockN>, cute::Int<kHeadDimV>>());
  using SmemLayoutV = decltype(cute::tile_to_shape(
      SmemLayoutAtomV{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimV>, cute::Int<kStages>>{}));
  // V^T: the same bytes seen as (Dv, kBlockN, stages).
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutV{},
      cute::make_ordered_layout(
          cute::Shape<cute::Int<kHeadDimV>, cute::Int<kBlockN>, cute::Int<kStages>>{},
          cute::Step<cute::_2, cute::_1, cute::_3>{})));

  // Global tensors as (rows, head dim, heads, batch); packed layouts use batch 1 and row offsets.
  using ShapeQKV = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using TMA_Q = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{},
                        StrideQKV{}),
      SmemLayoutQ{}, cute::select<0, 2>(TileShapeQK{}), cute::_1{}));
  using TMA_K = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{},
                        StrideQKV{}),
      cute::take<0, 2>(SmemLayoutK{}), cute::select<1, 2>(TileShapeQK{}), cute::_1{}));
  using TMA_V = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{},
                        StrideQKV{}),
      cute::take<0, 2>(SmemLayoutV{}), cute::select<2, 1>(TileShapePV{}), cute::_1{}));

  static constexpr uint32_t kTmaBytesQ = cute::size(SmemLayoutQ{}) * sizeof(Element);
  static constexpr uint32_t kTmaBytesK =
      cute::size(cute::take<0, 2>(SmemLayoutK{})) * sizeof(Element);
  static constexpr uint32_t kTmaBytesV =
      cute::size(cute::take<0, 2>(SmemLayoutV{})) * sizeof(Element);

  using PipelineK = cutlass::PipelineTmaAsync<kStages>;
  using PipelineV = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename PipelineK::PipelineState;

  // Q buffers. Two where the kernel's tile loop issues the next tile's first Q K^T under this
  // tile's epilogue: the plain and softcap kernels (dense K / V, whole tiles, Q by TMA) at hdim
  // 128, measured +1-2% from 2k keys on, even at 1k and 3-4% slower at 512 (bench/NOTES.md;
  // so the launch takes the kSingleQ kernel for tiles of few n-blocks, fwd_next_qk_pays);
  // elsewhere one. It lost 3-7% on hdim 64's 128-row tile, 3-4% on its 192-row tile (three
  // warpgroups), 3-5% in the hdim 128 flex kernels on block lists, and moved hdim 96 by -1 to
  // +0.4%; hdim 192 / 256 have no room for a second Q.
  static constexpr int kSmemBytesQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemBytesKV = kStages * kBlockN * (kHeadDim + kHeadDimV) * int(sizeof(Element));
  static constexpr int kSmemBytesO = kBlockM * kHeadDimV * int(sizeof(Element));
  static constexpr bool kNextQkEligible = !kIsFlex && !kIsPaged && !Config::kIsSplit &&
                                          !Config::kPackGqa && !Config::kStreamKPieces &&
                                          !Config::kSingleQ && kNumMmaWarpGroups == 2 && kHeadDim == 128 &&
                                          kHeadDimV == 128;
  static constexpr int kQStages =
      kNextQkEligible && 2 * kSmemBytesQ + kSmemBytesKV + kSmemBytesO + 2048 <= 227 * 1024 ? 2 : 1;

  struct TensorStorage {
    cute::array_aligned<Element, kQStages * cute::cosize_v<SmemLayoutQ>, 1024> smem_q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> smem_v;
  };

  struct DenseParams {
    TMA_Q tma_load_q;
    TMA_K tma_load_k;
    TMA_V tma_load_v;
    ShapeQKV shape_q, shape_k, shape_v;  // paged: k/v as (page_size, D, H_kv, pages)
  };
  // What the producer needs to find a key row: page = page_table[key / page_size], row within
  // it key % page_size. The K/V TMA descriptors above then span the pages.
  struct PagedKV {
    int const* page_table;
    int64_t page_table_batch_stride;
    cutlass::FastDivmod page_size;
    bool use_tma;  // every page holds whole n-blocks: TMA; otherwise gathered loads
    Element const* k;
    Element const* v;
    int64_t k_row_stride, k_page_stride, k_head_stride;
    int64_t v_row_stride, v_page_stride, v_head_stride;
    int head_dim, head_dim_v;  // the real ones: columns past them are zero-filled
  };
  struct PagedParams : DenseParams {
    PagedKV paged;
  };
  // The plain kernel keeps its parameter layout: paged fields exist only in paged kernels.
  using Params = std::conditional_t<kIsPaged, PagedParams, DenseParams>;

  // TMA when every page holds whole n-blocks; gathered loads otherwise.
  static bool use_paged_tma(FwdParams const& p) { return p.page_size % kBlockN == 0; }

  // The smallest power of two that is at least x.
  static constexpr int pow2_ceil(int x) { return x <= 1 ? 1 : 2 * pow2_ceil((x + 1) / 2); }

  // TMA needs every non-unit stride to be a multiple of 16 bytes; the stride of an extent-1
  // mode is never used, so any such value does.
  static int64_t tma_stride(int64_t stride, int64_t extent) {
    return extent > 1 ? stride : int64_t(16 / sizeof(Element));
  }

  static Params to_params(FwdParams const& p) {
    using namespace cute;
    bool const packed_q = p.cu_seqlens_q != nullptr;
    bool const packed_k = p.cu_seqlens_k != nullptr;
    // Extents are at least 1 so that the descriptors encode even when no row is ever loaded.
    int const rows_q = max(packed_q ? p.total_q : p.seqlen_q, 1);
    int rows_k = max(packed_k ? p.total_k : p.seqlen_k, 1);
    int const batch_q = packed_q ? 1 : p.batch;
    int batch_k = packed_k ? 1 : p.batch;
    if constexpr (kIsPaged) {
      rows_k = p.page_size;
      batch_k = max(p.total_k / p.page_size, 1);  // pages
    }
    ShapeQKV shape_q{rows_q, p.head_dim, p.num_heads, batch_q};
    ShapeQKV shape_k{rows_k, p.head_dim, p.num_heads_kv, batch_k};
    ShapeQKV shape_v{rows_k, p.head_dim_v, p.num_heads_kv, batch_k};
    StrideQKV stride_q{tma_stride(p.q_row_stride, rows_q), _1{},
                       tma_stride(p.q_head_stride, p.num_heads),
                       tma_stride(p.q_batch_stride, batch_q)};
    StrideQKV stride_k{tma_stride(p.k_row_stride, rows_k), _1{},
                       tma_stride(p.k_head_stride, p.num_heads_kv),
                       tma_stride(p.k_batch_stride, batch_k)};
    StrideQKV stride_v{tma_stride(p.v_row_stride, rows_k), _1{},
                       tma_stride(p.v_head_stride, p.num_heads_kv),
                       tma_stride(p.v_batch_stride, batch_k)};
    Tensor mQ = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.q)),
                            make_layout(shape_q, stride_q));
    Tensor mK = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.k)),
                            make_layout(shape_k, stride_k));
    Tensor mV = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.v)),
                            make_layout(shape_v, stride_v));
    DenseParams dense{
        make_tma_copy(SM90_TMA_LOAD{}, mQ, SmemLayoutQ{}, select<0, 2>(TileShapeQK{}), _1{}),
        make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(SmemLayoutK{}), select<1, 2>(TileShapeQK{}),
                      _1{}),
        make_tma_copy(SM90_TMA_LOAD{}, mV, take<0, 2>(SmemLayoutV{}), select<2, 1>(TileShapePV{}),
                      _1{}),
        shape_q,
        shape_k,
        shape_v};
    if constexpr (kIsPaged) {
      PagedKV paged{p.page_table,
                    p.page_table_batch_stride,
                    cutlass::FastDivmod(p.page_size),
                    use_paged_tma(p),
                    static_cast<Element const*>(p.k),
                    static_cast<Element const*>(p.v),
                    p.k_row_stride,
                    p.k_batch_stride,
                    p.k_head_stride,
                    p.v_row_stride,
                    p.v_batch_stride,
                    p.v_head_stride,
                    p.head_dim,
                    p.head_dim_v};
      return PagedParams{dense, paged};
    } else {
      return dense;
    }
  }

  CUTLASS_DEVICE static void prefetch_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_load_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_v.get_tma_descriptor());
  }

  // Q's buffers, used in turn: the Q of the CTA's tile number q (counting the tiles whose Q it
  // loads) goes to buffer q % kQStages, which the consumers hand back once per tile (empty, all
  // MMA threads arrive).
  struct QBarriers {
    cutlass::arch::ClusterTransactionBarrier full_[kQStages];
    cutlass::arch::ClusterBarrier empty_[kQStages];

    CUTLASS_DEVICE void init() {
      for (int i = 0; i < kQStages; ++i) {
        full_[i].init(/*arrive_count=*/1);
        empty_[i].init(/*arrive_count=*/kNumMmaThreads);
      }
    }
    CUTLASS_DEVICE static uint32_t phase(int q) { return uint32_t(q / kQStages) & 1; }
    CUTLASS_DEVICE cutlass::arch::ClusterTransactionBarrier& full(int q) { return full_[q % kQStages]; }
    CUTLASS_DEVICE cutlass::arch::ClusterBarrier& empty(int q) { return empty_[q % kQStages]; }
    // Producer, before loading tile q's Q: the consumers are done with the buffer's last use.
    CUTLASS_DEVICE void acquire(int q) {
      if (q >= kQStages) empty(q).wait(phase(q - kQStages));
    }
    CUTLASS_DEVICE void wait_full(int q) { full(q).wait(phase(q)); }
    CUTLASS_DEVICE void release(int q) { empty(q).arrive(); }
  };
  CUTLASS_DEVICE static Element* q_buffer(TensorStorage& storage, int q) {
    return storage.smem_q.data() + (q % kQStages) * cute::cosize_v<SmemLayoutQ>;
  }

  // Producer: called by one elected thread of the producer warp, once per tile with work;
  // `walk` (NBlockRange, FlexBlockWalk) gives the n-blocks in the order the consumers use them.
  template <class Walk>
  CUTLASS_DEVICE static void load(Params const& params, TensorStorage& storage,
                                  QBarriers& barrier_q, int q_loads, bool load_q,
                                  PipelineK& pipeline_k,
                                  PipelineV& pipeline_v, PipelineState& smem_pipe_write,
                                  SeqlenInfo const& seqlen, int m_block, int head, int head_kv,
                                  int batch, Walk walk) {
    using namespace cute;
    Tensor sQ = make_tensor(make_smem_ptr(q_buffer(storage, q_loads)), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
    int const batch_q = get<3>(params.shape_q) == 1 ? 0 : batch;
    int const batch_k = get<3>(params.shape_k) == 1 ? 0 : batch;
    Tensor mQ = params.tma_load_q.get_tma_tensor(params.shape_q)(_, _, head, batch_q);
    Tensor mK = params.tma_load_k.get_tma_tensor(params.shape_k)(_, _, head_kv, batch_k);
    Tensor mV = params.tma_load_v.get_tma_tensor(params.shape_v)(_, _, head_kv, batch_k);
    Tensor gQ = local_tile(domain_offset(make_coord(seqlen.offset_q, _0{}), mQ),
                           select<0, 2>(TileShapeQK{}), make_coord(m_block, _0{}));  // (M, D)
    Tensor gK = local_tile(domain_offset(make_coord(seqlen.offset_k, _0{}), mK),
                           select<1, 2>(TileShapeQK{}), make_coord(_, _0{}));  // (N, D, n_blocks)
    Tensor gV = local_tile(domain_offset(make_coord(seqlen.offset_k, _0{}), mV),
                           select<2, 1>(TileShapePV{}), make_coord(_, _0{}));  // (N, Dv, n_blocks)
    auto q_partition = tma_partition(params.tma_load_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                     group_modes<0, 2>(gQ));
    Tensor tQgQ = get<0>(q_partition);
    Tensor tQsQ = get<1>(q_partition);
    auto k_partition = tma_partition(params.tma_load_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                     group_modes<0, 2>(gK));
    auto v_partition = tma_partition(params.tma_load_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                     group_modes<0, 2>(gV));
    Tensor tKgK = get<0>(k_partition);  // (TMA, n_blocks)
    Tensor tKsK = get<1>(k_partition);  // (TMA, stages)
    Tensor tVgV = get<0>(v_partition);
    Tensor tVsV = get<1>(v_partition);

    using BarrierType = cutlass::arch::ClusterTransactionBarrier::ValueType;
    auto load_k = [&](int n_block) {
      pipeline_k.producer_acquire(smem_pipe_write);
      copy(params.tma_load_k.with(*pipeline_k.producer_get_barrier(smem_pipe_write), 0),
           tKgK(_, n_block), tKsK(_, smem_pipe_write.index()));
    };
    auto load_v = [&](int n_block) {
      pipeline_v.producer_acquire(smem_pipe_write);
      copy(params.tma_load_v.with(*pipeline_v.producer_get_barrier(smem_pipe_write), 0),
           tVgV(_, n_block), tVsV(_, smem_pipe_write.index()));
    };
    // With one Q buffer the first K goes out before waiting for it: it overlaps the previous
    // tile's tail. With two, Q goes first: its buffer was handed back a tile ago, and the MMA
    // warpgroups want it before the previous tile's epilogue. Packed GQA tiles (load_q false) have
    // their Q gathered by the MMA warpgroups.
    auto load_q_tile = [&] {
      if (!load_q) return;
      barrier_q.acquire(q_loads);
      barrier_q.full(q_loads).arrive_and_expect_tx(kTmaBytesQ);
      copy(params.tma_load_q.with(reinterpret_cast<BarrierType&>(barrier_q.full(q_loads)), 0), tQgQ,
           tQsQ);
    };
    int n_block = walk.first();
    if constexpr (kQStages > 1) load_q_tile();
    load_k(n_block);
    if constexpr (kQStages == 1) load_q_tile();
    load_v(n_block);
    ++smem_pipe_write;
    while (walk.next(n_block)) {
      load_k(n_block);
      load_v(n_block);
      ++smem_pipe_write;
    }
  }

  // Copies key rows [n_block * kBlockN, + kBlockN) of K or V (kDim columns, `dim` of them real)
  // into one pipeline stage `sX` (kBlockN, kDim), 16 bytes per cp.async; rows past seqlen_k and
  // columns past dim are zero-filled, so no page past the sequence is read.
  template <int kDim, class SmemTile>
  CUTLASS_DEVICE static void gather_block(PagedKV const& paged, int const* page_table,
                                          Element const* head_base, int64_t row_stride,
                                          int64_t page_stride, int dim, SmemTile sX, int n_block,
                                          int seqlen_k, int thread_idx) {
    constexpr int kElemsPerChunk = 16 / int(sizeof(Element));
    constexpr int kChunksPerRow = kDim / kElemsPerChunk;
    // Each thread keeps one column chunk: a row takes a power of two of threads (index math by
    // shifts), of which those past kChunksPerRow copy nothing.
    constexpr int kThreadsPerRow = pow2_ceil(kChunksPerRow);
    constexpr int kRowsPerPass = kNumGatherThreads / kThreadsPerRow;
    constexpr int kPasses = kBlockN / kRowsPerPass;
    // Rows in batches: a batch's page-table reads are all in flight before its copies are
    // issued, and the producer's register budget holds one batch of 64-bit offsets.
    constexpr int kBatch = kGatherBatch;
    static_assert(kNumGatherThreads % kThreadsPerRow == 0 && kBlockN % kRowsPerPass == 0 &&
                      kPasses % kBatch == 0,
                  "gathered loads: whole passes over the block");
    int const chunk = thread_idx % kThreadsPerRow;
    if (chunk >= kChunksPerRow) return;
    int const col = chunk * kElemsPerChunk;
    int const first_row = thread_idx / kThreadsPerRow;
#pragma unroll 1
    for (int pass = 0; pass < kPasses; pass += kBatch) {
      int64_t offset[kBatch];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kBatch; ++j) {
        // Rows past seqlen_k read the last key's page (always mapped) and are zero-filled.
        int const key =
            min(n_block * kBlockN + first_row + (pass + j) * kRowsPerPass, seqlen_k - 1);
        int page_idx, row_in_page;
        paged.page_size.fast_divmod(page_idx, row_in_page, key);
        offset[j] = int64_t(page_table[page_idx]) * page_stride + int64_t(row_in_page) * row_stride;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kBatch; ++j) {
        int const row = first_row + (pass + j) * kRowsPerPass;
        bool const valid = n_block * kBlockN + row < seqlen_k && col < dim;
        cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
            *reinterpret_cast<cute::uint128_t const*>(head_base + (valid ? offset[j] + col : 0)),
            *reinterpret_cast<cute::uint128_t*>(&sX(row, col)), valid);
      }
    }
  }

  // Producer for paged K/V. With TMA (paged.use_tma) it is called by one thread, as load;
  // otherwise by all kNumGatherThreads threads of the producer warpgroup (thread_idx), of which
  // `leader` alone issues Q's TMA. The pipelines' producer arrival counts match (kernel).
  template <class Walk>
  CUTLASS_DEVICE static void load_paged(Params const& params, TensorStorage& storage,
                                        QBarriers& barrier_q, int q_loads, bool load_q,
                                        PipelineK& pipeline_k,
                                        PipelineV& pipeline_v, PipelineState& smem_pipe_write,
                                        SeqlenInfo const& seqlen, int m_block, int head,
                                        int head_kv, int batch, Walk walk, int thread_idx,
                                        bool leader) {
    using namespace cute;
    PagedKV const& paged = params.paged;
    static_assert(kQStages == 1, "paged kernels keep one Q buffer");
    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
    int const batch_q = get<3>(params.shape_q) == 1 ? 0 : batch;
    Tensor mQ = params.tma_load_q.get_tma_tensor(params.shape_q)(_, _, head, batch_q);
    Tensor gQ = local_tile(domain_offset(make_coord(seqlen.offset_q, _0{}), mQ),
                           select<0, 2>(TileShapeQK{}), make_coord(m_block, _0{}));  // (M, D)
    auto [tQgQ, tQsQ] = tma_partition(params.tma_load_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                      group_modes<0, 2>(gQ));
    int const* page_table = paged.page_table + batch * paged.page_table_batch_stride;

    // TMA: an n-block lies inside one page (page_size is a multiple of kBlockN). Key rows of the
    // last n-block past seqlen_k are loaded as the page holds them: their scores are masked, but
    // a non-finite V there would still reach O (0 * inf); the gathered path zero-fills them.
    auto tma_block = [&](auto const& tma_load, ShapeQKV const& shape, auto tile_shape, auto& sX,
                         auto& pipeline, int n_block) {
      int page_idx, row_in_page;
      paged.page_size.fast_divmod(page_idx, row_in_page, n_block * kBlockN);
      Tensor mX = tma_load.get_tma_tensor(shape)(_, _, head_kv, page_table[page_idx]);
      Tensor gX = local_tile(mX, tile_shape, make_coord(_, _0{}));  // (N, D, blocks of a page)
      auto partition =
          tma_partition(tma_load, _0{}, Layout<_1>{}, group_modes<0, 2>(sX), group_modes<0, 2>(gX));
      pipeline.producer_acquire(smem_pipe_write);
      copy(tma_load.with(*pipeline.producer_get_barrier(smem_pipe_write), 0),
           get<0>(partition)(_, row_in_page / kBlockN),
           get<1>(partition)(_, smem_pipe_write.index()));
    };
    Element const* k_head = paged.k + head_kv * paged.k_head_stride;
    Element const* v_head = paged.v + head_kv * paged.v_head_stride;
    auto load_k = [&](int n_block) {
      if (paged.use_tma) {
        tma_block(params.tma_load_k, params.shape_k, select<1, 2>(TileShapeQK{}), sK, pipeline_k,
                  n_block);
      } else {
        pipeline_k.producer_acquire(smem_pipe_write);
        gather_block<kHeadDim>(paged, page_table, k_head, paged.k_row_stride, paged.k_page_stride,
                               paged.head_dim, sK(_, _, smem_pipe_write.index()), n_block,
                               seqlen.seqlen_k, thread_idx);
        pipeline_k.producer_commit(smem_pipe_write, cutlass::arch::cpasync_barrier_arrive_noinc);
      }
    };
    auto load_v = [&](int n_block) {
      if (paged.use_tma) {
        tma_block(params.tma_load_v, params.shape_v, select<2, 1>(TileShapePV{}), sV, pipeline_v,
                  n_block);
      } else {
        pipeline_v.producer_acquire(smem_pipe_write);
        gather_block<kHeadDimV>(paged, page_table, v_head, paged.v_row_stride, paged.v_page_stride,
                                paged.head_dim_v, sV(_, _, smem_pipe_write.index()), n_block,
                                seqlen.seqlen_k, thread_idx);
        pipeline_v.producer_commit(smem_pipe_write, cutlass::arch::cpasync_barrier_arrive_noinc);
      }
    };

    using BarrierType = cutlass::arch::ClusterTransactionBarrier::ValueType;
    // Same order as load: the first K before waiting for Q's buffer.
    int n_block = walk.first();
    load_k(n_block);
    if (load_q) {
      barrier_q.acquire(q_loads);
      if (leader) {
        barrier_q.full(q_loads).arrive_and_expect_tx(kTmaBytesQ);
        copy(params.tma_load_q.with(reinterpret_cast<BarrierType&>(barrier_q.full(q_loads)), 0),
             tQgQ, tQsQ);
      }
    }
    load_v(n_block);
    ++smem_pipe_write;
    while (walk.next(n_block)) {
      load_k(n_block);
      load_v(n_block);
      ++smem_pipe_write;
    }
  }

  // Packed GQA (pack_gqa_sm90.hpp): each MMA warpgroup gathers the 64 Q rows it multiplies,
  // 16 bytes per cp.async, tile row r from query row r / group of head head_kv * group +
  // r % group; rows past the sequence and columns past the real head dim are zero-filled, as
  // TMA does for the unpacked tiles. The warpgroup waits for its own copies only.
  CUTLASS_DEVICE static void load_q_packed(FwdParams const& p, TensorStorage& storage,
                                           SeqlenInfo const& seqlen, int m_block, int head_kv,
                                           int batch, PackGqa const& packing, int thread_idx) {
    using namespace cute;
    static_assert(kQStages == 1, "packed kernels keep one Q buffer");
    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
    constexpr int kElemsPerChunk = 16 / int(sizeof(Element));
    constexpr int kChunksPerRow = kHeadDim / kElemsPerChunk;
    constexpr int kWarpGroupRows = 64;
    constexpr int kThreads = cutlass::NumThreadsPerWarpGroup;
    static_assert((kWarpGroupRows * kChunksPerRow) % kThreads == 0, "whole passes over Q");
    int const warp_group = thread_idx / kThreads;
    int const lane = thread_idx % kThreads;
    Element const* q = static_cast<Element const*>(p.q) +
                       (p.cu_seqlens_q != nullptr ? int64_t(seqlen.offset_q) * p.q_row_stride
                                                  : int64_t(batch) * p.q_batch_stride);
    int const first_row = m_block * kBlockM + warp_group * kWarpGroupRows;
    // Not unrolled: unrolled, the per-copy rows and columns (functions of the thread alone) are
    // hoisted out of the tile loop and held through the mainloop, where they spill at hdim 256.
#pragma unroll 1
    for (int i = lane; i < kWarpGroupRows * kChunksPerRow; i += kThreads) {
      int const row = i / kChunksPerRow;
      int const col = (i % kChunksPerRow) * kElemsPerChunk;
      int query_row, head;
      packing.split(first_row + row, head_kv, query_row, head);
      bool const valid = first_row + row < seqlen.seqlen_q_range && col < p.head_dim;
      Element const* src =
          valid ? q + int64_t(query_row) * p.q_row_stride + int64_t(head) * p.q_head_stride + col
                : q;
      SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>::copy(
          *reinterpret_cast<uint128_t const*>(src),
          *reinterpret_cast<uint128_t*>(&sQ(warp_group * kWarpGroupRows + row, col)), valid);
    }
    cp_async_fence();
    cp_async_wait<0>();
    // The copies were generic-proxy writes; WGMMA reads shared memory through the async proxy.
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(kThreads, int(FwdNamedBarrier::kWarpGroupLocalWG0) + warp_group);
  }

  CUTLASS_DEVICE static void warp_scheduler_barrier_sync(int warp_group) {
    if constexpr (kNumMmaWarpGroups > 1) {
      cutlass::arch::NamedBarrier::sync(2 * cutlass::NumThreadsPerWarpGroup,
                                        int(FwdNamedBarrier::kWarpSchedulerWG0) + warp_group);
    }
  }

  CUTLASS_DEVICE static void warp_scheduler_barrier_arrive(int warp_group) {
    if constexpr (kNumMmaWarpGroups > 1) {
      int const next = warp_group + 1 == kNumMmaWarpGroups ? 0 : warp_group + 1;
      cutlass::arch::NamedBarrier::arrive(2 * cutlass::NumThreadsPerWarpGroup,
                                          int(FwdNamedBarrier::kWarpSchedulerWG0) + next);
    }
  }

  // The first warpgroup goes first: it passes its own scheduler barrier once.
  CUTLASS_DEVICE static void mma_init(int warp_group) {
    if constexpr (kNumMmaWarpGroups > 1) {
      if (warp_group == 0) {
        cutlass::arch::NamedBarrier::arrive(2 * cutlass::NumThreadsPerWarpGroup,
                                            int(FwdNamedBarrier::kWarpSchedulerWG0));
      }
    }
  }

  // The S accumulator of one warpgroup's rows (MMA, MMA_M, MMA_N).
  CUTLASS_DEVICE static auto make_fragment_s() {
    return cute::partition_fragment_C(TiledMmaQK{}, cute::select<0, 1>(TileShapeQK{}));
  }

  // The warpgroup index, warp-uniform. The shared-memory operands' WGMMA descriptors depend only
  // on the warpgroup, so they are sliced at its first thread: with the index known uniform,
  // ptxas keeps Q's descriptor in uniform registers instead of rebuilding it per thread around
  // every Q K^T.
  CUTLASS_DEVICE static int uniform_warp_group(int thread_idx) {
    return __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
  }

  // A tile's first S = Q K^T, issued (not waited for) in the warpgroup's turn: the first K stage
  // at smem_pipe_read (not consumed here: mma releases it) against Q of the CTA's tile number q.
  // mma issues it itself, or the kernel does under the previous tile's last P V (s_issued).
  // operands_ready false: no such tile is coming; the GEMM still runs, outside the turns and
  // without waiting, on whatever the buffers hold, and its result is never read.
  template <class TensorS>
  CUTLASS_DEVICE static void issue_first_qk(TensorStorage& storage, QBarriers& barrier_q, int q,
                                            bool q_by_tma, PipelineK& pipeline_k,
                                            PipelineState const& smem_pipe_read, TensorS& tSrS,
                                            int thread_idx, bool operands_ready = true) {
    using namespace cute;
    Tensor sQ = make_tensor(make_smem_ptr(q_buffer(storage, q)), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    TiledMmaQK tiled_mma_qk;
    int const warp_group = uniform_warp_group(thread_idx);
    auto wg_mma_qk = tiled_mma_qk.get_thread_slice(warp_group * cutlass::NumThreadsPerWarpGroup);
    Tensor tSrQ = wg_mma_qk.partition_fragment_A(sQ);
    Tensor tSrK = wg_mma_qk.partition_fragment_B(sK);
    if (operands_ready) {
      pipeline_k.consumer_wait(smem_pipe_read);
      if (q_by_tma) barrier_q.wait_full(q);
      warp_scheduler_barrier_sync(warp_group);
    }
    gemm</*kZeroInit=*/true, /*kWait=*/-1>(tiled_mma_qk, tSrQ,
                                           tSrK(_, _, _, smem_pipe_read.index()), tSrS);
    if (operands_ready) warp_scheduler_barrier_arrive(warp_group);
  }

  // Consumer: accumulates the unnormalised output of this thread's rows into tOrO and leaves
  // the running max/sum in softmax over the n-blocks of `walk` (at least one). q_loads: tiles
  // with work this CTA has done before this one. Hands Q's buffer back when release_q is set;
  // otherwise the caller does (when O reuses that buffer). The flex variant applies `mods`
  // (FlexTileMods: final scores, mask_mod on the blocks the walk marks); NoTileMods elsewhere.
  // zero_v_tail: zero the V rows past mask.seqlen_k in the boundary block (clear_v_tail).
  // tSrS: the S accumulator (make_fragment_s); s_issued: the tile's first Q K^T is already in
  // flight into it (issue_first_qk).
  // under_last_pv: called once the tile's last P V is issued and before it is waited for, with
  // nothing in registers but the softmax state to work on: work that reads neither tOrO nor P
  // (the row sums' reduction and the log-sum-exp of finalize, the next tile's first Q K^T) runs
  // under that GEMM instead of after it. It returns whether it issued a GEMM (into tSrS), and
  // then has waited for the P V itself, leaving that GEMM in flight.
  template <class TensorO, class TensorS, class Softmax, class Walk, class TileMods,
            class UnderLastPv>
  CUTLASS_DEVICE static void mma(TensorStorage& storage, QBarriers& barrier_q, int q_loads,
                                 bool q_by_tma, bool release_q, PipelineK& pipeline_k,
                                 PipelineV& pipeline_v,
                                 PipelineState& smem_pipe_read, TensorO& tOrO, TensorS& tSrS,
                                 bool s_issued, Softmax& softmax,
                                 FwdMask<kBlockM, kBlockN> const& mask, float softcap_scale,
                                 int thread_idx, int m_block, Walk walk, TileMods const& mods,
                                 bool zero_v_tail, UnderLastPv&& under_last_pv) {
    using namespace cute;
    Tensor sQ = make_tensor(make_smem_ptr(q_buffer(storage, q_loads)), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutVt{});
    int const warp_group = uniform_warp_group(thread_idx);

    TiledMmaQK tiled_mma_qk;
    TiledMmaPV tiled_mma_pv;
    auto thr_mma_qk = tiled_mma_qk.get_thread_slice(thread_idx);
    auto wg_mma_qk = tiled_mma_qk.get_thread_slice(warp_group * cutlass::NumThreadsPerWarpGroup);
    auto wg_mma_pv = tiled_mma_pv.get_thread_slice(warp_group * cutlass::NumThreadsPerWarpGroup);
    Tensor tSrQ = wg_mma_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K)
    Tensor tSrK = wg_mma_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stages)
    Tensor tOrV = wg_mma_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stages)
    Tensor tScS = thr_mma_qk.partition_C(make_identity_tensor(select<0, 1>(TileShapeQK{})));
    Tensor tOrP = make_tensor<Element>(acc_as_a_operand_layout(tSrS.layout()));

    // Softcap: s = softcap * tanh(s * scale / softcap); the outer softcap lives in scale_log2.
    auto scores_transform = [&](auto& scores) {
      if constexpr (kHasSoftcap) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(scores); ++i) scores(i) = tanh_approx(scores(i) * softcap_scale);
      }
    };

    int n_block = walk.first();
    float scores_scale[Softmax::kNumRows];
    constexpr bool kClearVTailBeforePvWait = kHeadDimV > 64 && kHeadDimV <= 128 && kStages >= 2;

    // Keys past the sequence in a boundary block have P = 0, but the V rows behind them (memory
    // past seqused_k, such as a cache's unused tail, or a paged cache's last page) may hold NaN or
    // Inf, and 0 * NaN is NaN in the P V GEMM. With zero_v_tail each warpgroup zeroes those rows
    // of block n_block's stage once its softmax is done, before the next iteration's P V GEMM
    // reads it (outside the warp scheduler's turn; it waits for V a little earlier than the GEMM
    // would). Both warpgroups write the same zeros, each before its own read, so neither can
    // read anything but zero there.
    // The one n-block with keys past the sequence, if it needs zeroing; -1 if none.
    int const v_tail_block = zero_v_tail && mask.seqlen_k % kBlockN != 0 ? mask.seqlen_k / kBlockN : -1;
    auto clear_v_tail = [&](PipelineState const& stage_v) {
      if (n_block != v_tail_block) return;
      int const valid = mask.seqlen_k - n_block * kBlockN;
      pipeline_v.consumer_wait(stage_v);
      int const stage = stage_v.index();
      Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
      zero_smem_rows<kBlockN, kHeadDimV>([&](int row, int col) { return &sV(row, col, stage); }, valid,
                                         thread_idx % cutlass::NumThreadsPerWarpGroup,
                                         cutlass::NumThreadsPerWarpGroup);
      cutlass::arch::fence_view_async_shared();  // the GEMM reads through the async proxy
      cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup,
                                        int(FwdNamedBarrier::kWarpGroupLocalWG0) + warp_group);
    };

    if (!s_issued) {
      issue_first_qk(storage, barrier_q, q_loads, q_by_tma, pipeline_k, smem_pipe_read, tSrS,
                     thread_idx);
    }
    warpgroup_wait<0>();
    trace::mark(thread_idx, trace::kFirstS);
    pipeline_k.consumer_release(smem_pipe_read);
    scores_transform(tSrS);
    if constexpr (kIsFlex) mods.score(tSrS, tScS, m_block, n_block);
    if (mask.needs_mask(m_block, n_block)) mask.apply(tSrS, tScS, m_block, n_block);
    if constexpr (kIsFlex) {
      if (walk.masked) mods.mask(tSrS, tScS, m_block, n_block);
    }
    softmax.template online</*kFirst=*/true>(tSrS, scores_scale);
    convert_into(tSrS, tOrP);
    clear(tOrO);
    trace::mark(thread_idx, trace::kFirstP);

    clear_v_tail(smem_pipe_read);
    PipelineState smem_pipe_read_v = smem_pipe_read;
    ++smem_pipe_read;
    while (walk.next(n_block)) {
      pipeline_k.consumer_wait(smem_pipe_read);
      warp_scheduler_barrier_sync(warp_group);
      gemm</*kZeroInit=*/true, /*kWait=*/-1>(tiled_mma_qk, tSrQ,
                                             tSrK(_, _, _, smem_pipe_read.index()), tSrS);
      if constexpr (!kRescaleAfterPv) softmax.rescale_o(tOrO, scores_scale);
      pipeline_v.consumer_wait(smem_pipe_read_v);
      gemm</*kZeroInit=*/false, /*kWait=*/-1>(tiled_mma_pv, tOrP,
                                              tOrV(_, _, _, smem_pipe_read_v.index()), tOrO);
      warp_scheduler_barrier_arrive(warp_group);
      warpgroup_wait<1>();  // S is ready; P V may still run
      pipeline_k.consumer_release(smem_pipe_read);
      scores_transform(tSrS);
      if constexpr (kIsFlex) mods.score(tSrS, tScS, m_block, n_block);
      if (mask.needs_mask(m_block, n_block)) mask.apply(tSrS, tScS, m_block, n_block);
      if constexpr (kIsFlex) {
        if (walk.masked) mods.mask(tSrS, tScS, m_block, n_block);
      }
      softmax.template online</*kFirst=*/false>(tSrS, scores_scale);
      // The clear's branch ends ptxas's scheduling region, so the wait for this warpgroup's
      // P V stays after the softmax instead of being hoisted above it (the softmax then runs
      // under that GEMM). It writes block n_block's V stage, which the in-flight P V (the
      // walk's previous block, in another stage) does not read. At hdimV 256 the longer live
      // ranges spill. With one stage both blocks share it, and the clear's wait for V(n_block)
      // would wait on the release of V(previous) that follows it. At hdimV 64 the P V GEMM is
      // too short to hide the softmax and the later wait measured 2-4% slower (H100); at 128 it
      // gains 1-3% alone, 3-4% with the uniform descriptors and the epilogue's changes
      // (bench/results/fwd_sm90_v42_levers_ab_h100.txt).
      if constexpr (kClearVTailBeforePvWait) clear_v_tail(smem_pipe_read);
      warpgroup_wait<0>();
      pipeline_v.consumer_release(smem_pipe_read_v);
      convert_into(tSrS, tOrP);
      if constexpr (kRescaleAfterPv) softmax.rescale_o(tOrO, scores_scale);
      if constexpr (!kClearVTailBeforePvWait) clear_v_tail(smem_pipe_read);
      smem_pipe_read_v = smem_pipe_read;
      ++smem_pipe_read;
    }
    trace::mark(thread_idx, trace::kLoopEnd);
    if (release_q) barrier_q.release(q_loads);  // every Q K^T of this tile has completed
    // (kRescaleAfterPv: the last iteration did it; a tile of one n-block has O cleared.)
    if constexpr (!kRescaleAfterPv) softmax.rescale_o(tOrO, scores_scale);
    pipeline_v.consumer_wait(smem_pipe_read_v);
    gemm</*kZeroInit=*/false, /*kWait=*/-1>(tiled_mma_pv, tOrP,
                                            tOrV(_, _, _, smem_pipe_read_v.index()), tOrO);
    if (!under_last_pv()) warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    pipeline_v.consumer_release(smem_pipe_read_v);
  }
};

}  // namespace cuflash::sm90
