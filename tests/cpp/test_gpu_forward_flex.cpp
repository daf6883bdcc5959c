// GPU forward kernel with score_mod, mask_mod and block sparsity (the flex kernels) against the
// CPU reference (DESIGN.md section 5): every built-in mod, with causal / window / softcap, varlen,
// block lists broadcast over heads and per head (with varlen too), block sizes that are several kernel blocks, and
// rows that see no key. Outputs are poisoned before each run; every element is checked for NaN
// and compared with the accuracy rule in gpu_test_util.hpp.
#include <gtest/gtest.h>

#if CUFLASH_HAS_CUDA  // a build without the CUDA toolkit has no device kernels to test

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "api/kernels.hpp"
#include "api/params_builder.hpp"
#include "cuflash/cuflash.hpp"
#include "gpu_test_problem.hpp"
#include "gpu_test_util.hpp"

namespace cuflash {
namespace {

using gpu_testing::DeviceBuffer;
using gpu_testing::expect_not_supported, gpu_testing::expect_output_close, gpu_testing::is_built;
using gpu_testing::from_device_16bit, gpu_testing::to_device_16bit;
using gpu_testing::kCpu, gpu_testing::kCuda, gpu_testing::kNegInf;

struct FlexCase {
  std::string label;
  DType dtype = DType::kBFloat16;
  int batch = 1, seqlen_q = 1, seqlen_k = 1, heads = 2, heads_kv = 2, head_dim = 128;
  int head_dim_v = 0;  // 0: head_dim
  bool causal = false;  // the bottom-right option, on top of any mask_mod
  int window_left = -1, window_right = -1;
  float softcap = 0.f;
  ScoreModKind score_mod = ScoreModKind::kNone;
  MaskModKind mask_mod = MaskModKind::kNone;
  std::vector<double> mask_scalars;
  bool varlen = false;  // packed rows; sequence 1 is empty, the others drawn up to seqlen_q/k
  // Block sparsity: 0 off, else the lists' head count (1: broadcast, or heads).
  int sparse_heads = 0;
  // Document ids: runs of 1..doc_length_max positions; numbered in order (documents packed one
  // after another), or with doc_ids_unsorted each run's id drawn from 0..3 (documents
  // interleaved, ids not monotone).
  int doc_length_max = 150;
  bool doc_ids_unsorted = false;
  int block_m = 128, block_n = 128;
  bool full_lists = true, mask_lists = true;
  // Row blocks left with no block at all (every output row 0, lse -inf).
  bool empty_row_blocks = false;
  int num_splits = 1;  // split-KV (the flex_split kernels); <= 0 lets cuflash choose
  // Packed GQA tiles (the flex_*packgqa kernels): a group's query heads in one tile, each row's
  // mods given its own query row and head. Unset: cuflash chooses.
  std::optional<bool> pack_gqa;
  // softmax_scale -1 / sqrt(head_dim): without a score_mod or softcap the flex kernels then keep
  // the scale out of the exponent (the running max is taken before it there).
  bool negative_scale = false;
  // CUFLASH_FWD_ZERO_V_TAIL around the call where set ("1": the V rows past the keys of the
  // boundary block are zeroed in shared memory even where TMA already read zeros there).
  const char* zero_v_tail = nullptr;
  unsigned seed = 1;
  int dim_v() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
};

std::string case_name(const FlexCase& c) {
  return gpu_testing::case_name(c.label, c.dtype, c.head_dim, c.dim_v());
}

enum class Block : std::uint8_t { kSkip, kMask, kFull };

// One problem in the rows of gpu_testing::RowLayout; aux arrays and block lists as the API
// takes them.
struct Problem : gpu_testing::RowLayout {
  FlexCase c;
  std::vector<float> q, k, v;
  float scale = 1.f;
  std::vector<float> score_table;  // alibi (H,) or relative bias (H, 2R + 1)
  int bias_width = 0;
  std::vector<int> doc_ids;  // (B, doc_len)
  int doc_len = 0;
  // Block lists (B, H_b, row blocks[, col blocks]) and the state they give each block.
  int row_blocks = 0, col_blocks = 0;
  std::vector<int> mask_cnt, mask_idx, full_cnt, full_idx;
  std::vector<Block> blocks;  // (B, H_b, row blocks, col blocks)

