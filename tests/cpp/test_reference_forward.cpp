// Forward pass of the CPU reference against the naive oracle of naive_attention.hpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "naive_attention.hpp"
#include "reference/numeric.hpp"

namespace cuflash::testing {
namespace {

// Runs the forward pass of one configuration and compares it with the oracle.
void check(const CaseConfig& config) {
  SCOPED_TRACE(describe(config));
  AttentionCase c(config);
  c.run_forward();
  c.check_forward();
}

void check(const CaseConfig& config, Tolerance out_tol) {
  SCOPED_TRACE(describe(config));
  AttentionCase c(config);
  c.run_forward();
  c.check_forward(out_tol);
}

// Rows of the dense lse that are -inf (no visible key).
int count_empty_rows(const AttentionCase& c) {
  int empty = 0;
  c.lse.for_each([&](const Index& index) { empty += c.lse.at(index) == -kInf ? 1 : 0; });
  return empty;
}

TEST(ReferenceForward, DtypesAndOddLengths) {
  const int shapes[][2] = {{1, 1}, {1, 17}, {17, 1}, {17, 17}, {5, 12}, {12, 5}};
  unsigned seed = 10;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (const auto& shape : shapes) {
      CaseConfig c;
      c.dtype = dtype;
      c.seqlen_q = shape[0];
      c.seqlen_k = shape[1];
      c.seed = seed++;
      check(c);
    }
  }
}

TEST(ReferenceForward, HeadRatiosOneToEight) {
  unsigned seed = 20;
  for (int heads_kv : {1, 2}) {
    for (int ratio = 1; ratio <= 8; ++ratio) {
      CaseConfig c;
      c.batch = 1;
      c.seqlen_q = 6;
      c.seqlen_k = 9;
      c.heads_kv = heads_kv;
      c.heads = ratio * heads_kv;
      c.dtype = ratio % 2 ? DType::kBFloat16 : DType::kFloat32;
      c.causal = ratio % 3 == 0;
      c.seed = seed++;
      check(c);
    }
  }
}

TEST(ReferenceForward, HeadDimVDiffersFromHeadDim) {
  unsigned seed = 30;
  for (auto dims : {std::pair{16, 8}, std::pair{8, 24}, std::pair{24, 16}}) {
    for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
      CaseConfig c;
      c.head_dim = dims.first;
      c.head_dim_v = dims.second;
      c.heads = 4;
      c.heads_kv = 2;
      c.dtype = dtype;
      c.seed = seed++;
      check(c);
    }
  }
}

TEST(ReferenceForward, CausalIsBottomRightAligned) {
  unsigned seed = 40;
  for (auto lengths : {std::pair{5, 9}, std::pair{9, 9}, std::pair{9, 4}, std::pair{1, 17}}) {
    CaseConfig c;
    c.causal = true;
    c.seqlen_q = lengths.first;
    c.seqlen_k = lengths.second;
    c.seed = seed++;
    check(c);
  }
  // With Sq > Sk the first Sq - Sk queries see no key: out 0, lse -inf.
  CaseConfig c;
  c.causal = true;
  c.batch = 1;
  c.heads = c.heads_kv = 1;
  c.seqlen_q = 9;
  c.seqlen_k = 4;
  AttentionCase run(c);
  run.run_forward();
  run.check_forward();
  EXPECT_EQ(count_empty_rows(run), 5);
}

TEST(ReferenceForward, SlidingWindow) {
  const int windows[][2] = {{0, 0}, {2, -1}, {-1, 2}, {1, 3}, {3, 0}, {0, 5}};
  unsigned seed = 50;
  for (const auto& window : windows) {
    for (auto lengths : {std::pair{7, 11}, std::pair{11, 7}, std::pair{8, 8}}) {
      CaseConfig c;
      c.window_left = window[0];
      c.window_right = window[1];
      c.seqlen_q = lengths.first;
      c.seqlen_k = lengths.second;
      c.seed = seed++;
      check(c);
    }
  }
  // causal with a left window.
  for (int left : {0, 1, 4}) {
    CaseConfig c;
    c.causal = true;
    c.window_left = left;
    c.seqlen_q = 6;
    c.seqlen_k = 10;
    c.seed = seed++;
    check(c);
  }
}

TEST(ReferenceForward, Softcap) {
  unsigned seed = 60;
  for (float softcap : {0.3f, 1.0f, 30.0f}) {
    for (bool causal : {false, true}) {
      CaseConfig c;
      c.softcap = softcap;
      c.causal = causal;
      c.softmax_scale = 1.5f;  // scores large enough for the cap to matter
      c.seed = seed++;
      check(c);
    }
  }
}

