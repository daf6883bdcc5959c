// Backward preprocess for sm90: per query row, dPsum = rowsum(dO * O) - dlse and lse in log2 units,
// written to the padded workspace rows (see padded_rows in tile_size_bwd_sm90.hpp). Rows past
// a sequence's end, and rows whose lse is -inf (no visible key), get lse_log2 = +inf and
// dPsum = 0, so that the main kernel computes P = 0 for them without any row masking.
// dlse, the gradient reaching lse (d lse_i / d s_ij = P_ij), enters only here:
// dS = P * (dP - rowsum(dO * O)) + P * dlse = P * (dP - dPsum), and d_sink likewise.
// It also zeroes the head's dQ counter (BwdParams::dq_done) and the row block's first-writer
// tickets (BwdParams::dq_tickets); without tickets dq_accum is cleared by a memset before it
// (and with block lists, where the lists say so, by flash_bwd_dq_clear_sm90 after it).
// Measured on the H100 (bench/NOTES.md, "Run of 2026-12-05 (twentieth)" and the run after it):
// clearing dq_accum here as well took 133 / 146 us at hdim256 / 128 against the
// memset's 42 plus this kernel's 58 / 76; spreading a row over more lanes with several rows' loads
// in flight per thread (75-92 registers) took 95 / 82 us; rows over as many lanes as the head dim
// fills, one load pair per lane (below), made the whole backward 1-2% faster at hdim128 and 2-7%
// at hdim64 (2k / 4k).
// A second small kernel reduces the learnable-sink gradient.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "sm90/tile_size_bwd_sm90.hpp"

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
  int* dq_done;     // (B, H), or null: zeroed here
  // First-writer tickets of dq_accum (BwdParams::dq_tickets), tickets_per_block per row block of
  // the workspace rows, or null: zeroed here for every row block a batch owns.
  int* dq_tickets;
  int tickets_per_block;
  int q_rows_padded;
  int seqlen_q;  // dense length, or max length when packed
  int head_dim_v;
  int const* cu_seqlens_q;
  int const* seqused_q;
  // The packed queries' row-block list (BwdParams::row_block_list, {sequence, row block}), or
  // null: the grid's x is an entry of the list and its z is 1.
  int2 const* row_blocks;
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

template <int kBlockM>
CUTE_DEVICE void preprocess_rows(int const* cu_seqlens_q, int const* seqused_q, int seqlen_q_dense, int batch,
                                 int& offset, int& offset_padded, int& seqlen, int& capacity) {
  bool const varlen = cu_seqlens_q != nullptr;
  offset = varlen ? cu_seqlens_q[batch] : 0;
  offset_padded = varlen ? (offset + batch * kBlockM) / kBlockM * kBlockM
                         : batch * ((seqlen_q_dense + kBlockM - 1) / kBlockM * kBlockM);
  capacity = varlen ? cu_seqlens_q[batch + 1] - offset : seqlen_q_dense;  // rows the batch owns
  seqlen = seqused_q ? min(seqused_q[batch], capacity) : capacity;  // capped as in BwdSeqlen
}

