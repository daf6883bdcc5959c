// What dispatch hands to the kernels: strides, lengths, defaults and option normalisation in
// FwdParams / BwdParams / CombineParams, built from validated arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "api/params_builder.hpp"
#if CUFLASH_HAS_CUDA
#include "api/kernels.hpp"
#endif
#include "sm90/dq_accum_start_sm90.hpp"
#include "sm90/stream_k_tail.hpp"
#include "sm90/tile_size_sm90.hpp"
#include "api/validate.hpp"
#include "cuflash/cuflash.hpp"

namespace cuflash::detail {
namespace {

// A run-time setting's parser refuses `value` with kInvalidArgument naming its variable, and
// the message lists what it takes.
template <class Parse>
void expect_setting_refused(Parse parse, const char* value, const char* variable) {
  try {
    parse(value);
    FAIL() << variable << "=" << value << ": expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), Error::Kind::kInvalidArgument);
    EXPECT_EQ(e.argument(), variable);
    EXPECT_NE(std::string(e.what()).find("expected '"), std::string::npos) << e.what();
  }
}

void* dummy_data() {
  static float storage[4];
  return storage;
}

TensorView tensor(DType dtype, std::initializer_list<std::int64_t> shape) {
  return TensorView(dummy_data(), dtype, shape);
}

#if CUFLASH_HAS_CUDA
// The argument a kernel's check refuses (kNotSupported) when `check` runs; empty if none.
template <class Check>
std::string refused_argument(Check check) {
  try {
    check();
  } catch (const Error& error) {
    return error.kind() == Error::Kind::kNotSupported ? error.argument() : std::string();
  }
  return {};
}
#endif

TEST(ParamsWindow, NormalizesCausalAndLocalAsTheSeed) {
  struct Case {
    bool causal;
    int left, right;
    bool is_causal, is_local;
    int out_left, out_right;
  };
  const Case cases[] = {
      {false, -1, -1, false, false, -1, -1},  // no mask
      {true, -1, -1, true, false, -1, 0},     // causal
      {false, -1, 0, true, false, -1, 0},     // window (unbounded, 0) is causal
      {true, -1, 0, true, false, -1, 0},     {false, 5, 0, false, true, 5, 0},  // sliding window
      {true, 5, -1, false, true, 5, 0},    // causal with a left window
      {false, -1, 3, false, true, -1, 3},  // only the right side bounded
      {false, 7, -4, false, true, 7, -1},  // any negative side is unbounded
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "causal=" << c.causal << " left=" << c.left << " right=" << c.right);
    const MaskWindow w = normalize_window(c.causal, c.left, c.right);
    EXPECT_EQ(w.is_causal, c.is_causal);
    EXPECT_EQ(w.is_local, c.is_local);
    EXPECT_EQ(w.window_left, c.out_left);
    EXPECT_EQ(w.window_right, c.out_right);
  }
}

TEST(ParamsForward, WindowSidesPastTheSequencesAreUnbounded) {
  // A side reaching past every key (left) or row (right), INT_MAX included, is no bound: the
  // kernels then do no int arithmetic on it (row + offset - left overflowed and hid every key).
  ForwardArgs args;
  args.q = tensor(DType::kBFloat16, {2, 256, 8, 64});
  args.k = tensor(DType::kBFloat16, {2, 64, 2, 64});
  args.v = tensor(DType::kBFloat16, {2, 64, 2, 64});
  args.out = tensor(DType::kBFloat16, {2, 256, 8, 64});
  constexpr int kMax = std::numeric_limits<int>::max();
  struct Case {
    bool causal;
    int left, right;
    bool is_causal, is_local;
    int out_left, out_right;
  };
  const Case cases[] = {
      {false, kMax, 0, true, false, -1, 0},    // left past the keys: causal
      {true, kMax, -1, true, false, -1, 0},     // causal with such a left side
      {false, kMax, kMax, false, false, -1, -1},  // both past: no mask
      {false, 63, kMax, false, true, 63, -1},   // left 63 < 64 keys still bounds
      {false, 64, 255, false, true, -1, 255},   // left 64 does not; right 255 < 256 rows does
      {false, 3, 256, false, true, 3, -1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "causal=" << c.causal << " left=" << c.left << " right=" << c.right);
    args.opts.causal = c.causal;
    args.opts.window_left = c.left;
    args.opts.window_right = c.right;
    const FwdParams p = make_fwd_params(args, check_forward(args));
    EXPECT_EQ(p.is_causal, c.is_causal);
    EXPECT_EQ(p.is_local, c.is_local);
    EXPECT_EQ(p.window_left, c.out_left);
    EXPECT_EQ(p.window_right, c.out_right);
  }
  // Mask-mod sides and prefix lengths likewise become 2^30 (unbounded); within the sequences
  // and past 2^24 (float32 no longer exact) they are refused by name.
  args.opts = AttentionOptions{};
  args.opts.mask_mod.kind = MaskModKind::kSlidingWindow;
  args.opts.mask_mod.scalars = {16777217.0, 5.0};
  FwdParams p = make_fwd_params(args, check_forward(args));
  EXPECT_EQ(p.mask_mod.scalars[0], float(1 << 30));
  EXPECT_EQ(p.mask_mod.scalars[1], 5.f);
  args.opts.mask_mod.kind = MaskModKind::kPrefixLM;
  args.opts.mask_mod.scalars = {100.0};
  p = make_fwd_params(args, check_forward(args));
  EXPECT_EQ(p.mask_mod.scalars[0], 100.f);
  args.q = tensor(DType::kBFloat16, {1, 1 << 25, 8, 64});
  args.out = tensor(DType::kBFloat16, {1, 1 << 25, 8, 64});
  args.k = tensor(DType::kBFloat16, {1, 1 << 25, 2, 64});
  args.v = tensor(DType::kBFloat16, {1, 1 << 25, 2, 64});
  args.opts.mask_mod.scalars = {16777217.0};
  try {
    make_fwd_params(args, check_forward(args));
    ADD_FAILURE() << "a prefix of 2^24 + 1 within 2^25 tokens was taken";
  } catch (const Error& error) {
    EXPECT_EQ(error.argument(), "mask_mod.scalars[0]");
    EXPECT_NE(std::string(error.what()).find("past 2^24"), std::string::npos) << error.what();
  }
}

TEST(ParamsForward, DenseStridesAndDefaults) {
  ForwardArgs args;
  args.q = tensor(DType::kBFloat16, {2, 100, 8, 64});
  args.k = tensor(DType::kBFloat16, {2, 300, 2, 64});
  args.v = tensor(DType::kBFloat16, {2, 300, 2, 128});
  args.out = tensor(DType::kBFloat16, {2, 100, 8, 128});
  args.lse = tensor(DType::kFloat32, {2, 8, 100});
  args.learnable_sink = tensor(DType::kBFloat16, {8});
  args.opts.softcap = 30.f;
  args.opts.causal = true;
  const FwdParams p = make_fwd_params(args, check_forward(args));

  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.seqlen_q, 100);
  EXPECT_EQ(p.seqlen_k, 300);
  EXPECT_EQ(p.num_heads, 8);
  EXPECT_EQ(p.num_heads_kv, 2);
  EXPECT_EQ(p.head_dim, 64);
  EXPECT_EQ(p.head_dim_v, 128);
  EXPECT_EQ(p.total_q, 200);
  EXPECT_EQ(p.q_batch_stride, 100 * 8 * 64);
  EXPECT_EQ(p.q_row_stride, 8 * 64);
  EXPECT_EQ(p.q_head_stride, 64);
  EXPECT_EQ(p.k_batch_stride, 300 * 2 * 64);
  EXPECT_EQ(p.v_row_stride, 2 * 128);
  EXPECT_EQ(p.o_batch_stride, 100 * 8 * 128);
  EXPECT_EQ(p.o_head_stride, 128);
  EXPECT_EQ(p.lse_batch_stride, 8 * 100);
  EXPECT_EQ(p.lse_head_stride, 100);
  EXPECT_FLOAT_EQ(p.softmax_scale, 0.125f);
  EXPECT_FLOAT_EQ(p.softmax_scale_log2, 0.125f * 1.4426950408889634f);
  EXPECT_FLOAT_EQ(p.softcap, 30.f);
  EXPECT_TRUE(p.is_causal);
  EXPECT_FALSE(p.is_local);
  // Default: 100 rows fill a 128-row tile as well as the group's 400 packed rows fill 512.
  EXPECT_FALSE(p.pack_gqa);
  EXPECT_FALSE(p.pack_gqa_requested);
  EXPECT_EQ(p.learnable_sink, dummy_data());
  EXPECT_EQ(p.sink_dtype, static_cast<int>(DType::kBFloat16));
  EXPECT_EQ(p.dtype, static_cast<int>(DType::kBFloat16));
  EXPECT_EQ(p.num_splits, 1);
  EXPECT_EQ(p.cu_seqlens_q, nullptr);
  EXPECT_EQ(p.page_table, nullptr);
  EXPECT_FALSE(p.block_sparse.enabled);

  args.pack_gqa = false;
  args.opts.softmax_scale = 0.5f;
  const FwdParams explicit_params = make_fwd_params(args, check_forward(args));
  EXPECT_FALSE(explicit_params.pack_gqa);
  EXPECT_FLOAT_EQ(explicit_params.softmax_scale, 0.5f);
}

TEST(ParamsForward, PackGqaDefaultFollowsTileFill) {
  ForwardArgs args;
  auto call = [&](std::int64_t seqlen_q, std::int64_t heads, std::int64_t heads_kv) {
    args.q = tensor(DType::kBFloat16, {2, seqlen_q, heads, 64});
    args.k = tensor(DType::kBFloat16, {2, 300, heads_kv, 64});
    args.v = args.k;
    args.out = args.q;
    return make_fwd_params(args, check_forward(args));
  };
  EXPECT_TRUE(call(1, 8, 2).pack_gqa);     // decode: 4 of 128 rows against 1
  EXPECT_TRUE(call(40, 32, 8).pack_gqa);   // 160 of 256 rows against 40 of 128
  EXPECT_FALSE(call(1, 8, 8).pack_gqa);    // MHA: nothing to pack
  EXPECT_FALSE(call(512, 8, 2).pack_gqa);  // whole tiles either way
  args.pack_gqa = true;
  EXPECT_TRUE(call(512, 8, 2).pack_gqa);  // asked for
  EXPECT_TRUE(call(512, 8, 2).pack_gqa_requested);
  EXPECT_FALSE(call(512, 8, 8).pack_gqa);  // MHA: asked for, nothing to pack

  // Packed decode rows in device memory without max_seqlen_q: 256 sequences of one row each,
  // a total of 256 (whole tiles) but one row per sequence (4 of 128 packed against 1).
  std::vector<std::int32_t> cu(257), cu_k(257);
  for (int b = 0; b <= 256; ++b) cu[b] = b, cu_k[b] = 300 * b;
  const Device gpu{DeviceType::kCUDA, 0};
  ForwardArgs decode;
  decode.q = TensorView(dummy_data(), DType::kBFloat16, {256, 8, 64}, gpu);
  decode.k = TensorView(dummy_data(), DType::kBFloat16, {256 * 300, 2, 64}, gpu);
  decode.v = decode.k;
  decode.out = decode.q;
  decode.seq.cu_seqlens_q = TensorView(cu.data(), DType::kInt32, {257}, gpu);
  decode.seq.cu_seqlens_k = TensorView(cu_k.data(), DType::kInt32, {257}, gpu);
  FwdParams p = make_fwd_params(decode, check_forward(decode));
  EXPECT_EQ(p.seqlen_q, 256);
  EXPECT_TRUE(p.pack_gqa);
  // Hints of whole tiles (both sides: with one alone the rules read the means of both): no gain.
  decode.seq.max_seqlen_q = 256;
  decode.seq.max_seqlen_k = 300;
  EXPECT_FALSE(make_fwd_params(decode, check_forward(decode)).pack_gqa);
}

// The flex kernels pack too: each row's mods see its own head. Not callables compiled at run
// time (their module's form is fixed before the call), nor block lists a packed tile cannot read.
TEST(ParamsForward, PackGqaDefaultWithMods) {
  std::vector<std::int32_t> cnt(2 * 8, 0), idx(2 * 8 * 3, 0);
  ForwardArgs args;
  auto call = [&](std::int64_t heads, std::int64_t heads_kv) {
    args.q = tensor(DType::kBFloat16, {2, 1, heads, 64});
    args.k = tensor(DType::kBFloat16, {2, 300, heads_kv, 64});
    args.v = args.k;
    args.out = args.q;
    return make_fwd_params(args, check_forward(args));
  };
  auto lists = [&](std::int64_t heads_b, int block_m) {
    BlockSparseTensors blocks;
    blocks.block_m = block_m;
    blocks.block_n = 128;
    blocks.mask_block_cnt = TensorView(cnt.data(), DType::kInt32, {2, heads_b, 1});
    blocks.mask_block_idx = TensorView(idx.data(), DType::kInt32, {2, heads_b, 1, 3});
    return blocks;
  };
  args.opts.mask_mod.kind = MaskModKind::kCausal;
  EXPECT_TRUE(call(8, 2).pack_gqa);  // decode: 4 of 128 rows against 1
  args.opts.score_mod.kind = ScoreModKind::kAlibi;
  args.opts.score_mod.aux = {tensor(DType::kFloat32, {8})};
  EXPECT_TRUE(call(8, 2).pack_gqa);
  args.opts.score_mod = {};
  // Broadcast lists whose row blocks hold whole packed tiles (32 query rows at group 4).
  args.opts.block_sparse = lists(1, 128);
  EXPECT_TRUE(call(8, 2).pack_gqa);
  EXPECT_EQ(block_lists_refuse_packing(call(8, 2)), "");
  args.opts.block_sparse = lists(1, 32);
  EXPECT_TRUE(call(8, 2).pack_gqa);
  // Lists per head; row blocks smaller than a packed tile; a group that does not divide 128.
  args.opts.block_sparse = lists(8, 128);
  EXPECT_FALSE(call(8, 2).pack_gqa);
  EXPECT_NE(block_lists_refuse_packing(call(8, 2)).find("broadcast over heads"), std::string::npos);
  args.pack_gqa = true;  // asked for: dispatch refuses it by name (the GPU tests check)
  EXPECT_TRUE(call(8, 2).pack_gqa);
  args.pack_gqa.reset();
  args.opts.block_sparse = lists(1, 16);
  EXPECT_FALSE(call(8, 2).pack_gqa);
  args.opts.block_sparse = lists(1, 128);
  EXPECT_FALSE(call(6, 2).pack_gqa);
  EXPECT_NE(block_lists_refuse_packing(call(6, 2)).find("must divide 128"), std::string::npos);
  args.opts.block_sparse.reset();
  EXPECT_TRUE(call(6, 2).pack_gqa);  // without lists any group packs
  // A callable's compiled kernel: packed only when asked.
  args.opts.expression_forward_kernel = 1;
  EXPECT_FALSE(call(8, 2).pack_gqa);
}

