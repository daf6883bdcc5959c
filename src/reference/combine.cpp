// Merge of split-KV partial results by their log-sum-exp (flash_attn_combine). The forward
// pass with num_splits > 1 runs through this code as well.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "reference/numeric.hpp"
#include "reference/parallel.hpp"
#include "reference/reference.hpp"
#include "reference/sequence.hpp"

namespace cuflash::reference {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

SequenceRows combine_rows(const CombineArgs& args) {
  const TensorView& out = args.out;
  if (out.ndim == 4) return dense_rows(static_cast<int>(out.shape[0]), out.shape[1], args.seqused);
  if (args.cu_seqlens) return packed_rows(*args.cu_seqlens, args.seqused);
  // Packed without cu_seqlens: all rows form one sequence, capped by seqused[0].
  SequenceRows rows;
  rows.layout = TokenLayout::kPacked;
  rows.batch = 1;
  rows.start = {0};
  rows.capacity = {out.shape[0]};
  rows.length = rows.capacity;
  if (args.seqused) {
    rows.length[0] = std::clamp<std::int64_t>(load_int(*args.seqused, 0), 0, out.shape[0]);
  }
  return rows;
}

}  // namespace

void combine(const CombineArgs& args) {
  const TensorView& out = args.out;
  const std::int64_t num_splits = args.out_partial.shape[0];
  const std::int64_t num_heads = out.size(-2);
  const std::int64_t head_dim = out.size(-1);
  const SequenceRows rows = combine_rows(args);

  std::vector<TensorView> out_parts, lse_parts;
  for (std::int64_t s = 0; s < num_splits; ++s) {
    out_parts.push_back(select_first(args.out_partial, s));
    lse_parts.push_back(select_first(args.lse_partial, s));
  }

  parallel_for(static_cast<std::int64_t>(rows.batch) * num_heads, [&](std::int64_t task) {
    const int b = static_cast<int>(task / num_heads);
    const std::int64_t h = task % num_heads;
    std::vector<double> split_lse(num_splits);
    std::vector<double> acc(head_dim);
    for (std::int64_t pos = 0; pos < rows.capacity[b]; ++pos) {
      double lse = kNegInf;
      std::fill(acc.begin(), acc.end(), 0.0);
      if (pos < rows.length[b]) {
        double max_lse = kNegInf;
        for (std::int64_t s = 0; s < num_splits; ++s) {
          const TensorView& part = lse_parts[s];
          split_lse[s] = load(part, rows.offset(part, b, pos) + h * part.stride_of(-1));
          max_lse = std::max(max_lse, split_lse[s]);
        }
        if (max_lse != kNegInf) {
          double sum = 0.0;
          for (double value : split_lse) sum += std::exp(value - max_lse);
          lse = max_lse + std::log(sum);
          for (std::int64_t s = 0; s < num_splits; ++s) {
            // An empty split (lse -inf) has weight 0; its partial output need not be finite.
            if (split_lse[s] == kNegInf) continue;
            const double weight = std::exp(split_lse[s] - lse);
            const TensorView& part = out_parts[s];
            const std::int64_t base = rows.offset(part, b, pos) + h * part.stride_of(-2);
            for (std::int64_t d = 0; d < head_dim; ++d) {
              acc[d] += weight * load(part, base + d * part.stride_of(-1));
            }
          }
        }
      }
      const std::int64_t base = rows.offset(out, b, pos) + h * out.stride_of(-2);
      for (std::int64_t d = 0; d < head_dim; ++d) store(out, base + d * out.stride_of(-1), acc[d]);
      if (args.lse)
        store(*args.lse, rows.offset(*args.lse, b, pos) + h * args.lse->stride_of(-1), lse);
    }
  });
}

}  // namespace cuflash::reference
