// Backward pass of the CPU reference: against central finite differences of the reference's
// own forward pass (fp32), and against the naive oracle's backward for every layout and option.
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "naive_attention.hpp"

namespace cuflash::testing {
namespace {

// Storage offsets of the q, k and v elements that belong to sequences in use.
std::vector<std::int64_t> used_q_offsets(const AttentionCase& c, int dim) {
  std::vector<std::int64_t> offsets;
  for (int b = 0; b < c.batch; ++b) {
    for (int i = 0; i < c.q_len[b]; ++i) {
      for (int h = 0; h < c.config.heads; ++h) {
        for (int d = 0; d < dim; ++d) offsets.push_back(c.q.offset(c.q_index(b, i, h, d)));
      }
    }
  }
  return offsets;
}

std::vector<std::int64_t> used_k_offsets(const AttentionCase& c, const HostTensor& t, int dim) {
  std::set<std::int64_t> offsets;  // shared pages appear once
  for (int b = 0; b < c.batch; ++b) {
    for (int j = 0; j < c.k_len[b]; ++j) {
      for (int h = 0; h < c.config.heads_kv; ++h) {
        for (int d = 0; d < dim; ++d) offsets.insert(t.offset(c.k_index(b, j, h, d)));
      }
    }
  }
  return {offsets.begin(), offsets.end()};
}

// d loss / d input by central differences, where loss = sum(out * dout) of the forward pass;
// compared with the gradient the backward pass wrote at the same storage offsets.
void expect_finite_differences(AttentionCase& c, HostTensor& input, const HostTensor& grad,
                               const std::vector<std::int64_t>& offsets, const std::string& name,
                               double step = 1e-2, Tolerance tol = {3e-4, 3e-3}) {
  Comparison cmp(name + " vs finite differences");
  for (std::int64_t offset : offsets) {
    const double x = input.load(offset);
    input.store(offset, x + step);
    const double x_plus = input.load(offset);  // the step as stored in fp32
    c.run_forward();
    const double loss_plus = c.loss();
    input.store(offset, x - step);
    const double x_minus = input.load(offset);
    c.run_forward();
    const double loss_minus = c.loss();
    input.store(offset, x);
    const double numeric = (loss_plus - loss_minus) / (x_plus - x_minus);
    cmp.expect(grad.load(offset), numeric, tol, "@" + std::to_string(offset));
  }
  EXPECT_TRUE(cmp.result());
}

// Backward of one fp32 configuration against finite differences of every input in use.
void check_gradients(const CaseConfig& config) {
  SCOPED_TRACE(describe(config));
  ASSERT_EQ(config.dtype, DType::kFloat32);
  AttentionCase c(config);
  c.run_backward();
  // Keep copies: the finite-difference runs overwrite out.
  const HostTensor dq = c.dq, dk = c.dk, dv = c.dv, d_sink = c.d_sink;
  expect_finite_differences(c, c.q, dq, used_q_offsets(c, config.head_dim), "dq");
  expect_finite_differences(c, c.k, dk, used_k_offsets(c, c.k, config.head_dim), "dk");
  expect_finite_differences(c, c.v, dv, used_k_offsets(c, c.v, config.head_dim_v), "dv");
  if (config.sink_dtype) {
    std::vector<std::int64_t> heads;
    for (int h = 0; h < config.heads; ++h) heads.push_back(h);
    expect_finite_differences(c, c.sink, d_sink, heads, "d_sink");
  }
}

// Backward of one configuration against the naive oracle.
void check_naive(const CaseConfig& config) {
  SCOPED_TRACE(describe(config));
  AttentionCase c(config);
  c.run_backward();
  c.check_backward();
}

CaseConfig small_case(unsigned seed) {
  CaseConfig c;
  c.batch = 2;
  c.seqlen_q = 4;
  c.seqlen_k = 5;
  c.heads = 2;
  c.heads_kv = 2;
  c.head_dim = 8;
  c.head_dim_v = 8;
  c.seed = seed;
  return c;
}

TEST(ReferenceBackwardFiniteDifferences, Plain) {
  check_gradients(small_case(1));
  CaseConfig c = small_case(2);
  c.seqlen_q = 6;
  c.seqlen_k = 3;
  c.head_dim_v = 16;
  check_gradients(c);
}

TEST(ReferenceBackwardFiniteDifferences, Softcap) {
  CaseConfig c = small_case(3);
  c.softcap = 1.5f;
  c.softmax_scale = 0.6f;  // |scores| around the cap, where tanh bends
  check_gradients(c);
}

TEST(ReferenceBackwardFiniteDifferences, CausalAndWindow) {
  CaseConfig c = small_case(4);
  c.causal = true;
  c.window_left = 1;
  c.seqlen_q = 5;
  c.seqlen_k = 7;
  check_gradients(c);
  c = small_case(5);
  c.window_left = 2;
  c.window_right = 1;
  c.seqlen_q = 6;
  check_gradients(c);
}

TEST(ReferenceBackwardFiniteDifferences, GroupedQueryHeads) {
  CaseConfig c = small_case(6);
  c.heads = 4;
  c.heads_kv = 2;
  c.batch = 1;
  check_gradients(c);
  c = small_case(7);
  c.heads = 3;
  c.heads_kv = 1;
  c.batch = 1;
  c.causal = true;
  check_gradients(c);
}

TEST(ReferenceBackwardFiniteDifferences, VarlenWithSeqused) {
  CaseConfig c = small_case(8);
  c.packed_q = {3, 0, 4};
  c.packed_k = {4, 2, 0};
  c.seqused_q = {2, 0, 4};
  c.seqused_k = {4, 1, 0};
  c.causal = true;
  check_gradients(c);
}

TEST(ReferenceBackwardFiniteDifferences, ScoreMods) {
  CaseConfig c = small_case(9);
  c.score_mod = ScoreModKind::kAlibi;
  c.causal = true;
  c.seqlen_q = 5;
  check_gradients(c);
  c = small_case(10);
  c.score_mod = ScoreModKind::kRelativeBias;
  c.relative_radius = 2;
  c.softcap = 1.5f;
  check_gradients(c);
}

TEST(ReferenceBackwardFiniteDifferences, LearnableSink) {
  CaseConfig c = small_case(11);
  c.sink_dtype = DType::kFloat32;
  check_gradients(c);
  // Rows with no visible key still feel the sink through nothing: d_sink ignores them.
  c = small_case(12);
  c.sink_dtype = DType::kFloat32;
  c.sink_mean = 1.0;
  c.causal = true;
  c.seqlen_q = 6;
  c.seqlen_k = 3;
  check_gradients(c);
}

TEST(ReferenceBackwardFiniteDifferences, MaskModAndBlockSparsity) {
  CaseConfig c = small_case(13);
  c.mask_mod = MaskModKind::kDocument;
  c.seqlen_q = 6;
  c.seqlen_k = 6;
  check_gradients(c);
  c = small_case(14);
  c.block_sparse = true;
  c.block_m = 2;
  c.block_n = 2;
  c.mask_mod = MaskModKind::kCausal;
  c.seqlen_q = 5;
  c.seqlen_k = 6;
  check_gradients(c);
}

// A loss that also uses lse (return_lse): sum(out * dout) + sum(lse * dlse) over rows with a
// visible key.
TEST(ReferenceBackwardFiniteDifferences, GradientOfLse) {
  CaseConfig c = small_case(40);
  c.with_dlse = true;
  check_gradients(c);
  c = small_case(41);
  c.with_dlse = true;
  c.softcap = 1.5f;
  c.softmax_scale = 0.6f;
  c.sink_dtype = DType::kFloat32;
  check_gradients(c);
  // Rows without a visible key (causal, more queries than keys), GQA, a window.
  c = small_case(42);
  c.with_dlse = true;
  c.causal = true;
  c.seqlen_q = 6;
  c.seqlen_k = 3;
  c.heads = 4;
  c.heads_kv = 2;
  check_gradients(c);
  c = small_case(43);
  c.with_dlse = true;
  c.packed_q = {3, 0, 4};
  c.packed_k = {4, 2, 0};
  c.seqused_q = {2, 0, 4};
  c.window_left = 1;
  c.window_right = 0;
  c.layout = Layout::kStrided;
  check_gradients(c);
}

TEST(ReferenceBackwardFiniteDifferences, PagedKv) {
  CaseConfig c = small_case(15);
  c.page_size = 3;
  c.seqlen_k = 6;
  c.seqused_k = {5, 2};
  check_gradients(c);
}

TEST(ReferenceBackward, Dtypes) {
  unsigned seed = 100;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (auto lengths : {std::pair{1, 1}, std::pair{17, 9}, std::pair{3, 17}}) {
      CaseConfig c;
      c.dtype = dtype;
      c.seqlen_q = lengths.first;
      c.seqlen_k = lengths.second;
      c.heads = 4;
      c.heads_kv = 2;
      c.head_dim = 16;
      c.head_dim_v = 8;
      c.sink_dtype = DType::kBFloat16;
      c.seed = seed++;
      check_naive(c);
    }
  }
}

TEST(ReferenceBackward, HeadRatiosOneToEight) {
  unsigned seed = 110;
  for (int ratio = 1; ratio <= 8; ++ratio) {
    CaseConfig c;
    c.batch = 1;
    c.heads_kv = ratio % 2 ? 1 : 2;
    c.heads = ratio * c.heads_kv;
    c.seqlen_q = 5;
    c.seqlen_k = 6;
    c.causal = ratio % 2 == 0;
    c.seed = seed++;
    check_naive(c);
  }
}

TEST(ReferenceBackward, Options) {
  unsigned seed = 120;
  std::vector<CaseConfig> configs;
  CaseConfig c;
  c.softcap = 0.5f;
  c.causal = true;
  configs.push_back(c);
  c = CaseConfig{};
  c.window_left = 3;
  c.window_right = 0;
  c.seqlen_q = 9;
  c.seqlen_k = 6;
  c.sink_dtype = DType::kFloat16;
  configs.push_back(c);
  c = CaseConfig{};
  c.score_mod = ScoreModKind::kAlibi;
  c.mask_mod = MaskModKind::kPrefixLM;
  c.mask_scalars = {2};
  configs.push_back(c);
  c = CaseConfig{};
  c.score_mod = ScoreModKind::kRelativeBias;
  c.mask_mod = MaskModKind::kSlidingWindow;
  c.mask_scalars = {1, 2};
  configs.push_back(c);
  c = CaseConfig{};
  c.mask_mod = MaskModKind::kDocument;
  c.seqlen_q = 10;
  c.seqlen_k = 10;
  configs.push_back(c);
  for (CaseConfig& config : configs) {
    config.seed = seed++;
    check_naive(config);
  }
}

TEST(ReferenceBackward, GradientOfLse) {
  unsigned seed = 140;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    CaseConfig c;
    c.dtype = dtype;
    c.with_dlse = true;
    c.packed_q = {3, 0, 7, 1};
    c.packed_k = {5, 4, 0, 9};
    c.heads = 4;
    c.heads_kv = 2;
    c.causal = true;
    c.sink_dtype = DType::kFloat32;
    c.seed = seed++;
    check_naive(c);
    c = CaseConfig{};
    c.dtype = dtype;
    c.with_dlse = true;
    c.softcap = 0.5f;
    c.score_mod = ScoreModKind::kAlibi;
    c.layout = Layout::kStrided;
    c.seed = seed++;
    check_naive(c);
  }
}

