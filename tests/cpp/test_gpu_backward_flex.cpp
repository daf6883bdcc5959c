// GPU backward kernel with score_mod, mask_mod and block sparsity (the flex kernels) against the
// CPU reference (DESIGN.md section 5): every built-in mod, with causal / window / softcap, GQA,
// varlen (with block lists too, per sequence over the longest), the transposed (column-block) lists
// broadcast over heads and per head, block sizes that are several kernel blocks, and rows or
// column blocks that see nothing. dq / dk / dv are poisoned before each run; every element is
// checked for NaN and compared with the accuracy rule in gpu_test_util.hpp (at most twice the
// error of the same backward done naively in the input dtype).
#include <gtest/gtest.h>

#if CUFLASH_HAS_CUDA  // a build without the CUDA toolkit has no device kernels to test

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cuflash/cuflash.hpp"
#include "gpu_test_problem.hpp"
#include "gpu_test_util.hpp"

namespace cuflash {
namespace {

using gpu_testing::DeviceBuffer;
using gpu_testing::expect_grad_close, gpu_testing::expect_not_supported, gpu_testing::is_built;
using gpu_testing::from_device_16bit, gpu_testing::to_device_16bit;
using gpu_testing::kCpu, gpu_testing::kCuda, gpu_testing::kNegInf;

struct FlexBwdCase {
  std::string label;
  DType dtype = DType::kBFloat16;
  int batch = 1, seqlen_q = 1, seqlen_k = 1, heads = 2, heads_kv = 2, head_dim = 128;
  int head_dim_v = 0;  // 0: head_dim
  int dim_v() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
  bool causal = false;  // the bottom-right option, on top of any mask_mod
  int window_left = -1, window_right = -1;
  float softcap = 0.f;
  ScoreModKind score_mod = ScoreModKind::kNone;
  MaskModKind mask_mod = MaskModKind::kNone;
  std::vector<double> mask_scalars;
  bool varlen = false;  // packed rows; sequence 1 has no queries, the others drawn up to seqlen_q/k
  // Block sparsity: 0 off, else the lists' head count (1: broadcast, or heads).
  int sparse_heads = 0;
  // Document ids: runs of 1..doc_length_max positions; numbered in order (documents packed one
  // after another), or with doc_ids_unsorted each run's id drawn from 0..3 (documents
  // interleaved, ids not monotone).
  int doc_length_max = 150;
  bool doc_ids_unsorted = false;
  int block_m = 128, block_n = 128;
  bool full_lists = true, mask_lists = true;
  // Column blocks left with no block at all (their dk / dv are 0).
  bool empty_col_blocks = false;
  // >= 0: only blocks at most this many blocks off the diagonal are listed (banded lists, as a
  // sliding window's), so that each row block has few writers at any length.
  int list_band = -1;
  // The backward gets the forward (row-block) lists only, no column-block ones.
  bool forward_lists_only = false;
  // Run twice and compared bit for bit as well.
  bool deterministic = false;
  unsigned seed = 1;
};

std::string case_name(const FlexBwdCase& c) {
  return gpu_testing::case_name(c.label, c.dtype, c.head_dim, c.dim_v());
}

enum class Block : std::uint8_t { kSkip, kMask, kFull };

// One problem in the rows of gpu_testing::RowLayout; out and lse from the reference forward (out rounded to the dtype, as a kernel
// stores it); aux arrays and both the forward (row-block) and the backward (column-block) lists
// of one block state table.
struct Problem : gpu_testing::RowLayout {
  FlexBwdCase c;
  std::vector<float> q, k, v, dout, out, lse;
  float scale = 1.f;
  std::vector<float> score_table;  // alibi (H,) or relative bias (H, 2R + 1)
  int bias_width = 0;
  std::vector<int> doc_ids;  // (B, doc_len)
  int doc_len = 0;
  int row_blocks = 0, col_blocks = 0;
  std::vector<Block> blocks;  // (B, H_b, row blocks, col blocks)
  // Forward lists (B, H_b, row blocks[, col blocks]) and backward ones (B, H_b, col blocks[, row
  // blocks]).
  std::vector<int> mask_cnt, mask_idx, full_cnt, full_idx;
  std::vector<int> q_mask_cnt, q_mask_idx, q_full_cnt, q_full_idx;

  // Varlen: the sequence without queries has dk = dv = 0.
  explicit Problem(const FlexBwdCase& fc) : RowLayout(fc, false, false), c(fc) {
    std::mt19937 rng(c.seed);
    draw_lengths(rng);
    std::normal_distribution<float> normal(0.f, 1.f);
    using gpu_testing::fill_normal;
    fill_normal(q, std::size_t(rows_q) * c.heads * c.head_dim, c.dtype, normal, rng);
    fill_normal(k, std::size_t(rows_k) * c.heads_kv * c.head_dim, c.dtype, normal, rng);
    fill_normal(v, std::size_t(rows_k) * c.heads_kv * c.dim_v(), c.dtype, normal, rng);
    fill_normal(dout, std::size_t(rows_q) * c.heads * c.dim_v(), c.dtype, normal, rng);
    scale = 1.f / std::sqrt(float(c.head_dim));

    if (c.score_mod == ScoreModKind::kAlibi) {
      // Small slopes keep the dtype-rounded naive scores sharp enough for the accuracy rule.
      for (int h = 0; h < c.heads; ++h) score_table.push_back(std::ldexp(1.f, -(h % 4) - 5));
    } else if (c.score_mod == ScoreModKind::kRelativeBias) {
      bias_width = 2 * 40 + 1;
      for (int i = 0; i < c.heads * bias_width; ++i) score_table.push_back(normal(rng));
    }
    if (c.mask_mod == MaskModKind::kDocument) {
      // Documents of random lengths; with seqlen_q > seqlen_k the last ones hold queries only.
      doc_len = std::max(c.seqlen_q, c.seqlen_k);
      std::uniform_int_distribution<int> doc_length(1, c.doc_length_max), any_doc(0, 3);
      for (int b = 0; b < c.batch; ++b) {
        int doc = 0, left = doc_length(rng);
        for (int i = 0; i < doc_len; ++i) {
          if (left-- == 0) doc = c.doc_ids_unsorted ? any_doc(rng) : doc + 1, left = doc_length(rng);
          doc_ids.push_back(doc);
        }
      }
    }
    if (c.sparse_heads > 0) make_block_lists(rng);
    run_forward();
  }