TEST(ParamsForward, StridedInputsKeepTheirStrides) {
  ForwardArgs args;
  // q, k and v as slices of one (B, S, 3, H, D) tensor.
  const std::int64_t row = 3 * 4 * 64;
  args.q = TensorView(dummy_data(), DType::kFloat16, {2, 50, 4, 64}, {50 * row, row, 64, 1});
  args.k = args.q;
  args.v = args.q;
  args.out = tensor(DType::kFloat16, {2, 50, 4, 64});
  const FwdParams p = make_fwd_params(args, check_forward(args));
  EXPECT_EQ(p.q_batch_stride, 50 * row);
  EXPECT_EQ(p.k_row_stride, row);
  EXPECT_EQ(p.v_head_stride, 64);
  EXPECT_EQ(p.lse, nullptr);
  EXPECT_FALSE(p.pack_gqa);
}

// A dimension of size 1 is never stepped over: whatever stride it comes with (DLPack exporters
// may give 1), the kernels see 8 elements, which their 16-byte rule accepts.
TEST(ParamsForward, SizeOneDimensionsTakeAnyStride) {
  ForwardArgs args;
  args.q = TensorView(dummy_data(), DType::kBFloat16, {1, 1, 4, 128}, {1, 1, 128, 1});
  args.k = TensorView(dummy_data(), DType::kBFloat16, {1, 300, 1, 128}, {3, 128, 5, 1});
  args.v = args.k;
  args.out = TensorView(dummy_data(), DType::kBFloat16, {1, 1, 4, 128}, {1, 1, 128, 1});
  const FwdParams p = make_fwd_params(args, check_forward(args));
  EXPECT_EQ(p.q_batch_stride, 8);
  EXPECT_EQ(p.q_row_stride, 8);
  EXPECT_EQ(p.q_head_stride, 128);
  EXPECT_EQ(p.k_batch_stride, 8);
  EXPECT_EQ(p.k_row_stride, 128);
  EXPECT_EQ(p.k_head_stride, 8);
  EXPECT_EQ(p.o_row_stride, 8);

  BackwardArgs bwd;
  bwd.q = args.q;
  bwd.k = args.k;
  bwd.v = args.v;
  bwd.out = args.out;
  bwd.dout = args.out;
  bwd.lse = TensorView(dummy_data(), DType::kFloat32, {1, 4, 1}, {1, 1, 1});
  bwd.dq = args.q;
  bwd.dk = TensorView(dummy_data(), DType::kBFloat16, {1, 300, 1, 128}, {7, 128, 9, 1});
  bwd.dv = bwd.dk;
  const BwdParams b = make_bwd_params(bwd, check_backward(bwd));
  EXPECT_EQ(b.do_row_stride, 8);
  EXPECT_EQ(b.dq_batch_stride, 8);
  EXPECT_EQ(b.dk_head_stride, 8);
  EXPECT_EQ(b.dk_row_stride, 128);
  // An empty tensor (no keys here) whatever strides it reports: a contiguous one's, with its
  // empty dimension taken as one.
  ForwardArgs no_keys = args;
  no_keys.k = TensorView(dummy_data(), DType::kBFloat16, {2, 0, 4, 128}, {0, 0, 0, 0});
  no_keys.v = no_keys.k;
  no_keys.q = TensorView(dummy_data(), DType::kBFloat16, {2, 3, 4, 128});
  no_keys.out = no_keys.q;
  const FwdParams e = make_fwd_params(no_keys, check_forward(no_keys));
  EXPECT_EQ(e.k_head_stride, 128);
  EXPECT_EQ(e.k_row_stride, 4 * 128);
  EXPECT_EQ(e.k_batch_stride, 4 * 128);
#if CUFLASH_HAS_CUDA
  // The kernels' stride checks pass (a kernel missing from this build may still refuse).
  EXPECT_EQ(refused_argument([&] { sm90::check_forward_supported(p); }), "");
  EXPECT_EQ(refused_argument([&] { sm90::backward_workspace_bytes(b); }), "");
#endif
}

TEST(ParamsForward, PackedAndPagedLayouts) {
  std::vector<std::int32_t> cu_q{0, 30, 50}, cu_k{0, 40, 100};
  ForwardArgs args;
  args.q = tensor(DType::kFloat32, {50, 4, 64});
  args.k = tensor(DType::kFloat32, {100, 2, 64});
  args.v = tensor(DType::kFloat32, {100, 2, 64});
  args.out = tensor(DType::kFloat32, {50, 4, 64});
  args.lse = tensor(DType::kFloat32, {4, 50});
  args.seq.cu_seqlens_q = TensorView(cu_q.data(), DType::kInt32, {3});
  args.seq.cu_seqlens_k = TensorView(cu_k.data(), DType::kInt32, {3});
  FwdParams p = make_fwd_params(args, check_forward(args));
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.seqlen_q, 30);  // the longest sequence, read from host memory
  EXPECT_EQ(p.seqlen_k, 60);
  EXPECT_EQ(p.total_q, 50);
  EXPECT_EQ(p.total_k, 100);
  EXPECT_EQ(p.q_batch_stride, 0);
  EXPECT_EQ(p.q_row_stride, 4 * 64);
  EXPECT_EQ(p.k_head_stride, 64);
  EXPECT_EQ(p.lse_batch_stride, 0);
  EXPECT_EQ(p.lse_head_stride, 50);
  EXPECT_EQ(p.cu_seqlens_q, cu_q.data());
  EXPECT_EQ(p.cu_seqlens_k, cu_k.data());

  // The rules read the longest sequence where it is known.
  EXPECT_EQ(p.typical_seqlen_q, 30);
  EXPECT_EQ(p.typical_seqlen_k, 60);

  args.seq.max_seqlen_q = 40;  // a hint wins over the computed maximum
  p = make_fwd_params(args, check_forward(args));
  EXPECT_EQ(p.seqlen_q, 40);
  EXPECT_EQ(typical_seqlen_q(p), 40);

  // Lengths in device memory: without a hint seqlen is the bound total, the rules read the mean
  // (50 / 2 rows, 100 / 2 keys).
  ForwardArgs on_device = args;
  for (TensorView* t : {&on_device.q, &on_device.k, &on_device.v, &on_device.out, &*on_device.lse,
                        &*on_device.seq.cu_seqlens_q, &*on_device.seq.cu_seqlens_k}) {
    t->device = Device{DeviceType::kCUDA, 0};
  }
  for (TensorView* t : {&on_device.q, &on_device.k, &on_device.v, &on_device.out}) t->dtype = DType::kBFloat16;
  on_device.seq.max_seqlen_q.reset();
  p = make_fwd_params(on_device, check_forward(on_device));
  EXPECT_EQ(p.seqlen_q, 50);
  EXPECT_EQ(p.seqlen_k, 100);
  EXPECT_EQ(typical_seqlen_q(p), 25);
  EXPECT_EQ(typical_seqlen_k(p), 50);
  // A hint on one side only: the means of both (a causal offset compares like with like).
  on_device.seq.max_seqlen_k = 70;
  p = make_fwd_params(on_device, check_forward(on_device));
  EXPECT_EQ(p.seqlen_k, 70);
  EXPECT_EQ(typical_seqlen_q(p), 25);
  EXPECT_EQ(typical_seqlen_k(p), 50);
  on_device.seq.max_seqlen_q = 30;
  p = make_fwd_params(on_device, check_forward(on_device));
  EXPECT_EQ(typical_seqlen_q(p), 30);
  EXPECT_EQ(typical_seqlen_k(p), 70);
  // Parameters filled by hand (no typical lengths): seqlen_q / seqlen_k.
  FwdParams by_hand;
  by_hand.seqlen_q = 7;
  by_hand.seqlen_k = 9;
  EXPECT_EQ(typical_seqlen_q(by_hand), 7);
  EXPECT_EQ(typical_seqlen_k(by_hand), 9);

  std::vector<std::int32_t> page_table{0, 1, 2, 5, 4, 3}, seqused_k{40, 30};
  ForwardArgs paged;
  paged.q = tensor(DType::kFloat32, {2, 10, 4, 64});
  paged.k = tensor(DType::kFloat32, {6, 16, 2, 64});
  paged.v = tensor(DType::kFloat32, {6, 16, 2, 64});
  paged.out = tensor(DType::kFloat32, {2, 10, 4, 64});
  paged.seq.page_table = TensorView(page_table.data(), DType::kInt32, {2, 3});
  paged.seq.seqused_k = TensorView(seqused_k.data(), DType::kInt32, {2});
  p = make_fwd_params(paged, check_forward(paged));
  EXPECT_EQ(p.page_size, 16);
  EXPECT_EQ(p.seqlen_k, 48);  // max_pages * page_size
  EXPECT_EQ(p.page_table, page_table.data());
  EXPECT_EQ(p.page_table_batch_stride, 3);
  EXPECT_EQ(p.k_batch_stride, 16 * 2 * 64);  // the page stride
  EXPECT_EQ(p.k_row_stride, 2 * 64);
  EXPECT_EQ(p.seqused_k, seqused_k.data());
}

TEST(ParamsForward, ModsAndBlockSparsity) {
  std::vector<std::int32_t> cnt(2 * 2, 1), idx(2 * 2 * 2, 0);
  ForwardArgs args;
  args.q = tensor(DType::kFloat32, {2, 128, 8, 64});
  args.k = tensor(DType::kFloat32, {2, 128, 8, 64});
  args.v = tensor(DType::kFloat32, {2, 128, 8, 64});
  args.out = tensor(DType::kFloat32, {2, 128, 8, 64});
  args.opts.score_mod.kind = ScoreModKind::kRelativeBias;
  args.opts.score_mod.aux = {tensor(DType::kFloat32, {8, 9})};
  args.opts.mask_mod.kind = MaskModKind::kSlidingWindow;
  args.opts.mask_mod.scalars = {16, 2};
  BlockSparseTensors blocks;
  blocks.block_m = 64;
  blocks.block_n = 64;
  blocks.full_block_cnt = TensorView(cnt.data(), DType::kInt32, {2, 1, 2});
  blocks.full_block_idx = TensorView(idx.data(), DType::kInt32, {2, 1, 2, 2});
  args.opts.block_sparse = blocks;
  const FwdParams p = make_fwd_params(args, check_forward(args));

  EXPECT_EQ(p.score_mod.kind, static_cast<int>(ScoreModKind::kRelativeBias));
  EXPECT_EQ(p.score_mod.num_aux, 1);
  EXPECT_EQ(p.score_mod.aux_rows[0], 8);
  EXPECT_EQ(p.score_mod.aux_cols[0], 9);
  EXPECT_EQ(p.mask_mod.kind, static_cast<int>(MaskModKind::kSlidingWindow));
  EXPECT_EQ(p.mask_mod.num_scalars, 2);
  EXPECT_FLOAT_EQ(p.mask_mod.scalars[0], 16.f);
  EXPECT_FLOAT_EQ(p.mask_mod.scalars[1], 2.f);
  EXPECT_TRUE(p.block_sparse.enabled);
  EXPECT_EQ(p.block_sparse.mask_block_cnt, nullptr);
  EXPECT_EQ(p.block_sparse.full_block_cnt, cnt.data());
  EXPECT_EQ(p.block_sparse.full_block_idx, idx.data());
  EXPECT_EQ(p.block_sparse.num_heads_b, 1);
  EXPECT_EQ(p.block_sparse.num_row_blocks, 2);
  EXPECT_EQ(p.block_sparse.num_col_blocks, 2);
}

TEST(ParamsForward, DocumentMaskBlockLists) {
  // Dispatch builds block lists from document ids when the caller gives none; not for kernels
  // compiled at run time, nor for packed sequences without their longest length.
  ForwardArgs args;
  args.q = tensor(DType::kFloat32, {2, 300, 4, 64});
  args.k = tensor(DType::kFloat32, {2, 1000, 4, 64});
  args.v = tensor(DType::kFloat32, {2, 1000, 4, 64});
  args.out = tensor(DType::kFloat32, {2, 300, 4, 64});
  args.opts.mask_mod.kind = MaskModKind::kDocument;
  args.opts.mask_mod.aux = {tensor(DType::kInt32, {2, 1000})};
  const AttentionShape shape = check_forward(args);
  EXPECT_TRUE(document_lists_apply(args.opts, args.seq, shape, 0));
  EXPECT_FALSE(document_lists_apply(args.opts, args.seq, shape, /*expression_kernel=*/1));

  BlockSparseParams bs;
  plan_document_block_lists(bs, shape, /*backward=*/false);
  EXPECT_TRUE(bs.enabled);
  EXPECT_FALSE(bs.row_lists);
  EXPECT_EQ(bs.num_heads_b, 1);
  EXPECT_EQ(bs.block_m, kDocumentListBlock);
  EXPECT_EQ(bs.block_n, kDocumentListBlock);
  EXPECT_EQ(bs.num_row_blocks, 3);  // ceil(300 / 128)
  EXPECT_EQ(bs.num_col_blocks, 8);  // ceil(1000 / 128)
  EXPECT_EQ(bs.mask_block_cnt, nullptr);  // set when the lists are built
  plan_document_block_lists(bs, shape, /*backward=*/true);
  EXPECT_TRUE(bs.row_lists);  // the backward tabulates the forward's lists

  ForwardArgs other = args;
  other.opts.mask_mod = MaskMod{};
  other.opts.mask_mod.kind = MaskModKind::kCausal;
  EXPECT_FALSE(document_lists_apply(other.opts, other.seq, check_forward(other), 0));

  std::vector<std::int32_t> cnt(2 * 3, 0), idx(2 * 3 * 8, 0);
  other = args;
  BlockSparseTensors given;
  given.mask_block_cnt = TensorView(cnt.data(), DType::kInt32, {2, 1, 3});
  given.mask_block_idx = TensorView(idx.data(), DType::kInt32, {2, 1, 3, 8});
  other.opts.block_sparse = given;
  EXPECT_FALSE(document_lists_apply(other.opts, other.seq, check_forward(other), 0));

  // Packed: only with max_seqlen_q and max_seqlen_k.
  std::vector<std::int32_t> cu_q = {0, 100, 300}, cu_k = {0, 600, 1000};
  other = args;
  other.q = tensor(DType::kFloat32, {300, 4, 64});
  other.out = tensor(DType::kFloat32, {300, 4, 64});
  other.k = tensor(DType::kFloat32, {1000, 4, 64});
  other.v = tensor(DType::kFloat32, {1000, 4, 64});
  other.seq.cu_seqlens_q = TensorView(cu_q.data(), DType::kInt32, {3});
  other.seq.cu_seqlens_k = TensorView(cu_k.data(), DType::kInt32, {3});
  EXPECT_FALSE(document_lists_apply(other.opts, other.seq, check_forward(other), 0));
  other.seq.max_seqlen_q = 200;
  EXPECT_FALSE(document_lists_apply(other.opts, other.seq, check_forward(other), 0));
  other.seq.max_seqlen_k = 600;
  const AttentionShape packed = check_forward(other);
  EXPECT_TRUE(document_lists_apply(other.opts, other.seq, packed, 0));
  plan_document_block_lists(bs, packed, /*backward=*/false);
  EXPECT_EQ(bs.num_row_blocks, 2);  // ceil(200 / 128)
  EXPECT_EQ(bs.num_col_blocks, 5);  // ceil(600 / 128)
}