TEST(ReferenceBackward, VarlenAndSeqused) {
  unsigned seed = 130;
  CaseConfig c;
  c.packed_q = {3, 0, 7, 1};
  c.packed_k = {5, 4, 0, 9};
  c.heads = 4;
  c.heads_kv = 1;
  c.causal = true;
  c.seed = seed++;
  check_naive(c);
  // Rows past seqused get dq = 0, keys past seqused_k get dk = dv = 0.
  c.seqused_q = {2, 0, 7, 0};
  c.seqused_k = {5, 1, 0, 4};
  c.seed = seed++;
  check_naive(c);
  c = CaseConfig{};
  c.batch = 3;
  c.seqlen_q = 6;
  c.seqlen_k = 8;
  c.seqused_q = {6, 2, 0};
  c.seqused_k = {3, 8, 0};
  c.dtype = DType::kBFloat16;
  c.seed = seed++;
  check_naive(c);
}

TEST(ReferenceBackward, PagedKv) {
  unsigned seed = 140;
  for (int page_size : {1, 3, 16}) {
    for (bool packed_q : {false, true}) {
      CaseConfig c;
      c.page_size = page_size;
      c.batch = 3;
      c.seqlen_q = 4;
      c.seqlen_k = 17;
      if (packed_q) c.packed_q = {4, 0, 2};
      c.seqused_k = {17, 6, 10};
      c.heads = 4;
      c.heads_kv = 2;
      c.causal = page_size != 3;
      c.seed = seed++;
      check_naive(c);
    }
  }
  // A page shared by two sequences receives the sum of both gradients.
  CaseConfig c;
  c.page_size = 2;
  c.seqlen_k = 6;
  c.share_pages = true;
  c.seed = seed++;
  check_naive(c);
}

