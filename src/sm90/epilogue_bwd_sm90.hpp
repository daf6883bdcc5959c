// Backward epilogue for sm90: dK / dV of one column block leave the MMA warpgroups either
// as fp16/bf16 tiles (MHA: staged through the K / V smem, then predicated 16-byte stores, which
// also keeps packed sequences from writing into their neighbours) or, when several query heads
// share a kv head, as fp32 atomics into dk_accum / dv_accum (fragment-order chunks, see
// mainloop_bwd_sm90.hpp), ordered by query head when deterministic.
#pragma once

#include "sm90/mainloop_bwd_sm90.hpp"

namespace cuflash::sm90::bwd {

template <class Mainloop>
struct EpilogueBwdSm90 {
  using Element = typename Mainloop::Element;
  static constexpr int kBlockN = Mainloop::kBlockN;
  static constexpr int kHeadDim = Mainloop::kHeadDim;
  static constexpr int kHeadDimV = Mainloop::kHeadDimV;
  static constexpr int NumMmaWG = Mainloop::NumMmaWG;
  static constexpr int NumMmaThreads = Mainloop::NumMmaThreads;
  static constexpr bool dKV_swapAB = Mainloop::dKV_swapAB;

  using SmemCopyAtomdKV = Copy_Atom<std::conditional_t<!dKV_swapAB, SM90_U32x4_STSM_N, SM90_U16x8_STSM_T>, Element>;
  using ShapedKAcc = std::conditional_t<!dKV_swapAB, Shape<Int<kBlockN>, Int<kHeadDim>>, Shape<Int<kHeadDim>, Int<kBlockN>>>;
  using ShapedVAcc = std::conditional_t<!dKV_swapAB, Shape<Int<kBlockN>, Int<kHeadDimV>>, Shape<Int<kHeadDimV>, Int<kBlockN>>>;

  struct Params {
    Element* dk;
    Element* dv;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
    float* dk_accum;     // GQA: (H_kv, k_rows_padded, kHeadDim), else null
    float* dv_accum;     // GQA: (H_kv, k_rows_padded, kHeadDimV)
    int* dkv_semaphore;  // GQA and deterministic: (H_kv, k_rows_padded / kBlockN)
    int k_rows_padded;
    int num_heads_kv;
    int head_dim, head_dim_v;  // actual (<= kHeadDim / kHeadDimV)
    float softmax_scale;
    int qhead_per_kvhead;
    bool varlen_k;  // dk / dv packed (total_k, H_kv, D): rows offset by cu_seqlens_k
    bool deterministic;
  };

  template <class TiledMma, class Frag, class SmemLayout, int kD>
  CUTE_DEVICE static void store_tile(Frag const& acc, Element* smem_ptr, Element* gmem, int64_t row_stride, int rows,
                                     int cols, int thread_idx) {
    Tensor rOut = make_tensor_like<Element>(acc);
    convert_fragment(acc, rOut);
    Tensor s = make_tensor(make_smem_ptr(smem_ptr), SmemLayout{});  // (N, D)
    Tensor s_view = cute::conditional_return<!dKV_swapAB>(
        as_position_independent_swizzle_tensor(s),
        as_position_independent_swizzle_tensor(
            make_tensor(make_smem_ptr(smem_ptr),
                        composition(SmemLayout{}, make_layout(make_shape(Int<kD>{}, Int<kBlockN>{}),
                                                              make_stride(Int<kBlockN>{}, _1{}))))));
    auto smem_tiled_copy = make_tiled_copy_C(SmemCopyAtomdKV{}, TiledMma{});
    auto smem_thr_copy = smem_tiled_copy.get_thread_slice(thread_idx);
    cute::copy(smem_tiled_copy, smem_thr_copy.retile_S(rOut), smem_thr_copy.partition_D(s_view));
    cutlass::arch::NamedBarrier::sync(NumMmaThreads, uint32_t(BwdBarrier::kEpilogue));
    // 16-byte chunks stay contiguous under the 16-bit K-major swizzles.
    constexpr int kChunks = kD / 8;
    for (int idx = thread_idx; idx < kBlockN * kChunks; idx += NumMmaThreads) {
      int const row = idx / kChunks;
      int const col = (idx % kChunks) * 8;
      if (row < rows && col < cols) {
        *reinterpret_cast<uint4*>(gmem + row * row_stride + col) = *reinterpret_cast<uint4 const*>(&s(row, col));
      }
    }
  }