TEST(ParamsForward, WindowMaskModFoldsIntoTheWindow) {
  // Dense, seqlen_q == seqlen_k: a causal or sliding-window mask_mod alone is a window, run by
  // the plain kernels, intersected with the call's causal / window options.
  ForwardArgs args;
  args.q = tensor(DType::kBFloat16, {2, 256, 4, 64});
  args.k = tensor(DType::kBFloat16, {2, 256, 4, 64});
  args.v = tensor(DType::kBFloat16, {2, 256, 4, 64});
  args.out = tensor(DType::kBFloat16, {2, 256, 4, 64});
  auto folded = [](const ForwardArgs& a) {
    FwdParams p = make_fwd_params(a, check_forward(a));
    const bool did = fold_window_mask_mod(p);
    return std::make_pair(did, p);
  };
  args.opts.mask_mod.kind = MaskModKind::kCausal;
  auto [did, p] = folded(args);
  EXPECT_TRUE(did);
  EXPECT_EQ(p.mask_mod.kind, 0);
  EXPECT_FALSE(needs_flex(p));
  EXPECT_TRUE(p.is_causal);
  EXPECT_FALSE(p.is_local);
  EXPECT_EQ(p.window_right, 0);

  args.opts.mask_mod.kind = MaskModKind::kSlidingWindow;
  args.opts.mask_mod.scalars = {100, 20};
  args.opts.window_left = 50;  // tighter on the left, unbounded on the right
  std::tie(did, p) = folded(args);
  EXPECT_TRUE(did);
  EXPECT_TRUE(p.is_local);
  EXPECT_EQ(p.window_left, 50);
  EXPECT_EQ(p.window_right, 20);

  args.opts.window_left = -1;
  args.opts.causal = true;
  args.opts.mask_mod.scalars = {100, 20};
  std::tie(did, p) = folded(args);
  EXPECT_TRUE(did);
  EXPECT_TRUE(p.is_local);
  EXPECT_EQ(p.window_left, 100);
  EXPECT_EQ(p.window_right, 0);

  args.opts.causal = false;
  args.opts.mask_mod.scalars = {double(1 << 30), 0};  // unbounded on the left: causal
  std::tie(did, p) = folded(args);
  EXPECT_TRUE(did);
  EXPECT_TRUE(p.is_causal);
  EXPECT_FALSE(p.is_local);

  // Not folded: other mask_mods, a score_mod, unequal lengths, packed sequences.
  auto expect_kept = [&](ForwardArgs a, const char* why) {
    auto [kept_did, kept] = folded(a);
    EXPECT_FALSE(kept_did) << why;
    EXPECT_EQ(kept.mask_mod.kind, int(a.opts.mask_mod.kind)) << why;
  };
  ForwardArgs other = args;
  other.opts.mask_mod = MaskMod{};
  other.opts.mask_mod.kind = MaskModKind::kPrefixLM;
  other.opts.mask_mod.scalars = {10};
  expect_kept(other, "prefix_lm");
  other = args;
  other.opts.score_mod.kind = ScoreModKind::kAlibi;
  other.opts.score_mod.aux = {tensor(DType::kFloat32, {4})};
  expect_kept(other, "score_mod");
  other = args;
  other.k = tensor(DType::kBFloat16, {2, 300, 4, 64});
  other.v = tensor(DType::kBFloat16, {2, 300, 4, 64});
  expect_kept(other, "seqlen_k != seqlen_q: top-left and bottom-right differ");
  std::vector<std::int32_t> cu = {0, 100, 256};
  other = args;
  for (TensorView* t : {&other.q, &other.k, &other.v, &other.out}) *t = tensor(DType::kBFloat16, {256, 4, 64});
  other.seq.cu_seqlens_q = TensorView(cu.data(), DType::kInt32, {3});
  other.seq.cu_seqlens_k = TensorView(cu.data(), DType::kInt32, {3});
  other.seq.max_seqlen_q = other.seq.max_seqlen_k = 156;
  expect_kept(other, "packed sequences: lengths per sequence");

  BackwardArgs bwd;
  bwd.q = bwd.k = bwd.v = bwd.out = bwd.dout = bwd.dq = bwd.dk = bwd.dv = tensor(DType::kBFloat16, {2, 256, 4, 64});
  bwd.lse = tensor(DType::kFloat32, {2, 4, 256});
  bwd.opts.mask_mod.kind = MaskModKind::kCausal;
  BwdParams b = make_bwd_params(bwd, check_backward(bwd));
  EXPECT_TRUE(fold_window_mask_mod(b));
  EXPECT_TRUE(b.is_causal);
  EXPECT_FALSE(needs_flex(b));
}

TEST(ParamsForward, EmptyAuxTensorOfAnEmptyProblem) {
  // No query or key rows: document ids of length 0 are valid and have 2 rows of 0 columns.
  ForwardArgs args;
  args.q = TensorView(nullptr, DType::kBFloat16, {2, 0, 8, 64});
  args.k = TensorView(nullptr, DType::kBFloat16, {2, 0, 8, 64});
  args.v = TensorView(nullptr, DType::kBFloat16, {2, 0, 8, 64});
  args.out = TensorView(nullptr, DType::kBFloat16, {2, 0, 8, 64});
  args.opts.mask_mod.kind = MaskModKind::kDocument;
  args.opts.mask_mod.aux = {TensorView(nullptr, DType::kInt32, {2, 0})};
  const FwdParams p = make_fwd_params(args, check_forward(args));
  EXPECT_EQ(p.mask_mod.aux_rows[0], 2);
  EXPECT_EQ(p.mask_mod.aux_cols[0], 0);
}

TEST(ParamsForward, SplitHeuristicAndBuffers) {
  FwdParams p;
  p.batch = 1;
  p.seqlen_q = 1;
  p.seqlen_k = 16384;
  p.num_heads = 8;
  p.num_heads_kv = 8;
  p.head_dim_v = 128;
  EXPECT_EQ(choose_num_splits(p, 4, 132), 4);
  EXPECT_EQ(choose_num_splits(p, 1000, 132), kMaxSplits);
  // Decode: 8 row tiles on 132 SMs, 128 key blocks: 16 splits.
  EXPECT_EQ(choose_num_splits(p, 0, 132), 16);
  p.seqlen_k = 512;  // 4 key blocks: never split
  EXPECT_EQ(choose_num_splits(p, 0, 132), 1);
  p.seqlen_k = 4096;
  p.batch = 64;  // enough row tiles to fill the device
  EXPECT_EQ(choose_num_splits(p, -1, 132), 1);
  // A window bounds the keys that are loaded.
  p.batch = 1;
  p.seqlen_k = 16384;
  p.is_local = true;
  p.window_left = 256;
  p.window_right = 0;
  EXPECT_EQ(choose_num_splits(p, 0, 132), 1);
  // GQA decode unpacked: one tile per query head (8 of them for 2 kv heads), so 16 splits
  // as for MHA; packed, one tile per kv head: 66.
  p.is_local = false;
  p.num_heads_kv = 2;
  EXPECT_EQ(choose_num_splits(p, 0, 132), 16);
  p.pack_gqa = true;
  EXPECT_EQ(choose_num_splits(p, 0, 132), 66);
  p.pack_gqa = false;
  // Built-in mods split as plain calls do (the flex_split kernels), with the keys a mask_mod
  // leaves: a document mask bounds nothing the host can see; a score_mod nothing at all.
  p.mask_mod.kind = int(MaskModKind::kDocument);
  EXPECT_EQ(choose_num_splits(p, 0, 132), 16);
  EXPECT_EQ(choose_num_splits(p, 3, 132), 3);
  p.mask_mod.kind = 0;
  p.score_mod.kind = int(ScoreModKind::kRelativeBias);
  EXPECT_EQ(choose_num_splits(p, 0, 132), 16);
  p.score_mod.kind = 0;
  // Top-left causal at decode keeps one key: no split; so does a sliding window with no right
  // side. With 1024 keys on the right: 1 + 1024 + 128 keys are 10 blocks, so 10 splits. A
  // prefix LM of 4096 keys: 33 blocks, 16 splits.
  p.mask_mod.kind = int(MaskModKind::kCausal);
  EXPECT_EQ(choose_num_splits(p, 0, 132), 1);
  p.mask_mod.kind = int(MaskModKind::kSlidingWindow);
  p.mask_mod.num_scalars = 2;
  p.mask_mod.scalars[0] = 4096;
  p.mask_mod.scalars[1] = 0;
  EXPECT_EQ(choose_num_splits(p, 0, 132), 1);
  p.mask_mod.scalars[1] = 1024;
  EXPECT_EQ(choose_num_splits(p, 0, 132), 10);
  p.mask_mod.kind = int(MaskModKind::kPrefixLM);
  p.mask_mod.num_scalars = 1;
  p.mask_mod.scalars[0] = 4096;
  EXPECT_EQ(choose_num_splits(p, 0, 132), 16);
  p.mask_mod = ModParams{};
  // Block lists split only when asked; callables not at all.
  p.block_sparse.enabled = true;
  EXPECT_EQ(choose_num_splits(p, 0, 132), 1);
  EXPECT_EQ(choose_num_splits(p, 2, 132), 2);
  p.block_sparse.enabled = false;
  p.mask_mod.kind = int(MaskModKind::kExpression);
  EXPECT_EQ(choose_num_splits(p, 0, 132), 1);
  p.mask_mod.kind = 0;
  // Packed sequences without hints: the typical sequence counts, not the totals. 8 sequences of
  // 16 rows on 8 kv heads (packed group 4) are 8 x 8 tiles of 64 rows, 2 splits over 8192 keys;
  // the total (128 rows, 4 tiles of the group's 512) made 256 tiles and no split.
  p.batch = 8;
  p.num_heads = 32;
  p.num_heads_kv = 8;
  p.pack_gqa = true;
  p.seqlen_q = 8 * 16;
  p.seqlen_k = 8 * 8192;
  p.typical_seqlen_q = 16;
  p.typical_seqlen_k = 8192;
  EXPECT_EQ(choose_num_splits(p, 0, 132), 2);
  p.typical_seqlen_q = p.typical_seqlen_k = 0;  // read as the totals
  EXPECT_EQ(choose_num_splits(p, 0, 132), 1);
  // Two sequences of 512 keys are 4 key blocks each: no split; their total, 8 blocks, split 8.
  p.batch = 2;
  p.seqlen_q = 2 * 16;
  p.seqlen_k = 2 * 512;
  p.typical_seqlen_q = 16;
  p.typical_seqlen_k = 512;
  EXPECT_EQ(choose_num_splits(p, 0, 132), 1);
  p.typical_seqlen_q = p.typical_seqlen_k = 0;
  EXPECT_EQ(choose_num_splits(p, 0, 132), 8);
  p.pack_gqa = false;
  p.score_mod.kind = int(ScoreModKind::kExpression);
  EXPECT_EQ(choose_num_splits(p, 0, 132), 1);
  p.score_mod.kind = 0;

  p = FwdParams{};
  p.batch = 2;
  p.seqlen_q = 3;
  p.num_heads = 4;
  p.head_dim_v = 64;
  p.num_splits = 1;
  EXPECT_EQ(split_kv_workspace_bytes(p), 0u);
  p.num_splits = 5;
  const std::size_t out_bytes = 5 * 2 * 3 * 4 * 64 * sizeof(float);  // 30720, a multiple of 256
  const std::size_t lse_bytes = 5 * 2 * 3 * 4 * sizeof(float);       // 480 -> 512
  EXPECT_EQ(lse_bytes, 480u);
  EXPECT_EQ(split_kv_workspace_bytes(p), out_bytes + 512);
  std::vector<char> workspace(split_kv_workspace_bytes(p));
  assign_split_kv_buffers(p, workspace.data());
  EXPECT_EQ(static_cast<void*>(p.out_partial), workspace.data());
  EXPECT_EQ(reinterpret_cast<char*>(p.lse_partial), workspace.data() + out_bytes);
}

TEST(ParamsForward, ShortKernelChoice) {
  EXPECT_EQ(parse_fwd_short_kernel(nullptr), FwdShortKernel::kAuto);
  EXPECT_EQ(parse_fwd_short_kernel(""), FwdShortKernel::kAuto);
  EXPECT_EQ(parse_fwd_short_kernel("long"), FwdShortKernel::kLong);
  EXPECT_EQ(parse_fwd_short_kernel("short"), FwdShortKernel::kShort);
  EXPECT_EQ(parse_fwd_short_kernel("auto"), FwdShortKernel::kAuto);
  expect_setting_refused(parse_fwd_short_kernel, "128", "CUFLASH_FWD_SHORT_KERNEL");
  // "long" and "short" override both twins' rules; "auto" follows them.
  using sm90::fwd_plain_narrow_tile;
  using sm90::fwd_single_q_kernel;
  EXPECT_TRUE(fwd_plain_narrow_tile(FwdShortKernel::kAuto, 512, 512, -1, 0));
  EXPECT_FALSE(fwd_plain_narrow_tile(FwdShortKernel::kLong, 512, 512, -1, 0));
  EXPECT_FALSE(fwd_plain_narrow_tile(FwdShortKernel::kAuto, 8192, 8192, -1, -1));
  EXPECT_TRUE(fwd_plain_narrow_tile(FwdShortKernel::kShort, 8192, 8192, -1, -1));
  EXPECT_TRUE(fwd_single_q_kernel(FwdShortKernel::kAuto, 512, -1, -1));
  EXPECT_FALSE(fwd_single_q_kernel(FwdShortKernel::kLong, 512, -1, -1));
  EXPECT_FALSE(fwd_single_q_kernel(FwdShortKernel::kAuto, 8192, -1, -1));
  EXPECT_TRUE(fwd_single_q_kernel(FwdShortKernel::kShort, 8192, -1, -1));
}

