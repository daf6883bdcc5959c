// Forward epilogue: the normalised O goes registers -> shared memory (stmatrix, reusing Q's
// buffer) -> global memory in 16-byte vectors, predicated on the rows this sequence owns,
// which covers packed (varlen) tails without a separate path. LSE goes straight from registers.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "api/params.hpp"
#include "sm90/mainloop_fwd_sm90.hpp"
#include "sm90/seqlen_info.hpp"
#include "sm90/utils_sm90.hpp"

namespace cuflash::sm90 {

template <class Config>
struct EpilogueFwdSm90 {
  using Element = typename Config::Element;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kHeadDimV = Config::kHeadDimV;
  static constexpr int kNumMmaThreads = Config::kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;

  using SmemLayoutAtomO =
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<
               cute::GMMA::Major::K, Element, cute::Int<kBlockM>, cute::Int<kHeadDimV>>());
  using SmemLayoutO = decltype(cute::tile_to_shape(
      SmemLayoutAtomO{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDimV>>{}));
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

  // tOrO: normalised fp32 output of this thread; lse: per thread row (natural log).
  // smem_release: arrived on once this thread has read O back from shared memory, when O's
  // buffer is Q's (null otherwise).
  template <class TensorO, class TiledMmaPV, int kRows>
  CUTLASS_DEVICE static void store(FwdParams const& p, Element* smem_o, TensorO const& tOrO,
                                   float const (&lse)[kRows], TiledMmaPV const& tiled_mma_pv,
                                   int thread_idx, SeqlenInfo const& seqlen, int m_block, int head,
                                   int batch, cutlass::arch::ClusterBarrier* smem_release) {
    using namespace cute;
    Tensor sO = make_tensor(make_smem_ptr(smem_o), SmemLayoutO{});

    // LSE: one thread of each quad writes the quad's rows.
    auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
    Tensor tOcO =
        thr_mma_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
    Tensor tOcO_rowcol = make_tensor(tOcO.data(), acc_rowcol_layout(tOcO.layout()));
    if (p.lse != nullptr && thread_idx % 4 == 0) {
      float* lse_ptr =
          p.cu_seqlens_q != nullptr
              ? p.lse + int64_t(head) * p.lse_head_stride + seqlen.offset_q
              : p.lse + int64_t(batch) * p.lse_batch_stride + int64_t(head) * p.lse_head_stride;
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < kRows; ++m) {
        int const row = m_block * kBlockM + get<0>(tOcO_rowcol(m, 0));
        if (row < seqlen.seqlen_q_range) lse_ptr[row] = lse[m];
      }
    }

    Tensor tOrO_out = make_tensor<Element>(tOrO.layout());
    convert_into(tOrO, tOrO_out);
    auto smem_tiled_copy_O = make_tiled_copy_C(SmemCopyAtomO{}, tiled_mma_pv);
    auto smem_thr_copy_O = smem_tiled_copy_O.get_thread_slice(thread_idx);
    Tensor taccOrO = smem_thr_copy_O.retile_S(tOrO_out);
    Tensor taccOsO = smem_thr_copy_O.partition_D(sO);
    // Every warpgroup must be done with the buffer (its last Q K^T when O reuses Q's buffer,
    // its reads of the previous tile's O otherwise) before any thread overwrites it.
    cutlass::arch::NamedBarrier::sync(kNumMmaThreads, int(FwdNamedBarrier::kEpilogue));
    copy(smem_tiled_copy_O, taccOrO, taccOsO);
    cutlass::arch::NamedBarrier::sync(kNumMmaThreads, int(FwdNamedBarrier::kEpilogue));

    Element* out_ptr = static_cast<Element*>(p.out) + int64_t(head) * p.o_head_stride +
                       (p.cu_seqlens_q != nullptr ? int64_t(seqlen.offset_q) * p.o_row_stride
                                                  : int64_t(batch) * p.o_batch_stride);
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

  // Split-KV: this split's normalised output and lse in fp32, straight from registers, into
  // out_partial (splits, rows, H, Dv) and lse_partial (splits, rows, H), rows = B * Sq or total_q
  // (the layout src/api allocates and the combine kernel reads).
  template <class TensorO, class TiledMmaPV, int kRows>
  CUTLASS_DEVICE static void store_partial(FwdParams const& p, TensorO const& tOrO,
                                           float const (&lse)[kRows],
                                           TiledMmaPV const& tiled_mma_pv, int thread_idx,
                                           SeqlenInfo const& seqlen, int m_block, int head,
                                           int batch, int split) {
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
      int const row = m_block * kBlockM + get<0>(coords(m, 0));
      if (row >= seqlen.seqlen_q_range) continue;
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