  template <class Frag>
  CUTE_DEVICE static void atomic_add_chunk(Frag const& acc, float* chunk, int thread_idx) {
    constexpr int kVecs = decltype(size(acc))::value / 4;
    constexpr int kWgChunk = decltype(size(acc))::value * cutlass::NumThreadsPerWarpGroup;
    int const wg = thread_idx / cutlass::NumThreadsPerWarpGroup;
    float4* dst = reinterpret_cast<float4*>(chunk + wg * kWgChunk) + thread_idx % cutlass::NumThreadsPerWarpGroup;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVecs; ++i) {
      atomicAdd(dst + i * cutlass::NumThreadsPerWarpGroup,
                make_float4(acc(4 * i), acc(4 * i + 1), acc(4 * i + 2), acc(4 * i + 3)));
    }
  }

  // `any_rows`: the mainloop visited at least one row block (else the fragments are zero).
  template <class FragdK, class FragdV>
  CUTE_DEVICE static void store(Params const& p, typename Mainloop::TensorStorage& smem, FragdK& tdKrdK,
                                FragdV& tdVrdV, bool any_rows, int thread_idx, BwdSeqlen const& seq, int n_block,
                                int head, int batch) {
    if (p.dk_accum == nullptr) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tdKrdK); ++i) { tdKrdK(i) *= p.softmax_scale; }
      int64_t const row0 = seq.offset_k + int64_t(n_block) * kBlockN;
      Element* dk = p.dk + (p.varlen_k ? 0 : batch * p.dk_batch_stride) + row0 * p.dk_row_stride + head * p.dk_head_stride;
      Element* dv = p.dv + (p.varlen_k ? 0 : batch * p.dv_batch_stride) + row0 * p.dv_row_stride + head * p.dv_head_stride;
      // Rows past seqused_k (up to the batch's own rows) get zeros.
      int const rows = seq.capacity_k - n_block * kBlockN;
      // Every warpgroup must be done reading K / V before they are overwritten.
      cutlass::arch::NamedBarrier::sync(NumMmaThreads, uint32_t(BwdBarrier::kEpilogue));
      store_tile<typename Mainloop::TiledMmadV, FragdV, typename Mainloop::SmemLayoutV, kHeadDimV>(
          tdVrdV, smem.v.data(), dv, p.dv_row_stride, rows, p.head_dim_v, thread_idx);
      store_tile<typename Mainloop::TiledMmadK, FragdK, typename Mainloop::SmemLayoutK, kHeadDim>(
          tdKrdK, smem.k.data(), dk, p.dk_row_stride, rows, p.head_dim, thread_idx);
    } else {
      int const head_kv = head / p.qhead_per_kvhead;
      int* semaphore =
          p.dkv_semaphore + workspace_row_block(head_kv, p.k_rows_padded, seq.offset_k_padded, kBlockN, n_block);
      if (p.deterministic) {
        if (thread_idx == 0) { semaphore_poll_eq(semaphore, head - head_kv * p.qhead_per_kvhead); }
        cutlass::arch::NamedBarrier::sync(NumMmaThreads, uint32_t(BwdBarrier::kEpilogue));
      }
      if (any_rows) {
        int64_t const row0 = int64_t(head_kv) * p.k_rows_padded + seq.offset_k_padded + int64_t(n_block) * kBlockN;
        atomic_add_chunk(tdKrdK, p.dk_accum + row0 * kHeadDim, thread_idx);
        atomic_add_chunk(tdVrdV, p.dv_accum + row0 * kHeadDimV, thread_idx);
      }
      if (p.deterministic) {
        // The barrier orders every thread's atomics before thread 0's release, which is
        // cumulative over them (as a CTA's stores before a CUTLASS semaphore release).
        cutlass::arch::NamedBarrier::sync(NumMmaThreads, uint32_t(BwdBarrier::kEpilogue));
        if (thread_idx == 0) { semaphore_increment(semaphore); }
      }
    }
  }
};

}  // namespace cuflash::sm90::bwd