// Grid (ceil(seqlen_q / kBlockM), H, B), or with kRowList (row-block list entries, H, 1): a
// kernel of its own, since reading the row block and the batch from the list spills 48 bytes
// at hdim256 within the 32 registers below (ptxas, CUDA 13.0), which the grid's kernel stays
// free of (the list's kernel keeps them: its calls drop far more empty CTAs).
// A row is read by kLanesPerRow lanes of 8 elements each (head dims up to 256), so a warp covers
// 32 / kLanesPerRow rows at a time: every lane holds
// one load pair per step at every head dim, where one row per warp left half (hdim128) or three
// quarters (hdim64) of the lanes idle. One load pair per lane fits 32 registers (ptxas, CUDA
// 13.0; the launch bounds ask for 8 CTAs per SM, a full SM of warps), the occupancy that carries
// this kernel's memory parallelism; more rows' loads in flight per lane measured slower (above).
template <class Element, int kBlockM, int kHeadDimV, bool kRowList>
__global__ void __launch_bounds__(256, 8) flash_bwd_preprocess_sm90(PreprocessParams const p) {
  constexpr int kLanesPerRow = kHeadDimV > 128 ? 32 : kHeadDimV > 64 ? 16 : 8;
  static_assert(kHeadDimV <= kLanesPerRow * 8, "a row's 8-element chunks must fit its lanes");
  constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  constexpr int kRowsPerStep = 8 * kRowsPerWarp;  // 8 warps
  // So that a warp whose first row is in the block has all its rows there.
  static_assert(kBlockM % kRowsPerWarp == 0, "the block's rows must fill whole warps");
  int m_block = blockIdx.x;
  int const head = blockIdx.y;
  int batch = blockIdx.z;
  if constexpr (kRowList) {
    // Every sequence with rows has an entry of row block 0; the list's empty entries lie past
    // sequence 0's rows (no counter, no ticket, no row).
    int2 const entry = __ldg(p.row_blocks + blockIdx.x);
    batch = entry.x;
    m_block = entry.y;
  }
  if (p.dq_done != nullptr && m_block == 0 && threadIdx.x == 0) {
    p.dq_done[int64_t(batch) * gridDim.y + head] = 0;
  }
  int offset, offset_padded, seqlen, capacity;
  preprocess_rows<kBlockM>(p.cu_seqlens_q, p.seqused_q, p.seqlen_q, batch, offset, offset_padded, seqlen, capacity);
  bool const varlen = p.cu_seqlens_q != nullptr;
  // Every row block the batch owns, past seqused too: the postprocess converts those rows (no
  // column block writes them, so their tickets say zeros).
  if (p.dq_tickets != nullptr && int(threadIdx.x) < p.tickets_per_block && m_block * kBlockM < capacity) {
    int64_t const row_block = workspace_row_block(head, p.q_rows_padded, offset_padded, kBlockM, m_block);
    p.dq_tickets[row_block * p.tickets_per_block + threadIdx.x] = 0;
  }
  if (m_block * kBlockM >= ((seqlen + kBlockM - 1) / kBlockM) * kBlockM) { return; }
  int const warp = threadIdx.x / 32;
  int const lane = threadIdx.x % 32;
  int const col = (lane % kLanesPerRow) * 8;
  Element const* out = static_cast<Element const*>(p.out) + (varlen ? 0 : batch * p.o_batch_stride) + head * p.o_head_stride;
  Element const* dout = static_cast<Element const*>(p.dout) + (varlen ? 0 : batch * p.do_batch_stride) + head * p.do_head_stride;
  float const* lse = p.lse + (varlen ? 0 : batch * p.lse_batch_stride) + head * p.lse_head_stride + offset;
  float const* dlse = p.dlse == nullptr
                          ? nullptr
                          : p.dlse + (varlen ? 0 : batch * p.dlse_batch_stride) + head * p.dlse_head_stride + offset;
  int64_t const stats = int64_t(head) * p.q_rows_padded + offset_padded;
  // The bound is the warp's first row, the same for all its lanes, so that the shuffles below
  // always run on the full warp.
  for (int r_warp = warp * kRowsPerWarp; r_warp < kBlockM; r_warp += kRowsPerStep) {
    int const r = r_warp + lane / kLanesPerRow;
    int const row = m_block * kBlockM + r;
    // The row's lse and dlse are loaded beside O and dO, so that a step waits for one round
    // trip to memory; loaded after the row sum's shuffles they made it two (three with dlse).
    float row_lse = -INFINITY, row_dlse = 0.f;
    if (row < seqlen) {
      row_lse = lse[row];
      if (dlse != nullptr) { row_dlse = dlse[row]; }
    }
    float sum = 0.f;
    if (row < seqlen && col < p.head_dim_v) {
      int64_t const grow = offset + row;
      uint4 const o_raw = *reinterpret_cast<uint4 const*>(out + grow * p.o_row_stride + col);
      uint4 const do_raw = *reinterpret_cast<uint4 const*>(dout + grow * p.do_row_stride + col);
      Element const* o8 = reinterpret_cast<Element const*>(&o_raw);
      Element const* do8 = reinterpret_cast<Element const*>(&do_raw);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 8; ++i) { sum += float(o8[i]) * float(do8[i]); }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int s = kLanesPerRow / 2; s > 0; s /= 2) { sum += __shfl_xor_sync(0xffffffff, sum, s); }
    if (lane % kLanesPerRow == 0) {
      float lse_log2 = INFINITY;
      if (row_lse != -INFINITY) {  // also rows past seqlen
        lse_log2 = row_lse * float(M_LOG2E);
        sum -= row_dlse;
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