TEST(ParamsBackward, LaunchOrderChoice) {
  EXPECT_EQ(parse_bwd_order(nullptr).order, BwdLaunchOrder::kAuto);
  EXPECT_EQ(parse_bwd_order("").order, BwdLaunchOrder::kAuto);
  EXPECT_EQ(parse_bwd_order("auto").order, BwdLaunchOrder::kAuto);
  EXPECT_EQ(parse_bwd_order("columns").order, BwdLaunchOrder::kColumns);
  EXPECT_EQ(parse_bwd_order("heads").order, BwdLaunchOrder::kHeads);
  EXPECT_EQ(parse_bwd_order("heads").head_group, 0);
  EXPECT_EQ(parse_bwd_order("heads:2").order, BwdLaunchOrder::kHeads);
  EXPECT_EQ(parse_bwd_order("heads:2").head_group, 2);
  for (const char* bad : {"rows", "heads:", "heads:0", "heads:x", "heads:2x", "headsx"}) {
    expect_setting_refused(parse_bwd_order, bad, "CUFLASH_BWD_ORDER");
  }
}

// A setting of named choices: unset and empty give the first, each name its value, and the
// others are refused naming the variable.
template <class Parse, class T>
void expect_setting_choices(Parse parse, const char* variable, std::initializer_list<std::pair<const char*, T>> choices,
                            std::initializer_list<const char*> refused) {
  EXPECT_EQ(parse(nullptr), choices.begin()->second);
  EXPECT_EQ(parse(""), choices.begin()->second);
  for (const auto& [name, value] : choices) EXPECT_EQ(parse(name), value) << name;
  for (const char* bad : refused) expect_setting_refused(parse, bad, variable);
}

TEST(ParamsBackward, DqSemaphoresChoice) {
  expect_setting_choices<decltype(&parse_bwd_dq_semaphores), BwdDqSemaphores>(
      parse_bwd_dq_semaphores, "CUFLASH_BWD_DQ_SEMAPHORES",
      {{"lines", BwdDqSemaphores::kLines}, {"packed", BwdDqSemaphores::kPacked}}, {"auto", "line", "32"});
  EXPECT_EQ(dq_semaphore_stride(BwdDqSemaphores::kPacked), 1);
  EXPECT_EQ(dq_semaphore_stride(BwdDqSemaphores::kLines) * int(sizeof(int)), 128);
}

TEST(Params, CheckInputsChoice) {
  expect_setting_choices<decltype(&parse_check_inputs), bool>(parse_check_inputs, "CUFLASH_CHECK_INPUTS",
                                                              {{"0", false}, {"1", true}}, {"on", "yes", "2"});
}

TEST(ParamsBackward, DqPathChoice) {
  expect_setting_choices<decltype(&parse_bwd_dq_path), BwdDqPath>(
      parse_bwd_dq_path, "CUFLASH_BWD_DQ",
      {{"auto", BwdDqPath::kAuto}, {"atomics", BwdDqPath::kAtomics}, {"bulk", BwdDqPath::kBulk}},
      {"on", "off", "pairs", "Bulk", "smem"});
}

TEST(ParamsBackward, DqConvertChoice) {
  expect_setting_choices<decltype(&parse_bwd_dq_convert), BwdDqConvert>(
      parse_bwd_dq_convert, "CUFLASH_BWD_DQ_CONVERT",
      {{"overlap", BwdDqConvert::kOverlap}, {"after", BwdDqConvert::kAfter}},
      {"on", "0", "Overlap", "auto", "inline", "grid"});
}

TEST(ParamsBackward, DqClearChoice) {
  expect_setting_choices<decltype(&parse_bwd_dq_clear), BwdDqClear>(
      parse_bwd_dq_clear, "CUFLASH_BWD_DQ_CLEAR",
      {{"auto", BwdDqClear::kAuto}, {"first", BwdDqClear::kFirstStore}, {"memset", BwdDqClear::kMemset}},
      {"on", "0", "First", "none", "clear"});
}

TEST(ParamsBackward, DetWalkChoice) {
  expect_setting_choices<decltype(&parse_bwd_det_walk), BwdDetWalk>(
      parse_bwd_det_walk, "CUFLASH_BWD_DET_WALK",
      {{"auto", BwdDetWalk::kAuto}, {"waves", BwdDetWalk::kWaves}, {"ascending", BwdDetWalk::kAscending}},
      {"on", "rotated", "Ascending"});
}


// The varlen backward's block lists (sm90/varlen_block_list_sm90.hpp): which calls walk them and
// the workspace they take.
TEST(ParamsBackward, VarlenBlockLists) {
  expect_setting_choices<decltype(&parse_bwd_block_list), BwdBlockList>(
      parse_bwd_block_list, "CUFLASH_BWD_BLOCK_LIST",
      {{"auto", BwdBlockList::kAuto}, {"off", BwdBlockList::kOff}, {"always", BwdBlockList::kAlways}},
      {"on", "1", "Always"});
  static const int cu_seqlens[65] = {};
  BwdParams p;
  p.batch = 64;
  p.num_heads = p.num_heads_kv = 16;
  p.head_dim = p.head_dim_v = 128;
  p.dtype = static_cast<int>(DType::kBFloat16);
  p.total_q = p.total_k = 64 * 1024;
  p.seqlen_q = p.total_q;  // no max_seqlen hints, lengths on the device
  p.seqlen_k = p.total_k;
  // Dense rows: no list.
  EXPECT_FALSE(bwd_block_list_pays(p, /*queries=*/true, 64));
  p.cu_seqlens_q = cu_seqlens;
  p.cu_seqlens_k = cu_seqlens;
  // The rectangle, 64 x 1024 row blocks of 64, against 1024 + 64 entries.
  EXPECT_EQ(varlen_block_list_entries(p.total_q, p.batch, 64), 1024 + 64);
  EXPECT_TRUE(bwd_block_list_pays(p, /*queries=*/true, 64));
  EXPECT_TRUE(bwd_block_list_pays(p, /*queries=*/false, 128));
  // With the hints (1k at most): 64 x 16 = 1024 column blocks against 512 + 64 entries.
  p.seqlen_q = p.seqlen_k = 1024;
  EXPECT_FALSE(bwd_block_list_pays(p, /*queries=*/true, 64));
  EXPECT_FALSE(bwd_block_list_pays(p, /*queries=*/false, 128));
  // Lengths far apart under a hint: one sequence of 32k keys.
  p.seqlen_k = 32 * 1024;
  EXPECT_TRUE(bwd_block_list_pays(p, /*queries=*/false, 128));
  // "always" under the hints too, "off" never; one sequence: nothing to gain.
  p.seqlen_k = 1024;
  p.block_list = static_cast<int>(BwdBlockList::kAlways);
  EXPECT_TRUE(bwd_block_list_pays(p, /*queries=*/true, 64));
  p.block_list = static_cast<int>(BwdBlockList::kOff);
  p.seqlen_k = p.total_k;
  EXPECT_FALSE(bwd_block_list_pays(p, /*queries=*/false, 128));
  p.block_list = static_cast<int>(BwdBlockList::kAuto);
  BwdParams one = p;
  one.batch = 1;
  EXPECT_FALSE(bwd_block_list_pays(one, /*queries=*/false, 128));
#if CUFLASH_HAS_CUDA
  // The workspace holds both lists where they pay: {sequence, block} pairs of ints, each list
  // 256-byte aligned (for the plain hdim128 kernel's tile).
  p.seqlen_q = p.total_q;
  const std::size_t with_lists = sm90::backward_workspace_bytes(p);
  BwdParams without = p;
  without.block_list = static_cast<int>(BwdBlockList::kOff);
  const std::size_t lists = with_lists - sm90::backward_workspace_bytes(without);
  // Blocks of at most 128 rows (or keys) and at least 32.
  EXPECT_GE(lists, 2 * (64 * 1024 / 128 + 64) * 2 * sizeof(int));
  EXPECT_LE(lists, 2 * (64 * 1024 / 32 + 64) * 2 * sizeof(int) + 512);
#endif
}

TEST(ParamsForward, ZeroVTailChoice) {
  expect_setting_choices<decltype(&parse_fwd_zero_v_tail), FwdZeroVTail>(
      parse_fwd_zero_v_tail, "CUFLASH_FWD_ZERO_V_TAIL",
      {{"auto", FwdZeroVTail::kAuto}, {"0", FwdZeroVTail::kOff}, {"1", FwdZeroVTail::kOn}},
      {"on", "true", "2"});
}

TEST(ParamsForward, ZeroVTailByDefaultWhereRowsPastTheKeysAreRead) {
  int const used = 0, pages = 0;
  FwdParams dense;
  dense.head_dim = dense.head_dim_v = 128;
  FwdParams seqused = dense, paged = dense;
  seqused.seqused_k = &used;
  paged.page_table = &pages;
  EXPECT_FALSE(resolve_fwd_zero_v_tail(FwdZeroVTail::kAuto, dense));
  EXPECT_TRUE(resolve_fwd_zero_v_tail(FwdZeroVTail::kAuto, seqused));
  EXPECT_TRUE(resolve_fwd_zero_v_tail(FwdZeroVTail::kAuto, paged));
  EXPECT_TRUE(resolve_fwd_zero_v_tail(FwdZeroVTail::kOn, dense));
  EXPECT_FALSE(resolve_fwd_zero_v_tail(FwdZeroVTail::kOff, paged));
  // The score_mod / mask_mod kernels have it at every head dim, 256 included.
  FwdParams flex = paged;
  flex.mask_mod.kind = static_cast<int>(MaskModKind::kCausal);
  ASSERT_TRUE(needs_flex(flex));
  EXPECT_TRUE(resolve_fwd_zero_v_tail(FwdZeroVTail::kAuto, flex));
  flex.head_dim = flex.head_dim_v = 256;
  EXPECT_TRUE(resolve_fwd_zero_v_tail(FwdZeroVTail::kAuto, flex));
  EXPECT_FALSE(resolve_fwd_zero_v_tail(FwdZeroVTail::kOff, flex));
  // cu_seqlens_k alone: rows past the last sequence (the kernel zeroes that sequence's tiles).
  FwdParams packed = dense;
  packed.cu_seqlens_k = &used;
  EXPECT_TRUE(resolve_fwd_zero_v_tail(FwdZeroVTail::kAuto, packed));
}

TEST(ParamsForward, NarrowTileCostModel) {
  using sm90::fwd_narrow_tile_pays;
  // Non-causal: 192-row tiles pad 512 and 1024 rows by an eighth, which costs less than the
  // two-warpgroup tile's exposed softmax (measured 0.93x / 0.95x with 128 rows).
  EXPECT_FALSE(fwd_narrow_tile_pays(512, 512, -1, -1));
  EXPECT_FALSE(fwd_narrow_tile_pays(1024, 1024, -1, -1));
  EXPECT_FALSE(fwd_narrow_tile_pays(2048, 2048, -1, -1));
  EXPECT_FALSE(fwd_narrow_tile_pays(16384, 16384, -1, -1));
  // Causal (window_right 0): the narrower tile computes less of the diagonal, which pays at
  // 512 / 1k (measured 1.12x / 1.13x) and no longer at 2k (0.97x).
  EXPECT_TRUE(fwd_narrow_tile_pays(512, 512, -1, 0));
  EXPECT_TRUE(fwd_narrow_tile_pays(1024, 1024, -1, 0));
  EXPECT_FALSE(fwd_narrow_tile_pays(2048, 2048, -1, 0));
  EXPECT_FALSE(fwd_narrow_tile_pays(8192, 8192, -1, 0));
  // A narrow band, and decoding (one row): the narrow tile.
  EXPECT_TRUE(fwd_narrow_tile_pays(4096, 4096, 256, 0));
  EXPECT_TRUE(fwd_narrow_tile_pays(1, 8192, -1, 0));
  // No rows or no keys: nothing to choose between.
  EXPECT_FALSE(fwd_narrow_tile_pays(0, 4096, -1, -1));
}

TEST(ParamsForward, NextQkRule) {
  using sm90::fwd_next_qk_pays;
  // Measured against the one-Q twin: 512 keys lost 3-4% with the next Q K^T under the epilogue,
  // 1k 0.2-0.9%, 2k on gained.
  EXPECT_FALSE(fwd_next_qk_pays(512, -1, -1));
  EXPECT_FALSE(fwd_next_qk_pays(512, -1, 0));
  EXPECT_FALSE(fwd_next_qk_pays(1024, -1, -1));
  EXPECT_FALSE(fwd_next_qk_pays(1024, -1, 0));
  EXPECT_TRUE(fwd_next_qk_pays(1025, -1, -1));
  EXPECT_TRUE(fwd_next_qk_pays(2048, -1, 0));
  EXPECT_TRUE(fwd_next_qk_pays(16384, -1, -1));
  // A window bounded on both sides caps a tile's keys; one side alone does not.
  EXPECT_FALSE(fwd_next_qk_pays(16384, 256, 0));
  EXPECT_TRUE(fwd_next_qk_pays(16384, 1024, 0));
  EXPECT_FALSE(fwd_next_qk_pays(16384, 512, 0));
  EXPECT_TRUE(fwd_next_qk_pays(16384, 256, -1));
  EXPECT_FALSE(fwd_next_qk_pays(0, -1, -1));
}

