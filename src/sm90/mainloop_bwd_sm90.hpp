// Backward mainloop for sm90: per column block (K, V resident in smem) the producer warp streams
// Q, dO (TMA) and lse_log2, dPsum (bulk copies) through two pipelines, and the MMA warpgroups run
//   S = Q K^T,  dP = dO V^T,  P = exp2(S * scale_log2 - lse_log2),  dS = P (dP - dPsum),
//   dV += P^T dO,  dK += dS^T Q,  dQ = dS K
// per row block. dQ goes to an fp32 accumulator in global memory: through smem and a bulk
// reduce-add issued by a second producer warp, or (when smem is short: hdim256) by atomics from
// registers; the sliced hdim256 kernels pass it in 4 KB pieces through a ring of smem slots to
// bulk reduce-adds instead (by default; dq_out_sm90.hpp).
// The fp32 accumulators in global memory hold each row block as one chunk in MMA-fragment order
// (value i of thread t of warpgroup w at w * chunk / NumMmaWG + (i / 4) * 512 + t * 4 + i % 4),
// which the postprocess kernel reads back with the same MMA partitioning.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "sm90/dq_accum_start_sm90.hpp"
#include "sm90/flash_bwd_dq_clear_sm90.hpp"
#include "sm90/dq_out_sm90.hpp"
#include "sm90/flex_bwd_sm90.hpp"
#include "sm90/trace_sm90.hpp"
#include "sm90/tile_size_bwd_sm90.hpp"
#include "sm90/utils_sm90.hpp"
#include "variants/variant.hpp"

namespace cuflash::sm90::bwd {

using namespace cute;

// 80- and 40-wide tiles need the WGMMA N extents that are not powers of two.
static_assert(is_same_v<decltype(GMMA::ss_op_selector<cutlass::half_t, cutlass::half_t, float, Shape<_64, _80, _16>>()),
                        GMMA::MMA_64x80x16_F32F16F16_SS<GMMA::Major::K, GMMA::Major::K>>,
              "compile with -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (cmake/CuflashKernels.cmake sets it)");

// Named barriers of the backward kernel (CUTLASS offsets the ids past its reserved ones).
enum class BwdBarrier : uint32_t {
  kPdS = 0,       // MMA warpgroups: P / dS written to smem
  kEpilogue = 1,  // MMA warpgroups: dK / dV staging and dK / dV atomics ordering
  kDqEmpty = 2,   // + warpgroup index (3 at most): dQ smem free for the MMA warpgroup
  kDqFull = 5,    // + warpgroup index: dQ smem filled, the reduce warp may issue the copy
  // Kernels with dQ by atomics (no dQ smem), deterministic with the dQ order warp:
  kDqReady = 2,  // the order warp found the row block's turn: the MMA warpgroups may add
  kDqDone = 3,   // the MMA warpgroups issued the row block's atomics: the order warp releases it
  // The sliced kernels with dQ through shared memory (CUFLASH_BWD_DQ=bulk) hand their slots over
  // on mbarriers (dq_out_sm90.hpp), and take kDqEmpty + 2 for:
  kDqLanded = 4,  // deterministic: both dQ warps' copies of the row block have landed
};

// ---------------------------------------------------------------------------------------------
// Small register-tensor helpers.

// View of an sm90 WGMMA accumulator ((2, 2, V), MMA_M, MMA_N) as (rows, cols) of the logical
// S tile; `Transposed` when the MMA computed the transpose (swapped operands).
template <bool Transposed, class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol_layout(Layout const& acc) {
  static_assert(decltype(rank<0>(acc))::value == 3, "expected a WGMMA accumulator layout");
  auto rows = make_layout(get<0, 1>(acc), get<1>(acc));
  auto cols = make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc));
  if constexpr (!Transposed) {
    return make_layout(rows, cols);
  } else {
    return make_layout(cols, rows);
  }
}

// The accumulator of one WGMMA reused as the 16-bit register A operand of the next:
// ((2, 2, V), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (V / 2, MMA_N)).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_a_operand_layout(Layout const& acc) {
  auto v = logical_divide(get<0, 2>(acc), Int<2>{});  // (2, V / 2)
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0>(v)), get<1>(acc),
                     make_layout(get<1>(v), get<2>(acc)));
}

template <class EngineIn, class LayoutIn, class EngineOut, class LayoutOut>
CUTE_DEVICE void convert_fragment(Tensor<EngineIn, LayoutIn> const& in, Tensor<EngineOut, LayoutOut>& out) {
  using From = typename EngineIn::value_type;
  using To = typename EngineOut::value_type;
  constexpr int N = decltype(size(in))::value;
  static_assert(N == decltype(size(out))::value);
  auto const& src = *reinterpret_cast<cutlass::Array<From, N> const*>(in.data());
  auto& dst = *reinterpret_cast<cutlass::Array<To, N>*>(out.data());
  dst = cutlass::NumericArrayConverter<To, From, N, cutlass::FloatRoundStyle::round_to_nearest>{}(src);
}

template <bool IsA, class ThrMma, class SmemTensor>
CUTE_DEVICE auto mma_operand_fragment(ThrMma const& thr_mma, SmemTensor const& s) {
  if constexpr (IsA) {
    return thr_mma.partition_fragment_A(s);
  } else {
    return thr_mma.partition_fragment_B(s);
  }
}

// One warpgroup-wide GEMM C (+)= A B over all k blocks, committed as one WGMMA batch.
// wg_wait >= 0 waits until at most that many batches are in flight.
template <bool ZeroInit, int WgWait, bool SwapAB, class TiledMma, class TA, class TB, class TC>
CUTE_DEVICE void wgmma_gemm(TiledMma tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC) {
  if constexpr (SwapAB) {
    wgmma_gemm<ZeroInit, WgWait, false>(tiled_mma, tCrB, tCrA, tCrC);
  } else {
    constexpr bool kAInRegs = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
    if constexpr (kAInRegs) { warpgroup_fence_operand(const_cast<TA&>(tCrA)); }
    warpgroup_fence_operand(tCrC);
    warpgroup_arrive();
    if constexpr (ZeroInit) { tiled_mma.accumulate_ = GMMA::ScaleOut::Zero; }
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
      cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    if constexpr (WgWait >= 0) { warpgroup_wait<WgWait>(); }
    warpgroup_fence_operand(tCrC);
    if constexpr (kAInRegs) { warpgroup_fence_operand(const_cast<TA&>(tCrA)); }
  }
}

// Part `Slice` of `NumSlices` equal parts of mode 1 (MMA_M) of an MMA fragment (V, MMA_M, X):
// the same rank, mode 1 narrowed, same registers / descriptors.
template <int Slice, int NumSlices, class T>
CUTE_DEVICE auto mma_m_slice(T&& t) {
  constexpr int kM = decltype(size<1>(t))::value;
  static_assert(kM % NumSlices == 0 && Slice < NumSlices);
  Tensor d = logical_divide(static_cast<T&&>(t), make_tile(Underscore{}, Int<kM / NumSlices>{}));
  return d(_, make_coord(_, Int<Slice>{}), _);
}

// wgmma_gemm on one slice of the MMA's M extent: the rows [Slice * M / NumSlices, ...) of each
// warpgroup's accumulator and of the operand on the M side (B when the operands are swapped).
template <bool ZeroInit, int WgWait, bool SwapAB, int Slice, int NumSlices, class TiledMma, class TA, class TB, class TC>
CUTE_DEVICE void wgmma_gemm_m_slice(TiledMma tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC) {
  auto tCrC_s = mma_m_slice<Slice, NumSlices>(tCrC);
  if constexpr (SwapAB) {
    wgmma_gemm<ZeroInit, WgWait, false>(tiled_mma, mma_m_slice<Slice, NumSlices>(tCrB), tCrA, tCrC_s);
  } else {
    wgmma_gemm<ZeroInit, WgWait, false>(tiled_mma, mma_m_slice<Slice, NumSlices>(tCrA), tCrB, tCrC_s);
  }
}

// fp32 add of `bytes` from smem into global memory, completed asynchronously (bulk group).
CUTE_DEVICE void bulk_reduce_add_f32(float const* smem_src, float* gmem_dst, int bytes) {
  uint32_t const smem = cute::cast_smem_ptr_to_uint(smem_src);
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(gmem_dst), "r"(smem), "r"(bytes) : "memory");
}

// Plain copy of `bytes` from smem into global memory, completed asynchronously (bulk group).
CUTE_DEVICE void bulk_store_f32(float const* smem_src, float* gmem_dst, int bytes) {
  uint32_t const smem = cute::cast_smem_ptr_to_uint(smem_src);
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
               ::"l"(gmem_dst), "r"(smem), "r"(bytes) : "memory");
}

// dq_accum without a clear (BwdParams::dq_tickets): per row block and MMA warpgroup half of its
// chunk, a ticket that the preprocess zeroes. The column block that takes it first stores its
// half (plain bulk copies) and, once they have landed, sets kDqTicketLanded with release; every
// later one waits for that bit (acquire, then a proxy fence: the add is an async-proxy write
// ordered after the store only through generic-proxy synchronisation) before its bulk
// reduce-add, so that no add reaches the chunk before the store. Deterministic runs order the
// writers by their semaphores already: rank 0 stores and sets the bit, the others add. The
// postprocess reads a ticket left at 0 as a half that no column block wrote (zeros). Saves the
// memset of dq_accum (134 MB at 16k tokens, hidden 2048: 42 us on the H100).
// Every wait ends because the walks that take tickets ascend: a first writer of row block m needs
// only its own MMA warpgroups' dQ of m. In the sliced kernels those also meet their sibling
// warpgroup at the P / dS barrier, whose dQ warp may wait for another column block's first store
// of an earlier row block; that chain of owners runs down the row blocks and ends. Walks that do
// not ascend (Params::dq_rotate_window: without a window, the column blocks of a head start spread
// over the row blocks so that they reach each one apart) take the ticket late, once the first
// piece of their dQ for the row block is in shared memory: from there a first writer's stores of
// that row block need nothing from outside its CTA (its MMA warpgroups have passed the step's
// P / dS barrier, and its dQ warps free their own slots), so they land whatever order the walks
// take, and a later writer waits only for a writer that has started. Before that they peek at the
// ticket: a row block already landed is added to without taking it. (The deterministic rotation
// orders its writers by ranks and never takes tickets.)
// kDqTicketLanded: dq_accum_start_sm90.hpp (a ticket set to it before the kernel: a cleared row block).
CUTE_DEVICE int dq_ticket_take(int* ticket) {
  int old;
  asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(ticket) : "memory");
  return old;
}
CUTE_DEVICE void dq_ticket_land(int* ticket) {
  asm volatile("red.release.gpu.global.or.b32 [%0], %1;\n" ::"l"(ticket), "r"(kDqTicketLanded) : "memory");
}
CUTE_DEVICE void dq_ticket_await(int const* ticket) {
  int value;
  while (true) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(ticket) : "memory");
    if (value & kDqTicketLanded) break;
    __nanosleep(64);
  }
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Whether a first writer's store of the ticket's row block has landed (acquire, then the proxy
// fence as in dq_ticket_await), without taking the ticket.
CUTE_DEVICE bool dq_ticket_landed(int const* ticket) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(ticket) : "memory");
  if (!(value & kDqTicketLanded)) { return false; }
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  return true;
}

// ---------------------------------------------------------------------------------------------
// Per-batch sequence geometry (dense, cu_seqlens, seqused).

struct BwdSeqlen {
  int offset_q, offset_k;                // first row of this batch in q / k (packed) or 0
  int offset_q_padded, offset_k_padded;  // first row of this batch in the workspace rows
  int seqlen_q, seqlen_k;                // rows in use (seqused caps)
  int capacity_q, capacity_k;            // rows the batch owns; gradients of unused rows are 0

