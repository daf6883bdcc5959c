// Forward epilogue: the normalised O goes registers -> shared memory (stmatrix, into its own
// buffer or Q's, see the kernel's kSeparateO) -> global memory, by one of two paths:
// - TMA store (dense O with its own buffer and 16-byte aligned base and strides): one thread of
//   each MMA warpgroup issues a bulk tensor store of that warpgroup's 64 rows, and the warpgroup
//   goes on to the next tile while it drains, without waiting for the other warpgroups. The
//   descriptor's bounds are the output's (seqlen_q, head_dim_v), so rows past
//   seqlen_q in the last m-block and columns past the real head dim are clipped by TMA.
// - 16-byte vector stores by every consumer thread, predicated on the rows this sequence owns,
//   which covers packed (varlen) tails, whose next rows belong to the next sequence, and O in
//   Q's buffer, whose next Q load must not wait for a store to drain.
// LSE goes straight from registers. Packed GQA tiles (pack_gqa_sm90.hpp) take the vector path
// with an address per row: their rows are (query row, head) pairs.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cstdint>
#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <type_traits>

#include "api/params.hpp"
#include "sm90/mainloop_fwd_sm90.hpp"
#include "sm90/pack_gqa_sm90.hpp"
#include "sm90/seqlen_info.hpp"
#include "sm90/utils_sm90.hpp"

namespace cuflash::sm90 {

template <class Config>
struct EpilogueFwdSm90 {
  using Element = typename Config::Element;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kHeadDimV = Config::kHeadDimV;
  static constexpr int kNumMmaThreads = Config::kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr bool kPackGqa = Config::kPackGqa;

  // (query row, head) of tile row `row` of a tile of head `tile_head` (the kv head when packed).
  CUTLASS_DEVICE static void place_row(PackGqa const& packing, int row, int tile_head,
                                       int& query_row, int& head) {
    if constexpr (kPackGqa) {
      packing.split(row, tile_head, query_row, head);
    } else {
      query_row = row;
      head = tile_head;
    }
  }

  using SmemLayoutAtomO =
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<
               cute::GMMA::Major::K, Element, cute::Int<kBlockM>, cute::Int<kHeadDimV>>());
  // Each warpgroup's 64 rows are one contiguous SmemLayoutOWarpGroup block (its own TMA store
  // source). Within it the row atoms come first, so that the TMA store moves 64-row boxes: one
  // box per 64 columns (2 at hdimV 128) instead of one per 8 rows and 64 columns (16). At
  // hdimV 256 rows first spills; there the head-dim atoms come first.
  static constexpr int kWarpGroupRows = 64;
  static_assert(kBlockM % kWarpGroupRows == 0);
  static constexpr bool kRowsFirstO = kHeadDimV <= 192;
  using SmemLayoutOWarpGroup = decltype(cute::tile_to_shape(
      SmemLayoutAtomO{}, cute::Shape<cute::Int<kWarpGroupRows>, cute::Int<kHeadDimV>>{},
      std::conditional_t<kRowsFirstO, cute::Step<cute::_1, cute::_2>,
                         cute::Step<cute::_2, cute::_1>>{}));
  // The warpgroups' blocks one after another: row r is row r % 64 of block r / 64.
  using SmemLayoutO = decltype(cute::blocked_product(
      SmemLayoutOWarpGroup{},
      cute::make_layout(cute::Shape<cute::Int<kBlockM / kWarpGroupRows>, cute::_1>{})));
  using SmemCopyAtomO = cute::Copy_Atom<cute::SM90_U32x4_STSM_N, Element>;