TEST(ParamsForward, SchedulerChoiceAndTileCounter) {
  EXPECT_EQ(parse_fwd_scheduler(nullptr), FwdScheduler::kDynamic);
  EXPECT_EQ(parse_fwd_scheduler(""), FwdScheduler::kDynamic);
  EXPECT_EQ(parse_fwd_scheduler("dynamic"), FwdScheduler::kDynamic);
  EXPECT_EQ(parse_fwd_scheduler("one_per_tile"), FwdScheduler::kOnePerTile);
  expect_setting_refused(parse_fwd_scheduler, "static", "CUFLASH_FWD_SCHEDULER");

  FwdParams p;
  p.batch = 2;
  p.seqlen_q = 3;
  p.num_heads = 4;
  p.head_dim_v = 64;
  // Equal tiles: no counter, no workspace.
  EXPECT_FALSE(fwd_tiles_unequal(p));
  EXPECT_EQ(forward_workspace_bytes(p, FwdScheduler::kDynamic), 0u);
  std::vector<char> none(1);
  assign_forward_workspace(p, none.data(), FwdScheduler::kDynamic);
  EXPECT_EQ(p.tile_counter, nullptr);

  // Each of these makes tiles unequal.
  auto unequal = [](void (*set)(FwdParams&)) {
    FwdParams q;
    set(q);
    return fwd_tiles_unequal(q);
  };
  static const int lengths[2] = {0, 0};
  EXPECT_TRUE(unequal([](FwdParams& q) { q.window_right = 0; }));  // causal
  EXPECT_TRUE(unequal([](FwdParams& q) { q.window_left = 16; }));
  EXPECT_TRUE(unequal([](FwdParams& q) { q.cu_seqlens_q = lengths; }));
  EXPECT_TRUE(unequal([](FwdParams& q) { q.cu_seqlens_k = lengths; }));
  EXPECT_TRUE(unequal([](FwdParams& q) { q.seqused_q = lengths; }));
  EXPECT_TRUE(unequal([](FwdParams& q) { q.seqused_k = lengths; }));
  EXPECT_TRUE(unequal([](FwdParams& q) { q.mask_mod.kind = 1; }));
  EXPECT_TRUE(unequal([](FwdParams& q) { q.block_sparse.enabled = true; }));
  EXPECT_FALSE(unequal([](FwdParams& q) { q.score_mod.kind = 1; }));

  // Causal: the counter takes a 256-byte slot, after the split-KV buffers when there are any;
  // one CTA per tile needs none.
  p.window_right = 0;
  EXPECT_EQ(forward_workspace_bytes(p, FwdScheduler::kOnePerTile), 0u);
  EXPECT_EQ(forward_workspace_bytes(p, FwdScheduler::kDynamic), 256u);
  std::vector<char> workspace(forward_workspace_bytes(p, FwdScheduler::kDynamic));
  assign_forward_workspace(p, workspace.data(), FwdScheduler::kDynamic);
  EXPECT_EQ(static_cast<void*>(p.tile_counter), workspace.data());
  assign_forward_workspace(p, workspace.data(), FwdScheduler::kOnePerTile);
  EXPECT_EQ(p.tile_counter, nullptr);

  p.num_splits = 5;
  const std::size_t split_bytes = split_kv_workspace_bytes(p);  // 30720 + 512, 256-aligned
  EXPECT_EQ(forward_workspace_bytes(p, FwdScheduler::kOnePerTile), split_bytes);
  EXPECT_EQ(forward_workspace_bytes(p, FwdScheduler::kDynamic), split_bytes + 256);
  workspace.assign(forward_workspace_bytes(p, FwdScheduler::kDynamic), 0);
  assign_forward_workspace(p, workspace.data(), FwdScheduler::kDynamic);
  EXPECT_EQ(static_cast<void*>(p.out_partial), workspace.data());
  EXPECT_EQ(reinterpret_cast<char*>(p.tile_counter), workspace.data() + split_bytes);
}

// The varlen row-block list (sm90/varlen_block_list_sm90.hpp): which calls get its workspace,
// how many entries it holds, and when the launch walks it rather than the rectangle.
TEST(ParamsForward, VarlenRowBlockList) {
  static const int cu_seqlens[13] = {};
  FwdParams p;
  p.batch = 12;
  p.num_heads = 4;
  p.num_heads_kv = 1;
  p.head_dim = p.head_dim_v = 128;
  p.total_q = 1800;
  p.seqlen_q = p.total_q;  // no max_seqlen_q, lengths on the device
  p.seqlen_k = 2000;
  // Dense queries, or one sequence: no list.
  EXPECT_FALSE(fwd_row_block_list_wanted(p));
  EXPECT_EQ(forward_workspace_bytes(p, FwdScheduler::kOnePerTile), 0u);
  p.cu_seqlens_q = cu_seqlens;
  // A bound on the row blocks with rows: one partial block per sequence at most.
  EXPECT_EQ(fwd_row_block_list_entries(p, 128), 15 + 12);
  EXPECT_EQ(fwd_row_block_list_entries(p, 192), 10 + 12);
  p.pack_gqa = true;  // four query heads per tile row
  EXPECT_EQ(fwd_row_block_list_entries(p, 128), 57 + 12);
  p.pack_gqa = false;
  EXPECT_TRUE(fwd_row_block_list_wanted(p));
  const std::size_t list_bytes = (15 + 12) * 2 * sizeof(int);
  EXPECT_EQ(forward_workspace_bytes(p, FwdScheduler::kOnePerTile), 256u);
  // After the tile counter (varlen tiles are unequal: dynamic scheduling).
  EXPECT_EQ(forward_workspace_bytes(p, FwdScheduler::kDynamic), 256u + 256u);
  std::vector<char> workspace(forward_workspace_bytes(p, FwdScheduler::kDynamic));
  // Not walked before the workspace is assigned.
  EXPECT_FALSE(fwd_row_block_list_pays(p, 128));
  assign_forward_workspace(p, workspace.data(), FwdScheduler::kDynamic);
  EXPECT_EQ(reinterpret_cast<char*>(p.row_block_list), workspace.data() + 256);
  EXPECT_EQ(std::size_t(p.row_block_list_capacity), list_bytes / (2 * sizeof(int)));
  // The listed count after the entries' pairs, inside the workspace.
  EXPECT_EQ(reinterpret_cast<char*>(fwd_row_block_list_listed(p)), workspace.data() + 256 + list_bytes);
  EXPECT_LE(reinterpret_cast<char*>(fwd_row_block_list_listed(p) + 1), workspace.data() + workspace.size());
  // The rectangle: 12 x 15 row blocks against 27 entries.
  EXPECT_TRUE(fwd_row_block_list_pays(p, 128));
  EXPECT_TRUE(fwd_row_block_list_pays(p, 192));
  // With the hint (300 rows at most) the rectangle, 12 x 3 = 36, is less than twice the list.
  p.seqlen_q = 300;
  EXPECT_FALSE(fwd_row_block_list_pays(p, 128));
  // Lengths far apart under a hint: one sequence of 1700 rows, eleven short ones (12 x 14 = 168
  // against 27).
  p.seqlen_q = 1700;
  EXPECT_TRUE(fwd_row_block_list_pays(p, 128));
  // A tile of fewer rows than the workspace was sized for would run past it.
  EXPECT_FALSE(fwd_row_block_list_pays(p, 64));
  {
    // Without the hint, few sequences: packed GQA decode, 4 sequences of 16 queries (a group of
    // 8: one 128-row block each). The rectangle, 4 x 4, is twice the list's 4 + 4 entries, not
    // more, and three quarters empty: the list.
    FwdParams decode = p;
    decode.batch = 4;
    decode.num_heads = 32;
    decode.num_heads_kv = 4;
    decode.pack_gqa = true;
    decode.total_q = decode.seqlen_q = 64;
    EXPECT_EQ(fwd_row_block_list_entries(decode, 128), 4 + 4);
    EXPECT_TRUE(fwd_row_block_list_pays(decode, 128));
    // With the hint (16 queries each) the rectangle is 4 x 1, every block with rows: no list.
    decode.seqlen_q = 16;
    EXPECT_FALSE(fwd_row_block_list_pays(decode, 128));
    // One query row each (8 packed rows, 32 in all: one block) without the hint: the rectangle,
    // 4 x 1 blocks all with rows, is less than the list's 1 + 4 entries: no list, it would only
    // add its builder.
    decode.total_q = decode.seqlen_q = 4;
    EXPECT_EQ(fwd_row_block_list_entries(decode, 128), 1 + 4);
    EXPECT_FALSE(fwd_row_block_list_pays(decode, 128));
    // Two sequences of any length without the hint: 2R blocks against R + 2 (the pays rule reads
    // the capacity only; nothing is written here).
    FwdParams two = p;
    two.batch = 2;
    two.total_q = two.seqlen_q = 8192;
    two.row_block_list_capacity = 64 + 2;  // as dispatch sizes it for this call
    EXPECT_TRUE(fwd_row_block_list_pays(two, 128));
    // With the hint the rectangle of the two is full: no list.
    two.seqlen_q = 4096;
    EXPECT_FALSE(fwd_row_block_list_pays(two, 128));
  }
  // CUFLASH_FWD_ROW_BLOCK_LIST: "always" walks the list under the hint too, "off" never (and
  // reserves no workspace).
  EXPECT_EQ(parse_fwd_row_block_list(nullptr), FwdRowBlockList::kAuto);
  EXPECT_EQ(parse_fwd_row_block_list("always"), FwdRowBlockList::kAlways);
  EXPECT_EQ(parse_fwd_row_block_list("off"), FwdRowBlockList::kOff);
  EXPECT_EQ(parse_fwd_row_block_list_order(nullptr), FwdRowBlockListOrder::kAuto);
  EXPECT_EQ(parse_fwd_row_block_list_order("auto"), FwdRowBlockListOrder::kAuto);
  EXPECT_EQ(parse_fwd_row_block_list_order("entries"), FwdRowBlockListOrder::kEntries);
  EXPECT_EQ(parse_fwd_row_block_list_order("heads"), FwdRowBlockListOrder::kHeads);
  expect_setting_refused(parse_fwd_row_block_list_order, "rows", "CUFLASH_FWD_ROW_BLOCK_LIST_ORDER");
  expect_setting_refused(parse_fwd_row_block_list, "on", "CUFLASH_FWD_ROW_BLOCK_LIST");
  p.seqlen_q = 300;
  p.row_block_list_mode = FwdRowBlockList::kAlways;
  EXPECT_TRUE(fwd_row_block_list_pays(p, 128));
  p.seqlen_q = 1700;
  p.row_block_list_mode = FwdRowBlockList::kOff;
  EXPECT_FALSE(fwd_row_block_list_pays(p, 128));
  EXPECT_EQ(forward_workspace_bytes(p, FwdScheduler::kDynamic), 256u);
  p.row_block_list_mode = FwdRowBlockList::kAuto;
  // One sequence: nothing to gain.
  p.batch = 1;
  EXPECT_FALSE(fwd_row_block_list_wanted(p));
  EXPECT_FALSE(fwd_row_block_list_pays(p, 128));
}

// The order of the forward's walk of its row-block list: the heads order (kAuto) where a typical
// sequence's K / V over all kv heads outgrows the L2 budget and nothing narrows the keys.
TEST(ParamsForward, RowBlockListOrder) {
  FwdParams p;
  p.num_heads = p.num_heads_kv = 16;
  p.head_dim = p.head_dim_v = 128;
  p.batch = 16;
  p.total_q = p.seqlen_q = p.seqlen_k = 16 * 4096;  // no hints: the means are the typical lengths
  p.typical_seqlen_q = p.typical_seqlen_k = 4096;
  // 16 x 4k at 16 heads: 4096 x 16 x 256 x 2 bytes = 32 MB per sequence, the measured gain.
  EXPECT_TRUE(fwd_list_heads_order(p));
  // At hdim64 the same call is 16 MB, the budget itself, and gained too.
  p.head_dim = p.head_dim_v = 64;
  EXPECT_TRUE(fwd_list_heads_order(p));
  p.head_dim = p.head_dim_v = 128;
  // Under the budget (64 x 1k: 8 MB), the entries order.
  p.typical_seqlen_k = 1024;
  EXPECT_FALSE(fwd_list_heads_order(p));
  p.typical_seqlen_k = 2047;
  EXPECT_FALSE(fwd_list_heads_order(p));
  p.typical_seqlen_k = 2048;
  EXPECT_TRUE(fwd_list_heads_order(p));
  // Fewer kv heads hold less: GQA 16:2 at 4k is 4 MB.
  p.typical_seqlen_k = 4096;
  p.num_heads_kv = 2;
  EXPECT_FALSE(fwd_list_heads_order(p));
  p.num_heads_kv = 16;
  // A causal mask, a window or a mask_mod: the entries order (measured: causal 16 x 4k lost 2-3%
  // with the heads order).
  p.is_causal = true;
  EXPECT_FALSE(fwd_list_heads_order(p));
  p.is_causal = false;
  p.is_local = true;
  EXPECT_FALSE(fwd_list_heads_order(p));
  p.is_local = false;
  p.mask_mod.kind = int(MaskModKind::kDocument);
  EXPECT_FALSE(fwd_list_heads_order(p));
  p.mask_mod.kind = 0;
  p.block_sparse.enabled = true;
  EXPECT_FALSE(fwd_list_heads_order(p));
  p.block_sparse.enabled = false;
  // The setting wins either way.
  p.row_block_list_order = FwdRowBlockListOrder::kEntries;
  EXPECT_FALSE(fwd_list_heads_order(p));
  p.typical_seqlen_k = 256;
  p.row_block_list_order = FwdRowBlockListOrder::kHeads;
  EXPECT_TRUE(fwd_list_heads_order(p));
}