TEST(ReferenceForward, SoftmaxScale) {
  CaseConfig c;
  c.softmax_scale = 0.07f;
  c.seed = 65;
  check(c);
}

// A scale of 0: every visible key weighs the same, masked ones nothing (the GPU kernels' exponent
// takes a tiny scale instead of 0 there, whose product with a masked -inf stays -inf).
TEST(ReferenceForward, ZeroSoftmaxScaleWeighsVisibleKeysAlike) {
  CaseConfig c;
  c.softmax_scale = 0.f;
  c.causal = true;
  c.seqlen_q = 9;
  c.seqlen_k = 14;
  c.seed = 66;
  check(c);
}

TEST(ReferenceForward, LearnableSink) {
  unsigned seed = 70;
  for (DType sink_dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (double mean : {-2.0, 0.0, 3.0}) {
      CaseConfig c;
      c.sink_dtype = sink_dtype;
      c.sink_mean = mean;
      c.heads = 4;
      c.heads_kv = 2;
      c.dtype = DType::kBFloat16;
      c.seed = seed++;
      check(c);
    }
  }
}

TEST(ReferenceForward, SinkOnFullyMaskedRowsGivesLseSink) {
  CaseConfig c;
  c.sink_dtype = DType::kFloat32;
  c.causal = true;
  c.seqlen_q = 8;
  c.seqlen_k = 3;
  c.seed = 75;
  AttentionCase run(c);
  run.run_forward();
  run.check_forward();
  // Query 0 sees no key: out = 0 and lse = sink[h] exactly (up to fp32).
  for (int b = 0; b < run.batch; ++b) {
    for (int h = 0; h < c.heads; ++h) {
      EXPECT_FLOAT_EQ(run.lse.at({b, h, 0}), static_cast<float>(run.sink.at({h})));
      for (int d = 0; d < c.head_dim_v; ++d) EXPECT_EQ(run.out.at({b, 0, h, d}), 0.0);
    }
  }
}

TEST(ReferenceForward, ScoreModAlibi) {
  unsigned seed = 80;
  for (bool causal : {false, true}) {
    for (auto lengths : {std::pair{6, 10}, std::pair{10, 6}}) {
      CaseConfig c;
      c.score_mod = ScoreModKind::kAlibi;
      c.causal = causal;
      c.heads = 4;
      c.heads_kv = 1;
      c.seqlen_q = lengths.first;
      c.seqlen_k = lengths.second;
      c.seed = seed++;
      check(c);
    }
  }
  CaseConfig c;
  c.score_mod = ScoreModKind::kAlibi;
  c.packed_q = {4, 0, 7};
  c.packed_k = {6, 3, 7};
  c.softcap = 2.0f;
  c.seed = seed++;
  check(c);
}

TEST(ReferenceForward, ScoreModRelativeBias) {
  unsigned seed = 90;
  for (int radius : {0, 2, 5}) {
    CaseConfig c;
    c.score_mod = ScoreModKind::kRelativeBias;
    c.relative_radius = radius;
    c.seqlen_q = 9;
    c.seqlen_k = 12;
    c.dtype = DType::kFloat16;
    c.seed = seed++;
    check(c);
  }
}

TEST(ReferenceForward, MaskMods) {
  struct ModCase {
    MaskModKind kind;
    std::vector<double> scalars;
  };
  const std::vector<ModCase> mods = {
      {MaskModKind::kCausal, {}},
      {MaskModKind::kSlidingWindow, {2, 1}},
      {MaskModKind::kSlidingWindow, {0, 0}},
      {MaskModKind::kSlidingWindow, {4, 0}},
      {MaskModKind::kPrefixLM, {3}},
      {MaskModKind::kPrefixLM, {0}},
      {MaskModKind::kDocument, {}},
  };
  unsigned seed = 100;
  for (const ModCase& mod : mods) {
    for (auto lengths : {std::pair{7, 7}, std::pair{5, 11}, std::pair{11, 5}}) {
      for (bool causal : {false, true}) {
        CaseConfig c;
        c.mask_mod = mod.kind;
        c.mask_scalars = mod.scalars;
        c.causal = causal;  // intersects with the mask_mod
        c.seqlen_q = lengths.first;
        c.seqlen_k = lengths.second;
        c.seed = seed++;
        check(c);
      }
    }
  }
}