  // Each block is skipped, masked or full at random; both list kinds in random order.
  void make_block_lists(std::mt19937& rng) {
    // Per sequence, over the longest (the call's max_seqlen_q / max_seqlen_k with varlen).
    const int longest_q = *std::max_element(len_q.begin(), len_q.end());
    const int longest_k = *std::max_element(len_k.begin(), len_k.end());
    row_blocks = (longest_q + c.block_m - 1) / c.block_m;
    col_blocks = (longest_k + c.block_n - 1) / c.block_n;
    const int heads_b = c.batch * c.sparse_heads;
    blocks.assign(std::size_t(heads_b) * row_blocks * col_blocks, Block::kSkip);
    std::uniform_int_distribution<int> pick(0, 9);
    for (int hb = 0; hb < heads_b; ++hb) {
      for (int rb = 0; rb < row_blocks; ++rb) {
        for (int cb = 0; cb < col_blocks; ++cb) {
          if (c.empty_col_blocks && cb % 2 == 1) continue;
          if (c.list_band >= 0 && std::abs(rb - cb) > c.list_band) continue;
          const int roll = pick(rng);
          Block state = roll < 2 ? Block::kSkip : roll < 6 ? Block::kMask : Block::kFull;
          if (state == Block::kMask && !c.mask_lists) state = Block::kFull;
          if (state == Block::kFull && !c.full_lists) state = Block::kMask;
          blocks[(std::size_t(hb) * row_blocks + rb) * col_blocks + cb] = state;
        }
      }
    }
    // outer / inner: row / column blocks for the forward lists, the reverse for the backward.
    auto make_lists = [&](bool transposed, Block kind, std::vector<int>& cnt,
                          std::vector<int>& idx) {
      const int outer = transposed ? col_blocks : row_blocks,
                inner = transposed ? row_blocks : col_blocks;
      cnt.assign(std::size_t(heads_b) * outer, 0);
      idx.assign(std::size_t(heads_b) * outer * inner, 0);
      for (int hb = 0; hb < heads_b; ++hb) {
        for (int o = 0; o < outer; ++o) {
          const std::size_t list = std::size_t(hb) * outer + o;
          std::vector<int> order(inner);
          for (int i = 0; i < inner; ++i) order[i] = i;
          std::shuffle(order.begin(), order.end(), rng);
          for (int i : order) {
            const int rb = transposed ? i : o, cb = transposed ? o : i;
            if (blocks[(std::size_t(hb) * row_blocks + rb) * col_blocks + cb] == kind) {
              idx[list * inner + cnt[list]++] = i;
            }
          }
        }
      }
    };
    make_lists(false, Block::kMask, mask_cnt, mask_idx);
    make_lists(false, Block::kFull, full_cnt, full_idx);
    make_lists(true, Block::kMask, q_mask_cnt, q_mask_idx);
    make_lists(true, Block::kFull, q_full_cnt, q_full_idx);
  }

  // Score of query i, key j (positions in their sequence) of head h from s = scaled, capped.
  // Both built-in score_mods have d score / d s = 1.
  float modded(float s, int h, int i, int j) const {
    switch (c.score_mod) {
      case ScoreModKind::kAlibi:
        return s + score_table[h] * float(j - i);
      case ScoreModKind::kRelativeBias: {
        const int radius = (bias_width - 1) / 2;
        return s + score_table[h * bias_width + std::clamp(j - i, -radius, radius) + radius];
      }
      default:
        return s;
    }
  }

  bool mask_mod_keeps(int b, int i, int j) const {
    switch (c.mask_mod) {
      case MaskModKind::kCausal:
        return j <= i;
      case MaskModKind::kSlidingWindow:
        return i - j <= c.mask_scalars[0] && j - i <= c.mask_scalars[1];
      case MaskModKind::kPrefixLM:
        return j <= i || j < c.mask_scalars[0];
      case MaskModKind::kDocument:
        return doc_ids[std::size_t(b) * doc_len + i] == doc_ids[std::size_t(b) * doc_len + j];
      default:
        return true;
    }
  }

  bool visible(int b, int h, int i, int j) const {
    const int sq = len_q[b], sk = len_k[b];
    const int diag = i + sk - sq;
    const int right = c.causal ? 0 : c.window_right;
    if ((right >= 0 && j > diag + right) || (c.window_left >= 0 && j < diag - c.window_left))
      return false;
    bool apply_mask_mod = true;
    if (c.sparse_heads > 0) {
      const int hb = c.sparse_heads == 1 ? 0 : h;
      const std::size_t list = std::size_t(b * c.sparse_heads + hb) * row_blocks + i / c.block_m;
      const Block state = blocks[list * col_blocks + j / c.block_n];
      if (state == Block::kSkip) return false;
      apply_mask_mod = state == Block::kMask;
    }
    return !apply_mask_mod || mask_mod_keeps(b, i, j);
  }

  // Where each int32 / fp32 side array lives for one call (host vectors or device buffers).
  struct Side {
    gpu_testing::SequencePointers sequences;
    void* score_table = nullptr;
    void* doc_ids = nullptr;
    void* lists[8] = {};  // mask cnt / idx, full cnt / idx, then the q_ ones
  };