// The forward's stream-K tail (sm90/stream_k_tail.hpp): when the cut pays, for which calls,
// and the workspace it takes.
TEST(ParamsForward, StreamKTailChoice) {
  EXPECT_EQ(parse_fwd_stream_k(nullptr), FwdStreamK::kAuto);
  EXPECT_EQ(parse_fwd_stream_k(""), FwdStreamK::kAuto);
  EXPECT_EQ(parse_fwd_stream_k("off"), FwdStreamK::kOff);
  EXPECT_EQ(parse_fwd_stream_k("always"), FwdStreamK::kAlways);
  expect_setting_refused(parse_fwd_stream_k, "on", "CUFLASH_FWD_STREAM_K");

  using sm90::stream_k_tail_ctas;
  // hdim128 at 16k tokens: 2048 tiles are 15.5 waves of 132; the 68 left share all the CTAs
  // where their rows are long enough to pay for the second kernel (8k and 16k keys, not 2k / 4k).
  EXPECT_EQ(stream_k_tail_ctas(2048, 16, 132, 1.7), 0);
  EXPECT_EQ(stream_k_tail_ctas(2048, 32, 132, 1.7), 0);
  EXPECT_EQ(stream_k_tail_ctas(2048, 64, 132, 1.7), 132);
  EXPECT_EQ(stream_k_tail_ctas(2048, 128, 132, 1.7), 132);
  EXPECT_EQ(stream_k_tail_ctas(2048, 16, 132, 1.7, /*always=*/true), 132);
  // Whole waves, one n-block per tile, a single CTA: nothing to cut.
  EXPECT_EQ(stream_k_tail_ctas(132 * 15, 16, 132, 1.7), 0);
  EXPECT_EQ(stream_k_tail_ctas(2048, 1, 132, 1.7), 0);
  EXPECT_EQ(stream_k_tail_ctas(2048, 16, 1, 1.7), 0);
  // A last wave of nearly every SM: each CTA's share would cost about a whole tile.
  EXPECT_EQ(stream_k_tail_ctas(132 * 15 + 130, 16, 132, 1.7), 0);
  EXPECT_GT(stream_k_tail_ctas(132 * 15 + 130, 16, 132, 1.7, /*always=*/true), 0);
  // Fewer tiles than SMs with long rows: the keys of each are shared (at least two n-blocks per CTA).
  EXPECT_EQ(stream_k_tail_ctas(40, 64, 132, 1.7), 132);
  EXPECT_EQ(stream_k_tail_ctas(3, 8, 132, 1.7, /*always=*/true), 12);

  FwdParams p;
  p.batch = 2;
  p.seqlen_q = p.seqlen_k = 8192;
  p.num_heads = p.num_heads_kv = 16;
  p.head_dim = p.head_dim_v = 128;
  p.num_sm = 132;
  EXPECT_EQ(fwd_stream_k_ctas(p, FwdStreamK::kAuto), 132);
  EXPECT_EQ(fwd_stream_k_ctas(p, FwdStreamK::kOff), 0);
  // Only plain kernels with tiles of equal cost.
  auto without = [&](void (*set)(FwdParams&)) {
    FwdParams q = p;
    set(q);
    return fwd_stream_k_ctas(q, FwdStreamK::kAlways);
  };
  static const int table[1] = {0};
  EXPECT_EQ(without([](FwdParams& q) { q.window_right = 0; }), 0);
  EXPECT_EQ(without([](FwdParams& q) { q.seqused_k = table; }), 0);
  EXPECT_EQ(without([](FwdParams& q) { q.num_splits = 2; }), 0);
  EXPECT_EQ(without([](FwdParams& q) { q.page_table = table; }), 0);
  EXPECT_EQ(without([](FwdParams& q) { q.pack_gqa = true; }), 0);
  EXPECT_EQ(without([](FwdParams& q) { q.score_mod.kind = 1; }), 0);
  EXPECT_EQ(without([](FwdParams& q) { q.expression_kernel = 1; }), 0);
  EXPECT_GT(without([](FwdParams& q) { q.softcap = 30.f; }), 0);

  // Workspace: the counters and flags, then the partial states, each 256-byte aligned.
  p.stream_k_ctas = 132;
  const std::size_t sync = stream_k_sync_bytes(p), partial = stream_k_partial_bytes(p);
  EXPECT_EQ(sync, 132u * (1 + 2 * 8) * sizeof(int));  // 128 rows: 8 MMA warps
  EXPECT_EQ(partial, 2u * 132 * 128 * (128 + 8) * sizeof(float));
  const std::size_t bytes = forward_workspace_bytes(p, FwdScheduler::kDynamic);
  EXPECT_EQ(bytes, (sync + 255) / 256 * 256 + partial);
  std::vector<char> workspace(bytes);
  assign_forward_workspace(p, workspace.data(), FwdScheduler::kDynamic);
  EXPECT_EQ(static_cast<void*>(p.stream_k_sync), workspace.data());
  EXPECT_EQ(reinterpret_cast<char*>(p.stream_k_partial), workspace.data() + (sync + 255) / 256 * 256);
  EXPECT_EQ(p.tile_counter, nullptr);
  // Only 128-row tiles have the tail: hdim64's 192-row tile does not (its 128-row one does),
  // nor the head dims above 128.
  p.head_dim = p.head_dim_v = 64;
  EXPECT_EQ(fwd_stream_k_ctas(p, FwdStreamK::kAlways), 0);
  p.short_kernel = FwdShortKernel::kShort;
  EXPECT_GT(fwd_stream_k_ctas(p, FwdStreamK::kAlways), 0);
  p.head_dim = 192;
  p.head_dim_v = 128;
  EXPECT_EQ(fwd_stream_k_ctas(p, FwdStreamK::kAlways), 0);
  p.stream_k_ctas = 0;
  EXPECT_EQ(forward_workspace_bytes(p, FwdScheduler::kDynamic), 0u);
}

// The cut itself, walked as the kernel's CTAs walk it: every unit of every tail tile belongs to
// exactly one piece; a tile's pieces are consecutive CTAs; every piece that shares its tile has a
// slot of its own, and the arrival counters stay clear of the ready flags. Any number of sharing
// CTAs (fewer than the tail tiles too, which the cost model never picks) must give a sound cut.
TEST(ParamsForward, StreamKTailPiecesCoverTheTail) {
  for (int grid : {3, 7, 132}) {
    for (int num_tiles : {1, 2, 5, grid - 1, grid + 1, 2 * grid + 5, 15 * grid + 68}) {
      for (int n_blocks : {2, 3, 8, 16, 33}) {
        for (int sk_ctas : {1, 2, grid / 2 + 1, grid, 10 * grid}) {
          const sm90::StreamKTail sk = sm90::plan_stream_k_tail(num_tiles, n_blocks, grid, sk_ctas);
          if (num_tiles % grid == 0 || num_tiles < 1) {
            EXPECT_FALSE(sk.enabled());
            continue;
          }
          ASSERT_TRUE(sk.enabled());
          EXPECT_EQ(sk.dp_tiles % grid, 0);
          EXPECT_EQ(sk.num_units, (num_tiles - sk.dp_tiles) * n_blocks);
          EXPECT_LE(sk.sk_ctas, std::min(grid, sk.num_units));
          std::vector<int> owner(sk.num_units, -1);
          std::map<int, std::vector<int>> ctas_of_tile;
          std::set<int> slots;
          struct Seen { int cta, tile, first_cta, num_pieces; };
          std::vector<Seen> pieces;
          for (int cta = 0; cta < sk.sk_ctas; ++cta) {
            const int end = sk.begin(cta + 1);
            EXPECT_LT(sk.begin(cta), end) << "every sharing CTA has an n-block";
            for (int unit = sk.begin(cta); unit < end; unit = sm90::stream_k_next_unit(sk, unit)) {
              const sm90::StreamKPiece piece = sm90::stream_k_piece(sk, unit, end);
              ASSERT_LT(piece.n_lo, piece.n_hi);
              ASSERT_LE(piece.n_hi, n_blocks);
              // Arrival counters and ready flags (8 warps) stay apart and inside the zeroed
              // region (grid * (1 + 2 * 8) ints), whatever the number of sharing CTAs.
              EXPECT_LT(sk.arrival_index(piece.tile), sk.ready_index(0, 0, 8));
              EXPECT_LT(sk.ready_index(2 * sk.sk_ctas - 1, 7, 8), grid * (1 + 2 * 8));
              for (int n = piece.n_lo; n < piece.n_hi; ++n) {
                int& who = owner[piece.tile * n_blocks + n];
                EXPECT_EQ(who, -1);
                who = cta;
              }
              ctas_of_tile[piece.tile].push_back(cta);
              pieces.push_back({cta, piece.tile, piece.first_cta, piece.num_pieces});
              if (piece.num_pieces > 1) {
                const int slot = sk.slot(cta, piece.tile);
                EXPECT_LT(slot, 2 * sk.sk_ctas);
                EXPECT_TRUE(slots.insert(slot).second) << "slot " << slot << " taken twice";
              }
            }
          }
          for (int who : owner) EXPECT_GE(who, 0);
          for (const auto& [tile, ctas] : ctas_of_tile) {
            for (std::size_t i = 0; i < ctas.size(); ++i) EXPECT_EQ(ctas[i], ctas[0] + int(i));
          }
          for (const Seen& seen : pieces) {
            const std::vector<int>& ctas = ctas_of_tile[seen.tile];
            EXPECT_EQ(seen.first_cta, ctas.front());
            EXPECT_EQ(seen.num_pieces, int(ctas.size()));
          }
        }
      }
    }
  }
}

TEST(ParamsForward, SplitCombineWritesIntoOutAndLse) {
  ForwardArgs args;
  args.q = tensor(DType::kBFloat16, {2, 10, 4, 64});
  args.k = tensor(DType::kBFloat16, {2, 900, 4, 64});
  args.v = tensor(DType::kBFloat16, {2, 900, 4, 32});
  args.out = tensor(DType::kBFloat16, {2, 10, 4, 32});
  args.lse = tensor(DType::kFloat32, {2, 4, 10});
  const AttentionShape shape = check_forward(args);
  FwdParams p = make_fwd_params(args, shape);
  p.num_splits = 3;
  std::vector<char> workspace(split_kv_workspace_bytes(p));
  assign_split_kv_buffers(p, workspace.data());
  const CombineParams c = make_split_combine_params(p, args, shape);
  EXPECT_EQ(c.num_splits, 3);
  EXPECT_EQ(c.batch, 2);
  EXPECT_EQ(c.seqlen, 10);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.out_partial, p.out_partial);
  EXPECT_EQ(c.op_split_stride, 2 * 10 * 4 * 32);
  EXPECT_EQ(c.op_batch_stride, 10 * 4 * 32);
  EXPECT_EQ(c.op_row_stride, 4 * 32);
  EXPECT_EQ(c.lp_split_stride, 2 * 10 * 4);
  EXPECT_EQ(c.lp_row_stride, 4);
  EXPECT_EQ(c.lp_head_stride, 1);
  EXPECT_EQ(c.out, args.out.data);
  EXPECT_EQ(c.o_batch_stride, 10 * 4 * 32);
  EXPECT_EQ(c.o_row_stride, 4 * 32);
  // The forward's lse is (B, H, Sq): rows are contiguous, heads Sq apart.
  EXPECT_EQ(c.lse_batch_stride, 4 * 10);
  EXPECT_EQ(c.lse_row_stride, 1);
  EXPECT_EQ(c.lse_head_stride, 10);
  EXPECT_EQ(c.out_dtype, static_cast<int>(DType::kBFloat16));
}

TEST(ParamsBackward, StridesAndBlockLists) {
  std::vector<std::int32_t> cnt(2 * 2, 1), idx(2 * 2 * 2, 0);
  BackwardArgs args;
  args.q = tensor(DType::kFloat16, {2, 128, 8, 64});
  args.k = tensor(DType::kFloat16, {2, 96, 2, 64});
  args.v = tensor(DType::kFloat16, {2, 96, 2, 32});
  args.out = tensor(DType::kFloat16, {2, 128, 8, 32});
  args.dout =
      TensorView(dummy_data(), DType::kFloat16, {2, 128, 8, 32}, {128 * 8 * 64, 8 * 64, 64, 1});
  args.lse = tensor(DType::kFloat32, {2, 8, 128});
  args.dq = tensor(DType::kFloat16, {2, 128, 8, 64});
  args.dk = tensor(DType::kFloat16, {2, 96, 2, 64});
  args.dv = tensor(DType::kFloat16, {2, 96, 2, 32});
  args.learnable_sink = tensor(DType::kFloat32, {8});
  args.d_sink = tensor(DType::kFloat32, {8});
  args.deterministic = true;
  args.opts.window_left = 32;
  BlockSparseTensors blocks;
  blocks.block_m = 64;
  blocks.block_n = 64;
  blocks.q_mask_block_cnt = TensorView(cnt.data(), DType::kInt32, {2, 1, 2});
  blocks.q_mask_block_idx = TensorView(idx.data(), DType::kInt32, {2, 1, 2, 2});
  args.opts.block_sparse = blocks;
  const BwdParams p = make_bwd_params(args, check_backward(args));

  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.seqlen_q, 128);
  EXPECT_EQ(p.seqlen_k, 96);
  EXPECT_EQ(p.total_q, 256);
  EXPECT_EQ(p.total_k, 192);
  EXPECT_EQ(p.num_heads, 8);
  EXPECT_EQ(p.num_heads_kv, 2);
  EXPECT_EQ(p.head_dim, 64);
  EXPECT_EQ(p.head_dim_v, 32);
  EXPECT_EQ(p.q, args.q.data);
  EXPECT_EQ(p.dout, args.dout.data);
  EXPECT_EQ(p.lse, args.lse.data);
  EXPECT_EQ(p.dq, args.dq.data);
  EXPECT_EQ(p.q_batch_stride, 128 * 8 * 64);
  EXPECT_EQ(p.q_head_stride, 64);
  EXPECT_EQ(p.k_row_stride, 2 * 64);
  EXPECT_EQ(p.v_batch_stride, 96 * 2 * 32);
  EXPECT_EQ(p.dq_row_stride, 8 * 64);
  EXPECT_EQ(p.lse_batch_stride, 8 * 128);
  EXPECT_FLOAT_EQ(p.softmax_scale, 0.125f);  // 1 / sqrt(head_dim)
  EXPECT_FLOAT_EQ(p.softmax_scale_log2, 0.125f * 1.4426950408889634f);
  EXPECT_FLOAT_EQ(p.softcap, 0.f);
  EXPECT_FALSE(p.is_causal);
  EXPECT_EQ(p.dtype, static_cast<int>(DType::kFloat16));
  EXPECT_EQ(p.learnable_sink, args.learnable_sink->data);
  EXPECT_FALSE(p.pack_gqa);
  EXPECT_EQ(p.do_batch_stride, 128 * 8 * 64);
  EXPECT_EQ(p.do_row_stride, 8 * 64);
  EXPECT_EQ(p.o_row_stride, 8 * 32);
  EXPECT_EQ(p.dk_batch_stride, 96 * 2 * 64);
  EXPECT_EQ(p.dv_head_stride, 32);
  EXPECT_EQ(p.lse_head_stride, 128);
  EXPECT_TRUE(p.is_local);
  EXPECT_EQ(p.window_left, 32);
  EXPECT_EQ(p.window_right, -1);
  EXPECT_TRUE(p.deterministic);
  EXPECT_NE(p.d_sink, nullptr);
  EXPECT_EQ(p.sink_dtype, static_cast<int>(DType::kFloat32));
  EXPECT_TRUE(p.block_sparse.enabled);
  EXPECT_EQ(p.block_sparse.mask_block_cnt, cnt.data());  // the transposed (q_) lists
  EXPECT_EQ(p.workspace, nullptr);
}

