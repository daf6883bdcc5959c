// combine (flash_attn_combine) of the CPU reference: merging split-KV partial results by lse.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "naive_attention.hpp"

namespace cuflash::testing {
namespace {

struct CombineConfig {
  int splits = 3;
  int batch = 2;
  int seqlen = 5;
  std::vector<int> packed;  // non-empty: packed rows with these sequence lengths
  bool with_cu_seqlens = true;
  std::vector<int> seqused;
  int heads = 3;
  int head_dim = 8;
  DType out_dtype = DType::kFloat32;
  bool with_lse = true;
  Layout layout = Layout::kContiguous;
  bool lse_heads_major = false;  // lse_partial stored (splits, B, H, S) as the GPU writes it
  double empty_fraction = 0.2;   // partials with lse = -inf
  double lse_spread = 3.0;
  unsigned seed = 1;
};

class CombineCase {
 public:
  explicit CombineCase(const CombineConfig& cfg) : config(cfg), rng(cfg.seed) {
    const bool packed = !cfg.packed.empty();
    Index rows;
    if (packed) {
      std::vector<int> cu{0};
      for (int len : cfg.packed) cu.push_back(cu.back() + len);
      total = cu.back() + 2;  // two rows past the last sequence stay untouched
      rows = {total};
      cu_seqlens = int_tensor({static_cast<std::int64_t>(cu.size())}, cu);
      for (std::size_t b = 0; b < cfg.packed.size(); ++b) {
        sequences.push_back({cu[b], cfg.packed[b]});
      }
      if (!cfg.with_cu_seqlens) sequences = {{0, total}};
    } else {
      rows = {cfg.batch, cfg.seqlen};
      for (int b = 0; b < cfg.batch; ++b) sequences.push_back({b, cfg.seqlen});
    }
    for (std::size_t b = 0; b < sequences.size(); ++b) {
      used.push_back(cfg.seqused.empty() ? sequences[b].second
                                         : std::min(cfg.seqused[b], sequences[b].second));
    }
    if (!cfg.seqused.empty())
      seqused = int_tensor({static_cast<std::int64_t>(cfg.seqused.size())}, cfg.seqused);

    Index out_shape = rows, lse_shape = rows;
    out_shape.push_back(cfg.heads);
    out_shape.push_back(cfg.head_dim);
    lse_shape.push_back(cfg.heads);
    Index partial_shape = out_shape;
    partial_shape.insert(partial_shape.begin(), cfg.splits);
    Index lse_partial_shape = lse_shape;
    lse_partial_shape.insert(lse_partial_shape.begin(), cfg.splits);
    if (cfg.lse_heads_major)
      std::swap(lse_partial_shape[lse_partial_shape.size() - 1],
                lse_partial_shape[lse_partial_shape.size() - 2]);
    out_partial = HostTensor(DType::kFloat32, partial_shape, cfg.layout);
    lse_partial = HostTensor(DType::kFloat32, lse_partial_shape);
    out = HostTensor(cfg.out_dtype, out_shape, cfg.layout);
    lse = HostTensor(DType::kFloat32, lse_shape, cfg.layout);

    out_partial.fill_normal(rng);
    std::uniform_real_distribution<double> spread(-cfg.lse_spread, cfg.lse_spread);
    std::bernoulli_distribution empty(cfg.empty_fraction);
    lse_partial.for_each(
        [&](const Index& index) { lse_partial.set(index, empty(rng) ? -kInf : spread(rng)); });
  }

  // lse_partial[s, row..., h] whatever its storage order.
  double partial_lse(int s, const Index& row, int h) const {
    Index index{s};
    index.insert(index.end(), row.begin(), row.end());
    if (config.lse_heads_major) {
      index.insert(index.end() - 1, h);  // (s, [b,] h, pos)
    } else {
      index.push_back(h);
    }
    return lse_partial.at(index);
  }

  TensorView lse_partial_view() const {
    TensorView view = lse_partial.view();
    if (config.lse_heads_major) {
      std::swap(view.shape[view.ndim - 1], view.shape[view.ndim - 2]);
      std::swap(view.stride[view.ndim - 1], view.stride[view.ndim - 2]);
    }
    return view;
  }