  explicit Problem(const FlexCase& fc) : RowLayout(fc, false, false), c(fc) {
    std::mt19937 rng(c.seed);
    draw_lengths(rng);
    std::normal_distribution<float> normal(0.f, 1.f);
    using gpu_testing::fill_normal;
    fill_normal(q, std::size_t(rows_q) * c.heads * c.head_dim, c.dtype, normal, rng);
    fill_normal(k, std::size_t(rows_k) * c.heads_kv * c.head_dim, c.dtype, normal, rng);
    fill_normal(v, std::size_t(rows_k) * c.heads_kv * c.dim_v(), c.dtype, normal, rng);
    scale = (c.negative_scale ? -1.f : 1.f) / std::sqrt(float(c.head_dim));

    if (c.score_mod == ScoreModKind::kAlibi) {
      // Small slopes: a bias of hundreds would leave the dtype-rounded naive scores with an
      // error so large that the accuracy rule could not catch a wrong kernel.
      for (int h = 0; h < c.heads; ++h) score_table.push_back(std::ldexp(1.f, -(h % 4) - 5));
    } else if (c.score_mod == ScoreModKind::kRelativeBias) {
      bias_width = 2 * 40 + 1;
      for (int i = 0; i < c.heads * bias_width; ++i) score_table.push_back(normal(rng));
    }
    if (c.mask_mod == MaskModKind::kDocument) {
      // Documents of random lengths; with seqlen_q > seqlen_k the last ones hold queries only,
      // so their rows see no key.
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
  }

  // Each block is skipped, masked or full at random; lists in random order.
  void make_block_lists(std::mt19937& rng) {
    // Per sequence, over the longest (the call's max_seqlen_q / max_seqlen_k with varlen).
    const int longest_q = *std::max_element(len_q.begin(), len_q.end());
    const int longest_k = *std::max_element(len_k.begin(), len_k.end());
    row_blocks = (longest_q + c.block_m - 1) / c.block_m;
    col_blocks = (longest_k + c.block_n - 1) / c.block_n;
    const int lists = c.batch * c.sparse_heads * row_blocks;
    mask_cnt.assign(lists, 0);
    full_cnt.assign(lists, 0);
    mask_idx.assign(std::size_t(lists) * col_blocks, 0);
    full_idx.assign(std::size_t(lists) * col_blocks, 0);
    blocks.assign(std::size_t(lists) * col_blocks, Block::kSkip);
    std::uniform_int_distribution<int> pick(0, 9);
    for (int list = 0; list < lists; ++list) {
      const int row_block = list % row_blocks;
      if (c.empty_row_blocks && row_block % 2 == 1) continue;
      std::vector<int> order(col_blocks);
      for (int j = 0; j < col_blocks; ++j) order[j] = j;
      std::shuffle(order.begin(), order.end(), rng);
      for (int j : order) {
        const int roll = pick(rng);
        Block state = roll < 2 ? Block::kSkip : roll < 6 ? Block::kMask : Block::kFull;
        if (state == Block::kMask && !c.mask_lists) state = Block::kFull;
        if (state == Block::kFull && !c.full_lists) state = Block::kMask;
        blocks[std::size_t(list) * col_blocks + j] = state;
        if (state == Block::kMask) mask_idx[std::size_t(list) * col_blocks + mask_cnt[list]++] = j;
        if (state == Block::kFull) full_idx[std::size_t(list) * col_blocks + full_cnt[list]++] = j;
      }
    }
  }

  // Score of query i, key j (positions in their sequence) of head h from s = scaled, capped.
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
      const int list = (b * c.sparse_heads + hb) * row_blocks + i / c.block_m;
      const Block state = blocks[std::size_t(list) * col_blocks + j / c.block_n];
      if (state == Block::kSkip) return false;
      apply_mask_mod = state == Block::kMask;
    }
    return !apply_mask_mod || mask_mod_keeps(b, i, j);
  }
};

struct Result {
  std::vector<double> out;  // (rows_q, H, D)
  std::vector<double> lse;
};

// The same attention done naively in the input dtype: scaled q, scores, capped and modified
// scores, probabilities and output each rounded to the dtype.
Result naive_low_precision(const Problem& pb) {
  const FlexCase& c = pb.c;
  Result result;
  result.out.assign(std::size_t(pb.rows_q) * c.heads * c.dim_v(), 0.0);
  result.lse.assign(pb.lse_size(), kNegInf);
  const int group = c.heads / c.heads_kv;
  std::vector<float> qs(c.head_dim), scores;
  for (int b = 0; b < c.batch; ++b) {
    const int sq = pb.len_q[b], sk = pb.len_k[b];
    for (int h = 0; h < c.heads; ++h) {
      const int hk = h / group;
      for (int i = 0; i < sq; ++i) {
        const float* qrow = &pb.q[(std::size_t(pb.start_q[b] + i) * c.heads + h) * c.head_dim];
        for (int d = 0; d < c.head_dim; ++d)
          qs[d] = gpu_testing::round_to(qrow[d] * pb.scale, c.dtype);
        scores.assign(sk, kNegInf);
        float row_max = kNegInf;
        for (int j = 0; j < sk; ++j) {
          if (!pb.visible(b, h, i, j)) continue;
          const float* krow =
              &pb.k[(std::size_t(pb.start_k[b] + j) * c.heads_kv + hk) * c.head_dim];
          float dot = 0.f;
          for (int d = 0; d < c.head_dim; ++d) dot += qs[d] * krow[d];
          float s = gpu_testing::round_to(dot, c.dtype);
          if (c.softcap > 0.f)
            s = gpu_testing::round_to(c.softcap * std::tanh(s / c.softcap), c.dtype);
          s = gpu_testing::round_to(pb.modded(s, h, i, j), c.dtype);
          scores[j] = s;
          row_max = std::max(row_max, s);
        }
        if (row_max == kNegInf) continue;  // nothing visible: out 0, lse -inf
        float denom = 0.f;
        for (int j = 0; j < sk; ++j) denom += std::exp(scores[j] - row_max);
        result.lse[pb.lse_index(b, h, i)] = row_max + std::log(denom);
        double* orow = &result.out[(std::size_t(pb.start_q[b] + i) * c.heads + h) * c.dim_v()];
        std::vector<float> acc(c.dim_v(), 0.f);
        for (int j = 0; j < sk; ++j) {
          if (scores[j] == kNegInf) continue;
          const float p = gpu_testing::round_to(std::exp(scores[j] - row_max) / denom, c.dtype);
          const float* vrow =
              &pb.v[(std::size_t(pb.start_k[b] + j) * c.heads_kv + hk) * c.dim_v()];
          for (int d = 0; d < c.dim_v(); ++d) acc[d] += p * vrow[d];
        }
        for (int d = 0; d < c.dim_v(); ++d) orow[d] = gpu_testing::round_to(acc[d], c.dtype);
      }
    }
  }
  return result;
}

// Where each int32 / fp32 mod and block-list array lives for one run (host vectors or device
// buffers).
struct SideData {
  void* score_table = nullptr;
  void* doc_ids = nullptr;
  void* mask_cnt = nullptr;
  void* mask_idx = nullptr;
  void* full_cnt = nullptr;
  void* full_idx = nullptr;
};

// The options and side tensors of a call, for either device.
void set_flex_args(ForwardArgs& args, const Problem& pb, Device device,
                   const gpu_testing::SequencePointers& sequences, const SideData& side) {
  const FlexCase& c = pb.c;
  const std::int64_t B = c.batch;
  pb.set_sequences(args.seq, device, sequences);
  gpu_testing::set_window_options(args.opts, c);
  if (c.negative_scale) args.opts.softmax_scale = pb.scale;
  args.opts.score_mod.kind = c.score_mod;
  if (c.score_mod == ScoreModKind::kAlibi) {
    args.opts.score_mod.aux = {TensorView(side.score_table, DType::kFloat32, {c.heads}, device)};
  } else if (c.score_mod == ScoreModKind::kRelativeBias) {
    args.opts.score_mod.aux = {
        TensorView(side.score_table, DType::kFloat32, {c.heads, pb.bias_width}, device)};
  }
  args.opts.mask_mod.kind = c.mask_mod;
  args.opts.mask_mod.scalars = c.mask_scalars;
  if (c.mask_mod == MaskModKind::kDocument) {
    args.opts.mask_mod.aux = {TensorView(side.doc_ids, DType::kInt32, {B, pb.doc_len}, device)};
  }
  if (c.sparse_heads > 0) {
    BlockSparseTensors bs;
    bs.block_m = c.block_m;
    bs.block_n = c.block_n;
    const std::int64_t hb = c.sparse_heads, rb = pb.row_blocks, cb = pb.col_blocks;
    if (c.mask_lists) {
      bs.mask_block_cnt = TensorView(side.mask_cnt, DType::kInt32, {B, hb, rb}, device);
      bs.mask_block_idx = TensorView(side.mask_idx, DType::kInt32, {B, hb, rb, cb}, device);
    }
    if (c.full_lists) {
      bs.full_block_cnt = TensorView(side.full_cnt, DType::kInt32, {B, hb, rb}, device);
      bs.full_block_idx = TensorView(side.full_idx, DType::kInt32, {B, hb, rb, cb}, device);
    }
    args.opts.block_sparse = bs;
  }
}

Result run_reference(const Problem& pb) {
  const FlexCase& c = pb.c;
  std::vector<float> q = pb.q, k = pb.k, v = pb.v, table = pb.score_table;
  std::vector<float> out(std::size_t(pb.rows_q) * c.heads * c.dim_v(), std::nanf(""));
  std::vector<float> lse(pb.lse_size(), std::nanf(""));
  gpu_testing::HostSequences sequences(pb);
  std::vector<int> docs = pb.doc_ids, mask_cnt = pb.mask_cnt, mask_idx = pb.mask_idx,
                   full_cnt = pb.full_cnt, full_idx = pb.full_idx;
  ForwardArgs args;
  args.q = pb.query_view(q.data(), DType::kFloat32, c.head_dim, kCpu);
  args.k = pb.key_view(k.data(), DType::kFloat32, c.head_dim, kCpu);
  args.v = pb.key_view(v.data(), DType::kFloat32, c.dim_v(), kCpu);
  args.out = pb.query_view(out.data(), DType::kFloat32, c.dim_v(), kCpu);
  args.lse = pb.lse_view(lse.data(), kCpu);
  set_flex_args(args, pb, kCpu, sequences.pointers(),
                {table.data(), docs.data(), mask_cnt.data(), mask_idx.data(), full_cnt.data(),
                 full_idx.data()});
  forward(args);
  return {std::vector<double>(out.begin(), out.end()), std::vector<double>(lse.begin(), lse.end())};
}

Result run_gpu(const Problem& pb) {
  const FlexCase& c = pb.c;
  DeviceBuffer q = to_device_16bit(pb.q, c.dtype), k = to_device_16bit(pb.k, c.dtype),
               v = to_device_16bit(pb.v, c.dtype);
  DeviceBuffer out = gpu_testing::poisoned_16bit(std::size_t(pb.rows_q) * c.heads * c.dim_v());
  DeviceBuffer lse = gpu_testing::poisoned_fp32(pb.lse_size());
  const gpu_testing::DeviceSequences sequences(pb);
  DeviceBuffer table = DeviceBuffer::from(pb.score_table);
  DeviceBuffer docs = DeviceBuffer::from(pb.doc_ids);
  DeviceBuffer mask_cnt = DeviceBuffer::from(pb.mask_cnt);
  DeviceBuffer mask_idx = DeviceBuffer::from(pb.mask_idx);
  DeviceBuffer full_cnt = DeviceBuffer::from(pb.full_cnt);
  DeviceBuffer full_idx = DeviceBuffer::from(pb.full_idx);

  ForwardArgs args;
  args.q = pb.query_view(q.data(), c.dtype, c.head_dim, kCuda);
  args.k = pb.key_view(k.data(), c.dtype, c.head_dim, kCuda);
  args.v = pb.key_view(v.data(), c.dtype, c.dim_v(), kCuda);
  args.out = pb.query_view(out.data(), c.dtype, c.dim_v(), kCuda);
  args.lse = pb.lse_view(lse.data(), kCuda);
  set_flex_args(args, pb, kCuda, sequences.pointers(),
                {table.data(), docs.data(), mask_cnt.data(), mask_idx.data(), full_cnt.data(),
                 full_idx.data()});
  args.num_splits = c.num_splits;
  args.pack_gqa = c.pack_gqa;
  forward(args);
  gpu_testing::check_cuda(cudaDeviceSynchronize(), "forward kernel");

  Result result;
  result.out = from_device_16bit(out, c.dtype);
  for (float x : lse.to_host<float>()) result.lse.push_back(x);
  return result;
}

// Rows of lse that are -inf in the reference: the case must produce some when it says so.
std::size_t count_empty_rows(const Result& ref) {
  return std::size_t(std::count(ref.lse.begin(), ref.lse.end(), double(kNegInf)));
}

class GpuForwardFlex : public ::testing::TestWithParam<FlexCase> {};

TEST_P(GpuForwardFlex, MatchesReference) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const FlexCase& c = GetParam();
  const Problem pb(c);
  std::optional<gpu_testing::ScopedEnv> zero_v_tail;
  if (c.zero_v_tail) zero_v_tail.emplace("CUFLASH_FWD_ZERO_V_TAIL", c.zero_v_tail);
  const std::optional<Result> gpu = gpu_testing::run_if_built([&] { return run_gpu(pb); });
  if (!gpu) return;
  const Result ref = run_reference(pb);
  const Result naive = naive_low_precision(pb);
  expect_output_close("out", gpu->out, naive.out, ref.out);
  expect_output_close("lse", gpu->lse, naive.lse, ref.lse);
  if (c.empty_row_blocks || c.label.find("empty") != std::string::npos)
    EXPECT_GT(count_empty_rows(ref), 0u) << "the case was meant to have rows without keys";
}

