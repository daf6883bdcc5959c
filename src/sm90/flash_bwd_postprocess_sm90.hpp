// Backward postprocess for sm90: fp32 accumulators (dQ, and dK / dV when query heads share a
// kv head) to fp16/bf16 with scaling. Each CTA reads one fragment-order chunk exactly as the
// main kernel's MMA threads wrote it (see mainloop_bwd_sm90.hpp), places the values by the
// same MMA partitioning into a row-major smem tile, then writes rows with 16-byte stores.
#pragma once

#include <cute/tensor.hpp>

#include "sm90/mainloop_bwd_sm90.hpp"

namespace cuflash::sm90::bwd {

struct PostprocessParams {
  float const* accum;  // (H, rows_padded, kCols) in chunks of kRows * kCols
  void* out;           // (B, S, H, D) or packed (total, H, D)
  int64_t out_batch_stride, out_row_stride, out_head_stride;
  int rows_padded;
  int seqlen;  // dense length, or max length when packed
  int cols;    // actual head dim
  float scale;
  int const* cu_seqlens;
};

// Grid (ceil(seqlen / kRows), heads, B), size(TiledMma) threads. `Swapped`: the accumulator
// holds the (cols, rows) transpose.
template <class Element, class TiledMma, bool Swapped, int kRows, int kCols>
__global__ void __launch_bounds__(decltype(size(TiledMma{}))::value)
    flash_bwd_postprocess_sm90(PostprocessParams const p) {
  using namespace cute;
  constexpr int NumThreads = decltype(size(TiledMma{}))::value;
  constexpr int kPad = 8;  // breaks smem bank conflicts between rows
  __shared__ alignas(16) Element tile[kRows][kCols + kPad];

  int const block = blockIdx.x;
  int const head = blockIdx.y;
  int const batch = blockIdx.z;
  bool const varlen = p.cu_seqlens != nullptr;
  int const offset = varlen ? p.cu_seqlens[batch] : 0;
  int const offset_padded = varlen ? (offset + batch * kRows) / kRows * kRows
                                   : batch * ((p.seqlen + kRows - 1) / kRows * kRows);
  // Every row the batch owns is written: rows past seqused hold zero sums.
  int const capacity = varlen ? p.cu_seqlens[batch + 1] - offset : p.seqlen;
  if (block * kRows >= capacity) { return; }

  using AccShape = std::conditional_t<!Swapped, Shape<Int<kRows>, Int<kCols>>, Shape<Int<kCols>, Int<kRows>>>;
  int const thread_idx = threadIdx.x;
  auto thr_mma = TiledMma{}.get_thread_slice(thread_idx);
  Tensor coords = thr_mma.partition_C(make_identity_tensor(AccShape{}));
  constexpr int kValues = decltype(size(coords))::value;
  constexpr int kWgChunk = kValues * cutlass::NumThreadsPerWarpGroup;
  float const* chunk = p.accum + (int64_t(head) * p.rows_padded + offset_padded + int64_t(block) * kRows) * kCols +
                       (thread_idx / cutlass::NumThreadsPerWarpGroup) * kWgChunk;
  float4 const* src = reinterpret_cast<float4 const*>(chunk) + thread_idx % cutlass::NumThreadsPerWarpGroup;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kValues / 4; ++i) {
    float4 const v = src[i * cutlass::NumThreadsPerWarpGroup];
    float const vals[4] = {v.x, v.y, v.z, v.w};
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 4; ++j) {
      auto const c = coords(4 * i + j);
      int const row = get<Swapped ? 1 : 0>(c);
      int const col = get<Swapped ? 0 : 1>(c);
      tile[row][col] = Element(vals[j] * p.scale);
    }
  }
  __syncthreads();

  Element* out = static_cast<Element*>(p.out) + (varlen ? 0 : batch * p.out_batch_stride) +
                 (int64_t(offset) + int64_t(block) * kRows) * p.out_row_stride + head * p.out_head_stride;
  int const rows = capacity - block * kRows;
  constexpr int kChunks = kCols / 8;
  for (int idx = thread_idx; idx < kRows * kChunks; idx += NumThreads) {
    int const row = idx / kChunks;
    int const col = (idx % kChunks) * 8;
    if (row < rows && col < p.cols) {
      *reinterpret_cast<uint4*>(out + row * p.out_row_stride + col) = *reinterpret_cast<uint4 const*>(&tile[row][col]);
    }
  }
}

}  // namespace cuflash::sm90::bwd