  // Global stores: 16 bytes per thread, a power-of-two number of threads per row.
  static constexpr int kElemsPerVector = 16 / sizeof(Element);
  static constexpr int kBlockKGmem = kHeadDimV % 128 == 0 ? 128 : (kHeadDimV % 64 == 0 ? 64 : 32);
  static constexpr int kThreadsPerRow = kBlockKGmem / kElemsPerVector;
  static_assert(kNumMmaThreads % kThreadsPerRow == 0);
  using GmemLayoutAtom = cute::Layout<
      cute::Shape<cute::Int<kNumMmaThreads / kThreadsPerRow>, cute::Int<kThreadsPerRow>>,
      cute::Stride<cute::Int<kThreadsPerRow>, cute::_1>>;
  using GmemTiledCopyO = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<128>, Element>{},
      GmemLayoutAtom{}, cute::Layout<cute::Shape<cute::_1, cute::Int<kElemsPerVector>>>{}));

  // TMA store of O over (seqlen_q, head_dim_v, heads, batch); split-KV kernels write fp32
  // partials from registers instead and have no descriptor.
  static constexpr bool kHasTmaStore = !Config::kIsSplit;
  using ShapeO = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideO = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using TileShapeOWarpGroup = cute::Shape<cute::Int<kWarpGroupRows>, cute::Int<kHeadDimV>>;
  using TMA_O = decltype(cute::make_tma_copy(
      cute::SM90_TMA_STORE{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeO{}, StrideO{}),
      SmemLayoutOWarpGroup{}, TileShapeOWarpGroup{}, cute::_1{}));
  struct TmaStoreParams {
    TMA_O tma_store_o;
    ShapeO shape_o;
    bool use_tma_store;  // dense O with 16-byte aligned base and strides
  };
  struct NoTmaStoreParams {};
  using Params = std::conditional_t<kHasTmaStore, TmaStoreParams, NoTmaStoreParams>;

  // Per warpgroup, the thread that issues the TMA store of its rows and waits for it: lane 0
  // of its last warp.
  static constexpr int kTmaStoreLane = cutlass::NumThreadsPerWarpGroup - cutlass::NumThreadsPerWarp;

  static Params to_params(FwdParams const& p) {
    using namespace cute;
    if constexpr (kHasTmaStore) {
      using Mainloop = MainloopFwdSm90<Config>;
      // Extents are at least 1 so that the descriptor encodes even when no tile is stored.
      int const rows = max(p.seqlen_q, 1);
      ShapeO const shape_o{rows, p.head_dim_v, p.num_heads, p.batch};
      StrideO const stride_o{Mainloop::tma_stride(p.o_row_stride, rows), _1{},
                             Mainloop::tma_stride(p.o_head_stride, p.num_heads),
                             Mainloop::tma_stride(p.o_batch_stride, p.batch)};
      // Packed O (cu_seqlens_q) takes the vector path: a tile's rows past its sequence belong to
      // the next one, and the descriptor's bounds are the whole output's.
      bool const aligned = reinterpret_cast<std::uintptr_t>(p.out) % 16 == 0 &&
                           (get<0>(stride_o) * int64_t(sizeof(Element))) % 16 == 0 &&
                           (get<2>(stride_o) * int64_t(sizeof(Element))) % 16 == 0 &&
                           (get<3>(stride_o) * int64_t(sizeof(Element))) % 16 == 0;
      bool const use_tma_store = p.cu_seqlens_q == nullptr && aligned;
      // An unaligned output (which dispatch refuses before any launch) gets a never-used
      // descriptor over one aligned row so that encoding does not fail.
      Element* const base =
          reinterpret_cast<Element*>(reinterpret_cast<std::uintptr_t>(p.out) & ~std::uintptr_t(15));
      int64_t const unit = Mainloop::tma_stride(0, 1);
      Tensor mO =
          aligned ? make_tensor(make_gmem_ptr(base), make_layout(shape_o, stride_o))
                  : make_tensor(make_gmem_ptr(base), make_layout(ShapeO{1, p.head_dim_v, 1, 1},
                                                                 StrideO{unit, _1{}, unit, unit}));
      return {make_tma_copy(SM90_TMA_STORE{}, mO, SmemLayoutOWarpGroup{}, TileShapeOWarpGroup{},
                            _1{}),
              shape_o, use_tma_store};
    } else {
      return {};
    }
  }

  CUTLASS_DEVICE static void prefetch_descriptors(Params const& params) {
    if constexpr (kHasTmaStore) {
      if (params.use_tma_store)
        cute::prefetch_tma_descriptor(params.tma_store_o.get_tma_descriptor());
    }
  }

  // Before the CTA exits, the last TMA store must have read O's shared memory.
  CUTLASS_DEVICE static void store_tail(int thread_idx) {
    if constexpr (kHasTmaStore) {
      if (thread_idx % cutlass::NumThreadsPerWarpGroup == kTmaStoreLane) cute::tma_store_wait<0>();
    }
  }

  // tOrO: normalised fp32 output of this thread; lse: per thread row (natural log).
  // kSeparateO: O has its own shared-memory buffer (the TMA path needs it); otherwise smem_o is
  // Q's buffer and smem_release is arrived on once this thread has read O back from it (null
  // when the tile loaded no Q).
  //
  // Shared-memory protocol of the TMA path (O's own buffer, one tile after another), per MMA
  // warpgroup: each writes, and stores by TMA, only its own 64 rows, so nothing here makes the
  // warpgroups wait for each other and the pingpong offset between them carries over the tile
  // boundary (one's epilogue runs under the other's last P V and first Q K^T of the next tile).
  //   1. The warpgroup's store thread (kTmaStoreLane) waits (cp.async.bulk.wait_group.read 0)
  //      until its previous store has read its rows of sO; the warpgroup's named barrier then
  //      holds the warpgroup until it has.
  //   2. Every thread writes its part of O (stmatrix) and fences its writes to the async proxy
  //      (fence.proxy.async.shared::cta); the named barrier again makes them all visible.
  //   3. The store thread issues the store of the 64 rows and commits it; nobody waits for it
  //      here: the warpgroup starts the next tile while it drains, and step 1 of the next
  //      epilogue (or store_tail at exit) is where it must have read sO.
  // Q's buffer is untouched, so the producer's next Q load does not depend on the store.
  template <bool kSeparateO, class TensorO, class TiledMmaPV, int kRows>
  CUTLASS_DEVICE static void store(Params const& params, FwdParams const& p, Element* smem_o,
                                   TensorO const& tOrO, float const (&lse)[kRows],
                                   TiledMmaPV const& tiled_mma_pv, int thread_idx,
                                   SeqlenInfo const& seqlen, int m_block,
                                   PackGqa const& packing, int head, int batch,
                                   cutlass::arch::ClusterBarrier* smem_release) {
    using namespace cute;
    Tensor sO = make_tensor(make_smem_ptr(smem_o), SmemLayoutO{});
    constexpr bool packed = kPackGqa;

    // LSE: one thread of each quad writes the quad's rows. On the TMA path after O's store is
    // issued: the proxy fence before it (MEMBAR) waits for this thread's earlier global stores,
    // so LSE stores issued before it would put their latency on the warpgroup's path.
    auto store_lse = [&]() {
      auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
      Tensor tOcO =
          thr_mma_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
      Tensor tOcO_rowcol = make_tensor(tOcO.data(), acc_rowcol_layout(tOcO.layout()));
      if (p.lse != nullptr && thread_idx % 4 == 0) {
        float* lse_ptr = p.cu_seqlens_q != nullptr ? p.lse + seqlen.offset_q
                                                   : p.lse + int64_t(batch) * p.lse_batch_stride;
        CUTLASS_PRAGMA_UNROLL
        for (int m = 0; m < kRows; ++m) {
          int const row = m_block * kBlockM + get<0>(tOcO_rowcol(m, 0));
          int query_row, row_head;
          place_row(packing, row, head, query_row, row_head);
          if (row < seqlen.seqlen_q_range)
            lse_ptr[int64_t(row_head) * p.lse_head_stride + query_row] = lse[m];
        }
      }
    };

    Tensor tOrO_out = make_tensor<Element>(tOrO.layout());
    convert_into(tOrO, tOrO_out);
    auto smem_tiled_copy_O = make_tiled_copy_C(SmemCopyAtomO{}, tiled_mma_pv);
    auto smem_thr_copy_O = smem_tiled_copy_O.get_thread_slice(thread_idx);
    Tensor taccOrO = smem_thr_copy_O.retile_S(tOrO_out);
    Tensor taccOsO = smem_thr_copy_O.partition_D(sO);

    if constexpr (kSeparateO && kHasTmaStore) {
      if (params.use_tma_store && !packed) {
        int const warp_group = thread_idx / cutlass::NumThreadsPerWarpGroup;
        bool const store_thread = thread_idx % cutlass::NumThreadsPerWarpGroup == kTmaStoreLane;
        int const barrier = int(FwdNamedBarrier::kWarpGroupLocalWG0) + warp_group;
        // This warpgroup's previous store has read its rows of sO (step 1 above).
        if (store_thread) tma_store_wait<0>();
        cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, barrier);
        copy(smem_tiled_copy_O, taccOrO, taccOsO);
        tma_store_fence();  // this thread's stmatrix writes, seen by the TMA unit
        cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, barrier);
        if (store_thread) {
          constexpr int kWarpGroups = kBlockM / kWarpGroupRows;
          Tensor sO_rows = make_tensor(
              make_smem_ptr(smem_o + warp_group * cute::cosize_v<SmemLayoutOWarpGroup>),
              SmemLayoutOWarpGroup{});
          Tensor mO = params.tma_store_o.get_tma_tensor(params.shape_o)(_, _, head, batch);
          Tensor gO = local_tile(mO, TileShapeOWarpGroup{},
                                 make_coord(m_block * kWarpGroups + warp_group, _0{}));
          auto block_tma_o = params.tma_store_o.get_slice(_0{});
          copy(params.tma_store_o, block_tma_o.partition_S(sO_rows), block_tma_o.partition_D(gO));
          tma_store_arrive();
        }
        store_lse();
        return;
      }
    }
    store_lse();

    // Every warpgroup must be done with the buffer (its last Q K^T when O reuses Q's buffer,
    // its reads of the previous tile's O otherwise) before any thread overwrites it.
    cutlass::arch::NamedBarrier::sync(kNumMmaThreads, int(FwdNamedBarrier::kEpilogue));
    copy(smem_tiled_copy_O, taccOrO, taccOsO);
    cutlass::arch::NamedBarrier::sync(kNumMmaThreads, int(FwdNamedBarrier::kEpilogue));

    Element* out_ptr = static_cast<Element*>(p.out) +
                       (p.cu_seqlens_q != nullptr ? int64_t(seqlen.offset_q) * p.o_row_stride
                                                  : int64_t(batch) * p.o_batch_stride);
    if constexpr (packed) {
      store_packed_rows(p, sO, out_ptr, thread_idx, seqlen, m_block, packing, head, smem_release);
      return;
    }
    out_ptr += int64_t(head) * p.o_head_stride;
    Tensor mO = make_tensor(make_gmem_ptr(out_ptr),
                            make_layout(make_shape(seqlen.seqlen_q_range, Int<kHeadDimV>{}),
                                        make_stride(p.o_row_stride, _1{})));
    Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(m_block, _0{}));
    GmemTiledCopyO gmem_tiled_copy_O;
    auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(thread_idx);
    Tensor tOsO = gmem_thr_copy_O.partition_S(sO);  // (CPY, CPY_M, CPY_K)
    Tensor tOgO = gmem_thr_copy_O.partition_D(gO);
    Tensor tOcO_gmem =
        gmem_thr_copy_O.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
    Tensor tOrO_gmem = make_fragment_like(tOsO);
    copy(gmem_tiled_copy_O, tOsO, tOrO_gmem);
    if (smem_release != nullptr) smem_release->arrive();
    int const rows_left = seqlen.seqlen_q_range - m_block * kBlockM;
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < size<1>(tOgO); ++m) {
      if (get<0>(tOcO_gmem(0, m, 0)) < rows_left) {
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < size<2>(tOgO); ++k) {
          // Head dims below the kernel's (rounded-up) one: store only the real columns.
          if (get<1>(tOcO_gmem(0, m, k)) < p.head_dim_v)
            copy(gmem_tiled_copy_O, tOrO_gmem(_, m, k), tOgO(_, m, k));
        }
      }
    }
  }

  // Packed GQA: O from shared memory to each row's own (query row, head) in global memory.
  template <class SmemTensorO>
  CUTLASS_DEVICE static void store_packed_rows(FwdParams const& p, SmemTensorO const& sO,
                                               Element* out_ptr, int thread_idx,
                                               SeqlenInfo const& seqlen, int m_block,
                                               PackGqa const& packing, int head_kv,
                                               cutlass::arch::ClusterBarrier* smem_release) {
    using namespace cute;
    GmemTiledCopyO gmem_tiled_copy_O;
    auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(thread_idx);
    Tensor tOsO = gmem_thr_copy_O.partition_S(sO);  // (CPY, CPY_M, CPY_K)
    Tensor tOcO_gmem =
        gmem_thr_copy_O.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
    Tensor tOrO_gmem = make_fragment_like(tOsO);
    copy(gmem_tiled_copy_O, tOsO, tOrO_gmem);
    if (smem_release != nullptr) smem_release->arrive();
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < size<1>(tOrO_gmem); ++m) {
      int const row = m_block * kBlockM + get<0>(tOcO_gmem(0, m, 0));
      if (row >= seqlen.seqlen_q_range) continue;
      int query_row, head;
      packing.split(row, head_kv, query_row, head);
      Element* row_ptr =
          out_ptr + int64_t(query_row) * p.o_row_stride + int64_t(head) * p.o_head_stride;
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < size<2>(tOrO_gmem); ++k) {
        int const col = get<1>(tOcO_gmem(0, m, k));
        if (col < p.head_dim_v) {
          Tensor dst = make_tensor(make_gmem_ptr(row_ptr + col),
                                   make_layout(Int<kElemsPerVector>{}));
          copy(AutoVectorizingCopyWithAssumedAlignment<128>{}, tOrO_gmem(_, m, k), dst);
        }
      }
    }
  }

  // Split-KV: this split's normalised output and lse in fp32, straight from registers, into
  // out_partial (splits, rows, H, Dv) and lse_partial (splits, rows, H), rows = B * Sq or total_q
  // (the layout src/api allocates and the combine kernel reads).
  template <class TensorO, class TiledMmaPV, int kRows>
  CUTLASS_DEVICE static void store_partial(FwdParams const& p, TensorO const& tOrO,
                                           float const (&lse)[kRows],
                                           TiledMmaPV const& tiled_mma_pv, int thread_idx,
                                           SeqlenInfo const& seqlen, int m_block,
                                           PackGqa const& packing, int tile_head, int batch,
                                           int split) {
    using namespace cute;
    auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
    Tensor tOcO =
        thr_mma_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
    Tensor coords = make_tensor(tOcO.data(), acc_rowcol_layout(tOcO.layout()));
    Tensor out = make_tensor(tOrO.data(), acc_rowcol_layout(tOrO.layout()));
    bool const packed = p.cu_seqlens_q != nullptr;
    int64_t const rows_total = packed ? int64_t(p.total_q) : int64_t(p.batch) * p.seqlen_q;
    int64_t const first_row = int64_t(split) * rows_total +
                              (packed ? int64_t(seqlen.offset_q) : int64_t(batch) * p.seqlen_q);
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      int const tile_row = m_block * kBlockM + get<0>(coords(m, 0));
      if (tile_row >= seqlen.seqlen_q_range) continue;
      int row, head;
      place_row(packing, tile_row, tile_head, row, head);
      int64_t const row_head = (first_row + row) * p.num_heads + head;
      if (thread_idx % 4 == 0) p.lse_partial[row_head] = lse[m];
      float* out_row = p.out_partial + row_head * p.head_dim_v;
      // Columns come in adjacent pairs (the accumulator's innermost mode).
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(out); n += 2) {
        int const col = get<1>(coords(m, n));
        if (col < p.head_dim_v)
          *reinterpret_cast<float2*>(out_row + col) = make_float2(out(m, n), out(m, n + 1));
      }
    }
  }
};

}  // namespace cuflash::sm90