TEST(ReferenceBackward, BlockSparseBackwardLists) {
  unsigned seed = 150;
  for (bool broadcast : {false, true}) {
    for (MaskModKind mod : {MaskModKind::kNone, MaskModKind::kDocument}) {
      CaseConfig c;
      c.block_sparse = true;
      c.block_broadcast_heads = broadcast;
      c.mask_mod = mod;
      c.seqlen_q = 10;
      c.seqlen_k = 13;
      c.block_m = 3;
      c.block_n = 4;
      c.heads = 4;
      c.heads_kv = 2;
      c.seed = seed++;
      check_naive(c);
    }
  }
  for (bool full_lists : {false, true}) {
    CaseConfig c;
    c.block_sparse = true;
    c.block_full_lists = full_lists;
    c.block_mask_lists = !full_lists;
    c.mask_mod = MaskModKind::kCausal;
    c.causal = true;
    c.seqlen_q = 7;
    c.seqlen_k = 9;
    c.block_m = 2;
    c.block_n = 3;
    c.seed = seed++;
    check_naive(c);
  }
}

TEST(ReferenceBackward, BlockSparseUsesTheColumnLists) {
  // Empty backward lists, full forward lists: the backward pass skips every block.
  CaseConfig c;
  c.block_sparse = true;
  c.block_mask_lists = false;
  c.seed = 160;
  AttentionCase run(c);
  run.run_forward();
  run.q_full_cnt.for_each([&](const Index& index) { run.q_full_cnt.set(index, 0); });
  run.run_backward();  // forward again (same lists), backward with the emptied column lists
  for (const HostTensor* grad : {&run.dq, &run.dk, &run.dv}) {
    grad->for_each([&](const Index& index) { ASSERT_EQ(grad->at(index), 0.0); });
  }
}