TEST(ParamsBackward, PackedSequences) {
  std::vector<std::int32_t> cu_q{0, 30, 50}, cu_k{0, 40, 100}, used_k{40, 25};
  BackwardArgs args;
  args.q = tensor(DType::kBFloat16, {50, 4, 64});
  args.k = tensor(DType::kBFloat16, {100, 2, 64});
  args.v = tensor(DType::kBFloat16, {100, 2, 64});
  args.out = tensor(DType::kBFloat16, {50, 4, 64});
  args.dout = tensor(DType::kBFloat16, {50, 4, 64});
  args.lse = tensor(DType::kFloat32, {4, 50});
  args.dq = tensor(DType::kBFloat16, {50, 4, 64});
  args.dk = tensor(DType::kBFloat16, {100, 2, 64});
  args.dv = tensor(DType::kBFloat16, {100, 2, 64});
  args.seq.cu_seqlens_q = TensorView(cu_q.data(), DType::kInt32, {3});
  args.seq.cu_seqlens_k = TensorView(cu_k.data(), DType::kInt32, {3});
  args.seq.seqused_k = TensorView(used_k.data(), DType::kInt32, {2});
  args.opts.causal = true;
  args.opts.softmax_scale = 0.3f;
  const BwdParams p = make_bwd_params(args, check_backward(args));
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.seqlen_q, 30);
  // The longest cu_seqlens_k segment (60), as a max_seqlen_k hint would give, not the longest
  // after seqused_k (40): block lists are shaped by it alike with and without the hint.
  EXPECT_EQ(p.seqlen_k, 60);
  EXPECT_EQ(p.total_q, 50);
  EXPECT_EQ(p.total_k, 100);
  EXPECT_EQ(p.cu_seqlens_q, cu_q.data());
  EXPECT_EQ(p.cu_seqlens_k, cu_k.data());
  EXPECT_EQ(p.seqused_q, nullptr);
  EXPECT_EQ(p.seqused_k, used_k.data());
  EXPECT_EQ(p.q_batch_stride, 0);
  EXPECT_EQ(p.dq_batch_stride, 0);
  EXPECT_EQ(p.dk_row_stride, 2 * 64);
  EXPECT_EQ(p.lse_batch_stride, 0);
  EXPECT_EQ(p.lse_head_stride, 50);
  EXPECT_TRUE(p.is_causal);
  EXPECT_EQ(p.window_right, 0);
  EXPECT_FLOAT_EQ(p.softmax_scale, 0.3f);
  EXPECT_EQ(p.page_table, nullptr);
  EXPECT_FALSE(p.block_sparse.enabled);
  EXPECT_EQ(typical_seqlen_q(p), 30);
  EXPECT_EQ(typical_seqlen_k(p), 60);

  // Lengths in device memory without hints: the bounds, and the means for the rules.
  BackwardArgs on_device = args;
  for (TensorView* t : {&on_device.q, &on_device.k, &on_device.v, &on_device.out, &on_device.dout,
                        &on_device.lse, &on_device.dq, &on_device.dk, &on_device.dv,
                        &*on_device.seq.cu_seqlens_q, &*on_device.seq.cu_seqlens_k, &*on_device.seq.seqused_k}) {
    t->device = Device{DeviceType::kCUDA, 0};
  }
  const BwdParams d = make_bwd_params(on_device, check_backward(on_device));
  EXPECT_EQ(d.seqlen_q, 50);
  EXPECT_EQ(d.seqlen_k, 100);
  EXPECT_EQ(typical_seqlen_q(d), 25);
  EXPECT_EQ(typical_seqlen_k(d), 50);
}

TEST(ParamsBackward, PagedKV) {
  std::vector<std::int32_t> page_table{0, 1, 2, 5, 4, 3};
  BackwardArgs args;
  args.q = tensor(DType::kFloat32, {2, 10, 4, 64});
  args.k = tensor(DType::kFloat32, {6, 16, 2, 64});
  args.v = tensor(DType::kFloat32, {6, 16, 2, 64});
  args.out = tensor(DType::kFloat32, {2, 10, 4, 64});
  args.dout = tensor(DType::kFloat32, {2, 10, 4, 64});
  args.lse = tensor(DType::kFloat32, {2, 4, 10});
  args.dq = tensor(DType::kFloat32, {2, 10, 4, 64});
  args.dk = tensor(DType::kFloat32, {6, 16, 2, 64});
  args.dv = tensor(DType::kFloat32, {6, 16, 2, 64});
  args.seq.page_table = TensorView(page_table.data(), DType::kInt32, {2, 3});
  const BwdParams p = make_bwd_params(args, check_backward(args));
  EXPECT_EQ(p.page_table, page_table.data());
  EXPECT_EQ(p.page_table_batch_stride, 3);
  EXPECT_EQ(p.page_size, 16);
  EXPECT_EQ(p.seqlen_k, 48);
  EXPECT_EQ(p.dk_batch_stride, 16 * 2 * 64);  // the page stride
  EXPECT_EQ(p.dk_row_stride, 2 * 64);
}

TEST(ParamsCombine, DenseAndPackedStrides) {
  CombineArgs args;
  args.out_partial = tensor(DType::kFloat32, {4, 2, 64, 8, 128});
  args.lse_partial = tensor(DType::kFloat32, {4, 2, 64, 8});
  args.out = tensor(DType::kBFloat16, {2, 64, 8, 128});
  args.lse = TensorView(dummy_data(), DType::kFloat32, {2, 64, 8}, {8 * 64, 1, 64});
  CombineParams p = make_combine_params(args, check_combine(args));
  EXPECT_EQ(p.num_splits, 4);
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.seqlen, 64);
  EXPECT_EQ(p.num_heads, 8);
  EXPECT_EQ(p.head_dim, 128);
  EXPECT_EQ(p.op_split_stride, 2 * 64 * 8 * 128);
  EXPECT_EQ(p.op_batch_stride, 64 * 8 * 128);
  EXPECT_EQ(p.op_row_stride, 8 * 128);
  EXPECT_EQ(p.op_head_stride, 128);
  EXPECT_EQ(p.lp_batch_stride, 64 * 8);
  EXPECT_EQ(p.lp_row_stride, 8);
  EXPECT_EQ(p.lse_batch_stride, 8 * 64);
  EXPECT_EQ(p.lse_row_stride, 1);
  EXPECT_EQ(p.lse_head_stride, 64);
  EXPECT_EQ(p.out_dtype, static_cast<int>(DType::kBFloat16));
  EXPECT_FALSE(p.packed);

  // Partials broadcast over the batch (batch stride 0) stay a dense, batched call.
  CombineArgs broadcast = args;
  broadcast.out_partial = TensorView(dummy_data(), DType::kFloat32, {4, 2, 64, 8, 128},
                                     {64 * 8 * 128, 0, 8 * 128, 128, 1});
  broadcast.lse_partial = TensorView(dummy_data(), DType::kFloat32, {4, 2, 64, 8}, {64 * 8, 0, 8, 1});
  p = make_combine_params(broadcast, check_combine(broadcast));
  EXPECT_EQ(p.op_batch_stride, 0);
  EXPECT_EQ(p.batch, 2);
  EXPECT_FALSE(p.packed);

  std::vector<std::int32_t> cu{0, 30, 50};
  CombineArgs packed;
  packed.out_partial = tensor(DType::kFloat32, {3, 50, 8, 64});
  packed.lse_partial = tensor(DType::kFloat32, {3, 50, 8});
  packed.out = tensor(DType::kFloat32, {50, 8, 64});
  packed.cu_seqlens = TensorView(cu.data(), DType::kInt32, {3});
  p = make_combine_params(packed, check_combine(packed));
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.seqlen, 50);
  EXPECT_EQ(p.op_batch_stride, 0);
  EXPECT_EQ(p.op_row_stride, 8 * 64);
  EXPECT_EQ(p.lp_row_stride, 8);
  EXPECT_EQ(p.o_batch_stride, 0);
  EXPECT_EQ(p.o_row_stride, 8 * 64);
  EXPECT_EQ(p.lse, nullptr);
  EXPECT_EQ(p.cu_seqlens, cu.data());
  EXPECT_TRUE(p.packed);
}

#if CUFLASH_HAS_CUDA
// The backward's launches hold the batch and the heads in grid z and y: more than 65535 of
// either is refused by name before any device work; none is a call with nothing to launch.
TEST(ParamsBackward, GridLimitsAndEmptyBatch) {
  BwdParams p;
  p.dtype = int(DType::kBFloat16);
  p.head_dim = 128;
  p.head_dim_v = 128;
  p.num_heads = 4;
  p.num_heads_kv = 4;
  p.seqlen_q = 64;
  p.seqlen_k = 64;
  auto refusal = [&] { return refused_argument([&] { sm90::backward_workspace_bytes(p); }); };
  p.batch = 65535;
  p.total_q = p.total_k = std::int64_t(p.batch) * 64;
  EXPECT_EQ(refusal(), "");
  p.batch = 65536;
  p.total_q = p.total_k = std::int64_t(p.batch) * 64;
  EXPECT_EQ(refusal(), "q");
  std::vector<std::int32_t> cu(2, 0);
  p.cu_seqlens_q = cu.data();
  EXPECT_EQ(refusal(), "cu_seqlens_q");
  p.cu_seqlens_q = nullptr;
  p.batch = 2;
  p.num_heads = p.num_heads_kv = 70000;
  EXPECT_EQ(refusal(), "q");
  // No sequences, or no query rows: a workspace of 0 bytes (run_backward then needs none).
  p.num_heads = p.num_heads_kv = 4;
  p.batch = 0;
  p.total_q = p.total_k = 0;
  EXPECT_EQ(sm90::backward_workspace_bytes(p), 0u);
  p.batch = 2;
  p.seqlen_q = 0;
  p.total_q = 0;
  p.total_k = 128;
  EXPECT_EQ(sm90::backward_workspace_bytes(p), 0u);
}

// The forward's scheduler counts tiles in int: more than it holds (packed sequences without
// max_seqlen_q count each as long as total_q, unless the varlen row-block list holds them) is
// refused by name, not wrapped into a grid that writes nothing.
TEST(ParamsForward, TileCountFitsTheScheduler) {
  FwdParams p;
  p.dtype = int(DType::kBFloat16);
  p.head_dim = p.head_dim_v = 128;
  p.num_heads = p.num_heads_kv = 32;
  p.batch = 8192;
  p.seqlen_q = p.seqlen_k = 1 << 20;
  std::vector<std::int32_t> cu(2, 0);
  p.cu_seqlens_q = cu.data();
  p.total_q = 1 << 20;
  auto refusal = [&] { return refused_argument([&] { sm90::check_forward_supported(p); }); };
  // The rectangle: 2^14 x 32 x 8192 = 2^32 tiles; the row-block list: (2^13 + 8192) x 32.
  EXPECT_EQ(refusal(), "");
  p.row_block_list_mode = FwdRowBlockList::kOff;
  EXPECT_EQ(refusal(), "max_seqlen_q");
  p.row_block_list_mode = FwdRowBlockList::kAuto;
  p.seqlen_q = 128;
  EXPECT_EQ(refusal(), "");
  // A list past the count as well: (2^23 + 8192) x 128 tiles.
  p.seqlen_q = p.total_q = 1 << 30;
  p.num_heads = p.num_heads_kv = 128;
  EXPECT_EQ(refusal(), "max_seqlen_q");
  // Forced, the list must fit whatever the rectangle (a hint of 128 rows: 8192 x 128 tiles).
  p.seqlen_q = 128;
  EXPECT_EQ(refusal(), "");
  p.row_block_list_mode = FwdRowBlockList::kAlways;
  EXPECT_EQ(refusal(), "max_seqlen_q");
  p.row_block_list_mode = FwdRowBlockList::kAuto;
  p.num_heads = p.num_heads_kv = 32;
  p.cu_seqlens_q = nullptr;
  p.batch = 64;
  p.seqlen_q = 1 << 23;  // dense: 2^17 x 32 x 64 = 2^28 tiles
  EXPECT_EQ(refusal(), "");
  p.num_splits = 16;
  EXPECT_EQ(refusal(), "q");
  // Packed GQA: the group's rows of a sequence are counted in int as well.
  p.num_splits = 1;
  p.batch = 1;
  p.num_heads = 128;
  p.num_heads_kv = 1;
  p.pack_gqa = true;
  p.seqlen_q = 1 << 24;
  EXPECT_EQ(refusal(), "q");  // 2^31 rows
  p.seqlen_q = 1 << 23;
  EXPECT_EQ(refusal(), "");
}

// The plain sm90 forward takes each row's running max before the softmax scale, so a negative
// scale without softcap is refused by name, before any device work; with softcap, or in the flex
// kernels, the scale's sign does not matter.
TEST(ParamsForward, NegativeScaleRefusedByThePlainKernels) {
  FwdParams p;
  p.dtype = int(DType::kBFloat16);
  p.head_dim = 128;
  p.head_dim_v = 128;
  p.softmax_scale = -0.125f;
  auto refusal = [&] { return refused_argument([&] { sm90::check_forward_supported(p); }); };
  EXPECT_EQ(refusal(), "softmax_scale");
  p.softcap = 30.f;
  EXPECT_NE(refusal(), "softmax_scale");
  p.softcap = 0.f;
  p.softmax_scale = 0.f;
  EXPECT_NE(refusal(), "softmax_scale");
}
#endif

