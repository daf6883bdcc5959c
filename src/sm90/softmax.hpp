// Online softmax over WGMMA accumulators, in base 2 with the softmax scale folded into
// one FFMA per score: p = exp2(s * scale_log2 - max * scale_log2).
// Each thread holds kRows rows; the four threads of a quad share a row.
#pragma once

#include <cutlass/cutlass.h>

#include <cmath>
#include <cute/tensor.hpp>

#include "sm90/utils_sm90.hpp"

namespace cuflash::sm90 {

CUTLASS_DEVICE float quad_allreduce_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
}

CUTLASS_DEVICE float quad_allreduce_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 2);
  return x + __shfl_xor_sync(0xffffffff, x, 1);
}

// kLazyRescaleLog2 > 0: the running max of a row moves only when a block's max exceeds it by more
// than 2^kLazyRescaleLog2 in probability (FlashAttention-4's conditional rescaling). Until then
// the row keeps its old reference point: its probabilities may reach 2^kLazyRescaleLog2 (fine in
// fp32 and in the bf16 / fp16 P), nothing changes in the result but rounding, and its output
// needs no rescale, so a warp none of whose rows moved skips the FMUL per output element of that
// n-block. 0: the max moves whenever it grows.
template <int kRows, int kLazyRescaleLog2 = 0>
struct OnlineSoftmax {
  static constexpr int kNumRows = kRows;
  // Running max of the raw (unscaled) scores; with kLazyRescaleLog2, the reference point, which
  // may sit up to kLazyRescaleLog2 / scale_log2 below that max.
  float row_max[kRows];
  float row_sum[kRows];  // this thread's part of the running denominator
  float scale_log2;

  CUTLASS_DEVICE explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {}

  // Turns scores into unnormalised probabilities in place; scores_scale receives the
  // factor by which the running output must be rescaled.
  template <bool kFirst, class TensorS>
  CUTLASS_DEVICE void online(TensorS& tSrS, float (&scores_scale)[kRows]) {
    using namespace cute;
    Tensor scores = make_tensor(tSrS.data(), acc_rowcol_layout(tSrS.layout()));
    static_assert(decltype(size<0>(scores))::value == kRows);
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      float block_max = kFirst ? -INFINITY : row_max[m];
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(scores); ++n) block_max = fmaxf(block_max, scores(m, n));
      block_max = quad_allreduce_max(block_max);
      bool kept = false;
      if constexpr (!kFirst && kLazyRescaleLog2 > 0) {
        // False when the row has seen no key yet (+inf or NaN): the max then moves as before.
        kept = (block_max - row_max[m]) * scale_log2 <= float(kLazyRescaleLog2);
        if (kept) block_max = row_max[m];
      }
      // A row with no visible key so far keeps max -inf; subtracting 0 keeps exp2 at 0, not NaN.
      float const max_scaled = block_max == -INFINITY ? 0.f : block_max * scale_log2;
      scores_scale[m] = kFirst || kept ? 1.f : exp2f(row_max[m] * scale_log2 - max_scaled);
      row_max[m] = block_max;
      float sum = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(scores); ++n) {
        float const p = exp2f(scores(m, n) * scale_log2 - max_scaled);
        scores(m, n) = p;
        sum += p;
      }
      row_sum[m] = kFirst ? sum : row_sum[m] * scores_scale[m] + sum;
    }
  }

  template <class TensorO>
  CUTLASS_DEVICE void rescale_o(TensorO& tOrO, float const (&scores_scale)[kRows]) const {
    using namespace cute;
    Tensor out = make_tensor(tOrO.data(), acc_rowcol_layout(tOrO.layout()));
    if constexpr (kLazyRescaleLog2 > 0) {
      bool moved = false;
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < kRows; ++m) moved |= scores_scale[m] != 1.f;
      if (!__any_sync(0xffffffff, moved)) return;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(out); ++n) out(m, n) *= scores_scale[m];
    }
  }

  // Final normalisation. sink_log2: the sink logit times log2(e), or -inf without a sink.
  // Gives the factor for each output row and its log-sum-exp (natural log); a row that saw
  // no key and no sink gets factor 0 and lse -inf.
  // sink_log2: per row, since packed GQA tiles hold rows of several heads.
  CUTLASS_DEVICE void finalize(float const (&sink_log2_rows)[kRows], float (&out_scale)[kRows],
                               float (&lse)[kRows]) const {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      float const sink_log2 = sink_log2_rows[m];
      float sum = quad_allreduce_sum(row_sum[m]);
      float const max_scaled = row_max[m] == -INFINITY ? -INFINITY : row_max[m] * scale_log2;
      // The sink joins the denominator; taking the larger of the two maxima keeps exp2 finite.
      float const max_all = fmaxf(max_scaled, sink_log2);
      float const row_factor = max_all == -INFINITY ? 0.f : exp2f(max_scaled - max_all);
      float const sink_term = sink_log2 == -INFINITY ? 0.f : exp2f(sink_log2 - max_all);
      float const denom = sum * row_factor + sink_term;
      bool const empty = !(denom > 0.f);
      out_scale[m] = empty ? 0.f : row_factor / denom;
      lse[m] = empty ? -INFINITY : max_all * float(M_LN2) + __logf(denom);
    }
  }
};

}  // namespace cuflash::sm90
