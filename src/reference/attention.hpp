// What the forward and backward references share: sizes, sequences, scores, mask, sink.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "cuflash/options.hpp"
#include "reference/mask.hpp"
#include "reference/numeric.hpp"
#include "reference/score.hpp"
#include "reference/sequence.hpp"

namespace cuflash::reference {

constexpr double kNegativeInfinity = -std::numeric_limits<double>::infinity();

// Four partial sums: the additions pipeline and the result stays well within double precision.
inline double dot_product(const double* a, const double* b, std::int64_t n) {
  double sum[4] = {0.0, 0.0, 0.0, 0.0};
  std::int64_t d = 0;
  for (; d + 4 <= n; d += 4) {
    for (int lane = 0; lane < 4; ++lane) sum[lane] += a[d + lane] * b[d + lane];
  }
  for (; d < n; ++d) sum[0] += a[d] * b[d];
  return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

class AttentionProblem {
 public:
  AttentionProblem(const TensorView& q, const TensorView& k, const TensorView& v,
                   const SequenceLayout& seq, const AttentionOptions& opts,
                   const std::optional<TensorView>& learnable_sink, bool backward)
      : seqs(make_sequences(seq, q, k)),
        num_heads(q.size(-2)),
        num_heads_kv(k.size(-2)),
        head_dim(q.size(-1)),
        head_dim_v(v.size(-1)),
        score(opts, head_dim, num_heads),
        mask(opts, seqs, backward) {
    if (learnable_sink) {
      for (std::int64_t h = 0; h < num_heads; ++h) {
        sinks.push_back(load(*learnable_sink, h * learnable_sink->stride[0]));
      }
    }
  }
  AttentionProblem(const AttentionProblem&) = delete;
  AttentionProblem& operator=(const AttentionProblem&) = delete;

  std::int64_t kv_head(std::int64_t h) const { return h / (num_heads / num_heads_kv); }
  bool has_sink() const { return !sinks.empty(); }

  // Scores of query row i of head h against every key of the sequence (row-major `keys`,
  // seqlen_k x head_dim); hidden pairs get -inf. `slopes`, when given, receives
  // d score / d (scale * <q, k>) for the backward pass.
  void score_row(const HeadMask& head_mask, int h, std::int64_t i, const double* q_row,
                 const std::vector<double>& keys, std::vector<double>& scores,
                 std::vector<double>* slopes) const {
    const std::int64_t seqlen_k = head_mask.seqlen_k;
    scores.assign(seqlen_k, kNegativeInfinity);
    if (slopes) slopes->assign(seqlen_k, 0.0);
    for (std::int64_t j = 0; j < seqlen_k; ++j) {
      if (!head_mask.visible(i, j)) continue;
      const double* k_row = keys.data() + j * head_dim;
      const double dot = dot_product(q_row, k_row, head_dim);
      double slope = 0.0;
      scores[j] = score(score.scale() * dot, head_mask.batch(), h, i, j, &slope);
      if (slopes) (*slopes)[j] = slope;
    }
  }

  const Sequences seqs;
  const std::int64_t num_heads, num_heads_kv, head_dim, head_dim_v;
  const ScoreFunction score;
  const Mask mask;
  std::vector<double> sinks;  // empty without a learnable sink
};

// Rows [0, count) of head h of sequence b of `t` as a row-major (count x dim) matrix.
inline std::vector<double> load_rows(const SequenceRows& rows, const TensorView& t, int b,
                                     std::int64_t h, std::int64_t count) {
  const std::int64_t dim = t.size(-1);
  std::vector<double> result(count * dim);
  for (std::int64_t pos = 0; pos < count; ++pos) {
    const std::int64_t base = rows.offset(t, b, pos) + h * t.stride_of(-2);
    for (std::int64_t d = 0; d < dim; ++d) {
      result[pos * dim + d] = load(t, base + d * t.stride_of(-1));
    }
  }
  return result;
}

// Writes `values` (dim entries; null means zeros) to row (b, pos) of head h of `t`.
inline void store_row(const SequenceRows& rows, const TensorView& t, int b, std::int64_t pos,
                      std::int64_t h, const double* values) {
  const std::int64_t dim = t.size(-1);
  const std::int64_t base = rows.offset(t, b, pos) + h * t.stride_of(-2);
  for (std::int64_t d = 0; d < dim; ++d) {
    store(t, base + d * t.stride_of(-1), values ? values[d] : 0.0);
  }
}

// The lse tensor, (B, H, Sq) or (H, total_q), viewed as (B, Sq, H) or (total_q, H) so that
// SequenceRows::offset addresses its rows.
inline TensorView lse_by_rows(const TensorView& lse) {
  return lse.ndim == 3 ? swap_dims(lse, 1, 2) : swap_dims(lse, 0, 1);
}

}  // namespace cuflash::reference