TEST(ReferenceBackward, BlockSparseFallsBackToForwardLists) {
  // Validation asks for the column lists; the reference derives the mask from the row lists.
  CaseConfig c;
  c.entry = Entry::kReference;
  c.block_sparse = true;
  c.block_backward_lists = false;
  c.mask_mod = MaskModKind::kCausal;
  c.seqlen_q = 9;
  c.seqlen_k = 9;
  c.block_m = 2;
  c.block_n = 4;
  c.seed = 165;
  check_naive(c);
}

TEST(ReferenceBackward, FullyMaskedRowsGetZeroGradients) {
  CaseConfig c;
  c.causal = true;
  c.seqlen_q = 9;
  c.seqlen_k = 3;
  c.sink_dtype = DType::kFloat32;
  c.seed = 170;
  AttentionCase run(c);
  run.run_backward();
  run.check_backward();
  for (int b = 0; b < run.batch; ++b) {
    for (int h = 0; h < c.heads; ++h) {
      for (int d = 0; d < c.head_dim; ++d) EXPECT_EQ(run.dq.at({b, 0, h, d}), 0.0);
    }
  }
}

TEST(ReferenceBackward, StridedTensors) {
  unsigned seed = 180;
  CaseConfig c;
  c.layout = Layout::kStrided;
  c.heads = 4;
  c.heads_kv = 2;
  c.sink_dtype = DType::kFloat32;
  c.seed = seed++;
  check_naive(c);
  c.packed_q = {3, 0, 5};
  c.packed_k = {4, 2, 6};
  c.seed = seed++;
  check_naive(c);
  c = CaseConfig{};
  c.layout = Layout::kStrided;
  c.page_size = 3;
  c.seqlen_k = 7;
  c.seed = seed++;
  check_naive(c);
  c = CaseConfig{};
  c.entry = Entry::kReference;  // the public API asks for a contiguous last dim
  c.layout = Layout::kStridedLastDim;
  c.head_dim = 3;
  c.head_dim_v = 5;
  c.dtype = DType::kFloat16;
  c.seed = seed++;
  check_naive(c);
}

TEST(ReferenceBackward, DeterministicAndRepeatable) {
  CaseConfig c;
  c.page_size = 2;
  c.seqlen_k = 8;
  c.share_pages = true;
  c.heads = 4;
  c.heads_kv = 1;
  c.seed = 190;
  AttentionCase first(c);
  first.run_backward();
  c.deterministic = true;
  AttentionCase second(c);
  second.run_backward();
  for (const auto& pair : {std::pair{&first.dq, &second.dq}, std::pair{&first.dk, &second.dk},
                           std::pair{&first.dv, &second.dv}}) {
    ASSERT_EQ(0, std::memcmp(pair.first->view().data, pair.second->view().data,
                             pair.first->storage_size() * sizeof(float)));
  }
}

// A caller's workspace allocator is not asked for anything on CPU tensors (they need no
// workspace), and the calls give what they give without one.
TEST(PublicApi, WorkspaceAllocatorUnusedOnCpu) {
  CaseConfig c;
  c.seqlen_q = 5;
  c.seqlen_k = 9;
  c.causal = true;
  c.seed = 191;
  AttentionCase ac(c);
  ac.run_backward();
  int calls = 0;
  WorkspaceAllocator const allocate = [&](std::size_t) {
    ++calls;
    return Workspace{};
  };
  forward(ac.forward_args(), nullptr, allocate);
  ac.check_forward();
  backward(ac.backward_args(), nullptr, allocate);
  ac.check_backward();
  EXPECT_EQ(calls, 0);
}

}  // namespace
}  // namespace cuflash::testing