TEST(ReferenceForward, MaskModSlidingWindowNegativeBoundIsOpen) {
  // Validation asks for whole numbers >= 0; the reference reads a negative bound as unbounded.
  for (auto scalars : {std::vector<double>{-1, 1}, std::vector<double>{2, -1}}) {
    CaseConfig c;
    c.entry = Entry::kReference;
    c.mask_mod = MaskModKind::kSlidingWindow;
    c.mask_scalars = scalars;
    c.seqlen_q = 8;
    c.seqlen_k = 8;
    c.seed = 115;
    check(c);
  }
}

TEST(ReferenceForward, MaskModDocumentWithVarlen) {
  CaseConfig c;
  c.mask_mod = MaskModKind::kDocument;
  c.packed_q = {5, 0, 9};
  c.packed_k = {7, 2, 9};
  c.heads = 4;
  c.heads_kv = 2;
  c.seed = 118;
  check(c);
}

TEST(ReferenceForward, VarlenWithEmptySequences) {
  unsigned seed = 120;
  const std::vector<std::vector<int>> q_lengths = {{3, 0, 7, 1}, {0, 0, 5, 17}, {1, 1, 1, 1}};
  const std::vector<std::vector<int>> k_lengths = {{5, 4, 0, 9}, {3, 0, 5, 17}, {17, 1, 0, 2}};
  for (std::size_t t = 0; t < q_lengths.size(); ++t) {
    for (bool causal : {false, true}) {
      CaseConfig c;
      c.packed_q = q_lengths[t];
      c.packed_k = k_lengths[t];
      c.causal = causal;
      c.heads = 6;
      c.heads_kv = 2;
      c.dtype = t == 1 ? DType::kFloat16 : DType::kFloat32;
      c.seed = seed++;
      check(c);
    }
  }
  // Packed q with dense k, and dense q with packed k.
  CaseConfig c;
  c.batch = 3;
  c.packed_q = {4, 0, 6};
  c.seqlen_k = 7;
  c.seed = seed++;
  check(c);
  c = CaseConfig{};
  c.batch = 3;
  c.seqlen_q = 5;
  c.packed_k = {0, 8, 3};
  c.seed = seed++;
  check(c);
}

TEST(ReferenceForward, SequsedCapsLengths) {
  unsigned seed = 130;
  {
    CaseConfig c;
    c.batch = 3;
    c.seqlen_q = 8;
    c.seqlen_k = 9;
    c.seqused_q = {8, 3, 0};
    c.seqused_k = {2, 9, 5};
    c.causal = true;
    c.seed = seed++;
    check(c);
  }
  {
    CaseConfig c;
    c.packed_q = {6, 4, 0, 5};
    c.packed_k = {7, 7, 3, 5};
    c.seqused_q = {6, 1, 0, 3};
    c.seqused_k = {0, 4, 3, 5};
    c.window_left = 2;
    c.window_right = 1;
    c.seed = seed++;
    check(c);
  }
  {
    // seqused_k = 0 everywhere: every row empty.
    CaseConfig c;
    c.seqused_k = {0, 0};
    c.seed = seed++;
    AttentionCase run(c);
    run.run_forward();
    run.check_forward();
    EXPECT_EQ(count_empty_rows(run), c.batch * c.heads * c.seqlen_q);
  }
}

TEST(ReferenceForward, PagedKv) {
  unsigned seed = 140;
  for (int page_size : {1, 3, 16}) {
    for (bool packed_q : {false, true}) {
      CaseConfig c;
      c.page_size = page_size;
      c.batch = 3;
      c.seqlen_q = 5;
      c.seqlen_k = 20;
      if (packed_q) c.packed_q = {5, 0, 3};
      c.seqused_k = {20, 7, 13};
      c.heads = 4;
      c.heads_kv = 2;
      c.causal = page_size == 3;
      c.dtype = page_size == 16 ? DType::kBFloat16 : DType::kFloat32;
      c.seed = seed++;
      check(c);
    }
  }
  // Without seqused_k every sequence holds max_pages * page_size keys.
  CaseConfig c;
  c.page_size = 3;
  c.seqlen_k = 8;  // 3 pages of 3
  c.seed = seed++;
  check(c);
  // Two sequences that share a page (prefix caching).
  c.share_pages = true;
  c.seed = seed++;
  check(c);
}