TEST(ParamsBackward, DqAccumStartRules) {
  using sm90::bwd::DqAccumCall;
  using sm90::bwd::dq_first_stores;
  using sm90::bwd::dq_rotate_window;
  // The benchmark's shapes on a 132-SM card: 16k tokens, hidden 2048 (2048 / hdim heads).
  auto call = [](int hdim, int seqlen, bool causal, bool deterministic) {
    DqAccumCall c;
    c.dq_bulk = hdim == 256;  // the sliced kernels' bulk dQ (the default path)
    c.dq_via_smem = hdim <= 192;  // the plain hdim192 kernels fit their dQ tile in shared memory
    c.kernel_window = causal;
    c.causal_or_local = causal;
    c.causal = causal;
    c.deterministic = deterministic;
    c.head_dim = hdim;
    c.num_sm = 132;
    c.batch = 16384 / seqlen;
    c.num_heads = 2048 / hdim;
    // bwd_tile: hdim256 64 x 80; hdim192 64 x 96; hdim128 80 x 128 without a window, 64 x 128
    // with one; hdim96 64 x 128; hdim64 128 x 128.
    int const block_m = hdim == 128 ? (causal ? 64 : 80) : hdim == 64 ? 128 : 64;
    int const block_n = hdim == 256 ? 80 : hdim == 192 ? 96 : 128;
    c.block_m = block_m;
    c.num_m_blocks = (seqlen + block_m - 1) / block_m;
    c.num_n_blocks = (seqlen + block_n - 1) / block_n;
    return c;
  };
  // hdim256 with a window: first stores up to 32 row blocks (2k rows), deterministic too.
  EXPECT_TRUE(dq_first_stores(call(256, 2048, true, false)));
  EXPECT_TRUE(dq_first_stores(call(256, 2048, true, true)));
  EXPECT_FALSE(dq_first_stores(call(256, 4096, true, false)));
  // hdim256 without a window: first stores where the walks rotate, not deterministic, 2k only.
  EXPECT_TRUE(dq_first_stores(call(256, 2048, false, false)));
  EXPECT_FALSE(dq_first_stores(call(256, 2048, false, true)));
  EXPECT_FALSE(dq_first_stores(call(256, 8192, false, false)));
  // hdim128 (dQ through shared memory): first stores where the walks rotate (no row-block cap
  // there), and in every deterministic run.
  EXPECT_TRUE(dq_first_stores(call(128, 2048, false, false)));
  EXPECT_TRUE(dq_first_stores(call(128, 8192, false, false)));
  EXPECT_FALSE(dq_first_stores(call(128, 2048, true, false)));
  EXPECT_TRUE(dq_first_stores(call(128, 2048, false, true)));
  EXPECT_TRUE(dq_first_stores(call(128, 8192, true, true)));
  // The other head dims' deterministic runs keep the memset (hdim64 measured slower) past 1k
  // rows, causal or not.
  EXPECT_FALSE(dq_first_stores(call(64, 2048, false, true)));
  EXPECT_FALSE(dq_first_stores(call(96, 2048, false, true)));
  EXPECT_TRUE(dq_first_stores(call(64, 1024, false, true)));
  EXPECT_TRUE(dq_first_stores(call(96, 512, false, true)));
  EXPECT_TRUE(dq_first_stores(call(256, 1024, false, true)));
  // A call without the row-block height never counts as short.
  DqAccumCall no_block_m = call(64, 512, false, true);
  no_block_m.block_m = 0;
  EXPECT_FALSE(dq_first_stores(no_block_m));
  EXPECT_TRUE(dq_first_stores(call(64, 1024, true, true)));
  EXPECT_TRUE(dq_first_stores(call(96, 1024, true, true)));
  EXPECT_FALSE(dq_first_stores(call(64, 2048, true, true)));
  EXPECT_FALSE(dq_first_stores(call(96, 2048, true, true)));
  // Causal, not deterministic, one dQ warp: first stores up to 1k rows, at hdim64 up to 8k.
  EXPECT_TRUE(dq_first_stores(call(128, 512, true, false)));
  EXPECT_TRUE(dq_first_stores(call(128, 1024, true, false)));
  EXPECT_TRUE(dq_first_stores(call(96, 1024, true, false)));
  EXPECT_FALSE(dq_first_stores(call(96, 2048, true, false)));
  EXPECT_TRUE(dq_first_stores(call(64, 8192, true, false)));
  EXPECT_FALSE(dq_first_stores(call(64, 16384, true, false)));
  // The rows counted are the padded row blocks' (a 1,025-row call has 17 of 64 rows at hdim128).
  EXPECT_FALSE(dq_first_stores(call(128, 1025, true, false)));
  // A local window that is not causal, bounded on both sides: first stores up to 512 keys a row
  // sees besides its own (window_left + window_right) at any length, deterministic or not; at
  // hdim96 up to 256, deterministic at hdims 192 / 256 up to 1024, at hdim64 outside
  // deterministic mode up to 2048.
  using sm90::bwd::dq_window_keys;
  auto local = [&](int hdim, int seqlen, bool deterministic, std::int64_t window_keys) {
    DqAccumCall c = call(hdim, seqlen, true, deterministic);
    c.causal = false;
    c.window_keys = window_keys;
    return c;
  };
  EXPECT_TRUE(dq_first_stores(local(128, 16384, false, 256)));
  EXPECT_TRUE(dq_first_stores(local(128, 2048, false, 512)));
  EXPECT_FALSE(dq_first_stores(local(128, 2048, false, 513)));
  EXPECT_TRUE(dq_first_stores(local(96, 8192, false, 256)));
  EXPECT_FALSE(dq_first_stores(local(96, 8192, false, 257)));
  EXPECT_FALSE(dq_first_stores(local(96, 2048, true, 257)));
  EXPECT_TRUE(dq_first_stores(local(64, 8192, false, 2048)));
  EXPECT_FALSE(dq_first_stores(local(64, 8192, false, 2049)));
  EXPECT_TRUE(dq_first_stores(local(64, 8192, true, 512)));
  EXPECT_FALSE(dq_first_stores(local(64, 8192, true, 513)));
  EXPECT_TRUE(dq_first_stores(local(192, 8192, false, 512)));
  EXPECT_FALSE(dq_first_stores(local(192, 8192, false, 513)));
  EXPECT_TRUE(dq_first_stores(local(192, 8192, true, 1024)));
  EXPECT_FALSE(dq_first_stores(local(192, 8192, true, 1025)));
  // A side unbounded (-1): not a narrow window.
  EXPECT_FALSE(dq_first_stores(local(128, 2048, false, -1)));
  // The sliced hdim256 kernels: a narrow window past their 32 row blocks too; a wider one there
  // keeps the memset, and within 32 row blocks every window stores first.
  EXPECT_TRUE(dq_first_stores(local(256, 16384, false, 512)));
  EXPECT_FALSE(dq_first_stores(local(256, 16384, false, 513)));
  EXPECT_TRUE(dq_first_stores(local(256, 4096, true, 1024)));
  EXPECT_FALSE(dq_first_stores(local(256, 4096, true, 1025)));
  EXPECT_TRUE(dq_first_stores(local(256, 2048, false, 4096)));
  // hdim256 with dQ by atomics (CUFLASH_BWD_DQ=atomics): the memset, narrow window or not.
  DqAccumCall atomics_window = local(256, 8192, false, 256);
  atomics_window.dq_bulk = false;
  EXPECT_FALSE(dq_first_stores(atomics_window));
  // window_keys from the call's mask: both sides bounded, local only (a causal call with a left
  // window arrives as local (L, 0)); the sum does not overflow.
  EXPECT_EQ(dq_window_keys(true, 256, 0), 256);
  EXPECT_EQ(dq_window_keys(true, 100, 30), 130);
  EXPECT_EQ(dq_window_keys(true, -1, 30), -1);
  EXPECT_EQ(dq_window_keys(true, 30, -1), -1);
  EXPECT_EQ(dq_window_keys(false, 256, 0), -1);
  EXPECT_EQ(dq_window_keys(true, 2147483647, 2147483647), std::int64_t(4294967294));
  // hdim192 (dQ through shared memory): causal and deterministic calls up to 1k rows store
  // first; past that the memset, but where its walks rotate (not deterministic, no window).
  EXPECT_TRUE(dq_first_stores(call(192, 512, true, false)));
  EXPECT_TRUE(dq_first_stores(call(192, 1024, true, true)));
  EXPECT_TRUE(dq_first_stores(call(192, 512, false, true)));
  EXPECT_FALSE(dq_first_stores(call(192, 2048, true, false)));
  EXPECT_FALSE(dq_first_stores(call(192, 2048, true, true)));
  EXPECT_FALSE(dq_first_stores(call(192, 2048, false, true)));
  EXPECT_TRUE(dq_first_stores(call(192, 2048, false, false)));
  // The 64-row hdim64 tile (a score derivative, e.g. softcap): rows, not row blocks, are capped.
  DqAccumCall hdim64_small_tile = call(64, 8192, true, false);
  hdim64_small_tile.block_m = 64;
  hdim64_small_tile.num_m_blocks = 128;
  EXPECT_TRUE(dq_first_stores(hdim64_small_tile));
  hdim64_small_tile.num_m_blocks = 129;
  EXPECT_FALSE(dq_first_stores(hdim64_small_tile));
  DqAccumCall flex_causal = call(128, 512, true, false);
  flex_causal.flex = true;
  EXPECT_FALSE(dq_first_stores(flex_causal));
  DqAccumCall flex_window = local(128, 512, false, 256);
  flex_window.flex = true;
  EXPECT_FALSE(dq_first_stores(flex_window));
  DqAccumCall flex_det = call(128, 2048, true, true);
  flex_det.flex = true;
  EXPECT_FALSE(dq_first_stores(flex_det));
  // More column blocks than SMs: no rotation over whole heads, so the memset.
  EXPECT_FALSE(dq_first_stores(call(128, 32768, false, false)));
  // More column blocks than row blocks (few queries, many keys): the memset.
  DqAccumCall wide_keys = call(128, 2048, false, false);
  wide_keys.num_m_blocks = 4;
  EXPECT_FALSE(dq_first_stores(wide_keys));
  // dQ by atomics from registers (neither path): always the memset, whatever is forced.
  DqAccumCall atomics = call(256, 2048, true, false);
  atomics.dq_bulk = false;
  atomics.clear = BwdDqClear::kFirstStore;
  EXPECT_FALSE(dq_first_stores(atomics));
  // Forced either way where dQ leaves by bulk copies.
  DqAccumCall forced = call(256, 8192, false, true);
  forced.clear = BwdDqClear::kFirstStore;
  EXPECT_TRUE(dq_first_stores(forced));
  forced = call(256, 2048, true, false);
  forced.clear = BwdDqClear::kMemset;
  EXPECT_FALSE(dq_first_stores(forced));
  // No SM count: no rotation, so no first stores without a window (but hdim128's deterministic
  // ones, which need no rotation), and ascending walks.
  DqAccumCall no_sm = call(256, 2048, false, false);
  no_sm.num_sm = 0;
  EXPECT_FALSE(dq_first_stores(no_sm));
  EXPECT_EQ(dq_rotate_window(no_sm, true), 0);
  DqAccumCall no_sm_det = call(128, 2048, false, true);
  no_sm_det.num_sm = 0;
  EXPECT_TRUE(dq_first_stores(no_sm_det));
  EXPECT_EQ(dq_rotate_window(no_sm_det, true), 0);
  // A CTA count past the 31-bit rotation arithmetic: no rotation.
  DqAccumCall huge = call(256, 2048, false, false);
  huge.batch = 1 << 26;
  EXPECT_FALSE(dq_first_stores(huge));
  // The launch's CTA count wins over the one the lengths give (typical lengths of calls without
  // hints are means), and a rotation window's end past the last CTA must fit too.
  DqAccumCall typical = call(256, 2048, false, false);
  EXPECT_TRUE(dq_first_stores(typical));
  typical.main_ctas = (std::int64_t(1) << 31) - 132;
  EXPECT_FALSE(dq_first_stores(typical));
  EXPECT_EQ(dq_rotate_window(typical, true), 0);
  typical.main_ctas = (std::int64_t(1) << 31) - 133;
  EXPECT_EQ(dq_rotate_window(typical, true), 132);

  // Rotation windows: first stores or deterministic, no window; deterministic runs rotate while a
  // head's column blocks fit on the card (auto) and ascend past that.
  EXPECT_EQ(dq_rotate_window(call(128, 2048, false, false), true), 132);
  EXPECT_EQ(dq_rotate_window(call(128, 2048, false, false), false), 0);
  EXPECT_EQ(dq_rotate_window(call(128, 2048, false, true), false), 132);
  EXPECT_EQ(dq_rotate_window(call(128, 2048, true, true), true), 0);  // a window walks ascending
  DqAccumCall long_det = call(256, 16384, false, true);  // 205 column blocks per head
  EXPECT_EQ(dq_rotate_window(long_det, false), 0);
  long_det.det_walk = BwdDetWalk::kWaves;
  EXPECT_EQ(dq_rotate_window(long_det, false), 132);
  DqAccumCall ascending = call(128, 2048, false, true);
  ascending.det_walk = BwdDetWalk::kAscending;
  EXPECT_EQ(dq_rotate_window(ascending, false), 0);
  // Flex kernels never rotate.
  DqAccumCall flex = call(128, 2048, false, true);
  flex.flex = true;
  EXPECT_EQ(dq_rotate_window(flex, false), 0);
}

// Block lists outside deterministic mode: the most writers per row block (column blocks of the
// lists' block_n keys) that still store first, the narrow-window limits in list blocks; 0 where
// the host rules decide.
TEST(ParamsBackward, DqListMaxWriters) {
  using sm90::bwd::DqAccumCall;
  using sm90::bwd::dq_first_stores;
  using sm90::bwd::dq_list_max_writers;
  auto lists = [](int hdim) {
    DqAccumCall c;
    c.flex = true;
    c.block_lists = true;
    c.dq_via_smem = hdim <= 192;
    c.kernel_window = true;
    c.head_dim = hdim;
    c.num_sm = 132;
    c.batch = 8;
    c.num_heads = 2048 / hdim;
    c.block_m = 64;
    c.num_m_blocks = 32;
    c.num_n_blocks = 16;
    return c;
  };
  // 512 keys besides a row block's own: 4 more 128-key blocks, 5 writers (a (256, 256) window).
  EXPECT_EQ(dq_list_max_writers(lists(128), 128), 5);
  EXPECT_EQ(dq_list_max_writers(lists(192), 128), 5);
  EXPECT_EQ(dq_list_max_writers(lists(96), 128), 3);   // 256 keys
  EXPECT_EQ(dq_list_max_writers(lists(64), 128), 17);  // 2048 keys
  EXPECT_EQ(dq_list_max_writers(lists(128), 64), 10);  // 64-key list blocks: 640 keys
  EXPECT_EQ(dq_list_max_writers(lists(128), 256), 2);  // 512 keys
  EXPECT_EQ(dq_list_max_writers(lists(128), 512), 1);
  EXPECT_EQ(dq_list_max_writers(lists(128), 1024), 0);  // one list block is past the limit
  EXPECT_EQ(dq_list_max_writers(lists(64), 1024), 2);
  // Where the rule does not apply: the host decides (the flex kernels then clear).
  DqAccumCall det = lists(128);
  det.deterministic = true;
  EXPECT_EQ(dq_list_max_writers(det, 128), 0);
  EXPECT_FALSE(dq_first_stores(det));
  DqAccumCall no_lists = lists(128);
  no_lists.block_lists = false;  // a mask_mod alone
  EXPECT_EQ(dq_list_max_writers(no_lists, 128), 0);
  EXPECT_FALSE(dq_first_stores(no_lists));
  EXPECT_EQ(dq_list_max_writers(lists(256), 128), 0);  // dQ by atomics: the host's memset
  DqAccumCall plain = lists(128);
  plain.flex = false;
  EXPECT_EQ(dq_list_max_writers(plain, 128), 0);
  EXPECT_EQ(dq_list_max_writers(lists(128), 0), 0);
  // A forced setting is the host's.
  DqAccumCall forced = lists(128);
  forced.clear = BwdDqClear::kMemset;
  EXPECT_EQ(dq_list_max_writers(forced, 128), 0);
  forced.clear = BwdDqClear::kFirstStore;
  EXPECT_EQ(dq_list_max_writers(forced, 128), 0);
  EXPECT_TRUE(dq_first_stores(forced));
}

}  // namespace
}  // namespace cuflash::detail