std::vector<FlexCase> flex_cases() {
  std::vector<FlexCase> cases;
  unsigned seed = 100;
  auto add = [&](FlexCase c) {
    c.seed = seed++;
    cases.push_back(c);
  };
  FlexCase c;
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
  c.label = "relative_bias_window", c.seqlen_q = 513, c.seqlen_k = 513, c.heads = 4, c.heads_kv = 1,
  c.window_left = 100, c.window_right = 20, c.score_mod = ScoreModKind::kRelativeBias;
  add(c);
  c = {};  // a negative softmax_scale on a mask_mod alone (the scale kept out of the exponent)
  c.label = "document_negative_scale", c.batch = 2, c.seqlen_q = 300, c.seqlen_k = 300,
  c.mask_mod = MaskModKind::kDocument, c.doc_length_max = 120, c.negative_scale = true;
  add(c);
  // mask_mods
  // Head dims 64 and 256.
  c = {};
  c.label = "prefix_lm_alibi", c.batch = 2, c.seqlen_q = 700, c.seqlen_k = 700, c.head_dim = 64,
  c.score_mod = ScoreModKind::kAlibi, c.mask_mod = MaskModKind::kPrefixLM, c.mask_scalars = {150};
  add(c);
  c = {};
  c.label = "document_long_causal", c.seqlen_q = 1000, c.seqlen_k = 1000, c.head_dim = 64,
  c.causal = true, c.mask_mod = MaskModKind::kDocument, c.doc_length_max = 500;
  add(c);
  c = {};
  c.label = "mask_causal_sk_gt_sq_relative_bias", c.seqlen_q = 450, c.seqlen_k = 800, c.head_dim = 64,
  c.heads = 4, c.heads_kv = 2, c.score_mod = ScoreModKind::kRelativeBias, c.mask_mod = MaskModKind::kCausal;
  add(c);
  c = {};
  c.label = "varlen_document_softcap", c.batch = 3, c.seqlen_q = 600, c.seqlen_k = 600, c.head_dim = 64,
  c.varlen = true, c.softcap = 20.f, c.mask_mod = MaskModKind::kDocument, c.doc_length_max = 300;
  add(c);
  c = {};
  c.label = "sparse_alibi", c.seqlen_q = 500, c.seqlen_k = 500, c.head_dim = 64,
  c.score_mod = ScoreModKind::kAlibi, c.sparse_heads = 1;
  add(c);
  c = {};
  c.label = "document_long_relative_bias", c.seqlen_q = 800, c.seqlen_k = 800, c.head_dim = 256,
  c.score_mod = ScoreModKind::kRelativeBias, c.mask_mod = MaskModKind::kDocument, c.doc_length_max = 400;
  add(c);
  // A score_mod over long causal rows; block lists over varlen windows (unpacked: the heuristic
  // would pack these rows where the build has the packed kernel); splits; at hdim 256 a negative
  // softmax_scale too.
  for (int d : {96, 192, 256}) {
    c = {};
    c.label = "alibi_causal_long", c.batch = 2, c.seqlen_q = 700, c.seqlen_k = 900, c.head_dim = d,
    c.causal = true, c.score_mod = ScoreModKind::kAlibi;
    add(c);
    c = {};
    c.label = "sparse_varlen_sliding_window_gqa", c.batch = 3, c.seqlen_q = 400, c.seqlen_k = 500,
    c.head_dim = d, c.heads = 4, c.heads_kv = 2, c.varlen = true, c.mask_mod = MaskModKind::kSlidingWindow,
    c.mask_scalars = {150, 30}, c.sparse_heads = 1, c.pack_gqa = false;
    add(c);
    c = {};
    c.label = "split3_prefix_lm_softcap", c.batch = 2, c.seqlen_q = 64, c.seqlen_k = 900, c.head_dim = d,
    c.softcap = 30.f, c.mask_mod = MaskModKind::kPrefixLM, c.mask_scalars = {500}, c.num_splits = 3;
    add(c);
    c = {};
    c.label = "document_negative_scale", c.batch = 2, c.seqlen_q = 300, c.seqlen_k = 300, c.head_dim = d,
    c.mask_mod = MaskModKind::kDocument, c.doc_length_max = 120, c.negative_scale = true;
    if (d == 256) add(c);
  }
  // The V-tail zeroing forced where auto leaves it off (dense keys, 333 of them: a partial last
  // block), at hdim 256: unsplit and packed, and split three ways.
  c = {};
  c.label = "zero_v_tail_forced_alibi_causal", c.batch = 2, c.seqlen_q = 200, c.seqlen_k = 333, c.heads = 4,
  c.heads_kv = 2, c.head_dim = 256, c.causal = true, c.score_mod = ScoreModKind::kAlibi, c.zero_v_tail = "1";
  add(c);
  c.label = "zero_v_tail_forced_alibi_causal_packed", c.pack_gqa = true;
  add(c);
  c = {};
  c.label = "zero_v_tail_forced_split3_prefix_lm", c.batch = 2, c.seqlen_q = 64, c.seqlen_k = 333, c.head_dim = 256,
  c.mask_mod = MaskModKind::kPrefixLM, c.mask_scalars = {100}, c.num_splits = 3, c.zero_v_tail = "1";
  add(c);
  // Head dims (192, 128): V and out narrower than Q and K (its flex kernels had no forward case).
  c = {};
  c.label = "alibi_causal_gqa", c.batch = 2, c.seqlen_q = 500, c.seqlen_k = 640, c.heads = 4, c.heads_kv = 2,
  c.head_dim = 192, c.head_dim_v = 128, c.causal = true, c.score_mod = ScoreModKind::kAlibi;
  add(c);
  c = {};
  c.label = "sparse_varlen_document_softcap", c.batch = 3, c.seqlen_q = 400, c.seqlen_k = 450, c.head_dim = 192,
  c.head_dim_v = 128, c.varlen = true, c.softcap = 20.f, c.mask_mod = MaskModKind::kDocument,
  c.doc_length_max = 150, c.sparse_heads = 1;
  add(c);
  c = {};
  c.label = "split3_sliding_window", c.batch = 2, c.seqlen_q = 40, c.seqlen_k = 900, c.head_dim = 192,
  c.head_dim_v = 128, c.mask_mod = MaskModKind::kSlidingWindow, c.mask_scalars = {300, 0}, c.num_splits = 3;
  add(c);
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
  // Documents longer than a block: the lists built from the ids skip the blocks of other
  // documents and run whole-document blocks without the per-element check.
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
  // varlen: positions count from each sequence's start
  c = {};
  c.label = "varlen_document_causal", c.batch = 4, c.seqlen_q = 300, c.seqlen_k = 333, c.heads = 4,
  c.heads_kv = 2, c.causal = true, c.varlen = true, c.mask_mod = MaskModKind::kDocument;
  add(c);
  c = {};
  c.label = "varlen_mask_causal_relative_bias", c.batch = 3, c.seqlen_q = 257, c.seqlen_k = 190,
  c.varlen = true, c.score_mod = ScoreModKind::kRelativeBias, c.mask_mod = MaskModKind::kCausal;
  add(c);
  // block sparsity
  c = {};
  c.label = "sparse_broadcast_mask_causal", c.seqlen_q = 700, c.seqlen_k = 700, c.heads = 3,
  c.heads_kv = 3, c.mask_mod = MaskModKind::kCausal, c.sparse_heads = 1;
  add(c);
  c = {};
  c.label = "sparse_per_head_document", c.batch = 2, c.seqlen_q = 520, c.seqlen_k = 610,
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
  c.label = "sparse_empty_row_blocks", c.batch = 2, c.seqlen_q = 530, c.seqlen_k = 530, c.heads = 2,
  c.mask_mod = MaskModKind::kCausal, c.sparse_heads = 2, c.empty_row_blocks = true;
  add(c);
  c = {};
  c.label = "sparse_one_short_block", c.seqlen_q = 17, c.seqlen_k = 17, c.sparse_heads = 1,
  c.score_mod = ScoreModKind::kAlibi, c.mask_mod = MaskModKind::kCausal;
  add(c);
  // fp16
  c = {};
  c.label = "fp16_document_sparse", c.dtype = DType::kFloat16, c.batch = 2, c.seqlen_q = 400,
  c.seqlen_k = 400, c.mask_mod = MaskModKind::kDocument, c.score_mod = ScoreModKind::kAlibi,
  c.sparse_heads = 1;
  add(c);
  // split-KV: each split walks its share of the row block's n-blocks (narrowed by the mask_mod,
  // or the listed blocks inside the share), the combine merges them
  c = {};
  c.label = "split3_decode_alibi_causal_gqa", c.batch = 2, c.seqlen_q = 4, c.seqlen_k = 1500, c.heads = 8,
  c.heads_kv = 2, c.causal = true, c.score_mod = ScoreModKind::kAlibi, c.num_splits = 3;
  add(c);
  c = {};
  c.label = "split5_decode_document", c.seqlen_q = 2, c.seqlen_k = 2000, c.mask_mod = MaskModKind::kDocument,
  c.num_splits = 5;
  add(c);
  c = {};
  c.label = "split2_sliding_window_softcap", c.seqlen_q = 300, c.seqlen_k = 900, c.softcap = 20.f,
  c.mask_mod = MaskModKind::kSlidingWindow, c.mask_scalars = {200, 0}, c.num_splits = 2;
  add(c);
  c = {};
  c.label = "split4_sparse_per_head_relative_bias", c.batch = 2, c.seqlen_q = 200, c.seqlen_k = 1100,
  c.score_mod = ScoreModKind::kRelativeBias, c.sparse_heads = 2, c.num_splits = 4;
  add(c);
  c = {};
  c.label = "split3_varlen_prefix_lm", c.batch = 3, c.seqlen_q = 40, c.seqlen_k = 700, c.varlen = true,
  c.mask_mod = MaskModKind::kPrefixLM, c.mask_scalars = {500}, c.num_splits = 3;
  add(c);
  c = {};  // 256-key list blocks: split boundaries fall inside list blocks
  c.label = "split4_sparse_blocks_256_alibi", c.seqlen_q = 150, c.seqlen_k = 1100, c.heads = 2,
  c.score_mod = ScoreModKind::kAlibi, c.sparse_heads = 1, c.block_n = 256, c.num_splits = 4;
  add(c);
  // Packed GQA: a tile holds 128 / group query rows of each of the group's heads; the head-
  // dependent score_mods (ALiBi slopes, relative-bias tables per head) and the mask_mods must see
  // each row's own head and query row. Groups that do not divide 128 (3, 6) put a query row's
  // heads on both sides of a tile edge.
  c = {};
  c.label = "packgqa_decode_alibi_causal", c.batch = 2, c.seqlen_q = 5, c.seqlen_k = 700,
  c.heads = 8, c.heads_kv = 2, c.causal = true, c.score_mod = ScoreModKind::kAlibi,
  c.pack_gqa = true;
  add(c);
  c = {};
  c.label = "packgqa_group3_relative_bias_document", c.batch = 2, c.seqlen_q = 300,
  c.seqlen_k = 300, c.heads = 6, c.heads_kv = 2, c.score_mod = ScoreModKind::kRelativeBias,
  c.mask_mod = MaskModKind::kDocument, c.pack_gqa = true;
  add(c);
  c = {};
  c.label = "packgqa_varlen_sliding_window_softcap", c.batch = 3, c.seqlen_q = 200,
  c.seqlen_k = 260, c.heads = 4, c.heads_kv = 1, c.varlen = true, c.softcap = 20.f,
  c.mask_mod = MaskModKind::kSlidingWindow, c.mask_scalars = {64, 16}, c.pack_gqa = true;
  add(c);
  c = {};
  c.label = "packgqa_prefix_lm_window", c.seqlen_q = 333, c.seqlen_k = 400, c.heads = 6,
  c.heads_kv = 1, c.window_left = 150, c.window_right = 30, c.mask_mod = MaskModKind::kPrefixLM,
  c.mask_scalars = {60}, c.score_mod = ScoreModKind::kAlibi, c.pack_gqa = true;
  add(c);
  c = {};
  c.label = "packgqa_document_empty_rows", c.seqlen_q = 400, c.seqlen_k = 150, c.heads = 4,
  c.heads_kv = 2, c.mask_mod = MaskModKind::kDocument, c.pack_gqa = true;
  add(c);
  // Block lists broadcast over heads: group 4 packs 32 query rows per tile, so list row blocks
  // of 64 rows hold two tiles' rows, and 128-row ones four.
  c = {};
  c.label = "packgqa_sparse_broadcast_mask_causal", c.seqlen_q = 500, c.seqlen_k = 500,
  c.heads = 8, c.heads_kv = 2, c.mask_mod = MaskModKind::kCausal,
  c.score_mod = ScoreModKind::kAlibi, c.sparse_heads = 1, c.pack_gqa = true;
  add(c);
  c = {};
  c.label = "packgqa_sparse_block_m64_sliding_window", c.batch = 2, c.seqlen_q = 300,
  c.seqlen_k = 420, c.heads = 4, c.heads_kv = 1, c.mask_mod = MaskModKind::kSlidingWindow,
  c.mask_scalars = {100, 40}, c.sparse_heads = 1, c.block_m = 64, c.empty_row_blocks = true,
  c.pack_gqa = true;
  add(c);
  // With split-KV (flex_split_packgqa): decoding, several splits per packed tile.
  c = {};
  c.label = "packgqa_split3_decode_prefix_lm", c.batch = 2, c.seqlen_q = 3, c.seqlen_k = 1500,
  c.heads = 6, c.heads_kv = 2, c.mask_mod = MaskModKind::kPrefixLM, c.mask_scalars = {700},
  c.score_mod = ScoreModKind::kRelativeBias, c.num_splits = 3, c.pack_gqa = true;
  add(c);
  c = {};
  c.label = "packgqa_split4_sparse_alibi", c.seqlen_q = 40, c.seqlen_k = 1100, c.heads = 8,
  c.heads_kv = 1, c.score_mod = ScoreModKind::kAlibi, c.sparse_heads = 1, c.num_splits = 4,
  c.pack_gqa = true;
  add(c);
  // Block lists with packed sequences: per sequence, counted over the longest.
  c = {};
  c.label = "sparse_varlen_sliding_window_gqa", c.batch = 3, c.seqlen_q = 400, c.seqlen_k = 500,
  c.heads = 4, c.heads_kv = 2, c.varlen = true, c.mask_mod = MaskModKind::kSlidingWindow,
  c.mask_scalars = {150, 30}, c.sparse_heads = 1;
  add(c);
  c = {};
  c.label = "sparse_varlen_per_head_alibi_causal", c.batch = 4, c.seqlen_q = 300, c.seqlen_k = 350,
  c.heads = 2, c.varlen = true, c.causal = true, c.score_mod = ScoreModKind::kAlibi,
  c.sparse_heads = 2, c.block_n = 256;
  add(c);
  c = {};
  c.label = "packgqa_sparse_varlen_mask_causal", c.batch = 3, c.seqlen_q = 200, c.seqlen_k = 300,
  c.heads = 8, c.heads_kv = 2, c.varlen = true, c.mask_mod = MaskModKind::kCausal,
  c.sparse_heads = 1, c.pack_gqa = true;
  add(c);
  // fp16, and the heuristic's own choice on a decode shape (packed where the kernel is built).
  c = {};
  c.label = "packgqa_fp16_sliding_window_alibi", c.dtype = DType::kFloat16, c.batch = 2,
  c.seqlen_q = 90, c.seqlen_k = 500, c.heads = 4, c.heads_kv = 2,
  c.score_mod = ScoreModKind::kAlibi, c.mask_mod = MaskModKind::kSlidingWindow,
  c.mask_scalars = {128, 0}, c.pack_gqa = true;
  add(c);
  c = {};
  c.label = "decode_gqa_alibi_causal_auto", c.batch = 2, c.seqlen_q = 2, c.seqlen_k = 900,
  c.heads = 8, c.heads_kv = 1, c.causal = true, c.score_mod = ScoreModKind::kAlibi;
  add(c);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Mods, GpuForwardFlex, ::testing::ValuesIn(flex_cases()),
                         gpu_testing::CaseName());