  void set_flex(SequenceLayout& seq, AttentionOptions& opts, Device device,
                const Side& side) const {
    const std::int64_t B = c.batch;
    set_sequences(seq, device, side.sequences);
    gpu_testing::set_window_options(opts, c);
    opts.score_mod.kind = c.score_mod;
    if (c.score_mod == ScoreModKind::kAlibi) {
      opts.score_mod.aux = {TensorView(side.score_table, DType::kFloat32, {c.heads}, device)};
    } else if (c.score_mod == ScoreModKind::kRelativeBias) {
      opts.score_mod.aux = {
          TensorView(side.score_table, DType::kFloat32, {c.heads, bias_width}, device)};
    }
    opts.mask_mod.kind = c.mask_mod;
    opts.mask_mod.scalars = c.mask_scalars;
    if (c.mask_mod == MaskModKind::kDocument) {
      opts.mask_mod.aux = {TensorView(side.doc_ids, DType::kInt32, {B, doc_len}, device)};
    }
    if (c.sparse_heads > 0) {
      BlockSparseTensors bs;
      bs.block_m = c.block_m;
      bs.block_n = c.block_n;
      const std::int64_t hb = c.sparse_heads, rb = row_blocks, cb = col_blocks;
      if (c.mask_lists) {
        bs.mask_block_cnt = TensorView(side.lists[0], DType::kInt32, {B, hb, rb}, device);
        bs.mask_block_idx = TensorView(side.lists[1], DType::kInt32, {B, hb, rb, cb}, device);
        if (!c.forward_lists_only) {
          bs.q_mask_block_cnt = TensorView(side.lists[4], DType::kInt32, {B, hb, cb}, device);
          bs.q_mask_block_idx = TensorView(side.lists[5], DType::kInt32, {B, hb, cb, rb}, device);
        }
      }
      if (c.full_lists) {
        bs.full_block_cnt = TensorView(side.lists[2], DType::kInt32, {B, hb, rb}, device);
        bs.full_block_idx = TensorView(side.lists[3], DType::kInt32, {B, hb, rb, cb}, device);
        if (!c.forward_lists_only) {
          bs.q_full_block_cnt = TensorView(side.lists[6], DType::kInt32, {B, hb, cb}, device);
          bs.q_full_block_idx = TensorView(side.lists[7], DType::kInt32, {B, hb, cb, rb}, device);
        }
      }
      opts.block_sparse = bs;
    }
  }

  // Host copies of the side arrays, kept alive by the caller while the views are used.
  struct HostSide {
    gpu_testing::HostSequences sequences;
    std::vector<int> docs, lists[8];
    std::vector<float> table;
    Side side;
    explicit HostSide(const Problem& pb) : sequences(pb) { pb.host_side(*this); }
  };
  void host_side(HostSide& h) const {
    h.docs = doc_ids;
    h.table = score_table;
    const std::vector<int>* all[8] = {&mask_cnt,   &mask_idx,   &full_cnt,   &full_idx,
                                      &q_mask_cnt, &q_mask_idx, &q_full_cnt, &q_full_idx};
    for (int i = 0; i < 8; ++i) {
      h.lists[i] = *all[i];
      h.side.lists[i] = h.lists[i].data();
    }
    h.side.sequences = h.sequences.pointers();
    h.side.score_table = h.table.data();
    h.side.doc_ids = h.docs.data();
  }