  template <int kBlockM, int kBlockN, class Params>
  CUTE_DEVICE static BwdSeqlen make(Params const& p, int b) {
    BwdSeqlen s;
    bool const varlen_q = p.cu_seqlens_q != nullptr;
    bool const varlen_k = p.cu_seqlens_k != nullptr;
    s.offset_q = varlen_q ? p.cu_seqlens_q[b] : 0;
    s.offset_k = varlen_k ? p.cu_seqlens_k[b] : 0;
    s.offset_q_padded = varlen_q ? (s.offset_q + b * kBlockM) / kBlockM * kBlockM
                                 : b * ((p.seqlen_q + kBlockM - 1) / kBlockM * kBlockM);
    s.offset_k_padded = varlen_k ? (s.offset_k + b * kBlockN) / kBlockN * kBlockN
                                 : b * ((p.seqlen_k + kBlockN - 1) / kBlockN * kBlockN);
    s.capacity_q = varlen_q ? p.cu_seqlens_q[b + 1] - s.offset_q : p.seqlen_q;
    s.capacity_k = varlen_k ? p.cu_seqlens_k[b + 1] - s.offset_k : p.seqlen_k;
    // seqused past the batch's rows is capped, as the reference does (no row past them is read).
    s.seqlen_q = p.seqused_q ? min(p.seqused_q[b], s.capacity_q) : s.capacity_q;
    s.seqlen_k = p.seqused_k ? min(p.seqused_k[b], s.capacity_k) : s.capacity_k;
    return s;
  }
};

// Row blocks [min, max) that see column block n_block, under the bottom-right aligned window
// (window_left / window_right already made finite by the host when unbounded).
template <int kBlockM, int kBlockN, bool HasWindow>
CUTE_DEVICE cute::tuple<int, int> m_block_range(BwdSeqlen const& s, int n_block, int window_left, int window_right) {
  if (n_block * kBlockN >= s.seqlen_k) { return {0, 0}; }  // keys past seqused_k
  int m_block_max = (s.seqlen_q + kBlockM - 1) / kBlockM;
  int m_block_min = 0;
  if constexpr (HasWindow) {
    int const diag = s.seqlen_q - s.seqlen_k;  // row = col + diag on the diagonal
    int const first_row = n_block * kBlockN + diag - window_right;
    m_block_min = first_row <= 0 ? 0 : first_row / kBlockM;
    int const col_last = cute::min((n_block + 1) * kBlockN, s.seqlen_k) - 1;
    int const last_row = col_last + diag + window_left;
    m_block_max = cute::min(m_block_max, last_row < 0 ? 0 : last_row / kBlockM + 1);
  }
  return {m_block_min, m_block_max};
}

// First column block that sees row block m_block: the rank of a column block among the
// contributors to that row block's dQ is n_block minus this.
template <int kBlockM, int kBlockN, bool HasWindow>
CUTE_DEVICE int n_block_first(BwdSeqlen const& s, int m_block, int window_left) {
  if constexpr (!HasWindow) {
    return 0;
  } else {
    int const first_col = m_block * kBlockM + s.seqlen_k - s.seqlen_q - window_left;
    return first_col <= 0 ? 0 : first_col / kBlockN;
  }
}

// Last column block that sees row block m_block (before capping at the last block with keys):
// the mirror of n_block_first, consistent with m_block_range.
template <int kBlockM, int kBlockN, bool HasWindow>
CUTE_DEVICE int n_block_last(BwdSeqlen const& s, int m_block, int window_right) {
  int const num_n_blocks = (s.seqlen_k + kBlockN - 1) / kBlockN;
  if constexpr (!HasWindow) {
    return num_n_blocks - 1;
  } else {
    int const last_col = (m_block + 1) * kBlockM - 1 - (s.seqlen_q - s.seqlen_k) + window_right;
    return last_col < 0 ? -1 : cute::min(num_n_blocks - 1, last_col / kBlockN);
  }
}

// ---------------------------------------------------------------------------------------------

// Variant_: variants::NoVariant (plain) or variants::FlexVariant (score_mod, mask_mod, block
// sparsity; instantiated with HasWindow, since causal / local stay runtime choices in it).
template <class Element_, int kHeadDim_, int kHeadDimV_, bool HasWindow_, bool HasSoftcap_,
          class Variant_ = variants::NoVariant>
struct MainloopBwdSm90 {
  using Element = Element_;
  using ElementAccum = float;
  using Variant = Variant_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr bool HasWindow = HasWindow_;
  static constexpr bool HasSoftcap = HasSoftcap_;
  static constexpr bool kIsFlex = Variant::kIsFlex;
  static_assert(!kIsFlex || HasWindow, "the flex variant has the window built in");
  // d score / d (softmax_scale * <q, k>) per element, applied to dS: softcap's 1 - tanh^2 times
  // the score_mod's derivative, unless both are 1.
  static constexpr bool kHasScoreGrad = HasSoftcap || !Variant::kUnitScoreGrad;

  static constexpr BwdTile kTile =
      bwd_tile(kHeadDim, kHeadDimV, HasWindow, kHasScoreGrad, kIsFlex, Variant::kBlockListTile);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int NumMmaWG = kTile.num_mma_wg;
  static constexpr int NumMmaThreads = NumMmaWG * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kStagesQ = 2;
  static constexpr int kStagesdO = kTile.stages_do;
  static constexpr int kStagesdS = kTile.stages_ds;
  static constexpr bool SdP_swapAB = kTile.sdp_swap_ab;
  static constexpr bool dKV_swapAB = kTile.dkv_swap_ab;
  static constexpr bool dQ_swapAB = kTile.dq_swap_ab;
  static constexpr int AtomMSdP = kTile.atom_m_sdp;
  static constexpr int AtomNdKV = kTile.atom_n_dkv;
  static constexpr int AtomMdQ = kTile.atom_m_dq;
  static_assert(NumMmaWG % AtomMSdP == 0 && NumMmaWG % AtomNdKV == 0 && NumMmaWG % AtomMdQ == 0);
  static_assert(kStagesdS == 1 || kStagesdS == kStagesQ);
  static_assert(kStagesdO == 1 || kStagesdO == kStagesQ);
  static constexpr bool kSameStages = kStagesdO == kStagesQ;

  // dV = P^T dO and dK = dS^T Q take P^T / dS^T straight from the S / dP accumulators when
  // each warpgroup holds whole rows of S^T that match its rows of dK / dV.
  static constexpr bool Mma_dKV_is_RS = AtomMSdP == 1 && AtomNdKV == NumMmaWG && SdP_swapAB && !dKV_swapAB;

  // --- MMAs ---
  template <int M, int N, int K>
  using TS = Shape<Int<M>, Int<N>, Int<K>>;