// A small hdim128 bf16 call with a mask_mod, for the refusals below.
struct SmallCall {
  DeviceBuffer q{64 * 2 * 128 * 2}, k{256 * 2 * 128 * 2}, v{256 * 2 * 128 * 2},
      out{64 * 2 * 128 * 2};
  ForwardArgs args;
  SmallCall() {
    args.q = TensorView(q.data(), DType::kBFloat16, {1, 64, 2, 128}, kCuda);
    args.k = TensorView(k.data(), DType::kBFloat16, {1, 256, 2, 128}, kCuda);
    args.v = TensorView(v.data(), DType::kBFloat16, {1, 256, 2, 128}, kCuda);
    args.out = TensorView(out.data(), DType::kBFloat16, {1, 64, 2, 128}, kCuda);
    args.opts.mask_mod.kind = MaskModKind::kCausal;
  }
};

TEST(GpuForwardFlexUnsupported, PackGqaWithUnreadableBlockListsIsRefused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  if (!is_built("fwd bf16 hdim128 flex packgqa")) GTEST_SKIP() << "hdim128 bf16 flex packgqa not built";
  SmallCall call;
  // Two query heads on one kv head: a packed tile holds both heads' rows.
  call.args.k = TensorView(call.k.data(), DType::kBFloat16, {1, 256, 1, 128}, kCuda);
  call.args.v = TensorView(call.v.data(), DType::kBFloat16, {1, 256, 1, 128}, kCuda);
  call.args.pack_gqa = true;
  DeviceBuffer cnt = DeviceBuffer::from(std::vector<int>(2, 0));
  DeviceBuffer idx = DeviceBuffer::from(std::vector<int>(2 * 2, 0));
  BlockSparseTensors bs;
  bs.block_m = 128;
  bs.block_n = 128;
  // Lists per head: the two heads of a packed tile would need different lists.
  bs.mask_block_cnt = TensorView(cnt.data(), DType::kInt32, {1, 2, 1}, kCuda);
  bs.mask_block_idx = TensorView(idx.data(), DType::kInt32, {1, 2, 1, 2}, kCuda);
  call.args.opts.block_sparse = bs;
  expect_not_supported(call.args, "pack_gqa");
  // Left to the heuristic, the tiles stay unpacked and the call runs.
  call.args.pack_gqa.reset();
  EXPECT_NO_THROW(forward(call.args));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // Broadcast lists with row blocks of 32 query rows: a packed tile holds 64.
  bs.block_m = 32;
  bs.mask_block_cnt = TensorView(cnt.data(), DType::kInt32, {1, 1, 2}, kCuda);
  bs.mask_block_idx = TensorView(idx.data(), DType::kInt32, {1, 1, 2, 2}, kCuda);
  call.args.opts.block_sparse = bs;
  call.args.pack_gqa = true;
  expect_not_supported(call.args, "pack_gqa");
}