  CombineArgs args() const {
    CombineArgs a;
    a.out_partial = out_partial.view();
    a.lse_partial = lse_partial_view();
    a.out = out.view();
    if (config.with_lse) a.lse = lse.view();
    if (!config.packed.empty() && config.with_cu_seqlens) a.cu_seqlens = cu_seqlens.view();
    if (!config.seqused.empty()) a.seqused = seqused.view();
    return a;
  }

  void run(Entry entry = Entry::kPublic) {
    out.poison();
    lse.poison();
    call_combine(args(), entry);
  }

  Index row_index(int b, int pos) const {
    if (config.packed.empty()) return {b, pos};
    return {sequences[b].first + pos};
  }

  void check() const {
    std::vector<double> out_expected(out.storage_size(), kNaN);
    std::vector<double> lse_expected(lse.storage_size(), kNaN);
    for (std::size_t b = 0; b < sequences.size(); ++b) {
      for (int pos = 0; pos < sequences[b].second; ++pos) {
        const Index row = row_index(static_cast<int>(b), pos);
        for (int h = 0; h < config.heads; ++h) {
          Index index = row;
          index.push_back(h);
          double merged = -kInf;
          std::vector<double> acc(config.head_dim, 0.0);
          if (pos < used[b]) {
            double max = -kInf;
            for (int s = 0; s < config.splits; ++s) max = std::max(max, partial_lse(s, row, h));
            double sum = 0.0;
            for (int s = 0; s < config.splits; ++s) sum += std::exp(partial_lse(s, row, h) - max);
            merged = max == -kInf ? -kInf : max + std::log(sum);
            for (int s = 0; s < config.splits; ++s) {
              const double lse_s = partial_lse(s, row, h);
              if (lse_s == -kInf) continue;
              Index partial{s};
              partial.insert(partial.end(), index.begin(), index.end());
              partial.push_back(0);
              for (int d = 0; d < config.head_dim; ++d) {
                partial.back() = d;
                acc[d] += std::exp(lse_s - merged) * out_partial.at(partial);
              }
            }
            if (merged == -kInf) std::fill(acc.begin(), acc.end(), 0.0);
          }
          lse_expected[lse.offset(index)] = merged;
          index.push_back(0);
          for (int d = 0; d < config.head_dim; ++d) {
            index.back() = d;
            out_expected[out.offset(index)] = acc[d];
          }
        }
      }
    }
    EXPECT_TRUE(compare_tensor("out", out, out_expected, dtype_tolerance(config.out_dtype)));
    if (config.with_lse) {
      EXPECT_TRUE(compare_tensor("lse", lse, lse_expected, kLseTolerance));
    }
  }

  CombineConfig config;
  std::mt19937 rng;
  std::int64_t total = 0;
  std::vector<std::pair<int, int>> sequences;  // (first row or batch index, rows)
  std::vector<int> used;
  HostTensor out_partial, lse_partial, out, lse, cu_seqlens, seqused;
};

void check(const CombineConfig& config, Entry entry = Entry::kPublic) {
  CombineCase c(config);
  c.run(entry);
  c.check();
}

TEST(ReferenceCombine, DenseOutputDtypes) {
  unsigned seed = 1;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int splits : {1, 2, 5}) {
      CombineConfig c;
      c.out_dtype = dtype;
      c.splits = splits;
      c.seed = seed++;
      check(c);
    }
  }
}

TEST(ReferenceCombine, PackedWithCuSeqlens) {
  unsigned seed = 20;
  CombineConfig c;
  c.packed = {3, 0, 6, 1};
  c.seed = seed++;
  check(c);
  c.out_dtype = DType::kBFloat16;
  c.with_lse = false;
  c.seed = seed++;
  check(c);
  // Without cu_seqlens every packed row is one sequence.
  c = CombineConfig{};
  c.packed = {4, 5};
  c.with_cu_seqlens = false;
  c.seed = seed++;
  check(c);
}

TEST(ReferenceCombine, SequsedRowsAreZero) {
  unsigned seed = 30;
  CombineConfig c;
  c.batch = 3;
  c.seqused = {5, 2, 0};
  c.seed = seed++;
  check(c);
  c = CombineConfig{};
  c.packed = {4, 0, 6};
  c.seqused = {1, 0, 6};
  c.seed = seed++;
  check(c);
}