  using TileShapeAtomSdP = std::conditional_t<!SdP_swapAB, TS<kBlockM, kBlockN / (NumMmaWG / AtomMSdP), kHeadDim>,
                                              TS<kBlockN, kBlockM / AtomMSdP, kHeadDim>>;
  using AtomLayoutSdP = std::conditional_t<!SdP_swapAB, Layout<Shape<Int<AtomMSdP>, Int<NumMmaWG / AtomMSdP>, _1>>,
                                           Layout<Shape<Int<NumMmaWG / AtomMSdP>, Int<AtomMSdP>, _1>>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, TileShapeAtomSdP>(), AtomLayoutSdP{}));

  template <int kD>
  using TileShapeAtomdKV = std::conditional_t<!dKV_swapAB, TS<kBlockN, kD / (NumMmaWG / AtomNdKV), kBlockM>,
                                              TS<kD / (NumMmaWG / AtomNdKV), kBlockN / AtomNdKV, kBlockM>>;
  using AtomLayoutdKV = std::conditional_t<!dKV_swapAB, Layout<Shape<Int<AtomNdKV>, Int<NumMmaWG / AtomNdKV>, _1>>,
                                           Layout<Shape<Int<NumMmaWG / AtomNdKV>, Int<AtomNdKV>, _1>>>;
  // P / dS live in smem K-major (kBlockN contiguous); their transposes are MN-major operands.
  template <int kD>
  using TiledMmadKVFor = decltype(make_tiled_mma(
      std::conditional_t<Mma_dKV_is_RS,
                         decltype(GMMA::rs_op_selector<Element, Element, ElementAccum, TileShapeAtomdKV<kD>,
                                                       GMMA::Major::K, GMMA::Major::MN>()),
                         decltype(GMMA::ss_op_selector<Element, Element, ElementAccum, TileShapeAtomdKV<kD>,
                                                       GMMA::Major::MN, GMMA::Major::MN>())>{},
      AtomLayoutdKV{}));
  using TiledMmadK = TiledMmadKVFor<kHeadDim>;
  using TiledMmadV = TiledMmadKVFor<kHeadDimV>;

  using TileShapeAtomdQ = std::conditional_t<!dQ_swapAB, TS<kBlockM, kHeadDim / (NumMmaWG / AtomMdQ), kBlockN>,
                                             TS<kHeadDim, kBlockM / AtomMdQ, kBlockN>>;
  using AtomLayoutdQ = std::conditional_t<!dQ_swapAB, Layout<Shape<Int<AtomMdQ>, Int<NumMmaWG / AtomMdQ>, _1>>,
                                          Layout<Shape<Int<NumMmaWG / AtomMdQ>, Int<AtomMdQ>, _1>>>;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, TileShapeAtomdQ,
                           !dQ_swapAB ? GMMA::Major::K : GMMA::Major::MN, !dQ_swapAB ? GMMA::Major::MN : GMMA::Major::K>(),
      AtomLayoutdQ{}));

  // --- Shared memory layouts ---
  // Swizzle atoms are chosen for the narrowest per-warpgroup extent in which each tile is used
  // as an MN-major operand (Q and dO in dK / dV, K in dQ).
  template <int MN, int K>
  using SmemAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<MN>, Int<K>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomK<kBlockM, kHeadDim / (NumMmaWG / AtomNdKV)>{},
                                             make_shape(Int<kBlockM>{}, Int<kHeadDim>{}, Int<kStagesQ>{})));
  using SmemLayoutdO = decltype(tile_to_shape(SmemAtomK<kBlockM, kHeadDimV / (NumMmaWG / AtomNdKV)>{},
                                              make_shape(Int<kBlockM>{}, Int<kHeadDimV>{}, Int<kStagesdO>{})));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK<kBlockN, kHeadDim / (NumMmaWG / AtomMdQ)>{},
                                             make_shape(Int<kBlockN>{}, Int<kHeadDim>{})));
  // V: also the staging of dV in the epilogue, whose warpgroups write kHeadDimV / (NumMmaWG /
  // AtomNdKV) columns each (96 in the 64-key hdim192 flex tile: 64-byte swizzle atoms).
  using SmemLayoutV = decltype(tile_to_shape(SmemAtomK<kBlockN, kHeadDimV / (NumMmaWG / AtomNdKV)>{},
                                             make_shape(Int<kBlockN>{}, Int<kHeadDimV>{})));
  using SmemLayoutPdS = decltype(tile_to_shape(SmemAtomK<kBlockM / AtomMSdP, kBlockN / (NumMmaWG / AtomMSdP)>{},
                                               make_shape(Int<kBlockM>{}, Int<kBlockN>{}, Int<kStagesdS>{})));
  // Transposed views (same memory).
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(make_shape(Int<kHeadDim>{}, Int<kBlockM>{}, Int<kStagesQ>{}),
                                 make_stride(Int<kBlockM>{}, _1{}, Int<kBlockM * kHeadDim>{}))));
  using SmemLayoutdOt = decltype(composition(
      SmemLayoutdO{}, make_layout(make_shape(Int<kHeadDimV>{}, Int<kBlockM>{}, Int<kStagesdO>{}),
                                  make_stride(Int<kBlockM>{}, _1{}, Int<kBlockM * kHeadDimV>{}))));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(make_shape(Int<kHeadDim>{}, Int<kBlockN>{}), make_stride(Int<kBlockN>{}, _1{}))));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_layout(make_shape(Int<kBlockN>{}, Int<kBlockM>{}, Int<kStagesdS>{}),
                                   make_stride(Int<kBlockM>{}, _1{}, Int<kBlockM * kBlockN>{}))));
  // Row statistics; each stage starts 128-byte aligned for the bulk copy.
  static constexpr int kStatsStride = (kBlockM + 31) / 32 * 32;
  using SmemLayoutLSE = Layout<Shape<Int<kBlockM>, Int<kStagesQ>>, Stride<_1, Int<kStatsStride>>>;
  using SmemLayoutdPsum = Layout<Shape<Int<kBlockM>, Int<kStagesdO>>, Stride<_1, Int<kStatsStride>>>;

  // P / dS register -> smem: stmatrix, transposing when the accumulator holds S^T.
  static constexpr int kPdSPerThread = kBlockM * kBlockN / NumMmaThreads;
  using SmemCopyAtomPdS = Copy_Atom<
      std::conditional_t<!SdP_swapAB,
                         std::conditional_t<kPdSPerThread % 8 == 0, SM90_U32x4_STSM_N, SM90_U32x2_STSM_N>,
                         std::conditional_t<kPdSPerThread % 8 == 0, SM90_U16x8_STSM_T, SM90_U16x4_STSM_T>>,
      Element>;

  static constexpr int kDqChunk = kBlockM * kHeadDim;  // floats per row block in dq_accum

  template <class T, int N, int Align>
  using SmemArray = std::conditional_t<N == 0, cute::array<T, 0>, cute::array_aligned<T, N, Align>>;

  template <bool DqViaSmem>
  struct TensorStorageT {
    SmemArray<Element, cosize_v<SmemLayoutK>, 1024> k;
    SmemArray<Element, cosize_v<SmemLayoutV>, 1024> v;
    SmemArray<Element, cosize_v<SmemLayoutQ>, 1024> q;
    SmemArray<Element, cosize_v<SmemLayoutdO>, 1024> d_o;
    SmemArray<Element, cosize_v<SmemLayoutPdS>, 1024> ds;
    SmemArray<ElementAccum, cosize_v<SmemLayoutLSE>, 128> lse;
    SmemArray<ElementAccum, cosize_v<SmemLayoutdPsum>, 128> dpsum;
    // Last, so that the empty ones cost no alignment padding.
    SmemArray<Element, Mma_dKV_is_RS ? 0 : cosize_v<SmemLayoutPdS>, 1024> p;
    SmemArray<ElementAccum, DqViaSmem ? kDqChunk : 0, 128> dq;
  };
  // dQ goes through smem and a bulk reduce-add when its buffer fits next to everything else
  // (the kernel adds a few barriers), else by atomics from registers.
  static constexpr int kSmemLimit = 227 * 1024 - 128;
  static constexpr bool kDqViaSmem = sizeof(TensorStorageT<true>) <= kSmemLimit;
  using TensorStorage = TensorStorageT<kDqViaSmem>;
  static_assert(sizeof(TensorStorage) <= kSmemLimit, "tile does not fit in shared memory");

  // hdim 256 (FlashAttention-3's Slice_dQKV_Mma): the dV, dQ and dK MMAs each run as two halves
  // of the head dim (each warpgroup's MMA_M split in two), so that dQ^T is live 32 registers at a
  // time: dV_0, dQ_0, dV_1 | dQ_0 out | dK_0, dQ_1, dK_1 | dQ_1 out.
  static constexpr bool kSliceDQKV = kHeadDim == 256 && kHeadDimV == 256 && NumMmaWG == 2 && dQ_swapAB &&
                                     dKV_swapAB && AtomMdQ == 1 && AtomNdKV == 1 && !Mma_dKV_is_RS && !kDqViaSmem;

  // The bulk dQ path is compiled into every sliced kernel (with softcap too: since the dQ warps
  // serve one warpgroup each, ptxas fits it there without spills; it had spilled 4-8 bytes).
  static constexpr bool kHasDqBulk = kSliceDQKV;

  using PipelineQ = cutlass::PipelineTmaAsync<kStagesQ>;
  using PipelinedO = cutlass::PipelineTmaAsync<kStagesdO>;
  using PipelineStateQ = typename PipelineQ::PipelineState;
  using PipelineStatedO = typename PipelinedO::PipelineState;

  // Each MMA warpgroup's dQ ring (dq_out_sm90.hpp): kDqSlots slots of a quarter of a half slice
  // of its dQ^T (two float4 per thread, 4 KB), what a bulk copy adds; kDqPieces per row block.
  // Three fill the shared memory the tile leaves (227 KB).
  static constexpr int kDqSlots = 3;
  static constexpr int kDqPieces = 8;
  static constexpr int kDqSlotFloats = kHasDqBulk ? kDqChunk / NumMmaWG / kDqPieces : 0;
  struct NoDqSlots {
    CUTE_DEVICE void init() {}
  };
  using DqSlotStorage =
      std::conditional_t<kHasDqBulk, bwd::DqSlotStorage<kDqSlotFloats, kDqSlots, NumMmaWG>, NoDqSlots>;
  using DqBulkStage = bwd::DqBulkStage<kDqSlotFloats, cutlass::NumThreadsPerWarpGroup>;

  // --- TMA ---
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;  // (rows, d, head, batch)
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  template <class SmemLayout, class TileShape>
  using TmaLoad = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQKV{}),
      SmemLayout{}, TileShape{}, _1{}));
  using TMA_Q = TmaLoad<decltype(take<0, 2>(SmemLayoutQ{})), Shape<Int<kBlockM>, Int<kHeadDim>>>;
  using TMA_dO = TmaLoad<decltype(take<0, 2>(SmemLayoutdO{})), Shape<Int<kBlockM>, Int<kHeadDimV>>>;
  using TMA_K = TmaLoad<SmemLayoutK, Shape<Int<kBlockN>, Int<kHeadDim>>>;
  using TMA_V = TmaLoad<SmemLayoutV, Shape<Int<kBlockN>, Int<kHeadDimV>>>;

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesdO = kBlockM * kHeadDimV * sizeof(Element);
  static constexpr uint32_t kBytesK = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesV = kBlockN * kHeadDimV * sizeof(Element);
  static constexpr uint32_t kBytesStats = kBlockM * sizeof(ElementAccum);

  struct Params {
    TMA_Q tma_q;
    TMA_dO tma_do;
    TMA_K tma_k;
    TMA_V tma_v;
    ShapeQKV shape_q, shape_do, shape_k, shape_v;
    float const* lse_log2;  // (H, q_rows_padded)
    float const* dpsum;     // (H, q_rows_padded)
    float* dq_accum;        // (H, q_rows_padded, kHeadDim) in fragment-order chunks
    int* dq_semaphore;      // (H, q_rows_padded / kBlockM) x dq_semaphore_stride, deterministic only
    int dq_semaphore_stride;  // ints from one row block's semaphore to the next
    int q_rows_padded;
    int num_m_blocks;
    int seqlen_q, seqlen_k;  // dense lengths, or max lengths when packed
    int num_heads;
    int window_left, window_right;  // finite
    float softmax_scale_log2;       // with softcap: softcap * log2(e)
    float softcap_val;              // softmax_scale / softcap
    bool deterministic;
    // Launch order: 0: grid (column blocks, heads, batch); g >= 1: grid (g, column blocks,
    // num_head_groups * batch), heads g * (z % num_head_groups) + x (those past num_heads idle).
    int head_group;
    int num_head_groups;
    // The packed keys' column-block list (BwdParams::col_block_list, {sequence, column block}),
    // or null: the grid's column-block index (x, or y heads inner) is an entry of the list, and
    // its batch extent is 1 (block_coords in the kernel).
    int2 const* col_blocks;
    // Deterministic dQ by atomics (no dQ smem): the second producer warp waits for each row
    // block's turn and releases it (order_dq), off the MMA warpgroups' path.
    bool dq_order_warp;
    // Without a window, deterministic or with first stores (dq_tickets): the column blocks of a
    // rotation group start their walks spread over the row blocks (rotation_group, dq_rank), so
    // that they reach each row block one after another. 0: not rotated (ascending walks);
    // w > 0: a group is a head's column blocks within one window of w consecutively launched
    // CTAs (w at most the CTAs resident at once, since a block waits on others of its group
    // launched after it), so that a head split over two waves of CTAs rotates within each wave
    // and the later group adds after the earlier one (the launcher; CUFLASH_BWD_DET_WALK).
    int dq_rotate_window;
    // dQ through shared memory and bulk reduce-adds (sliced kernels), also keeping the
    // deterministic order (store_dq_bulk).
    bool dq_bulk;
    // (B, H) counters of the CTAs whose dQ sums have landed (BwdParams::dq_done), or null.
    int* dq_done;
    // Per (row block of the workspace rows, MMA warpgroup) the first-writer tickets of dq_accum
    // (kDqTicketLanded; BwdParams::dq_tickets), or null: dq_accum was cleared and every writer adds
    // (as also where dq_list_writers says the clear kernel ran).
    int* dq_tickets;
    // Block lists deciding on the device (dq_list_max_writers): the most column blocks the lists
    // give one row block (BlockSparseParams::max_row_writers), or null. Past dq_list_max_writers
    // flash_bwd_dq_clear_sm90 has cleared dq_accum and landed every ticket, and the kernel runs
    // without the ticket code, as after the memset.
    int const* dq_list_writers;
    int dq_list_max_writers;
    int const* cu_seqlens_q;
    int const* cu_seqlens_k;
    int const* seqused_q;
    int const* seqused_k;
    cutlass::FastDivmod qhead_per_kvhead;
    // Last, so that the plain kernel's parameters keep their offsets.
    typename Variant::Params flex;
  };

  struct Arguments {
    Element const* q;
    Element const* k;
    Element const* v;
    Element const* d_o;
    ShapeQKV shape_q, shape_do, shape_k, shape_v;
    StrideQKV stride_q, stride_do, stride_k, stride_v;
  };

  static Params to_params(Arguments const& a, Params p) {
    p.tma_q = make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(a.q), a.shape_q, a.stride_q),
                            take<0, 2>(SmemLayoutQ{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{});
    p.tma_do = make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(a.d_o), a.shape_do, a.stride_do),
                             take<0, 2>(SmemLayoutdO{}), Shape<Int<kBlockM>, Int<kHeadDimV>>{}, _1{});
    p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(a.k), a.shape_k, a.stride_k), SmemLayoutK{},
                            Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
    p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(a.v), a.shape_v, a.stride_v), SmemLayoutV{},
                            Shape<Int<kBlockN>, Int<kHeadDimV>>{}, _1{});
    p.shape_q = a.shape_q;
    p.shape_do = a.shape_do;
    p.shape_k = a.shape_k;
    p.shape_v = a.shape_v;
    return p;
  }

  CUTE_DEVICE static void prefetch_tma_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
  }

  // The rotation group of column block n_block (Params::dq_rotate_window, no window): column blocks [lo,
  // lo + size) of its head, whose walks start at row blocks (n - lo) * M / size over the M row
  // blocks; size 0 where the walks are not rotated. Column blocks of earlier groups add first.
  struct RotationGroup {
    int lo = 0, size = 0, num_m_blocks = 0;
  };
  CUTE_DEVICE static RotationGroup rotation_group(Params const& p, BwdSeqlen const& seq, int n_block, int head,
                                                  int batch) {
    RotationGroup g;
    if constexpr (!HasWindow && !kIsFlex) {
      if (p.dq_rotate_window <= 0) { return g; }
      // Over the row blocks the walks visit: at most max_seqlen_q's (make_walk).
      int const num_m = cute::min((seq.seqlen_q + kBlockM - 1) / kBlockM, p.num_m_blocks);
      // Over the column blocks launched: at most max_seqlen_k's (a hint below a sequence's keys).
      int const num_n = cute::min((seq.seqlen_k + kBlockN - 1) / kBlockN, (p.seqlen_k + kBlockN - 1) / kBlockN);
      if (n_block >= num_n) { return g; }
      // Launches without a window are (column block, head, batch) grids, or with the column-block
      // list (entry, head, 1) ones whose entries run over a sequence's column blocks ascending:
      // the launch index of the head's column block 0 (the launcher rotates only grids of fewer
      // than 2^31 CTAs).
      int const window = p.dq_rotate_window;
      int const base = (int(blockIdx.z) * int(gridDim.y) + int(blockIdx.y)) * int(gridDim.x) + int(blockIdx.x) - n_block;
      int const first = (base + n_block) / window * window;
      int const lo = cute::max(first - base, 0);
      int const hi = cute::min(first + window - base, num_n);
      // Start row blocks (n - lo) * M / size are distinct only when size <= M; otherwise the
      // group walks ascending (its ranks lo + (n - lo) are the ascending ones too).
      if (hi - lo <= num_m) { g = {lo, hi - lo, num_m}; }
    }
    return g;
  }

  // The m-blocks that column block n_block visits; the producer, the dQ warps and the MMA
  // warpgroups each make the same walk.
  CUTE_DEVICE static auto make_walk(Params const& p, BwdSeqlen const& seq, int n_block, int head, int batch) {
    auto [m_block_min, m_block_max] = m_block_range<kBlockM, kBlockN, HasWindow>(seq, n_block, p.window_left, p.window_right);
    // A packed sequence longer than max_seqlen_q (a hint the host cannot check against device
    // cu_seqlens) walks only the row blocks the hint counts, as the forward computes only those:
    // the preprocess and the deterministic semaphores are laid out for no more.
    m_block_max = cute::min(m_block_max, p.num_m_blocks);
    if constexpr (kIsFlex) {
      // Deterministic: the ranks count only the column blocks whose walks visit the row block
      // (dq_rank_flex), so the row blocks a mask_mod or the lists leave out take no turn.
      return FlexColumnWalk<kBlockM, kBlockN>::make(p.flex, seq.seqlen_k, batch, head, n_block, m_block_min,
                                                     m_block_max);
    } else {
      RotationGroup const g = m_block_min < m_block_max ? rotation_group(p, seq, n_block, head, batch) : RotationGroup{};
      int const start = g.size > 0 ? (n_block - g.lo) * g.num_m_blocks / g.size : m_block_min;
      return MBlockRange<!HasWindow>::make(m_block_min, m_block_max, start);
    }
  }

  // The last column block that sees row block m_block among those launched: a packed sequence
  // with more keys than max_seqlen_k (a hint the host cannot check against device cu_seqlens) has
  // no CTA for the column blocks past the hint's, so the deterministic ranks must not wait on them.
  CUTE_DEVICE static int last_launched_n_block(Params const& p, BwdSeqlen const& seq, int m_block) {
    return cute::min(n_block_last<kBlockM, kBlockN, HasWindow>(seq, m_block, p.window_right),
                     (p.seqlen_k + kBlockN - 1) / kBlockN - 1);
  }

  // Deterministic dQ: the place of column block n_block among the contributors to row block
  // m_block's sum, which adds in that order (a semaphore per row block counts the adds). The
  // order is the one in which the column blocks reach the row block when they run side by side,
  // so that a CTA finds its predecessor done rather than waiting:
  //  - causal / local: the column block that starts on the row block adds first, then the ones
  //    to its left (descending n); the kernel launches a head's column blocks from the last down,
  //    so the blocks waited on are always launched earlier.
  //  - no window, rotated: the groups in order; within a group, the block that started closest
  //    below the row block first, then the group's others cyclically downwards.
  //  - otherwise (no window, not rotated): ascending n, every block starting at row block 0.
  // g: rotation_group of the column block, found once per walk.
  CUTE_DEVICE static int dq_rank(Params const& p, BwdSeqlen const& seq, RotationGroup const& g, int n_block,
                                 int m_block) {
    if constexpr (HasWindow) {
      return last_launched_n_block(p, seq, m_block) - n_block;
    } else {
      if (g.size == 0) { return n_block; }
      // The group's last column block whose start row block (n - lo) * M / size is <= m_block.
      int const first = cute::min(g.size - 1, ((m_block + 1) * g.size + g.num_m_blocks - 1) / g.num_m_blocks - 1);
      int const local = n_block - g.lo;
      return g.lo + (local <= first ? first - local : first + g.size - local);
    }
  }

  // Deterministic flex kernels with block lists: whether column block n is listed for row block
  // m_block's list row (nonzero), from the row-major copy of the classes when there is one (a
  // warp's 32 column blocks in one line).
  CUTE_DEVICE static int listed_class(BlockSparseParams const& bs, int m_block, int n, int head, int batch) {
    long long const head_lists = static_cast<long long>(batch) * bs.num_heads_b + (bs.num_heads_b == 1 ? 0 : head);
    int const row = m_block * kBlockM / bs.block_m;
    int const col = n * kBlockN / bs.block_n;
    return bs.row_class_by_row != nullptr
               ? bs.row_class_by_row[(head_lists * bs.num_row_blocks + row) * bs.num_col_blocks + col]
               : bs.row_class[(head_lists * bs.num_col_blocks + col) * bs.num_row_blocks + row];
  }

  // The class bytes a flex rank counts with block lists, loaded a row block ahead (by the dQ warps,
  // under the previous row block's adds) so that their L2 round trips are not between a release
  // and the next turn's poll: there they took 1.3 us of the deterministic dQ warp's 3.7 us step
  // on causal lists at hdim128 8k, against 0.4 us for the plain kernels' arithmetic rank
  // (bench/NOTES.md). Holds the first kRankChunks chunks of 32 column blocks (16k keys with
  // hdim128's 128-key column blocks); dq_rank_flex loads any further ones itself.
  static constexpr int kRankChunks = 4;
  struct RankLoads {
    uint32_t listed = 0;  // bit c: this lane's column block of chunk c is listed
  };
  CUTE_DEVICE static RankLoads rank_loads(Params const& p, BwdSeqlen const& seq, int n_block, int m_block, int head,
                                          int batch) {
    RankLoads loads;
    if constexpr (kIsFlex) {
      BlockSparseParams const& bs = p.flex.block_sparse;
      if (bs.row_class != nullptr) {
        int const last = last_launched_n_block(p, seq, m_block);
        int const lane = int(threadIdx.x) % cutlass::NumThreadsPerWarp;
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < kRankChunks; ++c) {
          int const n = n_block + 1 + c * cutlass::NumThreadsPerWarp + lane;
          if (n <= last && listed_class(bs, m_block, n, head, batch) != 0) { loads.listed |= 1u << c; }
        }
      }
    }
    return loads;
  }

  // Deterministic flex kernels: the contributors to row block m_block's dQ are the window's
  // column blocks whose walks visit it -- those whose row-block classes name it with block lists
  // (the walks read the same table; `loads` holds the first bytes, rank_loads), else those whose
  // mask_mod row_range keeps it (the same make_walk) -- so the rank counts only those from
  // n_block_last down, and a row block that a walk leaves out costs that column block nothing.
  // The whole warp counts, 32 column blocks a step. Without lists or mask_mod every column block
  // of the window visits: dq_rank.
  CUTE_DEVICE static int dq_rank_flex(Params const& p, BwdSeqlen const& seq, int n_block, int m_block, int head,
                                      int batch, RankLoads const& loads) {
    BlockSparseParams const& bs = p.flex.block_sparse;
    int const last = last_launched_n_block(p, seq, m_block);
    int const lane = int(threadIdx.x) % cutlass::NumThreadsPerWarp;
    int rank = 0;
    if (bs.row_class != nullptr) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kRankChunks; ++c) { rank += __popc(__ballot_sync(0xffffffffu, (loads.listed >> c) & 1u)); }
      for (int first = n_block + 1 + kRankChunks * cutlass::NumThreadsPerWarp; first <= last;
           first += cutlass::NumThreadsPerWarp) {
        int const n = first + lane;
        bool const listed = n <= last && listed_class(bs, m_block, n, head, batch) != 0;
        rank += __popc(__ballot_sync(0xffffffffu, listed));
      }
      return rank;
    }
    bool narrowed = false;
    p.flex.mask_mod.visit([&](auto const& mod) {
      narrowed = !std::is_same_v<std::decay_t<decltype(mod)>, variants::NoMaskMod>;
    });
    if (!narrowed) { return last - n_block; }
    for (int first = n_block + 1; first <= last; first += cutlass::NumThreadsPerWarp) {
      int const n = first + lane;
      bool visits = false;
      if (n <= last) {
        auto const walk = make_walk(p, seq, n, head, batch);
        visits = walk.m_block_min <= m_block && m_block < walk.m_block_max;
      }
      rank += __popc(__ballot_sync(0xffffffffu, visits));
    }
    return rank;
  }

  // Row block m_block's ticket for warpgroup wg's half of the chunk (Params::dq_tickets).
  CUTE_DEVICE static int* dq_ticket(Params const& p, BwdSeqlen const& seq, int head, int m_block, int wg) {
    int64_t const row_block = workspace_row_block(head, p.q_rows_padded, seq.offset_q_padded, kBlockM, m_block);
    return p.dq_tickets + row_block * NumMmaWG + wg;
  }

  // The dQ warp's lane 0: whether this column block writes the row block first (kDqTicketLanded).
  // Deterministic: rank 0, its turn already awaited (await_add_turn, whose proxy fence orders a
  // later rank's adds after rank 0's store). Otherwise the ticket decides, and a later writer
  // waits here for the first one's store to land.
  CUTE_DEVICE static bool dq_first_writer(Params const& p, int* ticket, int rank) {
    if (p.deterministic) { return rank == 0; }
    bool const first = dq_ticket_take(ticket) == 0;
    if (!first) { dq_ticket_await(ticket); }
    return first;
  }

  // The dQ warp's lane 0 at the top of a row block: an ascending walk (or a deterministic run)
  // decides here (dq_first_writer); a rotated one (`late`) only peeks, and is decided if a first
  // writer's store has already landed (it adds). Returns whether it is decided; `first` then
  // says whether this column block writes first. An undecided walk calls dq_first_writer once
  // its first dQ piece is in shared memory (kDqTicketLanded).
  CUTE_DEVICE static bool dq_first_writer_at_top(Params const& p, int* ticket, int rank, bool late, bool& first) {
    if (!late) {
      first = dq_first_writer(p, ticket, rank);
      return true;
    }
    first = false;
    return dq_ticket_landed(ticket);
  }

  // Runs a dQ warp's loop compiled with the first-store ticket code (std::true_type: dq_accum
  // starts from first stores, Params::dq_tickets) or without it (std::false_type: the memset, or
  // the clear kernel of block-list calls, Params::dq_list_writers), chosen once per CTA.
  // Compiled in and skipped at run time, the ticket code doubled the deterministic dQ warp's path
  // from its turn to its release (about 55 straight-line instructions to about 110 with 6-7 taken
  // jumps), and that warp's cycle sets the deterministic step: the deterministic hdim128
  // backward measured 8-10% slower once the tickets came in (bench/NOTES.md, "Run of 2026-12-06
  // (twenty-fourth)"). Without them the loop is again the code it was before.
  template <class Loop>
  CUTE_DEVICE static void with_ticket_code(Params const& p, Loop&& loop) {
    bool const cleared = p.dq_list_writers != nullptr && dq_list_cleared(p.dq_list_writers, p.dq_list_max_writers);
    if (p.dq_tickets != nullptr && !cleared) {
      loop(std::true_type{});
    } else {
      loop(std::false_type{});
    }
  }

  // Deterministic dQ: the semaphores of (head, sequence)'s row blocks, row block m at
  // m * dq_semaphore_stride; one per workspace row block (workspace_row_block, as dq_accum's
  // chunks and tickets), so that packed sequences without a max_seqlen_q hint take no more than
  // their rows' blocks.
  CUTE_DEVICE static int* dq_semaphores(Params const& p, BwdSeqlen const& seq, int head) {
    return p.dq_semaphore + workspace_row_block(head, p.q_rows_padded, seq.offset_q_padded, kBlockM, 0) *
                                p.dq_semaphore_stride;
  }
  CUTE_DEVICE static int* row_semaphore(Params const& p, int* semaphores, int m_block) {
    return semaphores + m_block * p.dq_semaphore_stride;
  }

  // Deterministic dQ: column block n_block's rank for row block m_block (the whole warp calling;
  // the elected lane's value, lane0, is the one used). `loads`: rank_loads of the same row block.
  CUTE_DEVICE static int turn_rank(Params const& p, BwdSeqlen const& seq, RotationGroup const& g, int n_block,
                                   int m_block, int head, int batch, bool lane0, RankLoads const& loads) {
    if constexpr (kIsFlex) {
      return dq_rank_flex(p, seq, n_block, m_block, head, batch, loads);
    } else {
      return lane0 ? dq_rank(p, seq, g, n_block, m_block) : 0;
    }
  }

  // Deterministic dQ: waits (the elected lane, the whole warp calling) until row block m_block's
  // `rank` earlier contributors have added. `seen`: the semaphore's value as peek_turn read it
  // (kSemaphoreNotRead: not read).
  CUTE_DEVICE static void await_rank(Params const& p, int* semaphore, int m_block, int rank, bool lane0,
                                     int seen = kSemaphoreNotRead) {
    trace::mark_bwd_dq_warp(trace::kBwdTurnWait);
    if (lane0) { semaphore_poll_eq(row_semaphore(p, semaphore, m_block), rank, seen); }
    trace::mark_bwd_dq_warp(trace::kBwdTurn);
    __syncwarp();
  }
  CUTE_DEVICE static void await_turn(Params const& p, BwdSeqlen const& seq, RotationGroup const& g, int* semaphore,
                                     int n_block, int m_block, int head, int batch, bool lane0,
                                     int seen = kSemaphoreNotRead) {
    await_rank(p, semaphore, m_block,
               turn_rank(p, seq, g, n_block, m_block, head, batch, lane0, rank_loads(p, seq, n_block, m_block, head, batch)),
               lane0, seen);
  }
  // Deterministic dQ by bulk adds (store_dq, store_dq_bulk): await_rank, then at every rank but 0
  // a proxy fence. The earlier ranks' sums are ordered before this turn only through the
  // semaphore (generic proxy: each rank's release after its full wait, acquired here), and only a
  // proxy fence in the adding thread orders its own async-proxy adds (or rank 0's store) after
  // what it acquired, as in dq_ticket_await. Without it an add could, by the memory model, read
  // the chunk before an earlier rank's sum: a lost sum after a first store, and over a memset a
  // change in the order of the sums, which would break the bitwise repeatability.
  CUTE_DEVICE static void await_add_turn(Params const& p, int* semaphore, int m_block, int rank, bool lane0,
                                         int seen = kSemaphoreNotRead) {
    await_rank(p, semaphore, m_block, rank, lane0, seen);
    if (lane0 && rank != 0) { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
  }
  // Deterministic dQ: the next row block's semaphore read with acquire (by the elected lane)
  // before this row block's adds are waited on and released, so that its round trip runs under
  // theirs; where the turn has already come, await_rank then neither polls nor takes the acquire
  // fence (that fence would also wait for this block's release to land; await_add_turn's proxy
  // fence stays). kSemaphoreNotRead where there is no next row block.
  CUTE_DEVICE static int peek_turn(Params const& p, int* semaphore, bool next_valid, int next_m_block, bool lane0) {
    return lane0 && next_valid ? semaphore_peek_acquire(row_semaphore(p, semaphore, next_m_block))
                                 : kSemaphoreNotRead;
  }

  // Deterministic launch order: the kernel maps blockIdx.x to the column block with this (the
  // flex kernels have the window built in, so they take the windowed order).
  CUTE_DEVICE static int column_block(Params const& p, int block_idx, int num_blocks) {
    return HasWindow && p.deterministic ? num_blocks - 1 - block_idx : block_idx;
  }

  // Producer warp: K, V once, then Q + lse_log2 and dO + dPsum per row block.
  CUTE_DEVICE static void load(Params const& p, TensorStorage& smem, PipelineQ pipeline_q, PipelinedO pipeline_do,
                               cutlass::arch::ClusterTransactionBarrier& barrier_kv, BwdSeqlen const& seq,
                               int n_block, int head, int batch) {
    auto walk = make_walk(p, seq, n_block, head, batch);
    if (!walk.valid()) { return; }
    int const head_kv = p.qhead_per_kvhead.divide(head);
    bool const varlen_q = p.cu_seqlens_q != nullptr;
    bool const varlen_k = p.cu_seqlens_k != nullptr;

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.d_o.data()), SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), SmemLayoutV{});

    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q)(_, _, head, varlen_q ? 0 : batch);
    Tensor mdO = p.tma_do.get_tma_tensor(p.shape_do)(_, _, head, varlen_q ? 0 : batch);
    Tensor mK = p.tma_k.get_tma_tensor(p.shape_k)(_, _, head_kv, varlen_k ? 0 : batch);
    Tensor mV = p.tma_v.get_tma_tensor(p.shape_v)(_, _, head_kv, varlen_k ? 0 : batch);
    Tensor gQ = local_tile(domain_offset(make_coord(seq.offset_q, _0{}), mQ), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                           make_coord(_, _0{}));  // (M, D, m_blocks)
    Tensor gdO = local_tile(domain_offset(make_coord(seq.offset_q, _0{}), mdO), Shape<Int<kBlockM>, Int<kHeadDimV>>{},
                            make_coord(_, _0{}));
    Tensor gK = local_tile(domain_offset(make_coord(seq.offset_k, _0{}), mK), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(n_block, _0{}));
    Tensor gV = local_tile(domain_offset(make_coord(seq.offset_k, _0{}), mV), Shape<Int<kBlockN>, Int<kHeadDimV>>{},
                           make_coord(n_block, _0{}));

    auto [tQgQ, tQsQ] = tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tdOgdO, tdOsdO] = tma_partition(p.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
    auto [tKgK, tKsK] = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

    int64_t const stats_base = int64_t(head) * p.q_rows_padded + seq.offset_q_padded;
    float const* lse_log2 = p.lse_log2 + stats_base;
    float const* dpsum = p.dpsum + stats_base;

    // Lane 0 issues everything: it is the pipelines' leader thread (expects the transaction bytes).
    if (threadIdx.x % cutlass::NumThreadsPerWarp != 0) { return; }
    PipelineStateQ write_q = cutlass::make_producer_start_state<PipelineQ>();
    PipelineStatedO write_do = cutlass::make_producer_start_state<PipelinedO>();
    int const m_block_first = walk.m_block;
    for (; walk.valid(); walk.next()) {
      int const m_block = walk.m_block;
      pipeline_q.producer_acquire(write_q);
      uint64_t* bar_q = pipeline_q.producer_get_barrier(write_q);
      copy(p.tma_q.with(*bar_q, 0, TMA::CacheHintSm90::EVICT_LAST), tQgQ(_, m_block), tQsQ(_, write_q.index()));
      SM90_BULK_COPY_G2S::copy(lse_log2 + m_block * kBlockM, bar_q,
                               smem.lse.data() + write_q.index() * kStatsStride, kBytesStats);
      if (m_block == m_block_first) {
        barrier_kv.arrive_and_expect_tx(kBytesK + kBytesV);
        copy(p.tma_k.with(reinterpret_cast<uint64_t&>(barrier_kv), 0), tKgK, tKsK);
        copy(p.tma_v.with(reinterpret_cast<uint64_t&>(barrier_kv), 0), tVgV, tVsV);
      }
      pipeline_do.producer_acquire(write_do);
      uint64_t* bar_do = pipeline_do.producer_get_barrier(write_do);
      copy(p.tma_do.with(*bar_do, 0, TMA::CacheHintSm90::EVICT_LAST), tdOgdO(_, m_block), tdOsdO(_, write_do.index()));
      SM90_BULK_COPY_G2S::copy(dpsum + m_block * kBlockM, bar_do,
                               smem.dpsum.data() + write_do.index() * kStatsStride, kBytesStats);
      ++write_q;
      ++write_do;
    }
    // Keep the CTA alive until the consumers have released every stage it filled.
    pipeline_q.producer_tail(write_q);
    pipeline_do.producer_tail(write_do);
  }

  // Second producer warp: bulk reduce-add of each warpgroup's dQ smem into dq_accum, in
  // column-block order per row block when deterministic.
  CUTE_DEVICE static void store_dq(Params const& p, TensorStorage& smem, BwdSeqlen const& seq, int n_block, int head,
                                   int batch) {
    if constexpr (kDqViaSmem) {
      with_ticket_code(p, [&](auto tickets) {
        store_dq_loop<decltype(tickets)::value>(p, smem, seq, n_block, head, batch);
      });
    }
  }
  template <bool kTickets>
  CUTE_DEVICE static void store_dq_loop(Params const& p, TensorStorage& smem, BwdSeqlen const& seq, int n_block,
                                        int head, int batch) {
    if constexpr (kDqViaSmem) {
      auto walk = make_walk(p, seq, n_block, head, batch);
      RotationGroup const rotation = rotation_group(p, seq, n_block, head, batch);
      constexpr int kWgChunk = kDqChunk / NumMmaWG;
      float* dq_accum = p.dq_accum + (int64_t(head) * p.q_rows_padded + seq.offset_q_padded) * kHeadDim;
      int* semaphore = dq_semaphores(p, seq, head);
      bool const lane0 = cute::elect_one_sync();
      int rank = 0;  // deterministic: this column block's rank for the walk's row block
      int seen = kSemaphoreNotRead;  // deterministic: its semaphore as peek_turn read it
      if (p.deterministic && walk.valid()) {
        rank = turn_rank(p, seq, rotation, n_block, walk.m_block, head, batch, lane0,
                         rank_loads(p, seq, n_block, walk.m_block, head, batch));
      }
      while (walk.valid()) {
        int const m_block = walk.m_block;
        if (p.deterministic) { await_add_turn(p, semaphore, m_block, rank, lane0, seen); }
        // Whether this column block writes the row block first (lane 0's value). One ticket
        // (warpgroup 0's) decides the whole chunk: this one warp stores both halves, and with a
        // ticket per half two column blocks could each take one and wait for the other's.
        // Ascending walks take it here, so that a later writer waits for the first one's store
        // while the MMA warpgroups still compute the block's dQ; rotated walks (late) peek here
        // and take it once the first half is in shared memory (see kDqTicketLanded).
        int* ticket = nullptr;
        bool first = false;
        bool decided = true;
        if constexpr (kTickets) {
          ticket = dq_ticket(p, seq, head, m_block, 0);
          bool const late = !p.deterministic && rotation.size > 0;
          decided = false;
          if (lane0) { decided = dq_first_writer_at_top(p, ticket, rank, late, first); }
          __syncwarp();
        }
        CUTLASS_PRAGMA_UNROLL
        for (int wg = 0; wg < NumMmaWG; ++wg) {
          cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp,
                                            uint32_t(BwdBarrier::kDqFull) + wg);
          if (lane0) {
            float* dst = dq_accum + int64_t(m_block) * kDqChunk + wg * kWgChunk;
            if constexpr (kTickets) {
              if (wg == 0 && !decided) { first = dq_first_writer(p, ticket, rank); }
            }
            if (first) {
              bulk_store_f32(smem.dq.data() + wg * kWgChunk, dst, kWgChunk * int(sizeof(float)));
            } else {
              bulk_reduce_add_f32(smem.dq.data() + wg * kWgChunk, dst, kWgChunk * int(sizeof(float)));
            }
            cute::tma_store_arrive();
          }
          // Lane 0 may have waited for a first store: the warp meets before the next barrier.
          if constexpr (kTickets) { __syncwarp(); }
        }
        // A first writer sets every half's ticket bit once its stores have landed (the later
        // writers wait for warpgroup 0's, the postprocess reads each half's): below, after the
        // smem halves are handed back, so that the MMA warpgroups never wait for the landing.
        auto land_first = [&] {
          CUTLASS_PRAGMA_UNROLL
          for (int wg = 0; wg < NumMmaWG; ++wg) { dq_ticket_land(dq_ticket(p, seq, head, m_block, wg)); }
        };
        if (p.deterministic) {
          // The next row block and its rank loads, issued under this block's adds.
          walk.next();
          RankLoads const ahead = walk.valid() ? rank_loads(p, seq, n_block, walk.m_block, head, batch) : RankLoads{};
          seen = peek_turn(p, semaphore, walk.valid(), walk.m_block, lane0);
          // The next column block may only add once this block's sums have landed.
          if (lane0) {
            // The full wait makes the adds visible to this thread; the release is cumulative
            // over them (no fence.sc between: it cost a tenth of the deterministic speed).
            asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
            if (first) { land_first(); }
            semaphore_increment(row_semaphore(p, semaphore, m_block));
            trace::mark_bwd_dq_warp(trace::kBwdReleased);
          }
          __syncwarp();
          CUTLASS_PRAGMA_UNROLL
          for (int wg = 0; wg < NumMmaWG; ++wg) {
            cutlass::arch::NamedBarrier::arrive(cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp,
                                                uint32_t(BwdBarrier::kDqEmpty) + wg);
          }
          if (walk.valid()) { rank = turn_rank(p, seq, rotation, n_block, walk.m_block, head, batch, lane0, ahead); }
        } else {
          for_each(make_int_sequence<NumMmaWG>{}, [&](auto wg) {
            if (lane0) { cute::tma_store_wait<NumMmaWG - 1 - decltype(wg)::value>(); }
            __syncwarp();
            cutlass::arch::NamedBarrier::arrive(cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp,
                                                uint32_t(BwdBarrier::kDqEmpty) + decltype(wg)::value);
          });
          if constexpr (kTickets) {
            if (lane0 && first) {
              asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
              land_first();
            }
            __syncwarp();
          }
          walk.next();
        }
      }
      if (lane0) { cute::tma_store_wait<0>(); }
    }
  }

  // Second producer warp of the kernels with dQ by atomics, deterministic with dq_order_warp: per
  // row block of the walk, wait (ahead of the MMA warpgroups) until the column blocks before this
  // one have added their dQ, let the MMA warpgroups add (kDqReady), and once they have issued
  // their atomics (kDqDone) pass the row block on. The release is ordered after every MMA
  // thread's atomics by the named barrier (each arrive synchronizes with this warp's sync) and the
  // cumulativity of the release, as CUTLASS's semaphores order a CTA's stores.
  CUTE_DEVICE static void order_dq(Params const& p, BwdSeqlen const& seq, int n_block, int head, int batch) {
    if constexpr (!kDqViaSmem) {
      auto walk = make_walk(p, seq, n_block, head, batch);
      RotationGroup const rotation = rotation_group(p, seq, n_block, head, batch);
      int* semaphore = dq_semaphores(p, seq, head);
      bool const lane0 = cute::elect_one_sync();
      int seen = kSemaphoreNotRead;  // the row block's semaphore as peek_turn read it
      while (walk.valid()) {
        int const m_block = walk.m_block;
        await_turn(p, seq, rotation, semaphore, n_block, m_block, head, batch, lane0, seen);
        cutlass::arch::NamedBarrier::arrive(NumMmaThreads + cutlass::NumThreadsPerWarp, uint32_t(BwdBarrier::kDqReady));
        // The next row block's turn, read while the MMA warpgroups add this one's.
        walk.next();
        seen = peek_turn(p, semaphore, walk.valid(), walk.m_block, lane0);
        cutlass::arch::NamedBarrier::sync(NumMmaThreads + cutlass::NumThreadsPerWarp, uint32_t(BwdBarrier::kDqDone));
        if (lane0) { semaphore_increment(row_semaphore(p, semaphore, m_block)); }
        trace::mark_bwd_dq_warp(trace::kBwdReleased);
        __syncwarp();
      }
    }
  }

  // Producer warp 1 + wg of the sliced kernels with dQ through shared memory (dq_bulk), one per
  // MMA warpgroup so that neither waits for the other's stores: per row block, the kDqPieces
  // pieces of warpgroup wg's dQ^T chunk in the order they are stored, each from its slot of the
  // ring by one bulk reduce-add. A slot is freed once its copy has read it; the warp keeps one
  // copy in flight, freeing the previous piece's slot after issuing the next. Deterministic runs
  // add each row block in column-block order, as store_dq does: both warps await the turn while
  // the MMA warpgroups compute the block's dQ, and once the copies of both have landed the first
  // warp passes the row block on.
  CUTE_DEVICE static void store_dq_bulk(Params const& p, DqSlotStorage& ring, BwdSeqlen const& seq, int n_block,
                                        int head, int batch, int wg) {
    if constexpr (kHasDqBulk) {
      with_ticket_code(p, [&](auto tickets) {
        store_dq_bulk_loop<decltype(tickets)::value>(p, ring, seq, n_block, head, batch, wg);
      });
    }
  }
  template <bool kTickets>
  CUTE_DEVICE static void store_dq_bulk_loop(Params const& p, DqSlotStorage& ring, BwdSeqlen const& seq, int n_block,
                                             int head, int batch, int wg) {
    if constexpr (kHasDqBulk) {
      static_assert(NumMmaWG == 2, "kDqLanded takes the id of a third warpgroup's kDqEmpty");
      auto walk = make_walk(p, seq, n_block, head, batch);
      float* dq_accum = p.dq_accum + (int64_t(head) * p.q_rows_padded + seq.offset_q_padded) * kHeadDim +
                        wg * (kDqChunk / NumMmaWG);
      int* semaphore = dq_semaphores(p, seq, head);
      RotationGroup const rotation = rotation_group(p, seq, n_block, head, batch);
      bool const lane0 = cute::elect_one_sync();
      int piece = 0;         // pieces issued
      bool pending = false;  // the last issued piece's slot is not yet freed
      int rank = 0;          // deterministic: this column block's rank for the walk's row block
      int seen = kSemaphoreNotRead;  // deterministic: its semaphore as peek_turn read it
      if (p.deterministic && walk.valid()) {
        rank = turn_rank(p, seq, rotation, n_block, walk.m_block, head, batch, lane0,
                         rank_loads(p, seq, n_block, walk.m_block, head, batch));
      }
      while (walk.valid()) {
        int const m_block = walk.m_block;
        if (p.deterministic) { await_add_turn(p, semaphore, m_block, rank, lane0, seen); }
        float* dq_row = dq_accum + int64_t(m_block) * kDqChunk;
        // The first writer of this half stores it, the others add once it has landed
        // (dq_first_writer): ascending walks take the ticket here, before the pieces are ready;
        // rotated ones (late) peek here and take it once the first piece is (kDqTicketLanded).
        int* ticket = nullptr;
        bool first = false;
        bool decided = true;
        if constexpr (kTickets) {
          ticket = dq_ticket(p, seq, head, m_block, wg);
          bool const late = !p.deterministic && rotation.size > 0;
          bool const lane_decided = lane0 && dq_first_writer_at_top(p, ticket, rank, late, first);
          decided = __any_sync(0xffffffff, lane_decided);
          first = __any_sync(0xffffffff, first);
        }
        CUTLASS_PRAGMA_NO_UNROLL
        for (int j = 0; j < kDqPieces; ++j, ++piece) {
          int const s = DqSlotStorage::slot_of(piece);
          ring.full[wg][s].wait(DqSlotStorage::parity_of(piece));
          if constexpr (kTickets) {
            if (!decided) {
              first = __any_sync(0xffffffff, lane0 && dq_first_writer(p, ticket, rank));
              decided = true;
            }
          }
          if (lane0) {
            if (first) {
              bulk_store_f32(ring.slot[wg][s].buffer, dq_row + j * kDqSlotFloats, kDqSlotFloats * int(sizeof(float)));
            } else {
              bulk_reduce_add_f32(ring.slot[wg][s].buffer, dq_row + j * kDqSlotFloats, kDqSlotFloats * int(sizeof(float)));
            }
            cute::tma_store_arrive();
            if (pending) {
              cute::tma_store_wait<1>();
              ring.empty[wg][DqSlotStorage::slot_of(piece + kDqSlots - 1)].arrive();
            }
          }
          pending = true;
          __syncwarp();
        }
        if constexpr (kTickets) {
          if (first && !p.deterministic) {
            // The stores landed (the last slot freed), then the ticket's bit.
            if (lane0) {
              asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
              ring.empty[wg][DqSlotStorage::slot_of(piece + kDqSlots - 1)].arrive();
              dq_ticket_land(ticket);
            }
            pending = false;
            __syncwarp();
          }
        }
        walk.next();
        if (p.deterministic) {
          // The next row block's rank loads, issued under this block's adds.
          RankLoads const ahead = walk.valid() ? rank_loads(p, seq, n_block, walk.m_block, head, batch) : RankLoads{};
          seen = peek_turn(p, semaphore, walk.valid(), walk.m_block, lane0);
          // The next column block may only add once this block's sums have landed.
          if (lane0) {
            // The last slot is handed back once its copy has read it, before the sums land.
            asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
            ring.empty[wg][DqSlotStorage::slot_of(piece + kDqSlots - 1)].arrive();
            // Visible to this thread once fully waited; the release below is cumulative.
            asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
            if constexpr (kTickets) {
              if (first) { dq_ticket_land(ticket); }
            }
          }
          pending = false;
          __syncwarp();
          cutlass::arch::NamedBarrier::sync(NumMmaWG * cutlass::NumThreadsPerWarp, uint32_t(BwdBarrier::kDqLanded));
          if (wg == 0 && lane0) {
            semaphore_increment(row_semaphore(p, semaphore, m_block));
            trace::mark_bwd_dq_warp(trace::kBwdReleased);
          }
          __syncwarp();
          if (walk.valid()) { rank = turn_rank(p, seq, rotation, n_block, walk.m_block, head, batch, lane0, ahead); }
        }
      }
      if (lane0) { cute::tma_store_wait<0>(); }  // no copy reads the ring after the CTA ends
    }
  }

  // MMA warpgroups. Returns false when the column block sees no row (dK = dV = 0).
  template <class FragdK, class FragdV>
  CUTE_DEVICE static bool mma(Params const& p, TensorStorage& smem, PipelineQ pipeline_q, PipelinedO pipeline_do,
                              cutlass::arch::ClusterTransactionBarrier& barrier_kv, BwdSeqlen const& seq,
                              FragdK& tdKrdK, FragdV& tdVrdV, DqSlotStorage& slot_storage, int thread_idx,
                              int n_block, int head, int batch) {
    auto walk = make_walk(p, seq, n_block, head, batch);
    if (!walk.valid()) { return false; }

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.d_o.data()), SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), SmemLayoutV{});
    Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(smem.d_o.data()), SmemLayoutdOt{});
    Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutKt{});
    Tensor sP = make_tensor(make_smem_ptr(smem.p.data()), SmemLayoutPdS{});
    Tensor sPt = make_tensor(make_smem_ptr(smem.p.data()), SmemLayoutPdSt{});
    Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), SmemLayoutPdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.data()), SmemLayoutPdSt{});

    int const wg_idx = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    int const thread_in_wg = thread_idx % cutlass::NumThreadsPerWarpGroup;
    auto wg_layout = make_layout(make_shape(Int<NumMmaWG>{}), make_stride(Int<cutlass::NumThreadsPerWarpGroup>{}));

    TiledMmaSdP tiled_mma_SdP;
    TiledMmadK tiled_mma_dK;
    TiledMmadV tiled_mma_dV;
    TiledMmadQ tiled_mma_dQ;
    auto wg_mma_SdP = tiled_mma_SdP.get_slice(wg_layout(wg_idx));
    auto wg_mma_dK = tiled_mma_dK.get_slice(wg_layout(wg_idx));
    auto wg_mma_dV = tiled_mma_dV.get_slice(wg_layout(wg_idx));
    auto wg_mma_dQ = tiled_mma_dQ.get_slice(wg_layout(wg_idx));
    auto thr_mma_SdP = tiled_mma_SdP.get_thread_slice(thread_idx);

    Tensor tSrQ = mma_operand_fragment<!SdP_swapAB>(wg_mma_SdP, sQ);
    Tensor tSrK = mma_operand_fragment<SdP_swapAB>(wg_mma_SdP, sK);
    Tensor tdPrdO = mma_operand_fragment<!SdP_swapAB>(wg_mma_SdP, sdO);
    Tensor tdPrV = mma_operand_fragment<SdP_swapAB>(wg_mma_SdP, sV);
    Tensor tdVrdO = mma_operand_fragment<dKV_swapAB>(wg_mma_dV, sdOt);
    Tensor tdKrQ = mma_operand_fragment<dKV_swapAB>(wg_mma_dK, sQt);
    Tensor tdQrdS = mma_operand_fragment<!dQ_swapAB>(wg_mma_dQ, sdS);
    Tensor tdQrK = mma_operand_fragment<dQ_swapAB>(wg_mma_dQ, sKt);

    auto smem_tiled_copy_PdS = make_tiled_copy_C(SmemCopyAtomPdS{}, tiled_mma_SdP);
    auto smem_thr_copy_PdS = smem_tiled_copy_PdS.get_thread_slice(thread_idx);
    Tensor tPsP = smem_thr_copy_PdS.partition_D(
        cute::conditional_return<!SdP_swapAB>(as_position_independent_swizzle_tensor(sP),
                                              as_position_independent_swizzle_tensor(sPt)));
    Tensor tdSsdS = smem_thr_copy_PdS.partition_D(
        cute::conditional_return<!SdP_swapAB>(as_position_independent_swizzle_tensor(sdS),
                                              as_position_independent_swizzle_tensor(sdSt)));

    // Coordinates (row of S, column of S) of this thread's accumulator elements: a per-thread
    // base plus the offsets of thread 0, which are compile-time constants. Written this way the
    // per-element indices stay immediates instead of loop-invariant registers.
    using ShapeSAcc = std::conditional_t<!SdP_swapAB, Shape<Int<kBlockM>, Int<kBlockN>>, Shape<Int<kBlockN>, Int<kBlockM>>>;
    Tensor tScS = thr_mma_SdP.partition_C(make_identity_tensor(ShapeSAcc{}));
    Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol_layout<SdP_swapAB>(tScS.layout()));
    Tensor tScS0 = tiled_mma_SdP.get_thread_slice(0).partition_C(make_identity_tensor(ShapeSAcc{}));
    Tensor tScS0_rc = make_tensor(tScS0.data(), acc_rowcol_layout<SdP_swapAB>(tScS0.layout()));
    constexpr int kRowMode = SdP_swapAB ? 1 : 0;
    auto row_offset = [&](int mi) { return int(get<kRowMode>(tScS0_rc(mi, 0))); };
    auto col_offset = [&](int ni) { return int(get<1 - kRowMode>(tScS0_rc(0, ni))); };
    int const row_base = int(get<kRowMode>(tScS_rc(0, 0))) - row_offset(0);
    int const col_base = int(get<1 - kRowMode>(tScS_rc(0, 0))) - col_offset(0);
    constexpr int kRows = decltype(size<0>(tScS_rc))::value;
    constexpr int kCols = decltype(size<1>(tScS_rc))::value;

    float* dq_accum = p.dq_accum + (int64_t(head) * p.q_rows_padded + seq.offset_q_padded) * kHeadDim;

    // Column masking: key columns past seqlen_k always; the window band when HasWindow.
    int const col_limit = seq.seqlen_k - n_block * kBlockN - col_base;  // in col_offset terms
    bool const mask_seqlen_k = seq.seqlen_k - n_block * kBlockN < kBlockN;
    int const diag = seq.seqlen_k - seq.seqlen_q;
    auto apply_mask = [&](auto& scores, int m_block) {
      if constexpr (HasWindow) {
        // Key column c of the tile is visible to query row r iff
        // -window_left <= c - r + n_block * kBlockN - m_block * kBlockM - diag <= window_right
        // and c < seqlen_k - n_block * kBlockN.
        int const shift = n_block * kBlockN - m_block * kBlockM - diag + col_base - row_base;
        CUTLASS_PRAGMA_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          CUTLASS_PRAGMA_UNROLL
          for (int ni = 0; ni < kCols; ++ni) {
            int const rel = shift + (col_offset(ni) - row_offset(mi));
            if (rel > p.window_right || rel < -p.window_left || col_offset(ni) >= col_limit) {
              scores(mi, ni) = -INFINITY;
            }
          }
        }
      } else {
        if (mask_seqlen_k) {
          CUTLASS_PRAGMA_UNROLL
          for (int ni = 0; ni < kCols; ++ni) {
            if (col_offset(ni) >= col_limit) {
              CUTLASS_PRAGMA_UNROLL
              for (int mi = 0; mi < kRows; ++mi) { scores(mi, ni) = -INFINITY; }
            }
          }
        }
      }
    };

    // Whether the window's edge cuts the tile of row block m_block (for the timeline's marks only).
    [[maybe_unused]] auto tile_is_cut = [&](int m_block) {
      if constexpr (HasWindow) {
        int const rel_max = n_block * kBlockN + kBlockN - 1 - m_block * kBlockM - diag;
        int const rel_min = n_block * kBlockN - (m_block * kBlockM + kBlockM - 1) - diag;
        return rel_max > p.window_right || rel_min < -p.window_left;
      } else {
        return false;
      }
    };

    // Flex variant: raw <q, k> to the final score (scale or softcap, then score_mod) with its
    // derivative in `grad`; and mask_mod. Positions past the sequence are not given to mask_mod
    // (the length mask hides their keys; their rows have lse_log2 = +inf, so P = 0), so an aux
    // array of the sequence's length is never read past its end.
    auto flex_scores = [&](auto const& flex, auto& scores, auto& grad, int m_block) {
      float const score_scale = flex.score_scale;
      if constexpr (HasSoftcap) {
        float const tanh_scale = flex.tanh_scale;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(scores); ++i) {
          float const t = cutlass::fast_tanh(scores(i) * tanh_scale);
          scores(i) = score_scale * t;
          grad(i) = 1.f - t * t;
        }
      } else if (kHasScoreGrad || score_scale != 1.f) {  // 1 without a score_mod: the scale is in the exponent
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(scores); ++i) {
          scores(i) *= score_scale;
          if constexpr (kHasScoreGrad) { grad(i) = 1.f; }
        }
      }
      flex.score_mod.visit([&](auto const& mod) {
        if constexpr (!std::is_same_v<std::decay_t<decltype(mod)>, variants::NoScoreMod>) {
          int const row_first = m_block * kBlockM + row_base;
          int const col_first = n_block * kBlockN + col_base;
          CUTLASS_PRAGMA_UNROLL
          for (int mi = 0; mi < kRows; ++mi) {
            int const row = row_first + row_offset(mi);
            CUTLASS_PRAGMA_UNROLL
            for (int ni = 0; ni < kCols; ++ni) {
              int const col = col_first + col_offset(ni);
              float const s = scores(mi, ni);
              scores(mi, ni) = mod.score(s, batch, head, row, col);
              if constexpr (kHasScoreGrad) { grad(mi, ni) *= mod.grad(s, batch, head, row, col); }
            }
          }
        }
      });
    };
    auto flex_mask = [&](auto const& flex, auto& scores, int m_block) {
      flex.mask_mod.visit([&](auto const& mod) {
        if constexpr (!std::is_same_v<std::decay_t<decltype(mod)>, variants::NoMaskMod>) {
          int const tile_row = m_block * kBlockM;
          int const tile_col = n_block * kBlockN;
          if (mod.all_visible(tile_row, cute::min(tile_row + kBlockM, seq.seqlen_q) - 1, tile_col,
                              cute::min(tile_col + kBlockN, seq.seqlen_k) - 1)) {
            return;
          }
          using Mod = std::decay_t<decltype(mod)>;
          // Key compares (as the forward's FlexTileMods::mask): the thread's column keys once,
          // columns clamped into the sequence (the length mask hides those past it). Not in the
          // softcap kernels, which this raises from 38 to 74 bytes of spills (hdim128, ptxas 13.0).
          constexpr bool kKeys = variants::HasKeyCompare<Mod>::value && !HasSoftcap;
          int col_keys[kKeys ? kCols : 1];
          if constexpr (kKeys) {
            CUTLASS_PRAGMA_UNROLL
            for (int ni = 0; ni < kCols; ++ni) {
              col_keys[ni] = mod.col_key(batch, cute::min(tile_col + col_base + col_offset(ni), seq.seqlen_k - 1));
            }
          }
          CUTLASS_PRAGMA_UNROLL
          for (int mi = 0; mi < kRows; ++mi) {
            int const row = tile_row + row_base + row_offset(mi);
            if (row >= seq.seqlen_q) { continue; }
            if constexpr (kKeys) {
              int const row_key = mod.row_key(batch, row);
              CUTLASS_PRAGMA_UNROLL
              for (int ni = 0; ni < kCols; ++ni) {
                if (col_keys[ni] != row_key) { scores(mi, ni) = -INFINITY; }
              }
            } else if constexpr (variants::HasRowInterval<Mod>::value) {
              // The row's keys as one interval (as the forward's FlexTileMods::mask); columns past
              // seqlen_k are hidden by the length mask either way.
              int col_begin = tile_col, col_end = tile_col + kBlockN;
              mod.row_interval(row, col_begin, col_end);
              col_begin -= tile_col + col_base;
              col_end -= tile_col + col_base;
              CUTLASS_PRAGMA_UNROLL
              for (int ni = 0; ni < kCols; ++ni) {
                if (col_offset(ni) < col_begin || col_offset(ni) >= col_end) { scores(mi, ni) = -INFINITY; }
              }
            } else {
              CUTLASS_PRAGMA_UNROLL
              for (int ni = 0; ni < kCols; ++ni) {
                int const col = tile_col + col_base + col_offset(ni);
                if (col < seq.seqlen_k && !mod.visible(batch, head, row, col)) { scores(mi, ni) = -INFINITY; }
              }
            }
          }
        }
      });
    };

    clear(tdKrdK);
    clear(tdVrdV);
    barrier_kv.wait(0);

    // Rows past the sequence in a boundary block may hold NaN or Inf: a cache's unused tail past
    // seqused, or with cu_seqlens the next sequence's rows (its own unused tail, if it has
    // seqused) or rows past the last sequence that the caller never filled. The masks and
    // lse = +inf only make their P and dS 0, and 0 * NaN is NaN in dS = P (dP - dPsum) and in
    // every GEMM that reads them (dQ = dS K, dK = dS^T Q, dV = P^T dO). So the MMA warpgroups
    // zero those rows of the boundary blocks before use: K and V once (they stay resident), Q
    // and dO at the boundary row block. Dense rows past the tensor are zero-filled by TMA.
    auto zero_rows = [&](auto const& tile, auto rows, auto cols, int row_begin) {
      zero_smem_rows<decltype(rows)::value, decltype(cols)::value>(tile, row_begin, thread_idx, NumMmaThreads);
    };
    auto sync_zeroed_rows = [&] {
      cutlass::arch::fence_view_async_shared();  // the WGMMAs read through the async proxy
      cutlass::arch::NamedBarrier::sync(NumMmaThreads, uint32_t(BwdBarrier::kPdS));
    };
    int const keys_in_block = seq.seqlen_k - n_block * kBlockN;
    bool const keys_unowned = p.seqused_k != nullptr || p.cu_seqlens_k != nullptr;
    if (keys_unowned && keys_in_block < kBlockN) {
      zero_rows([&](int r, int c) { return &sK(r, c); }, Int<kBlockN>{}, Int<kHeadDim>{}, keys_in_block);
      zero_rows([&](int r, int c) { return &sV(r, c); }, Int<kBlockN>{}, Int<kHeadDimV>{}, keys_in_block);
      sync_zeroed_rows();
    }
    bool const rows_unowned = p.seqused_q != nullptr || p.cu_seqlens_q != nullptr;
    int const q_tail_block = rows_unowned && seq.seqlen_q % kBlockM != 0 ? seq.seqlen_q / kBlockM : -1;

    PipelineStateQ read_q;
    PipelineStatedO read_do;
    int dq_piece = 0;  // bulk dQ: the pieces this warpgroup has put into its ring

    CUTLASS_PRAGMA_NO_UNROLL
    for (; walk.valid(); walk.next()) {
      int const m_block = walk.m_block;
      int const stage_q = read_q.index();
      int const stage_do = read_do.index();
      int const stage_ds = kStagesdS == 1 ? 0 : stage_q;
      trace::mark_bwd(thread_idx, tile_is_cut(m_block) ? trace::kBwdStepCut : trace::kBwdStep);

      if (m_block == q_tail_block) {
        pipeline_q.consumer_wait(read_q);
        pipeline_do.consumer_wait(read_do);
        int const rows_in_block = seq.seqlen_q - m_block * kBlockM;
        zero_rows([&](int r, int c) { return &sQ(r, c, stage_q); }, Int<kBlockM>{}, Int<kHeadDim>{}, rows_in_block);
        zero_rows([&](int r, int c) { return &sdO(r, c, stage_do); }, Int<kBlockM>{}, Int<kHeadDimV>{}, rows_in_block);
        sync_zeroed_rows();
      }

      // S = Q K^T
      Tensor tSrS = partition_fragment_C(tiled_mma_SdP, ShapeSAcc{});
      pipeline_q.consumer_wait(read_q);
      wgmma_gemm<true, -1, SdP_swapAB>(tiled_mma_SdP, tSrQ(_, _, _, stage_q), tSrK, tSrS);
      trace::mark_bwd(thread_idx, trace::kBwdQ);
      // Row statistics are read from smem where they are used rather than held in registers:
      // with S^T tiles each thread covers many rows.
      float const* lse = smem.lse.data() + stage_q * kStatsStride + row_base;

      // dP = dO V^T
      Tensor tdPrdP = partition_fragment_C(tiled_mma_SdP, ShapeSAcc{});
      pipeline_do.consumer_wait(read_do);
      wgmma_gemm<true, -1, SdP_swapAB>(tiled_mma_SdP, tdPrdO(_, _, _, stage_do), tdPrV, tdPrdP);
      warpgroup_wait<1>();

      Tensor scores = make_tensor(tSrS.data(), acc_rowcol_layout<SdP_swapAB>(tSrS.layout()));
      // d softcap(x)/dx = 1 - tanh^2, taken before masking so masked entries stay finite.
      Tensor dtanh = make_tensor_like(scores);
      if constexpr (HasSoftcap && !kIsFlex) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(scores); ++i) {
          float const t = cutlass::fast_tanh(scores(i) * p.softcap_val);
          scores(i) = t;
          dtanh(i) = 1.f - t * t;
        }
      }
      if constexpr (kIsFlex) { flex_scores(p.flex, scores, dtanh, m_block); }
      apply_mask(scores, m_block);
      if constexpr (kIsFlex) {
        if (walk.masked) { flex_mask(p.flex, scores, m_block); }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < kCols; ++ni) {
          scores(mi, ni) = exp2f(scores(mi, ni) * p.softmax_scale_log2 - lse[row_offset(mi)]);
        }
      }
      float const* dpsum = smem.dpsum.data() + stage_do * kStatsStride + row_base;

      // P for the dV MMA: to smem now (overlapping the dP MMA) when the MMA reads it from smem;
      // kept in registers otherwise, converted after dS so fp32 P and its 16-bit copy are not
      // both live while dS is computed.
      Tensor rP = make_tensor_like<Element>(tSrS);
      if constexpr (!Mma_dKV_is_RS) {
        convert_fragment(tSrS, rP);
        // With one P buffer, the previous step's dV MMA must be done reading it.
        if constexpr (kStagesdS == 1) {
          cutlass::arch::NamedBarrier::sync(NumMmaThreads, uint32_t(BwdBarrier::kPdS));
        }
        cute::copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(rP), tPsP(_, _, _, stage_ds));
      }

      // dS = P (dP - dPsum) [* dtanh]
      warpgroup_wait<0>();
      trace::mark_bwd(thread_idx, trace::kBwdSdP);
      Tensor dS = make_tensor(tdPrdP.data(), scores.layout());
      CUTLASS_PRAGMA_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < kCols; ++ni) {
          dS(mi, ni) = scores(mi, ni) * (dS(mi, ni) - dpsum[row_offset(mi)]);
          if constexpr (kHasScoreGrad) { dS(mi, ni) *= dtanh(mi, ni); }
        }
      }
      if constexpr (Mma_dKV_is_RS) { convert_fragment(tSrS, rP); }
      Tensor rdS = make_tensor_like<Element>(tdPrdP);
      convert_fragment(tdPrdP, rdS);
      // P must be visible before the dV MMA reads it; with one dS buffer the previous dQ / dK
      // MMAs of the other warpgroups must be done with it.
      if constexpr (!Mma_dKV_is_RS || kStagesdS == 1) {
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(NumMmaThreads, uint32_t(BwdBarrier::kPdS));
      }
      cute::copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(rdS), tdSsdS(_, _, _, stage_ds));
      trace::mark_bwd(thread_idx, trace::kBwdDs);

      using ShapedQAcc = std::conditional_t<!dQ_swapAB, Shape<Int<kBlockM>, Int<kHeadDim>>, Shape<Int<kHeadDim>, Int<kBlockM>>>;
      Tensor tdQrdQ = partition_fragment_C(tiled_mma_dQ, ShapedQAcc{});
      // dQ out, in fragment order (see the top of this file): values [4 * begin, 4 * end) of this
      // thread, by atomics (when not through smem), in column-block order when deterministic.
      static_assert(decltype(size(tdQrdQ))::value % 4 == 0);
      constexpr int kDqVecs = decltype(size(tdQrdQ))::value / 4;
      auto dq_vec = [&](int i) { return make_float4(tdQrdQ(4 * i), tdQrdQ(4 * i + 1), tdQrdQ(4 * i + 2), tdQrdQ(4 * i + 3)); };
      // Deterministic dQ by atomics: the order warp (order_dq) found the row block's turn before
      // the atomics and releases it after them.
      auto dq_atomics_wait = [&]() {
        if (p.dq_order_warp) {
          cutlass::arch::NamedBarrier::sync(NumMmaThreads + cutlass::NumThreadsPerWarp, uint32_t(BwdBarrier::kDqReady));
        }
      };
      auto dq_atomics = [&](auto begin, auto end) {
        float4* gdq = reinterpret_cast<float4*>(dq_accum + int64_t(m_block) * kDqChunk + wg_idx * (kDqChunk / NumMmaWG));
        CUTLASS_PRAGMA_UNROLL
        for (int i = decltype(begin)::value; i < decltype(end)::value; ++i) {
          atomicAdd(gdq + i * cutlass::NumThreadsPerWarpGroup + thread_in_wg, dq_vec(i));
        }
      };
      auto dq_atomics_release = [&]() {
        if (p.dq_order_warp) {
          asm volatile("" ::: "memory");  // the atomics stay before the arrive
          cutlass::arch::NamedBarrier::arrive(NumMmaThreads + cutlass::NumThreadsPerWarp, uint32_t(BwdBarrier::kDqDone));
        }
      };

      if constexpr (kSliceDQKV) {
        // The MMAs and dQ atomics of the branch below in halves of the head dim (kSliceDQKV):
        // slice h of each warpgroup's dV^T / dK^T / dQ^T accumulator is its MMA_M index h, i.e.
        // head dims [128 h, 128 h + 128) split between the warpgroups; the operand on the M side
        // (dO^T, Q^T, K^T) is sliced alike. dQ^T's slice h is its values [32 h, 32 h + 32).
        static_assert(decltype(size<1>(tdQrdQ))::value == 2 && decltype(size<2>(tdQrdQ))::value == 1);
        static_assert(decltype(stride<1>(tdQrdQ))::value == decltype(size<0>(tdQrdQ))::value);
        static_assert(decltype(size<1>(tdVrdV))::value == 2 && decltype(size<1>(tdKrdK))::value == 2);
        Tensor tdVrP_all = mma_operand_fragment<!dKV_swapAB>(wg_mma_dV, sPt);
        Tensor tdVrP = tdVrP_all(_, _, _, stage_ds);
        Tensor tdVrdO_cur = tdVrdO(_, _, _, stage_do);
        Tensor tdQrdS_cur = tdQrdS(_, _, _, stage_ds);
        Tensor tdKrdS_all = mma_operand_fragment<!dKV_swapAB>(wg_mma_dK, sdSt);
        Tensor tdKrdS = tdKrdS_all(_, _, _, stage_ds);
        Tensor tdKrQ_cur = tdKrQ(_, _, _, stage_q);
        // dQ^T slice h out: its values [h * H, h * H + H), by atomics or through the slot.
        constexpr int kH = kDqVecs / 2;
        constexpr int kPiecesPerSlice = kDqPieces / 2;
        static_assert(!kHasDqBulk || DqBulkStage::kVecs * kPiecesPerSlice == kH,
                      "the ring's pieces tile each dQ^T half slice");
        // Bulk (p.dq_bulk): the slice in kPiecesPerSlice stores into the warpgroup's ring, which
        // its producer warp adds to global memory (store_dq_bulk).
        auto dq_out = [&](auto slice) {
          constexpr int kBegin = decltype(slice)::value * kH;
          if constexpr (kHasDqBulk) {
            if (p.dq_bulk) {
              for_each(make_int_sequence<kPiecesPerSlice>{}, [&](auto j) {
                DqBulkStage::template store<kBegin + decltype(j)::value * DqBulkStage::kVecs>(
                    slot_storage, wg_idx, dq_piece + decltype(slice)::value * kPiecesPerSlice + decltype(j)::value,
                    thread_in_wg, dq_vec);
              });
              return;
            }
          }
          dq_atomics(Int<kBegin>{}, Int<kBegin + kH>{});
        };
        // dV_0 += P^T dO (first half)
        wgmma_gemm_m_slice<false, -1, dKV_swapAB, 0, 2>(tiled_mma_dV, tdVrP, tdVrdO_cur, tdVrdV);
        // dS visible to every warpgroup before dQ = dS K.
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(NumMmaThreads, uint32_t(BwdBarrier::kPdS));
        trace::mark_bwd(thread_idx, trace::kBwdPdS);
        wgmma_gemm_m_slice<true, -1, dQ_swapAB, 0, 2>(tiled_mma_dQ, tdQrdS_cur, tdQrK, tdQrdQ);
        // dV_1; waiting for all but it completes dV_0 and dQ_0.
        wgmma_gemm_m_slice<false, 1, dKV_swapAB, 1, 2>(tiled_mma_dV, tdVrP, tdVrdO_cur, tdVrdV);
        trace::mark_bwd(thread_idx, trace::kBwdMma0);
        dq_atomics_wait();
        dq_out(Int<0>{});
        trace::mark_bwd(thread_idx, trace::kBwdDq0);
        // dK_0 += dS^T Q; waiting for all but it completes dV_1 (the dV MMA is done with dO).
        wgmma_gemm_m_slice<false, -1, dKV_swapAB, 0, 2>(tiled_mma_dK, tdKrdS, tdKrQ_cur, tdKrdK);
        warpgroup_wait<1>();
        pipeline_do.consumer_release(read_do);
        // dQ_1, then dK_1 before dQ_1 goes out, so that the tensor cores have dK_1 while both
        // warpgroups (in step through the P / dS barrier) store dQ_1; waiting for all but dK_1
        // completes dK_0 and dQ_1. Measured: +1-2% non-causal, causal and deterministic even
        // (bench/NOTES.md, "the MMA order around the dQ stores"); dK_0 issued before the first
        // half's stores as well lost 2-3%.
        wgmma_gemm_m_slice<true, -1, dQ_swapAB, 1, 2>(tiled_mma_dQ, tdQrdS_cur, tdQrK, tdQrdQ);
        wgmma_gemm_m_slice<false, 1, dKV_swapAB, 1, 2>(tiled_mma_dK, tdKrdS, tdKrQ_cur, tdKrdK);
        trace::mark_bwd(thread_idx, trace::kBwdMma1);
        dq_out(Int<1>{});
        trace::mark_bwd(thread_idx, trace::kBwdDq1);
        dq_piece += kDqPieces;
        dq_atomics_release();
      } else {
        // dV += P^T dO
        if constexpr (Mma_dKV_is_RS) {
          Tensor tdVrP = make_tensor(rP.data(), acc_as_a_operand_layout(rP.layout()));
          wgmma_gemm<false, -1, false>(tiled_mma_dV, tdVrP, tdVrdO(_, _, _, stage_do), tdVrdV);
        } else {
          Tensor tdVrP = mma_operand_fragment<!dKV_swapAB>(wg_mma_dV, sPt);
          wgmma_gemm<false, -1, dKV_swapAB>(tiled_mma_dV, tdVrP(_, _, _, stage_ds), tdVrdO(_, _, _, stage_do), tdVrdV);
        }

        // dS visible to every warpgroup before dQ = dS K.
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(NumMmaThreads, uint32_t(BwdBarrier::kPdS));
        wgmma_gemm<true, 1, dQ_swapAB>(tiled_mma_dQ, tdQrdS(_, _, _, stage_ds), tdQrK, tdQrdQ);
        pipeline_do.consumer_release(read_do);  // the dV MMA is done with dO

        // dK += dS^T Q
        if constexpr (Mma_dKV_is_RS) {
          Tensor tdKrdS = make_tensor(rdS.data(), acc_as_a_operand_layout(rdS.layout()));
          wgmma_gemm<false, 1, false>(tiled_mma_dK, tdKrdS, tdKrQ(_, _, _, stage_q), tdKrdK);
        } else {
          Tensor tdKrdS = mma_operand_fragment<!dKV_swapAB>(wg_mma_dK, sdSt);
          wgmma_gemm<false, 1, dKV_swapAB>(tiled_mma_dK, tdKrdS(_, _, _, stage_ds), tdKrQ(_, _, _, stage_q), tdKrdK);
        }

        // dQ out.
        if constexpr (kDqViaSmem) {
          cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp,
                                            uint32_t(BwdBarrier::kDqEmpty) + wg_idx);
          trace::mark_bwd(thread_idx, trace::kBwdDqBuffer);
          float4* sdq = reinterpret_cast<float4*>(smem.dq.data() + wg_idx * (kDqChunk / NumMmaWG));
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < kDqVecs; ++i) { sdq[i * cutlass::NumThreadsPerWarpGroup + thread_in_wg] = dq_vec(i); }
          cutlass::arch::fence_view_async_shared();
          cutlass::arch::NamedBarrier::arrive(cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp,
                                              uint32_t(BwdBarrier::kDqFull) + wg_idx);
        } else {
          dq_atomics_wait();
          dq_atomics(Int<0>{}, Int<kDqVecs>{});
          dq_atomics_release();
        }
        trace::mark_bwd(thread_idx, trace::kBwdDq0);
      }

      warpgroup_wait<0>();
      trace::mark_bwd(thread_idx, trace::kBwdStepEnd);
      pipeline_q.consumer_release(read_q);  // the dK MMA is done with Q
      ++read_q;
      ++read_do;
    }
    return true;
  }
};

}  // namespace cuflash::sm90::bwd