TEST(ReferenceForward, SplitKvMatchesOneSplit) {
  unsigned seed = 160;
  const Tolerance split_tol{5e-6, 5e-6};
  for (int splits = 2; splits <= 5; ++splits) {
    CaseConfig c;
    c.num_splits = splits;
    c.seqlen_q = 4;
    c.seqlen_k = 13;
    c.causal = splits % 2 == 0;
    c.sink_dtype = splits >= 4 ? std::optional<DType>(DType::kBFloat16) : std::nullopt;
    c.seed = seed++;
    check(c, split_tol);

    // The same problem with one split: equal up to the fp32 rounding of the partials.
    AttentionCase split(c);
    split.run_forward();
    c.num_splits = 1;
    AttentionCase single(c);
    single.run_forward();
    Comparison cmp("split vs single");
    split.out.for_each([&](const Index& index) {
      cmp.expect(split.out.at(index), single.out.at(index), split_tol, index_string(index));
    });
    split.lse.for_each([&](const Index& index) {
      cmp.expect(split.lse.at(index), single.lse.at(index), split_tol, index_string(index));
    });
    EXPECT_TRUE(cmp.result());
  }
}

TEST(ReferenceForward, SplitKvLayouts) {
  unsigned seed = 170;
  const Tolerance split_tol{5e-6, 5e-6};
  CaseConfig c;
  c.num_splits = 3;
  c.packed_q = {4, 0, 6};
  c.packed_k = {5, 2, 0};
  c.seqused_q = {4, 0, 3};
  c.seed = seed++;
  check(c, split_tol);

  c = CaseConfig{};
  c.num_splits = 4;
  c.page_size = 3;
  c.seqlen_k = 11;
  c.seqused_k = {11, 5};
  c.seqused_q = {5, 2};
  c.seed = seed++;
  check(c, split_tol);

  // More splits than keys: empty splits have lse -inf and must not disturb the merge.
  c = CaseConfig{};
  c.num_splits = 5;
  c.seqlen_k = 3;
  c.dtype = DType::kFloat16;
  c.seed = seed++;
  check(c);

  c = CaseConfig{};
  c.num_splits = 2;
  c.with_lse = false;
  c.seed = seed++;
  check(c, split_tol);
}

TEST(ReferenceForward, NumSplitsHeuristicIsOneOnCpu) {
  for (int splits : {0, -1}) {
    CaseConfig c;
    c.num_splits = splits;
    c.seed = 180;
    AttentionCase heuristic(c);
    heuristic.run_forward();
    c.num_splits = 1;
    AttentionCase single(c);
    single.run_forward();
    EXPECT_EQ(0, std::memcmp(heuristic.out.view().data, single.out.view().data,
                             heuristic.out.numel() * sizeof(float)));
  }
}

TEST(ReferenceForward, BlockSparse) {
  unsigned seed = 190;
  for (bool broadcast : {false, true}) {
    for (MaskModKind mod : {MaskModKind::kNone, MaskModKind::kCausal, MaskModKind::kDocument}) {
      CaseConfig c;
      c.block_sparse = true;
      c.block_broadcast_heads = broadcast;
      c.mask_mod = mod;
      c.seqlen_q = 11;
      c.seqlen_k = 14;
      c.block_m = 3;
      c.block_n = 4;
      c.heads = 4;
      c.heads_kv = 2;
      c.seed = seed++;
      check(c);
    }
  }
  // Only one list family; with causal, window and softcap on top.
  for (bool full_lists : {false, true}) {
    CaseConfig c;
    c.block_sparse = true;
    c.block_full_lists = full_lists;
    c.block_mask_lists = !full_lists;
    c.mask_mod = MaskModKind::kPrefixLM;
    c.mask_scalars = {2};
    c.causal = true;
    c.window_left = 6;
    c.softcap = 2.0f;
    c.seqlen_q = 9;
    c.seqlen_k = 9;
    c.block_m = 2;
    c.block_n = 2;
    c.seed = seed++;
    check(c);
  }
}

TEST(ReferenceForward, FullyMaskedRowsAreZeroNotNan) {
  // Every block skipped: every row empty.
  CaseConfig c;
  c.block_sparse = true;
  c.block_full_lists = false;
  c.block_mask_lists = true;
  c.mask_mod = MaskModKind::kDocument;
  c.seed = 200;
  AttentionCase run(c);
  run.mask_cnt.for_each([&](const Index& index) { run.mask_cnt.set(index, 0); });
  run.block_states.assign(run.block_states.size(), 0);
  run.run_forward();
  run.check_forward();
  EXPECT_EQ(count_empty_rows(run), c.batch * c.heads * c.seqlen_q);

  // A window that misses every key of the first rows.
  CaseConfig w;
  w.window_left = 0;
  w.window_right = 0;
  w.seqlen_q = 9;
  w.seqlen_k = 4;
  w.seed = 201;
  AttentionCase window(w);
  window.run_forward();
  window.check_forward();
  EXPECT_EQ(count_empty_rows(window), w.batch * w.heads * 5);
}