TEST(ReferenceCombine, AllEmptySplitsGiveZeroAndMinusInfinity) {
  CombineConfig c;
  c.empty_fraction = 1.0;
  c.seed = 40;
  CombineCase run(c);
  run.run();
  run.check();
  run.lse.for_each([&](const Index& index) { EXPECT_EQ(run.lse.at(index), -kInf); });
  run.out.for_each([&](const Index& index) { EXPECT_EQ(run.out.at(index), 0.0); });
}

TEST(ReferenceCombine, LargeLseDoesNotOverflow) {
  CombineConfig c;
  c.lse_spread = 500.0;  // exp(lse) overflows fp32
  c.empty_fraction = 0.0;
  c.seed = 50;
  check(c);
  c.lse_spread = 2000.0;  // and double
  c.seed = 51;
  check(c);
}

TEST(ReferenceCombine, StridedViews) {
  unsigned seed = 60;
  for (bool heads_major : {false, true}) {
    CombineConfig c;
    c.layout = Layout::kStrided;
    c.lse_heads_major = heads_major;
    c.seed = seed++;
    check(c);
    c.packed = {2, 7};
    c.seed = seed++;
    check(c);
  }
}

// Attention over all keys equals the combine of attention over disjoint chunks of the keys.
TEST(ReferenceCombine, ChunkedAttentionMergesToFullAttention) {
  std::mt19937 rng(70);
  std::normal_distribution<double> normal;
  NaiveSpec spec;
  spec.heads = 2;
  spec.heads_kv = 2;
  spec.head_dim = 8;
  spec.head_dim_v = 8;
  spec.scale = 0.5;
  NaiveSequence all;
  all.seqlen_q = 4;
  all.seqlen_k = 11;
  for (int i = 0; i < all.seqlen_q * spec.heads * spec.head_dim; ++i) all.q.push_back(normal(rng));
  for (int i = 0; i < all.seqlen_k * spec.heads * spec.head_dim; ++i) {
    all.k.push_back(normal(rng));
    all.v.push_back(normal(rng));
  }
  const NaiveForward expected = naive_forward(spec, 0, all);

  const int bounds[] = {0, 3, 3, 8, 11};  // includes an empty chunk
  const int splits = 4;
  const int row = spec.heads * spec.head_dim;
  HostTensor out_partial(DType::kFloat32, {splits, 1, all.seqlen_q, spec.heads, spec.head_dim});
  HostTensor lse_partial(DType::kFloat32, {splits, 1, all.seqlen_q, spec.heads});
  for (int s = 0; s < splits; ++s) {
    NaiveSequence chunk = all;
    chunk.seqlen_k = bounds[s + 1] - bounds[s];
    chunk.k.assign(all.k.begin() + bounds[s] * row, all.k.begin() + bounds[s + 1] * row);
    chunk.v.assign(all.v.begin() + bounds[s] * row, all.v.begin() + bounds[s + 1] * row);
    const NaiveForward part = naive_forward(spec, 0, chunk);
    for (int i = 0; i < all.seqlen_q; ++i) {
      for (int h = 0; h < spec.heads; ++h) {
        lse_partial.set({s, 0, i, h}, part.lse[h * all.seqlen_q + i]);
        for (int d = 0; d < spec.head_dim; ++d) {
          out_partial.set({s, 0, i, h, d}, part.out[(i * spec.heads + h) * spec.head_dim + d]);
        }
      }
    }
  }
  HostTensor out(DType::kFloat32, {1, all.seqlen_q, spec.heads, spec.head_dim});
  HostTensor lse(DType::kFloat32, {1, all.seqlen_q, spec.heads});
  out.poison();
  lse.poison();
  CombineArgs args;
  args.out_partial = out_partial.view();
  args.lse_partial = lse_partial.view();
  args.out = out.view();
  args.lse = lse.view();
  call_combine(args, Entry::kPublic);
  Comparison cmp("chunked vs full");
  for (int i = 0; i < all.seqlen_q; ++i) {
    for (int h = 0; h < spec.heads; ++h) {
      cmp.expect(lse.at({0, i, h}), expected.lse[h * all.seqlen_q + i], {1e-6, 1e-6}, "lse");
      for (int d = 0; d < spec.head_dim; ++d) {
        cmp.expect(out.at({0, i, h, d}), expected.out[(i * spec.heads + h) * spec.head_dim + d],
                   {2e-6, 2e-6}, "out");
      }
    }
  }
  EXPECT_TRUE(cmp.result());
}

}  // namespace
}  // namespace cuflash::testing
