// Forward pass of the reference: exact softmax attention accumulated in double.
#include <algorithm>
#include <cmath>
#include <vector>

#include "reference/attention.hpp"
#include "reference/parallel.hpp"
#include "reference/reference.hpp"

namespace cuflash::reference {
namespace {

// Softmax statistics and unnormalised output of one query row over a range of keys.
struct RowPartial {
  double max = kNegativeInfinity;
  double sum = 0.0;         // sum of exp(s - max)
  std::vector<double> acc;  // sum of exp(s - max) * v
};

RowPartial attend(const std::vector<double>& scores, const std::vector<double>& values,
                  std::int64_t head_dim_v, std::int64_t j_begin, std::int64_t j_end) {
  RowPartial partial;
  partial.acc.assign(head_dim_v, 0.0);
  for (std::int64_t j = j_begin; j < j_end; ++j) partial.max = std::max(partial.max, scores[j]);
  if (partial.max == kNegativeInfinity) return partial;
  for (std::int64_t j = j_begin; j < j_end; ++j) {
    if (scores[j] == kNegativeInfinity) continue;
    const double p = std::exp(scores[j] - partial.max);
    partial.sum += p;
    const double* v_row = values.data() + j * head_dim_v;
    for (std::int64_t d = 0; d < head_dim_v; ++d) partial.acc[d] += p * v_row[d];
  }
  return partial;
}

void forward_single(const ForwardArgs& args, const AttentionProblem& problem) {
  const Sequences& seqs = problem.seqs;
  const std::int64_t num_heads = problem.num_heads;
  const std::int64_t head_dim_v = problem.head_dim_v;
  const std::optional<TensorView> lse =
      args.lse ? std::optional<TensorView>(lse_by_rows(*args.lse)) : std::nullopt;

  parallel_for(seqs.batch * num_heads, [&](std::int64_t task) {
    const int b = static_cast<int>(task / num_heads);
    const int h = static_cast<int>(task % num_heads);
    const HeadMask head_mask = problem.mask.head(b, h);
    const std::vector<double> q = load_rows(seqs.q, args.q, b, h, head_mask.seqlen_q);
    const std::vector<double> k =
        load_rows(seqs.k, args.k, b, problem.kv_head(h), head_mask.seqlen_k);
    const std::vector<double> v =
        load_rows(seqs.k, args.v, b, problem.kv_head(h), head_mask.seqlen_k);
    std::vector<double> scores, out_row(head_dim_v);
    for (std::int64_t i = 0; i < seqs.q.capacity[b]; ++i) {
      double row_lse = kNegativeInfinity;
      std::fill(out_row.begin(), out_row.end(), 0.0);
      if (i < head_mask.seqlen_q) {
        problem.score_row(head_mask, h, i, q.data() + i * problem.head_dim, k, scores, nullptr);
        const RowPartial partial = attend(scores, v, head_dim_v, 0, head_mask.seqlen_k);
        // The sink joins the denominator as one more logit with no value row.
        const double sink = problem.has_sink() ? problem.sinks[h] : kNegativeInfinity;
        const double max = std::max(partial.max, sink);
        if (max != kNegativeInfinity) {
          double sum = problem.has_sink() ? std::exp(sink - max) : 0.0;
          if (partial.sum > 0.0) sum += partial.sum * std::exp(partial.max - max);
          row_lse = max + std::log(sum);
          if (partial.sum > 0.0) {
            const double norm = std::exp(partial.max - row_lse);
            for (std::int64_t d = 0; d < head_dim_v; ++d) out_row[d] = partial.acc[d] * norm;
          }
        }
      }
      store_row(seqs.q, args.out, b, i, h, out_row.data());
      if (lse) store(*lse, seqs.q.offset(*lse, b, i) + h * lse->stride_of(-1), row_lse);
    }
  });
}

// Split-KV: fp32 partial results over equal chunks of each sequence's keys, merged by
// combine() as on the GPU. The sink becomes one more partial with lse = sink and out = 0,
// which is exactly its effect on the softmax.
void forward_split(const ForwardArgs& args, const AttentionProblem& problem, int num_splits) {
  const Sequences& seqs = problem.seqs;
  const std::int64_t num_heads = problem.num_heads;
  const std::int64_t head_dim_v = problem.head_dim_v;
  const bool packed = seqs.q.layout == TokenLayout::kPacked;
  const std::int64_t num_parts = num_splits + (problem.has_sink() ? 1 : 0);
  // Contiguous (parts, B, Sq, H, Dv) or (parts, total_q, H, Dv).
  const std::int64_t batch_dims = packed ? 1 : 2;
  std::int64_t rows_per_part = args.q.shape[0] * (packed ? 1 : args.q.shape[1]);
  std::vector<float> out_partial(num_parts * rows_per_part * num_heads * head_dim_v, 0.0f);
  std::vector<float> lse_partial(num_parts * rows_per_part * num_heads,
                                 -std::numeric_limits<float>::infinity());
  TensorView out_view, lse_view;
  out_view.data = out_partial.data();
  lse_view.data = lse_partial.data();
  out_view.ndim = batch_dims + 3;
  lse_view.ndim = batch_dims + 2;
  out_view.shape[0] = lse_view.shape[0] = num_parts;
  for (int d = 0; d < batch_dims; ++d)
    out_view.shape[d + 1] = lse_view.shape[d + 1] = args.q.shape[d];
  out_view.shape[batch_dims + 1] = lse_view.shape[batch_dims + 1] = num_heads;
  out_view.shape[batch_dims + 2] = head_dim_v;
  for (TensorView* view : {&out_view, &lse_view}) {
    std::int64_t running = 1;
    for (int d = view->ndim - 1; d >= 0; --d) {
      view->stride[d] = running;
      running *= view->shape[d];
    }
  }

  parallel_for(seqs.batch * num_heads, [&](std::int64_t task) {
    const int b = static_cast<int>(task / num_heads);
    const int h = static_cast<int>(task % num_heads);
    const HeadMask head_mask = problem.mask.head(b, h);
    const std::int64_t seqlen_k = head_mask.seqlen_k;
    const std::int64_t chunk = (seqlen_k + num_splits - 1) / num_splits;
    const std::vector<double> q = load_rows(seqs.q, args.q, b, h, head_mask.seqlen_q);
    const std::vector<double> k = load_rows(seqs.k, args.k, b, problem.kv_head(h), seqlen_k);
    const std::vector<double> v = load_rows(seqs.k, args.v, b, problem.kv_head(h), seqlen_k);
    std::vector<double> scores, out_row(head_dim_v);
    for (std::int64_t i = 0; i < head_mask.seqlen_q; ++i) {
      problem.score_row(head_mask, h, i, q.data() + i * problem.head_dim, k, scores, nullptr);
      for (std::int64_t part = 0; part < num_parts; ++part) {
        const TensorView out_part = select_first(out_view, part);
        const TensorView lse_part = select_first(lse_view, part);
        double part_lse = kNegativeInfinity;
        std::fill(out_row.begin(), out_row.end(), 0.0);
        if (part == num_splits) {
          part_lse = problem.sinks[h];
        } else {
          const std::int64_t j_begin = std::min(part * chunk, seqlen_k);
          const std::int64_t j_end = std::min(j_begin + chunk, seqlen_k);
          const RowPartial partial = attend(scores, v, head_dim_v, j_begin, j_end);
          if (partial.sum > 0.0) {
            part_lse = partial.max + std::log(partial.sum);
            for (std::int64_t d = 0; d < head_dim_v; ++d) out_row[d] = partial.acc[d] / partial.sum;
          }
        }
        store_row(seqs.q, out_part, b, i, h, out_row.data());
        store(lse_part, seqs.q.offset(lse_part, b, i) + h * lse_part.stride_of(-1), part_lse);
      }
    }
  });

  CombineArgs merge;
  merge.out_partial = out_view;
  merge.lse_partial = lse_view;
  merge.out = args.out;
  if (args.lse) merge.lse = lse_by_rows(*args.lse);
  merge.cu_seqlens = args.seq.cu_seqlens_q;
  merge.seqused = args.seq.seqused_q;
  combine(merge);
}

}  // namespace

void forward(const ForwardArgs& args) {
  const AttentionProblem problem(args.q, args.k, args.v, args.seq, args.opts, args.learnable_sink,
                                 /*backward=*/false);
  // There is no occupancy to balance on the CPU, so the heuristic (num_splits <= 0) is 1.
  const int num_splits = std::max(args.num_splits, 1);
  if (num_splits == 1) {
    forward_single(args, problem);
  } else {
    forward_split(args, problem, num_splits);
  }
}

}  // namespace cuflash::reference