// A call the kernels cannot take fails before the caller's allocator is asked for workspace and
// before the document mask's lists are built (both need workspace here), and so does sizing it.
TEST(GpuForwardFlexUnsupported, RefusedBeforeTheWorkspace) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  if (!is_built("fwd bf16 hdim128 flex")) GTEST_SKIP() << "hdim128 bf16 flex not built";
  SmallCall call;
  DeviceBuffer ids = DeviceBuffer::from(std::vector<int>(256, 0));
  call.args.opts.mask_mod = {};
  call.args.opts.mask_mod.kind = MaskModKind::kDocument;
  call.args.opts.mask_mod.aux = {TensorView(ids.data(), DType::kInt32, {1, 256}, kCuda)};
  // Rows of q 260 elements apart: not a multiple of 8, which TMA needs.
  DeviceBuffer q_padded{64 * 260 * 2};
  call.args.q = TensorView(q_padded.data(), DType::kBFloat16, {1, 64, 2, 128}, {64 * 260, 260, 128, 1}, kCuda);
  int allocations = 0;
  WorkspaceAllocator const allocate = [&](std::size_t bytes) {
    ++allocations;
    return Workspace{nullptr, bytes};
  };
  try {
    forward(call.args, nullptr, allocate);
    ADD_FAILURE() << "the call ran";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), Error::Kind::kNotSupported) << error.what();
    EXPECT_EQ(error.argument(), "q") << error.what();
  }
  EXPECT_EQ(allocations, 0);
  try {
    forward_workspace_size(call.args);
    ADD_FAILURE() << "the workspace was sized";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), Error::Kind::kNotSupported) << error.what();
  }
  // Aligned rows: the same call runs (and takes workspace for the lists).
  call.args.q = TensorView(call.q.data(), DType::kBFloat16, {1, 64, 2, 128}, kCuda);
  EXPECT_GT(forward_workspace_size(call.args), 0u);
  EXPECT_NO_THROW(forward(call.args));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(GpuForwardFlexUnsupported, BlockSmallerThanTileIsRefused) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  if (!is_built("fwd bf16 hdim128 flex")) GTEST_SKIP() << "hdim128 bf16 flex not built";
  SmallCall call;
  // block_m 64: a 128-row kernel tile would span two BlockMask row blocks.
  DeviceBuffer cnt = DeviceBuffer::from(std::vector<int>(2, 0));
  DeviceBuffer idx = DeviceBuffer::from(std::vector<int>(2 * 2, 0));
  BlockSparseTensors bs;
  bs.block_m = 64;
  bs.block_n = 128;
  bs.mask_block_cnt = TensorView(cnt.data(), DType::kInt32, {1, 1, 1}, kCuda);
  bs.mask_block_idx = TensorView(idx.data(), DType::kInt32, {1, 1, 1, 2}, kCuda);
  call.args.opts.block_sparse = bs;
  expect_not_supported(call.args, "block_sparse");
}