TEST(ReferenceForward, StridedTensors) {
  unsigned seed = 210;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    CaseConfig c;
    c.layout = Layout::kStrided;
    c.dtype = dtype;
    c.heads = 4;
    c.heads_kv = 2;
    c.causal = true;
    c.sink_dtype = DType::kFloat32;
    c.seed = seed++;
    check(c);
    c.packed_q = {3, 0, 8};
    c.packed_k = {4, 6, 8};
    c.seed = seed++;
    check(c);
    c = CaseConfig{};
    c.layout = Layout::kStrided;
    c.page_size = 3;
    c.seqlen_k = 10;
    c.num_splits = 3;
    c.seed = seed++;
    check(c, {5e-6, 5e-6});
  }
}

TEST(ReferenceForward, NonContiguousLastDimOnCpu) {
  unsigned seed = 220;
  for (bool packed : {false, true}) {
    CaseConfig c;
    c.entry = Entry::kReference;  // the public API asks for a contiguous last dim
    c.layout = Layout::kStridedLastDim;
    c.head_dim = 5;
    c.head_dim_v = 3;
    if (packed) {
      c.packed_q = {2, 5};
      c.packed_k = {6, 1};
    }
    c.seed = seed++;
    check(c);
  }
}

TEST(ReferenceForward, LseIsOptional) {
  CaseConfig c;
  c.with_lse = false;
  c.seed = 230;
  check(c);
  c.packed_q = {2, 6};
  c.packed_k = {3, 4};
  check(c);
}

TEST(ReferenceForward, PackGqaHasNoEffect) {
  CaseConfig c;
  c.heads = 6;
  c.heads_kv = 2;
  c.seed = 240;
  c.pack_gqa = false;
  AttentionCase unpacked(c);
  unpacked.run_forward();
  c.pack_gqa = true;
  AttentionCase packed(c);
  packed.run_forward();
  EXPECT_EQ(0, std::memcmp(unpacked.out.view().data, packed.out.view().data,
                           packed.out.numel() * sizeof(float)));
}

TEST(ReferenceForward, MissingScoreModAuxThrows) {
  CaseConfig c;
  c.seed = 250;
  AttentionCase run(c);
  ForwardArgs args = run.forward_args();
  args.opts.score_mod.kind = ScoreModKind::kAlibi;
  EXPECT_THROW(reference::forward(args), Error);
}

TEST(ReferenceNumeric, SixteenBitConversionsRoundToNearestEven) {
  std::mt19937 rng(260);
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               -2.5f,
                               65504.0f,
                               65519.0f,
                               65520.0f,
                               1e-8f,
                               5.96e-8f,
                               2.98e-8f,
                               6.1e-5f,
                               3.0e38f,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::denorm_min()};
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 20000; ++i) {
    std::uint32_t word = bits(rng);
    float f;
    std::memcpy(&f, &word, sizeof(f));
    if (!std::isnan(f)) values.push_back(f);
  }
  // Halfway cases between neighbouring fp16 and bf16 values.
  for (std::uint16_t h = 0; h < 0x7bff; h += 97) {
    values.push_back(static_cast<float>((half_to_double(h) + half_to_double(h + 1)) / 2));
    values.push_back(static_cast<float>((bf16_to_double(h) + bf16_to_double(h + 1)) / 2));
  }
  for (float f : values) {
    ASSERT_EQ(reference::float_to_half(f), double_to_half(f)) << f;
    ASSERT_EQ(reference::float_to_bfloat16(f), double_to_bf16(f)) << f;
  }
  for (std::uint32_t h = 0; h <= 0xffff; ++h) {
    const double expected = half_to_double(static_cast<std::uint16_t>(h));
    const double actual = reference::half_to_float(static_cast<std::uint16_t>(h));
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(actual));
    } else {
      ASSERT_EQ(actual, expected) << h;
    }
    const double bf = bf16_to_double(static_cast<std::uint16_t>(h));
    const double bf_actual = reference::bfloat16_to_float(static_cast<std::uint16_t>(h));
    if (!std::isnan(bf)) {
      ASSERT_EQ(bf_actual, bf) << h;
    }
  }
  EXPECT_TRUE(std::isnan(reference::half_to_float(reference::float_to_half(std::nanf("")))));
  EXPECT_TRUE(
      std::isnan(reference::bfloat16_to_float(reference::float_to_bfloat16(std::nanf("")))));
}

}  // namespace
}  // namespace cuflash::testing
