// Backward preprocess for sm90: per query row, dPsum = rowsum(dO * O) - dlse and lse in log2 units,
// written to the padded workspace rows (see padded_rows in tile_size_bwd_sm90.hpp). Rows past
// a sequence's end, and rows whose lse is -inf (no visible key), get lse_log2 = +inf and
// dPsum = 0, so that the main kernel computes P = 0 for them without any row masking.
// dlse, the gradient reaching lse (d lse_i / d s_ij = P_ij), enters only here:
// dS = P * (dP - rowsum(dO * O)) + P * dlse = P * (dP - dPsum), and d_sink likewise.
// It also clears the block's rows of the dQ sums and the head's dQ counter (BwdParams::dq_done),
// which a separate memset took 42 us of a 1.7 ms hdim256 backward for (bench/NOTES.md).
// A second small kernel reduces the learnable-sink gradient.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace cuflash::sm90::bwd {

struct PreprocessParams {
  void const* out;
  void const* dout;
  float const* lse;
  float const* dlse;  // lse's layout, or null
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t lse_batch_stride, lse_head_stride;
  int64_t dlse_batch_stride, dlse_head_stride;
  float* lse_log2;  // (H, q_rows_padded)
  float* dpsum;     // (H, q_rows_padded)
  float* dq_accum;  // (H, q_rows_padded, kHeadDim): cleared here
  int* dq_done;     // (B, H), or null: zeroed here
  int q_rows_padded;
  int seqlen_q;  // dense length, or max length when packed
  int head_dim_v;
  int const* cu_seqlens_q;
  int const* seqused_q;
};

struct DSinkParams {
  float const* lse_log2;
  float const* dpsum;
  void const* sink;  // (H,)
  int sink_dtype;    // cuflash::DType value: 0 fp16, 1 bf16, 2 fp32
  float* d_sink;     // (H,)
  int q_rows_padded;
  int batch;
  int seqlen_q;
  int const* cu_seqlens_q;
  int const* seqused_q;
};

// A batch's rows: where they start in the packed rows and in the padded workspace rows, how many
// the batch holds (capacity) and how many count (seqlen, capped by seqused).
template <int kBlockM>
CUTE_DEVICE void preprocess_rows(int const* cu_seqlens_q, int const* seqused_q, int seqlen_q_dense, int batch,
                                 int& offset, int& offset_padded, int& seqlen, int& capacity) {
  bool const varlen = cu_seqlens_q != nullptr;
  offset = varlen ? cu_seqlens_q[batch] : 0;
  offset_padded = varlen ? (offset + batch * kBlockM) / kBlockM * kBlockM
                         : batch * ((seqlen_q_dense + kBlockM - 1) / kBlockM * kBlockM);
  capacity = varlen ? cu_seqlens_q[batch + 1] - offset : seqlen_q_dense;
  seqlen = seqused_q ? min(seqused_q[batch], capacity) : capacity;  // capped as in BwdSeqlen
}