// The lists that dispatch builds from document ids (sm90::build_document_block_lists): every
// (row block, column block) pair listed as its ids say, columns ascending: ranges of ids that do
// not overlap leave the pair out, one id on both sides makes it full, anything else masked.
// Sequence 0 has documents packed in order (lists leave blocks out and hold full ones),
// sequence 1 interleaved ids; the keys outnumber the queries, and the ids run past both.
TEST(GpuDocumentBlockLists, ClassifyEveryBlockPair) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  constexpr int kBatch = 2, kSeqlenQ = 1000, kSeqlenK = 1300, kLength = 1400;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> run(1, 500), any_doc(0, 3);
  std::vector<int> ids;
  for (int b = 0; b < kBatch; ++b) {
    int doc = 0, left = run(rng);
    for (int i = 0; i < kLength; ++i) {
      if (left-- == 0) doc = b == 0 ? doc + 1 : any_doc(rng), left = run(rng);
      ids.push_back(doc);
    }
  }
  detail::AttentionShape shape;
  shape.seqlen_q = kSeqlenQ;
  shape.seqlen_k = kSeqlenK;
  BlockSparseParams bs;
  detail::plan_document_block_lists(bs, shape, /*backward=*/false);
  ASSERT_EQ(bs.num_row_blocks, 8);
  ASSERT_EQ(bs.num_col_blocks, 11);
  DeviceBuffer device_ids = DeviceBuffer::from(ids);
  ModParams mod;
  mod.kind = int(MaskModKind::kDocument);
  mod.num_aux = 1;
  mod.aux[0] = device_ids.data();
  mod.aux_cols[0] = kLength;
  DeviceBuffer workspace(sm90::document_block_lists_bytes(bs, kBatch));
  sm90::build_document_block_lists(bs, mod, kBatch, kSeqlenQ, kSeqlenK, workspace.data(), nullptr);
  gpu_testing::check_cuda(cudaDeviceSynchronize(), "document block lists");
  auto copy = [](const int* from, std::size_t count) {
    std::vector<int> host(count);
    gpu_testing::check_cuda(cudaMemcpy(host.data(), from, count * sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return host;
  };
  const int rows = bs.num_row_blocks, cols = bs.num_col_blocks;
  const std::vector<int> mask_cnt = copy(bs.mask_block_cnt, kBatch * rows),
                         full_cnt = copy(bs.full_block_cnt, kBatch * rows),
                         mask_idx = copy(bs.mask_block_idx, std::size_t(kBatch) * rows * cols),
                         full_idx = copy(bs.full_block_idx, std::size_t(kBatch) * rows * cols);
  int skipped = 0, full = 0;
  for (int b = 0; b < kBatch; ++b) {
    auto range = [&](int begin, int end) {
      const auto first = ids.begin() + b * kLength + begin, last = ids.begin() + b * kLength + end;
      return std::make_pair(*std::min_element(first, last), *std::max_element(first, last));
    };
    for (int m = 0; m < rows; ++m) {
      const auto q = range(m * 128, std::min((m + 1) * 128, kSeqlenQ));
      std::vector<int> want_mask, want_full;
      for (int n = 0; n < cols; ++n) {
        const auto k = range(n * 128, std::min((n + 1) * 128, kSeqlenK));
        if (k.second < q.first || q.second < k.first) {
          skipped += b == 0;
        } else if (q.first == q.second && k.first == k.second) {
          want_full.push_back(n);
          full += b == 0;
        } else {
          want_mask.push_back(n);
        }
      }
      const int list = b * rows + m;
      SCOPED_TRACE("sequence " + std::to_string(b) + ", row block " + std::to_string(m));
      ASSERT_EQ(mask_cnt[list], int(want_mask.size()));
      ASSERT_EQ(full_cnt[list], int(want_full.size()));
      EXPECT_EQ(std::vector<int>(mask_idx.begin() + list * cols, mask_idx.begin() + list * cols + mask_cnt[list]),
                want_mask);
      EXPECT_EQ(std::vector<int>(full_idx.begin() + list * cols, full_idx.begin() + list * cols + full_cnt[list]),
                want_full);
    }
  }
  EXPECT_GT(skipped, 0) << "the packed documents were meant to leave blocks out";
  EXPECT_GT(full, 0) << "the packed documents were meant to give whole-document blocks";
}

}  // namespace
}  // namespace cuflash

#endif  // CUFLASH_HAS_CUDA