  void run_forward() {
    std::vector<float> qf = q, kf = k, vf = v;
    out.assign(std::size_t(rows_q) * c.heads * c.dim_v(), 0.f);
    lse.assign(lse_size(), kNegInf);
    HostSide h(*this);
    ForwardArgs args;
    args.q = query_view(qf.data(), DType::kFloat32, c.head_dim, kCpu);
    args.k = key_view(kf.data(), DType::kFloat32, c.head_dim, kCpu);
    args.v = key_view(vf.data(), DType::kFloat32, c.dim_v(), kCpu);
    args.out = query_view(out.data(), DType::kFloat32, c.dim_v(), kCpu);
    args.lse = lse_view(lse.data(), kCpu);
    set_flex(args.seq, args.opts, kCpu, h.side);
    forward(args);
    for (float& x : out) x = gpu_testing::round_to(x, c.dtype);
  }
};

struct Grads {
  std::vector<double> dq, dk, dv;  // layouts of q, k, v
};

Grads run_reference(const Problem& pb) {
  const FlexBwdCase& c = pb.c;
  std::vector<float> q = pb.q, k = pb.k, v = pb.v, out = pb.out, dout = pb.dout, lse = pb.lse;
  std::vector<float> dq(q.size(), std::nanf("")), dk(k.size(), std::nanf("")),
      dv(v.size(), std::nanf(""));
  Problem::HostSide h(pb);
  BackwardArgs args;
  args.q = pb.query_view(q.data(), DType::kFloat32, c.head_dim, kCpu);
  args.k = pb.key_view(k.data(), DType::kFloat32, c.head_dim, kCpu);
  args.v = pb.key_view(v.data(), DType::kFloat32, c.dim_v(), kCpu);
  args.out = pb.query_view(out.data(), DType::kFloat32, c.dim_v(), kCpu);
  args.dout = pb.query_view(dout.data(), DType::kFloat32, c.dim_v(), kCpu);
  args.lse = pb.lse_view(lse.data(), kCpu);
  args.dq = pb.query_view(dq.data(), DType::kFloat32, c.head_dim, kCpu);
  args.dk = pb.key_view(dk.data(), DType::kFloat32, c.head_dim, kCpu);
  args.dv = pb.key_view(dv.data(), DType::kFloat32, c.dim_v(), kCpu);
  pb.set_flex(args.seq, args.opts, kCpu, h.side);
  backward(args);
  return {{dq.begin(), dq.end()}, {dk.begin(), dk.end()}, {dv.begin(), dv.end()}};
}

// The same backward done naively in the input dtype: scores, capped and modified scores,
// probabilities, dP, the row sums and dS each rounded to the dtype, gradients accumulated in
// fp32 and rounded once.
Grads naive_low_precision(const Problem& pb) {
  const FlexBwdCase& c = pb.c;
  auto r = [&](float x) { return gpu_testing::round_to(x, c.dtype); };
  const int D = c.head_dim, Dv = c.dim_v();
  std::vector<float> dq(pb.q.size(), 0.f), dk(pb.k.size(), 0.f), dv(pb.v.size(), 0.f);
  const int group = c.heads / c.heads_kv;
  std::vector<float> qs(D);
  for (int b = 0; b < c.batch; ++b) {
    const int sq = pb.len_q[b], sk = pb.len_k[b];
    for (int h = 0; h < c.heads; ++h) {
      const int hk = h / group;
      for (int i = 0; i < sq; ++i) {
        const float lse = pb.lse[pb.lse_index(b, h, i)];
        if (lse == kNegInf) continue;
        const std::size_t qrow = std::size_t(pb.start_q[b] + i) * c.heads + h;
        for (int d = 0; d < D; ++d) qs[d] = r(pb.q[qrow * D + d] * pb.scale);
        float delta = 0.f;
        for (int d = 0; d < Dv; ++d) delta += pb.dout[qrow * Dv + d] * pb.out[qrow * Dv + d];
        delta = r(delta);
        for (int j = 0; j < sk; ++j) {
          if (!pb.visible(b, h, i, j)) continue;
          const std::size_t krow = std::size_t(pb.start_k[b] + j) * c.heads_kv + hk;
          float dot = 0.f;
          for (int d = 0; d < D; ++d) dot += qs[d] * pb.k[krow * D + d];
          float s = r(dot), deriv = 1.f;
          if (c.softcap > 0.f) {
            const float t = std::tanh(s / c.softcap);
            s = r(c.softcap * t);
            deriv = 1.f - t * t;
          }
          s = r(pb.modded(s, h, i, j));
          const float p = r(std::exp(s - lse));
          float dp = 0.f;
          for (int d = 0; d < Dv; ++d) dp += pb.dout[qrow * Dv + d] * pb.v[krow * Dv + d];
          const float ds = r(p * (r(dp) - delta) * deriv);
          for (int d = 0; d < D; ++d) {
            dq[qrow * D + d] += ds * pb.k[krow * D + d] * pb.scale;
            dk[krow * D + d] += ds * pb.q[qrow * D + d] * pb.scale;
          }
          for (int d = 0; d < Dv; ++d) dv[krow * Dv + d] += p * pb.dout[qrow * Dv + d];
        }
      }
    }
  }
  Grads g;
  for (float x : dq) g.dq.push_back(r(x));
  for (float x : dk) g.dk.push_back(r(x));
  for (float x : dv) g.dv.push_back(r(x));
  return g;
}

Grads run_gpu(const Problem& pb) {
  const FlexBwdCase& c = pb.c;
  using gpu_testing::poisoned_16bit;
  DeviceBuffer q = to_device_16bit(pb.q, c.dtype), k = to_device_16bit(pb.k, c.dtype),
               v = to_device_16bit(pb.v, c.dtype);
  DeviceBuffer out = to_device_16bit(pb.out, c.dtype), dout = to_device_16bit(pb.dout, c.dtype);
  DeviceBuffer lse = DeviceBuffer::from(pb.lse);
  DeviceBuffer dq = poisoned_16bit(pb.q.size()), dk = poisoned_16bit(pb.k.size()),
               dv = poisoned_16bit(pb.v.size());
  const gpu_testing::DeviceSequences sequences(pb);
  DeviceBuffer table = DeviceBuffer::from(pb.score_table);
  DeviceBuffer docs = DeviceBuffer::from(pb.doc_ids);
  const std::vector<int>* all[8] = {&pb.mask_cnt,   &pb.mask_idx,   &pb.full_cnt,   &pb.full_idx,
                                    &pb.q_mask_cnt, &pb.q_mask_idx, &pb.q_full_cnt, &pb.q_full_idx};
  std::vector<DeviceBuffer> lists;
  for (const std::vector<int>* list : all) lists.push_back(DeviceBuffer::from(*list));
  Problem::Side side{sequences.pointers(), table.data(), docs.data(), {}};
  for (int i = 0; i < 8; ++i) side.lists[i] = lists[i].data();

  BackwardArgs args;
  args.q = pb.query_view(q.data(), c.dtype, c.head_dim, kCuda);
  args.k = pb.key_view(k.data(), c.dtype, c.head_dim, kCuda);
  args.v = pb.key_view(v.data(), c.dtype, c.dim_v(), kCuda);
  args.out = pb.query_view(out.data(), c.dtype, c.dim_v(), kCuda);
  args.dout = pb.query_view(dout.data(), c.dtype, c.dim_v(), kCuda);
  args.lse = pb.lse_view(lse.data(), kCuda);
  args.dq = pb.query_view(dq.data(), c.dtype, c.head_dim, kCuda);
  args.dk = pb.key_view(dk.data(), c.dtype, c.head_dim, kCuda);
  args.dv = pb.key_view(dv.data(), c.dtype, c.dim_v(), kCuda);
  pb.set_flex(args.seq, args.opts, kCuda, side);
  args.deterministic = c.deterministic;
  gpu_testing::backward_on_poisoned_workspace(args);

  Grads g;
  g.dq = from_device_16bit(dq, c.dtype);
  g.dk = from_device_16bit(dk, c.dtype);
  g.dv = from_device_16bit(dv, c.dtype);
  return g;
}

class GpuBackwardFlex : public ::testing::TestWithParam<FlexBwdCase> {};

TEST_P(GpuBackwardFlex, MatchesReference) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const FlexBwdCase& c = GetParam();
  const Problem pb(c);
  const std::optional<Grads> gpu = gpu_testing::run_if_built([&] { return run_gpu(pb); });
  if (!gpu) return;
  const Grads ref = run_reference(pb);
  const Grads naive = naive_low_precision(pb);
  expect_grad_close("dq", gpu->dq, naive.dq, ref.dq);
  expect_grad_close("dk", gpu->dk, naive.dk, ref.dk);
  expect_grad_close("dv", gpu->dv, naive.dv, ref.dv);
  if (c.deterministic) {
    // 16-bit values widened to double: the same bits iff the doubles' bytes are (== would take
    // -0 for +0).
    auto same_bits = [](const std::vector<double>& a, const std::vector<double>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
    };
    const Grads again = run_gpu(pb);
    EXPECT_TRUE(same_bits(gpu->dq, again.dq)) << "dq differs between two deterministic runs";
    EXPECT_TRUE(same_bits(gpu->dk, again.dk)) << "dk differs between two deterministic runs";
    EXPECT_TRUE(same_bits(gpu->dv, again.dv)) << "dv differs between two deterministic runs";
  }
  if (c.label.find("empty_rows") != std::string::npos) {
    EXPECT_GT(std::count(pb.lse.begin(), pb.lse.end(), kNegInf), 0)
        << "the case was meant to have rows without keys";
  }
}

std::vector<FlexBwdCase> flex_cases() {
  std::vector<FlexBwdCase> cases;
  unsigned seed = 2000;
  auto add = [&](FlexBwdCase c) {
    c.seed = seed++;
    cases.push_back(c);
  };
  FlexBwdCase c;
  // score_mods
  c = {};
  c.label = "alibi_gqa", c.batch = 2, c.seqlen_q = 300, c.seqlen_k = 300, c.heads = 4,
  c.heads_kv = 2, c.score_mod = ScoreModKind::kAlibi;
  add(c);
  c = {};
  c.label = "alibi_causal", c.seqlen_q = 200, c.seqlen_k = 333, c.causal = true,
  c.score_mod = ScoreModKind::kAlibi;
  add(c);
  c = {};
  c.label = "relative_bias_softcap", c.batch = 2, c.seqlen_q = 257, c.seqlen_k = 257,
  c.softcap = 20.f, c.score_mod = ScoreModKind::kRelativeBias;
  add(c);
  c = {};
  c.label = "relative_bias_window_mqa", c.seqlen_q = 513, c.seqlen_k = 513, c.heads = 4,
  c.heads_kv = 1, c.window_left = 100, c.window_right = 20,
  c.score_mod = ScoreModKind::kRelativeBias;
  add(c);
  // mask_mods
  // Equal dense lengths: causal and sliding-window mask_mods run as windows on the plain kernels
  // (fold_window_mask_mod), here with the call's own window on top; the other cases run the flex
  // kernels.
  c = {};
  c.label = "mask_causal", c.seqlen_q = 1023, c.seqlen_k = 1023, c.mask_mod = MaskModKind::kCausal;
  add(c);
  c = {};
  c.label = "sliding_window_with_window", c.batch = 2, c.seqlen_q = 600, c.seqlen_k = 600, c.window_left = 40,
  c.mask_mod = MaskModKind::kSlidingWindow, c.mask_scalars = {64, 16};
  add(c);
  c = {};
  c.label = "sliding_window_sk_gt_sq", c.seqlen_q = 650, c.seqlen_k = 700,
  c.mask_mod = MaskModKind::kSlidingWindow, c.mask_scalars = {64, 16};
  add(c);
  c = {};
  c.label = "mask_causal_sq_gt_sk", c.seqlen_q = 300, c.seqlen_k = 100,
  c.mask_mod = MaskModKind::kCausal;
  add(c);
  c = {};
  c.label = "mask_causal_with_causal_sk_gt_sq", c.seqlen_q = 150, c.seqlen_k = 400, c.causal = true,
  c.mask_mod = MaskModKind::kCausal;
  add(c);
  c = {};
  c.label = "sliding_window", c.batch = 2, c.seqlen_q = 700, c.seqlen_k = 700,
  c.mask_mod = MaskModKind::kSlidingWindow, c.mask_scalars = {64, 16};
  add(c);
  c = {};
  c.label = "sliding_window_softcap_alibi", c.seqlen_q = 400, c.seqlen_k = 520, c.softcap = 30.f,
  c.score_mod = ScoreModKind::kAlibi, c.mask_mod = MaskModKind::kSlidingWindow,
  c.mask_scalars = {200, 0};
  add(c);
  c = {};
  c.label = "prefix_lm", c.seqlen_q = 500, c.seqlen_k = 500, c.mask_mod = MaskModKind::kPrefixLM,
  c.mask_scalars = {100};
  add(c);
  c = {};
  c.label = "prefix_lm_softcap_causal", c.seqlen_q = 260, c.seqlen_k = 260, c.softcap = 15.f,
  c.causal = true, c.mask_mod = MaskModKind::kPrefixLM, c.mask_scalars = {130};
  add(c);
  c = {};
  c.label = "document_alibi", c.batch = 2, c.seqlen_q = 600, c.seqlen_k = 600,
  c.score_mod = ScoreModKind::kAlibi, c.mask_mod = MaskModKind::kDocument;
  add(c);
  c = {};
  c.label = "document_empty_rows", c.seqlen_q = 400, c.seqlen_k = 150,
  c.mask_mod = MaskModKind::kDocument;
  add(c);
  // Documents longer than a block: the lists built from the ids (forward row-block lists,
  // tabulated per column block) skip the blocks of other documents.
  c = {};
  c.label = "document_long_gqa", c.batch = 2, c.seqlen_q = 1100, c.seqlen_k = 1100, c.heads = 4,
  c.heads_kv = 2, c.mask_mod = MaskModKind::kDocument, c.doc_length_max = 700;
  add(c);
  c = {};
  c.label = "document_long_causal_softcap", c.seqlen_q = 900, c.seqlen_k = 1000, c.causal = true,
  c.softcap = 20.f, c.mask_mod = MaskModKind::kDocument, c.doc_length_max = 500;
  add(c);
  c = {};
  c.label = "document_unsorted", c.batch = 2, c.seqlen_q = 800, c.seqlen_k = 800,
  c.mask_mod = MaskModKind::kDocument, c.doc_length_max = 300, c.doc_ids_unsorted = true;
  add(c);
  c = {};
  c.label = "varlen_document_long", c.batch = 3, c.seqlen_q = 1000, c.seqlen_k = 1000, c.varlen = true,
  c.mask_mod = MaskModKind::kDocument, c.doc_length_max = 400;
  add(c);
  c = {};
  c.label = "deterministic_document_long_causal", c.batch = 2, c.seqlen_q = 700, c.seqlen_k = 700,
  c.head_dim = 256, c.causal = true, c.mask_mod = MaskModKind::kDocument, c.doc_length_max = 400,
  c.deterministic = true;
  add(c);
  c = {};
  c.label = "document_long", c.seqlen_q = 1000, c.seqlen_k = 1000, c.head_dim = 64,
  c.mask_mod = MaskModKind::kDocument, c.doc_length_max = 600;
  add(c);
  // Head dim 96 (its flex backward kernel had no case): a score_mod under a window, and a
  // deterministic document mask over packed sequences.
  c = {};
  c.label = "alibi_window_gqa", c.batch = 2, c.seqlen_q = 400, c.seqlen_k = 450, c.heads = 4, c.heads_kv = 2,
  c.head_dim = 96, c.window_left = 120, c.window_right = 10, c.score_mod = ScoreModKind::kAlibi;
  add(c);
  c = {};
  c.label = "deterministic_varlen_document", c.batch = 3, c.seqlen_q = 500, c.seqlen_k = 500, c.head_dim = 96,
  c.varlen = true, c.mask_mod = MaskModKind::kDocument, c.doc_length_max = 200, c.deterministic = true;
  add(c);
  // varlen: positions count from each sequence's start
  c = {};
  c.label = "varlen_document_causal_gqa", c.batch = 4, c.seqlen_q = 300, c.seqlen_k = 333,
  c.heads = 4, c.heads_kv = 2, c.causal = true, c.varlen = true,
  c.mask_mod = MaskModKind::kDocument;
  add(c);
  c = {};
  c.label = "varlen_mask_causal_relative_bias", c.batch = 3, c.seqlen_q = 257, c.seqlen_k = 190,
  c.varlen = true, c.score_mod = ScoreModKind::kRelativeBias, c.mask_mod = MaskModKind::kCausal;
  add(c);
  // deterministic: the row blocks a mask_mod leaves out pass their turn in the dQ order
  c = {};
  c.label = "deterministic_varlen_document_causal_gqa", c.batch = 3, c.seqlen_q = 500, c.seqlen_k = 520,
  c.heads = 4, c.heads_kv = 2, c.causal = true, c.varlen = true, c.mask_mod = MaskModKind::kDocument,
  c.deterministic = true;
  add(c);
  c = {};
  c.label = "deterministic_alibi_window", c.batch = 2, c.seqlen_q = 600, c.seqlen_k = 700,
  c.window_left = 150, c.window_right = 30, c.score_mod = ScoreModKind::kAlibi, c.deterministic = true;
  add(c);
  c = {};
  c.label = "deterministic_prefix_lm_softcap", c.seqlen_q = 700, c.seqlen_k = 700, c.softcap = 20.f,
  c.mask_mod = MaskModKind::kPrefixLM, c.mask_scalars = {200}, c.deterministic = true;
  add(c);
  c = {};
  c.label = "deterministic_document_empty_rows", c.seqlen_q = 400, c.seqlen_k = 150,
  c.mask_mod = MaskModKind::kDocument, c.deterministic = true;
  add(c);
  c = {};
  c.label = "deterministic_sliding_window_gqa", c.batch = 2, c.seqlen_q = 900, c.seqlen_k = 800,
  c.heads = 4, c.heads_kv = 2, c.mask_mod = MaskModKind::kSlidingWindow, c.mask_scalars = {100, 30},
  c.deterministic = true;
  add(c);
  // deterministic with block lists (lists in random order): the row blocks no list names take
  // no turn; GQA adds the dK / dV order, with column blocks that see no row block at all.
  c = {};
  c.label = "deterministic_sparse_per_head_causal_gqa", c.batch = 2, c.seqlen_q = 600, c.seqlen_k = 650,
  c.heads = 4, c.heads_kv = 2, c.causal = true, c.mask_mod = MaskModKind::kDocument, c.sparse_heads = 4,
  c.deterministic = true;
  add(c);
  c = {};
  c.label = "deterministic_sparse_empty_col_blocks_gqa", c.batch = 2, c.seqlen_q = 530, c.seqlen_k = 700,
  c.heads = 4, c.heads_kv = 1, c.mask_mod = MaskModKind::kCausal, c.sparse_heads = 1,
  c.empty_col_blocks = true, c.deterministic = true;
  add(c);
  // block lists with packed sequences: per sequence, counted over the longest
  c = {};
  c.label = "sparse_varlen_sliding_window_gqa", c.batch = 3, c.seqlen_q = 450, c.seqlen_k = 500,
  c.heads = 4, c.heads_kv = 2, c.varlen = true, c.mask_mod = MaskModKind::kSlidingWindow,
  c.mask_scalars = {150, 30}, c.sparse_heads = 1;
  add(c);
  c = {};
  c.label = "deterministic_sparse_varlen_per_head_causal_gqa", c.batch = 3, c.seqlen_q = 500,
  c.seqlen_k = 520, c.heads = 4, c.heads_kv = 2, c.varlen = true, c.causal = true,
  c.mask_mod = MaskModKind::kDocument, c.sparse_heads = 4, c.deterministic = true;
  add(c);
  c = {};
  c.label = "sparse_forward_lists_only_gqa", c.batch = 2, c.seqlen_q = 640, c.seqlen_k = 700, c.heads = 4,
  c.heads_kv = 2, c.causal = true, c.mask_mod = MaskModKind::kDocument, c.sparse_heads = 4,
  c.forward_lists_only = true;
  add(c);
  c = {};
  c.label = "deterministic_sparse_forward_lists_only", c.seqlen_q = 900, c.seqlen_k = 900, c.heads = 2,
  c.mask_mod = MaskModKind::kSlidingWindow, c.mask_scalars = {200, 50}, c.sparse_heads = 1,
  c.block_m = 256, c.forward_lists_only = true, c.deterministic = true;
  add(c);
  c = {};
  c.label = "deterministic_sparse_blocks_256x256_alibi", c.seqlen_q = 1000, c.seqlen_k = 900, c.heads = 2,
  c.score_mod = ScoreModKind::kAlibi, c.sparse_heads = 2, c.block_m = 256, c.block_n = 256,
  c.full_lists = false, c.deterministic = true;
  add(c);
  // block sparsity (128 x 128 blocks are two 64-row kernel m-blocks at head dim 128)
  c = {};
  c.label = "sparse_broadcast_mask_causal", c.seqlen_q = 700, c.seqlen_k = 700, c.heads = 3,
  c.heads_kv = 3, c.mask_mod = MaskModKind::kCausal, c.sparse_heads = 1;
  add(c);
  c = {};
  c.label = "sparse_per_head_document_gqa", c.batch = 2, c.seqlen_q = 520, c.seqlen_k = 610,
  c.heads = 2, c.heads_kv = 1, c.mask_mod = MaskModKind::kDocument, c.sparse_heads = 2;
  add(c);
  c = {};
  c.label = "sparse_blocks_256x256_window", c.seqlen_q = 900, c.seqlen_k = 1000, c.heads = 2,
  c.mask_mod = MaskModKind::kSlidingWindow, c.mask_scalars = {300, 100}, c.sparse_heads = 2,
  c.block_m = 256, c.block_n = 256;
  add(c);
  c = {};
  c.label = "sparse_block_m256_alibi_softcap", c.seqlen_q = 600, c.seqlen_k = 450,
  c.score_mod = ScoreModKind::kAlibi, c.softcap = 25.f, c.mask_mod = MaskModKind::kPrefixLM,
  c.mask_scalars = {200}, c.sparse_heads = 1, c.block_m = 256, c.block_n = 128;
  add(c);
  c = {};
  c.label = "sparse_full_lists_only_causal", c.seqlen_q = 640, c.seqlen_k = 640, c.causal = true,
  c.score_mod = ScoreModKind::kRelativeBias, c.sparse_heads = 2, c.mask_lists = false;
  add(c);
  c = {};
  c.label = "sparse_mask_lists_only_no_mask_mod", c.seqlen_q = 333, c.seqlen_k = 444,
  c.sparse_heads = 1, c.full_lists = false;
  add(c);
  c = {};
  c.label = "sparse_empty_col_blocks", c.batch = 2, c.seqlen_q = 530, c.seqlen_k = 530, c.heads = 2,
  c.mask_mod = MaskModKind::kCausal, c.sparse_heads = 2, c.empty_col_blocks = true;
  add(c);
  c = {};
  c.label = "sparse_one_short_block", c.seqlen_q = 17, c.seqlen_k = 17, c.sparse_heads = 1,
  c.score_mod = ScoreModKind::kAlibi, c.mask_mod = MaskModKind::kCausal;
  add(c);
  c = {};
  c.label = "sparse_per_head_gqa_causal_prefix_lm", c.batch = 2, c.seqlen_q = 300, c.seqlen_k = 400,
  c.heads = 4, c.heads_kv = 2, c.causal = true, c.mask_mod = MaskModKind::kPrefixLM,
  c.mask_scalars = {64}, c.sparse_heads = 4;
  add(c);
  // other head dims: 128 x 128 blocks over 128 x 128 tiles (64) and over 64 x 64 tiles (256)
  c = {};
  c.label = "sparse_document_alibi", c.batch = 2, c.seqlen_q = 400, c.seqlen_k = 400,
  c.head_dim = 64, c.mask_mod = MaskModKind::kDocument, c.score_mod = ScoreModKind::kAlibi,
  c.sparse_heads = 1;
  add(c);
  c = {};
  c.label = "sparse_sliding_window_softcap", c.seqlen_q = 333, c.seqlen_k = 300, c.head_dim = 256,
  c.softcap = 20.f, c.mask_mod = MaskModKind::kSlidingWindow, c.mask_scalars = {90, 40},
  c.sparse_heads = 2;
  add(c);
  // hdim 256 adds dQ by atomics: the deterministic order there (kept by the dQ order warp) over
  // mask_mod-narrowed windows.
  c = {};
  c.label = "deterministic_alibi_window", c.batch = 2, c.seqlen_q = 500, c.seqlen_k = 560, c.head_dim = 256,
  c.window_left = 150, c.window_right = 30, c.score_mod = ScoreModKind::kAlibi, c.deterministic = true;
  add(c);
  c = {};
  c.label = "deterministic_document_causal", c.batch = 2, c.seqlen_q = 420, c.seqlen_k = 420, c.head_dim = 256,
  c.causal = true, c.mask_mod = MaskModKind::kDocument, c.deterministic = true;
  add(c);
  c = {};
  c.label = "deterministic_sparse_sliding_window_gqa", c.batch = 2, c.seqlen_q = 500, c.seqlen_k = 450,
  c.heads = 4, c.heads_kv = 2, c.head_dim = 256, c.mask_mod = MaskModKind::kSlidingWindow,
  c.mask_scalars = {120, 40}, c.sparse_heads = 4, c.deterministic = true;
  add(c);
  c = {};
  c.label = "deterministic_sparse_document", c.seqlen_q = 450, c.seqlen_k = 450, c.head_dim = 64,
  c.mask_mod = MaskModKind::kDocument, c.sparse_heads = 1, c.deterministic = true;
  add(c);
  c = {};
  c.label = "sparse_forward_lists_only_softcap", c.seqlen_q = 333, c.seqlen_k = 400, c.head_dim = 256,
  c.softcap = 20.f, c.mask_mod = MaskModKind::kCausal, c.sparse_heads = 1, c.forward_lists_only = true;
  add(c);
  c = {};
  c.label = "mask_causal_relative_bias", c.seqlen_q = 300, c.seqlen_k = 300, c.head_dim = 192,
  c.score_mod = ScoreModKind::kRelativeBias, c.mask_mod = MaskModKind::kCausal;
  add(c);
  // Head dims 192 and 192 x 128: 128 x 128 blocks over the flex kernel's 64-key column blocks.
  c = {};
  c.label = "sparse_document_alibi", c.batch = 2, c.seqlen_q = 400, c.seqlen_k = 400,
  c.head_dim = 192, c.mask_mod = MaskModKind::kDocument, c.score_mod = ScoreModKind::kAlibi,
  c.sparse_heads = 1;
  add(c);
  c = {};
  c.label = "sparse_per_head_causal_softcap", c.seqlen_q = 333, c.seqlen_k = 300, c.head_dim = 192,
  c.head_dim_v = 128, c.causal = true, c.softcap = 20.f, c.mask_mod = MaskModKind::kSlidingWindow,
  c.mask_scalars = {90, 40}, c.sparse_heads = 2;
  add(c);
  c = {};
  c.label = "fp16_sparse_gqa_prefix_lm", c.dtype = DType::kFloat16, c.batch = 2, c.seqlen_q = 260,
  c.seqlen_k = 300, c.heads = 4, c.heads_kv = 2, c.head_dim = 192, c.mask_mod = MaskModKind::kPrefixLM,
  c.mask_scalars = {64}, c.sparse_heads = 4;
  add(c);
  c = {};
  c.label = "deterministic_alibi_window", c.batch = 2, c.seqlen_q = 300, c.seqlen_k = 360, c.head_dim = 192,
  c.head_dim_v = 128, c.window_left = 150, c.window_right = 30, c.score_mod = ScoreModKind::kAlibi,
  c.deterministic = true;
  add(c);
  c = {};
  c.label = "deterministic_sparse_prefix_lm_gqa", c.batch = 2, c.seqlen_q = 400, c.seqlen_k = 380,
  c.heads = 4, c.heads_kv = 2, c.head_dim = 192, c.mask_mod = MaskModKind::kPrefixLM, c.mask_scalars = {100},
  c.sparse_heads = 4, c.deterministic = true;
  add(c);
  // fp16
  c = {};
  c.label = "fp16_document_sparse", c.dtype = DType::kFloat16, c.batch = 2, c.seqlen_q = 400,
  c.seqlen_k = 400, c.mask_mod = MaskModKind::kDocument, c.score_mod = ScoreModKind::kAlibi,
  c.sparse_heads = 1;
  add(c);
  // Banded lists over 12 row blocks: at most 5 writers per row block, hdim128's limit, so that
  // dq_accum starts from first stores decided on the device, every row block's writers arriving
  // one after another (the random lists above over 6 column blocks take the device's clear).
  // Last, so that the cases before it keep their seeds.
  c = {};
  c.label = "sparse_banded_lists_long", c.batch = 2, c.seqlen_q = 1500, c.seqlen_k = 1450, c.heads = 2,
  c.mask_mod = MaskModKind::kSlidingWindow, c.mask_scalars = {200, 60}, c.sparse_heads = 2, c.list_band = 2;
  add(c);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Mods, GpuBackwardFlex, ::testing::ValuesIn(flex_cases()),
                         gpu_testing::CaseName());

// A small bf16 backward call with a causal mask_mod, for the refusals below.
struct SmallCall {
  static constexpr std::int64_t kSq = 64, kSk = 256, kHeads = 2;
  std::int64_t head_dim;
  DeviceBuffer q, k, v, out, dout, dq, dk, dv, lse;
  BackwardArgs args;
  explicit SmallCall(std::int64_t d)
      : head_dim(d),
        q(kSq * kHeads * d * 2),
        k(kSk * kHeads * d * 2),
        v(kSk * kHeads * d * 2),
        out(kSq * kHeads * d * 2),
        dout(kSq * kHeads * d * 2),
        dq(kSq * kHeads * d * 2),
        dk(kSk * kHeads * d * 2),
        dv(kSk * kHeads * d * 2),
        lse(kHeads * kSq * sizeof(float)) {
    auto rows = [&](DeviceBuffer& buffer, std::int64_t seqlen) {
      return TensorView(buffer.data(), DType::kBFloat16, {1, seqlen, kHeads, head_dim}, kCuda);
    };
    args.q = rows(q, kSq);
    args.k = rows(k, kSk);
    args.v = rows(v, kSk);
    args.out = rows(out, kSq);
    args.dout = rows(dout, kSq);
    args.dq = rows(dq, kSq);
    args.dk = rows(dk, kSk);
    args.dv = rows(dv, kSk);
    args.lse = TensorView(lse.data(), DType::kFloat32, {1, kHeads, kSq}, kCuda);
    args.opts.mask_mod.kind = MaskModKind::kCausal;
  }
};

// Backward block lists (one column block of block_n keys over the 256 keys) for SmallCall.
struct SmallLists {
  DeviceBuffer cnt, idx;
  SmallLists(BackwardArgs& args, int block_m, int block_n)
      : cnt(DeviceBuffer::from(std::vector<int>((256 + block_n - 1) / block_n, 0))),
        idx(DeviceBuffer::from(std::vector<int>(
            ((256 + block_n - 1) / block_n) * ((64 + block_m - 1) / block_m), 0))) {
    const std::int64_t col_blocks = (256 + block_n - 1) / block_n,
                       row_blocks = (64 + block_m - 1) / block_m;
    BlockSparseTensors bs;
    bs.block_m = block_m;
    bs.block_n = block_n;
    bs.q_mask_block_cnt = TensorView(cnt.data(), DType::kInt32, {1, 1, col_blocks}, kCuda);
    bs.q_mask_block_idx =
        TensorView(idx.data(), DType::kInt32, {1, 1, col_blocks, row_blocks}, kCuda);
    args.opts.block_sparse = bs;
  }
};

TEST(GpuBackwardFlexUnsupported, BlockNarrowerThanTileIsRefused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  // block_n 64: a 128-key column block of the head-dim-128 kernel would span two BlockMask
  // column blocks (a rule of that kernel: where it is not built, that is the error).
  if (!is_built("bwd bf16 hdim128 flex")) GTEST_SKIP() << "hdim128 bf16 flex backward not built";
  SmallCall call(128);
  SmallLists lists(call.args, 128, 64);
  expect_not_supported(call.args, "block_sparse");
}

TEST(GpuBackwardFlexUnsupported, BlockNotAMultipleOfTileIsRefused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  // The flex kernel of head dim 192 runs 64-key column blocks; a 96-key BlockMask block is not a
  // whole number of them (a rule of that kernel: where it is not built, that is the error).
  if (!is_built("bwd bf16 hdim192 flex")) GTEST_SKIP() << "hdim192 bf16 flex backward not built";
  SmallCall call(192);
  SmallLists lists(call.args, 128, 96);
  expect_not_supported(call.args, "block_sparse");
}

TEST(GpuBackwardFlexUnsupported, BuiltKernelsListFlex) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  // CUFLASH_FEATURES builds the flex kernels of both directions or neither: where the forward
  // flex kernel of hdim128 bf16 is listed (the CI set), its backward must be too.
  if (!is_built("bwd bf16 hdim128")) GTEST_SKIP() << "hdim128 bf16 backward not built";
  if (!is_built("fwd bf16 hdim128 flex")) GTEST_SKIP() << "the flex feature is not in this build";
#ifdef CUFLASH_KERNEL_REGEX_NARROWED
  GTEST_SKIP() << "CUFLASH_KERNEL_REGEX picked the kernels, not CUFLASH_FEATURES";
#endif
  EXPECT_TRUE(is_built("bwd bf16 hdim128 flex"));
}

}  // namespace
}  // namespace cuflash

#endif  // CUFLASH_HAS_CUDA