// Grid (ceil(seqlen_q / kBlockM), H, B), 256 threads. A row's 8-element chunks go to kLanes
// adjacent lanes (a power of two, so that the row sum reduces within them): 8 at hdim 64, 16 at
// 96 / 128, 32 above, and the CTA covers 256 / kLanes rows per pass. Each thread issues the loads
// of all its passes before any sum, so that they are in flight together. With one row per warp
// and one load pair in flight, hdim128 had left half the lanes idle and took 76 us where hdim256
// took 58 us for the same bytes (bench/NOTES.md).
template <class Element, int kBlockM, int kHeadDim, int kHeadDimV>
__global__ void __launch_bounds__(256) flash_bwd_preprocess_sm90(PreprocessParams const p) {
  constexpr int kThreads = 256;
  constexpr int kChunks = kHeadDimV / 8;
  constexpr int kLanes = kChunks <= 8 ? 8 : (kChunks <= 16 ? 16 : 32);
  static_assert(kChunks <= 32, "head dims up to 256");
  constexpr int kRowsPerPass = kThreads / kLanes;
  constexpr int kPasses = (kBlockM + kRowsPerPass - 1) / kRowsPerPass;
  int const m_block = blockIdx.x;
  int const head = blockIdx.y;
  int const batch = blockIdx.z;
  if (p.dq_done != nullptr && m_block == 0 && threadIdx.x == 0) {
    p.dq_done[int64_t(batch) * gridDim.y + head] = 0;
  }
  int offset, offset_padded, seqlen, capacity;
  preprocess_rows<kBlockM>(p.cu_seqlens_q, p.seqused_q, p.seqlen_q, batch, offset, offset_padded, seqlen, capacity);
  int64_t const stats = int64_t(head) * p.q_rows_padded + offset_padded;
  // dQ's sums start at zero in every block below the capacity: the postprocess converts all of
  // them (rows past seqused stay zero), the main kernel adds to those below seqused.
  if (m_block * kBlockM < capacity) {
    float4* dq = reinterpret_cast<float4*>(p.dq_accum + (stats + int64_t(m_block) * kBlockM) * kHeadDim);
    constexpr int kVecs = kBlockM * kHeadDim / 4;
    static_assert(kVecs % kThreads == 0);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVecs / kThreads; ++i) { dq[i * kThreads + threadIdx.x] = make_float4(0.f, 0.f, 0.f, 0.f); }
  }
  if (m_block * kBlockM >= ((seqlen + kBlockM - 1) / kBlockM) * kBlockM) { return; }
  bool const varlen = p.cu_seqlens_q != nullptr;
  int const lane_in_row = threadIdx.x % kLanes;
  int const row_in_pass = threadIdx.x / kLanes;
  int const col = lane_in_row * 8;
  Element const* out = static_cast<Element const*>(p.out) + (varlen ? 0 : batch * p.o_batch_stride) + head * p.o_head_stride;
  Element const* dout = static_cast<Element const*>(p.dout) + (varlen ? 0 : batch * p.do_batch_stride) + head * p.do_head_stride;
  float const* lse = p.lse + (varlen ? 0 : batch * p.lse_batch_stride) + head * p.lse_head_stride + offset;
  float const* dlse = p.dlse == nullptr
                          ? nullptr
                          : p.dlse + (varlen ? 0 : batch * p.dlse_batch_stride) + head * p.dlse_head_stride + offset;
  uint4 o_raw[kPasses], do_raw[kPasses];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kPasses; ++i) {
    int const r = i * kRowsPerPass + row_in_pass;
    int const row = m_block * kBlockM + r;
    o_raw[i] = make_uint4(0u, 0u, 0u, 0u);
    do_raw[i] = make_uint4(0u, 0u, 0u, 0u);
    if (r < kBlockM && row < seqlen && col < p.head_dim_v) {
      int64_t const grow = offset + row;
      o_raw[i] = *reinterpret_cast<uint4 const*>(out + grow * p.o_row_stride + col);
      do_raw[i] = *reinterpret_cast<uint4 const*>(dout + grow * p.do_row_stride + col);
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kPasses; ++i) {
    int const r = i * kRowsPerPass + row_in_pass;
    int const row = m_block * kBlockM + r;
    Element const* o8 = reinterpret_cast<Element const*>(&o_raw[i]);
    Element const* do8 = reinterpret_cast<Element const*>(&do_raw[i]);
    float sum = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 8; ++j) { sum += float(o8[j]) * float(do8[j]); }
    CUTLASS_PRAGMA_UNROLL
    for (int s = kLanes / 2; s > 0; s /= 2) { sum += __shfl_xor_sync(0xffffffff, sum, s); }
    if (lane_in_row == 0 && r < kBlockM) {
      float lse_log2 = INFINITY;
      if (row < seqlen) {
        float const l = lse[row];
        if (l != -INFINITY) {
          lse_log2 = l * float(M_LOG2E);
          if (dlse != nullptr) { sum -= dlse[row]; }
        }
      }
      p.lse_log2[stats + row] = lse_log2;
      p.dpsum[stats + row] = row < seqlen ? sum : 0.f;
    }
  }
}

// d_sink[h] = -sum_i exp(sink[h] - lse_i) * dPsum_i over all rows of all batches.
// Grid (H), 256 threads; a fixed reduction order keeps it deterministic.
template <int kBlockM>
__global__ void __launch_bounds__(256) flash_bwd_dsink_sm90(DSinkParams const p) {
  int const head = blockIdx.x;
  float sink;
  if (p.sink_dtype == 2) {
    sink = static_cast<float const*>(p.sink)[head];
  } else if (p.sink_dtype == 1) {
    sink = float(static_cast<cutlass::bfloat16_t const*>(p.sink)[head]);
  } else {
    sink = float(static_cast<cutlass::half_t const*>(p.sink)[head]);
  }
  float const sink_log2 = sink * float(M_LOG2E);
  float sum = 0.f;
  for (int b = 0; b < p.batch; ++b) {
    int offset, offset_padded, seqlen, capacity;
    preprocess_rows<kBlockM>(p.cu_seqlens_q, p.seqused_q, p.seqlen_q, b, offset, offset_padded, seqlen, capacity);
    int64_t const stats = int64_t(head) * p.q_rows_padded + offset_padded;
    for (int row = threadIdx.x; row < seqlen; row += blockDim.x) {
      float const lse_log2 = p.lse_log2[stats + row];
      if (lse_log2 != INFINITY) { sum += exp2f(sink_log2 - lse_log2) * p.dpsum[stats + row]; }
    }
  }
  __shared__ float partial[256];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int s = 128; s > 0; s /= 2) {
    if (int(threadIdx.x) < s) { partial[threadIdx.x] += partial[threadIdx.x + s]; }
    __syncthreads();
  }
  if (threadIdx.x == 0) { p.d_sink[head] = -partial[0]; }
}

}  // namespace cuflash::sm90::bwd
