// Backward pass of the reference, accumulated in double:
//   P = exp(S - lse), dP = dO V^T, D_i = rowsum(dO * O) - dlse_i, dS = P * (dP - D) * dscore/draw,
//   dQ = scale * dS K, dK = scale * dS^T Q, dV = P^T dO, d_sink[h] = -sum_i exp(sink - lse_i) D_i.
// The softmax statistics are recomputed in double from q, k and v rather than taken from the
// lse argument, so that the oracle does not inherit the forward pass's fp32 rounding. dlse, the
// gradient reaching lse (d lse_i / d s_ij = P_ij, d lse_i / d sink = P_sink), enters through D.
#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "reference/attention.hpp"
#include "reference/parallel.hpp"
#include "reference/reference.hpp"

namespace cuflash::reference {
namespace {

// Gradients one (batch entry, query head) task contributes to its kv head's keys and to its sink.
struct HeadGradients {
  std::vector<double> dk, dv;  // seqlen_k x head_dim, seqlen_k x head_dim_v
  double d_sink = 0.0;
};

// Writes the dq rows of (b, h) and returns its contributions to dk, dv and d_sink.
HeadGradients backward_head(const BackwardArgs& args, const AttentionProblem& problem, int b,
                            int h) {
  const Sequences& seqs = problem.seqs;
  const std::int64_t head_dim = problem.head_dim, head_dim_v = problem.head_dim_v;
  const HeadMask head_mask = problem.mask.head(b, h);
  const std::int64_t seqlen_q = head_mask.seqlen_q, seqlen_k = head_mask.seqlen_k;
  const double scale = problem.score.scale();
  const std::int64_t kv_head = problem.kv_head(h);
  const std::vector<double> k = load_rows(seqs.k, args.k, b, kv_head, seqlen_k);
  const std::vector<double> v = load_rows(seqs.k, args.v, b, kv_head, seqlen_k);
  const std::vector<double> q = load_rows(seqs.q, args.q, b, h, seqlen_q);
  const std::vector<double> out = load_rows(seqs.q, args.out, b, h, seqlen_q);
  const std::vector<double> dout = load_rows(seqs.q, args.dout, b, h, seqlen_q);

  HeadGradients grads;
  grads.dk.assign(seqlen_k * head_dim, 0.0);
  grads.dv.assign(seqlen_k * head_dim_v, 0.0);
  const std::optional<TensorView> dlse =
      args.dlse ? std::optional<TensorView>(lse_by_rows(*args.dlse)) : std::nullopt;
  std::vector<double> scores, slopes, dq_row(head_dim);
  for (std::int64_t i = 0; i < seqs.q.capacity[b]; ++i) {
    std::fill(dq_row.begin(), dq_row.end(), 0.0);
    if (i >= seqlen_q) {
      store_row(seqs.q, args.dq, b, i, h, nullptr);
      continue;
    }
    const double* q_row = q.data() + i * head_dim;
    const double* do_row = dout.data() + i * head_dim_v;
    problem.score_row(head_mask, h, i, q_row, k, scores, &slopes);

    const double sink = problem.has_sink() ? problem.sinks[h] : kNegativeInfinity;
    double max = sink;
    for (double s : scores) max = std::max(max, s);
    if (max == kNegativeInfinity) {  // nothing visible and no sink: no gradient
      store_row(seqs.q, args.dq, b, i, h, nullptr);
      continue;
    }
    double sum = problem.has_sink() ? std::exp(sink - max) : 0.0;
    for (double s : scores) sum += s == kNegativeInfinity ? 0.0 : std::exp(s - max);
    const double lse = max + std::log(sum);

    double delta = 0.0;  // D_i, from the given output as on the GPU
    for (std::int64_t d = 0; d < head_dim_v; ++d) delta += do_row[d] * out[i * head_dim_v + d];
    if (dlse) delta -= load(*dlse, seqs.q.offset(*dlse, b, i) + h * dlse->stride_of(-1));

    for (std::int64_t j = 0; j < seqlen_k; ++j) {
      if (scores[j] == kNegativeInfinity) continue;
      const double p = std::exp(scores[j] - lse);
      const double* v_row = v.data() + j * head_dim_v;
      const double dp = dot_product(do_row, v_row, head_dim_v);
      const double ds = p * (dp - delta) * slopes[j];
      const double* k_row = k.data() + j * head_dim;
      for (std::int64_t d = 0; d < head_dim; ++d) {
        dq_row[d] += ds * k_row[d];
        grads.dk[j * head_dim + d] += scale * ds * q_row[d];
      }
      for (std::int64_t d = 0; d < head_dim_v; ++d) grads.dv[j * head_dim_v + d] += p * do_row[d];
    }
    for (double& value : dq_row) value *= scale;
    store_row(seqs.q, args.dq, b, i, h, dq_row.data());
    if (problem.has_sink()) grads.d_sink -= std::exp(sink - lse) * delta;
  }
  return grads;
}

// Storage rows of k that belong to some sequence: the rows dk / dv are written to.
std::vector<bool> written_storage_rows(const SequenceRows& rows, const TensorView& k) {
  std::int64_t count = k.shape[0];
  if (rows.layout == TokenLayout::kDense) count = rows.batch * rows.dense_rows;
  if (rows.layout == TokenLayout::kPaged) count = k.shape[0] * rows.page_size;
  // Dense and paged: every row (unreferenced pages get zeros). Packed: rows of the
  // sequences only; rows past cu_seqlens_k[B] are not touched.
  std::vector<bool> written(count, rows.layout != TokenLayout::kPacked);
  if (rows.layout == TokenLayout::kPacked) {
    for (int b = 0; b < rows.batch; ++b) {
      for (std::int64_t pos = 0; pos < rows.capacity[b]; ++pos) {
        const std::int64_t row = rows.start[b] + pos;
        if (row >= 0 && row < count) written[row] = true;
      }
    }
  }
  return written;
}

}  // namespace

void backward(const BackwardArgs& args) {
  const AttentionProblem problem(args.q, args.k, args.v, args.seq, args.opts, args.learnable_sink,
                                 /*backward=*/true);
  const SequenceRows& k_rows = problem.seqs.k;
  const std::int64_t num_heads_kv = problem.num_heads_kv;
  const std::int64_t head_dim = problem.head_dim, head_dim_v = problem.head_dim_v;
  const std::int64_t num_heads = problem.num_heads;
  const std::int64_t num_tasks = problem.seqs.batch * num_heads;

  // A task owns one (batch entry, query head): its dq rows are its own; dk / dv are summed
  // below over the query heads of a kv head and over sequences that share a page.
  std::vector<HeadGradients> grads(num_tasks);
  parallel_for(num_tasks, [&](std::int64_t task) {
    grads[task] = backward_head(args, problem, static_cast<int>(task / num_heads),
                                static_cast<int>(task % num_heads));
  });

  // Fixed-order reduction: the result does not depend on thread timing.
  const std::vector<bool> written = written_storage_rows(k_rows, args.k);
  const std::int64_t storage_rows = static_cast<std::int64_t>(written.size());
  std::vector<double> dk(storage_rows * num_heads_kv * head_dim, 0.0);
  std::vector<double> dv(storage_rows * num_heads_kv * head_dim_v, 0.0);
  for (std::int64_t task = 0; task < num_tasks; ++task) {
    const int b = static_cast<int>(task / num_heads);
    const std::int64_t kv_head = problem.kv_head(task % num_heads);
    for (std::int64_t j = 0; j < k_rows.length[b]; ++j) {
      const std::int64_t row = k_rows.storage_row(b, j);
      for (std::int64_t d = 0; d < head_dim; ++d) {
        dk[(row * num_heads_kv + kv_head) * head_dim + d] += grads[task].dk[j * head_dim + d];
      }
      for (std::int64_t d = 0; d < head_dim_v; ++d) {
        dv[(row * num_heads_kv + kv_head) * head_dim_v + d] += grads[task].dv[j * head_dim_v + d];
      }
    }
  }
  for (std::int64_t row = 0; row < storage_rows; ++row) {
    if (!written[row]) continue;
    for (std::int64_t kv_head = 0; kv_head < num_heads_kv; ++kv_head) {
      const std::int64_t dk_base =
          k_rows.storage_offset(args.dk, row) + kv_head * args.dk.stride_of(-2);
      const std::int64_t dv_base =
          k_rows.storage_offset(args.dv, row) + kv_head * args.dv.stride_of(-2);
      for (std::int64_t d = 0; d < head_dim; ++d) {
        store(args.dk, dk_base + d * args.dk.stride_of(-1),
              dk[(row * num_heads_kv + kv_head) * head_dim + d]);
      }
      for (std::int64_t d = 0; d < head_dim_v; ++d) {
        store(args.dv, dv_base + d * args.dv.stride_of(-1),
              dv[(row * num_heads_kv + kv_head) * head_dim_v + d]);
      }
    }
  }

  if (args.d_sink && problem.has_sink()) {
    std::vector<double> d_sink(num_heads, 0.0);
    for (std::int64_t task = 0; task < num_tasks; ++task) {
      d_sink[task % num_heads] += grads[task].d_sink;
    }
    for (std::int64_t h = 0; h < num_heads; ++h) {
      store(*args.d_sink, h * args.d_sink->stride[0], d_sink[h]);
    }
  }
}

}  // namespace cuflash::reference
