// Argument validation: every bad input is rejected before any work starts, with an error that
// names the argument and gives the expected and the actual value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "cuflash/cuflash.hpp"
#if CUFLASH_HAS_CUDA
#include "api/device_workspace.hpp"
#endif

namespace cuflash {
namespace {

const Device kCpu{};
const Device kCuda0{DeviceType::kCUDA, 0};

// Validation never reads floating-point data: every such tensor may share one dummy address.
void* dummy_data() {
  static float storage[4];
  return storage;
}

TensorView tensor(DType dtype, std::initializer_list<std::int64_t> shape, Device device = kCpu) {
  return TensorView(dummy_data(), dtype, shape, device);
}

TensorView int_tensor(std::vector<std::int32_t>& values, std::initializer_list<std::int64_t> shape,
                      Device device = kCpu) {
  return TensorView(values.data(), DType::kInt32, shape, device);
}

void expect_error(const std::function<void()>& call, Error::Kind kind, const std::string& argument,
                  std::initializer_list<std::string> fragments) {
  try {
    call();
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_EQ(static_cast<int>(error.kind()), static_cast<int>(kind)) << message;
    EXPECT_EQ(error.argument(), argument) << message;
    for (const std::string& fragment : fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "message: " << message << "\nmissing: " << fragment;
    }
    return;
  } catch (const std::exception& other) {
    ADD_FAILURE() << "expected cuflash::Error, got another exception: " << other.what();
    return;
  }
  ADD_FAILURE() << "expected cuflash::Error naming " << argument << ", nothing was thrown";
}

#define EXPECT_INVALID(statement, argument, ...)                                              \
  do {                                                                                        \
    SCOPED_TRACE(#statement);                                                                 \
    expect_error([&] { statement; }, Error::Kind::kInvalidArgument, argument, {__VA_ARGS__}); \
  } while (0)

#define EXPECT_UNSUPPORTED(statement, argument, ...)                                       \
  do {                                                                                     \
    SCOPED_TRACE(#statement);                                                              \
    expect_error([&] { statement; }, Error::Kind::kNotSupported, argument, {__VA_ARGS__}); \
  } while (0)

// Dense problem: B = 2, Sq = Sk = 128, H = H_kv = 8, D = Dv = 64.
ForwardArgs dense_forward(DType dtype = DType::kFloat32, Device device = kCpu) {
  ForwardArgs args;
  args.q = tensor(dtype, {2, 128, 8, 64}, device);
  args.k = tensor(dtype, {2, 128, 8, 64}, device);
  args.v = tensor(dtype, {2, 128, 8, 64}, device);
  args.out = tensor(dtype, {2, 128, 8, 64}, device);
  args.lse = tensor(DType::kFloat32, {2, 8, 128}, device);
  return args;
}

BackwardArgs dense_backward(DType dtype = DType::kFloat32, Device device = kCpu) {
  BackwardArgs args;
  args.q = tensor(dtype, {2, 128, 8, 64}, device);
  args.k = tensor(dtype, {2, 96, 2, 64}, device);
  args.v = tensor(dtype, {2, 96, 2, 32}, device);
  args.out = tensor(dtype, {2, 128, 8, 32}, device);
  args.dout = tensor(dtype, {2, 128, 8, 32}, device);
  args.lse = tensor(DType::kFloat32, {2, 8, 128}, device);
  args.dq = tensor(dtype, {2, 128, 8, 64}, device);
  args.dk = tensor(dtype, {2, 96, 2, 64}, device);
  args.dv = tensor(dtype, {2, 96, 2, 32}, device);
  return args;
}

class ForwardValidation : public ::testing::Test {
 protected:
  // Packed problem: two sequences of 30 and 20 queries, 40 and 60 keys; H = 4, H_kv = 2.
  ForwardArgs varlen_forward() {
    ForwardArgs args;
    args.q = tensor(DType::kFloat32, {50, 4, 64});
    args.k = tensor(DType::kFloat32, {100, 2, 64});
    args.v = tensor(DType::kFloat32, {100, 2, 64});
    args.out = tensor(DType::kFloat32, {50, 4, 64});
    args.lse = tensor(DType::kFloat32, {4, 50});
    args.seq.cu_seqlens_q = int_tensor(cu_q_, {3});
    args.seq.cu_seqlens_k = int_tensor(cu_k_, {3});
    return args;
  }

  // Paged k/v: 6 pages of 16 rows, B = 2 with up to 3 pages each.
  ForwardArgs paged_forward() {
    ForwardArgs args;
    args.q = tensor(DType::kFloat32, {2, 10, 4, 64});
    args.k = tensor(DType::kFloat32, {6, 16, 2, 64});
    args.v = tensor(DType::kFloat32, {6, 16, 2, 64});
    args.out = tensor(DType::kFloat32, {2, 10, 4, 64});
    args.seq.page_table = int_tensor(page_table_, {2, 3});
    args.seq.seqused_k = int_tensor(seqused_k_, {2});
    return args;
  }

  // Block mask for the dense problem with 64 x 64 blocks: 2 row and 2 column blocks.
  BlockSparseTensors block_mask() {
    BlockSparseTensors b;
    b.block_m = 64;
    b.block_n = 64;
    b.mask_block_cnt = int_tensor(cnt_, {2, 1, 2});
    b.mask_block_idx = int_tensor(idx_, {2, 1, 2, 2});
    return b;
  }

  std::vector<std::int32_t> cu_q_{0, 30, 50};
  std::vector<std::int32_t> cu_k_{0, 40, 100};
  std::vector<std::int32_t> page_table_{0, 1, 2, 5, 4, -1};
  std::vector<std::int32_t> seqused_k_{40, 30};
  std::vector<std::int32_t> cnt_{1, 2, 2, 0};
  std::vector<std::int32_t> idx_{0, 0, 1, 0, 0, 1, 0, 0};
};

// --- Valid inputs -------------------------------------------------------------------------

TEST_F(ForwardValidation, AcceptsValidLayouts) {
  EXPECT_NO_THROW(validate(dense_forward()));
  EXPECT_NO_THROW(validate(dense_forward(DType::kBFloat16)));
  EXPECT_NO_THROW(validate(dense_forward(DType::kFloat16, kCuda0)));
  EXPECT_NO_THROW(validate(varlen_forward()));
  EXPECT_NO_THROW(validate(paged_forward()));

  ForwardArgs gqa = dense_forward();
  gqa.k = tensor(DType::kFloat32, {2, 77, 1, 64});
  gqa.v = tensor(DType::kFloat32, {2, 77, 1, 128});
  gqa.out = tensor(DType::kFloat32, {2, 128, 8, 128});
  gqa.lse.reset();
  EXPECT_NO_THROW(validate(gqa));
}

TEST_F(ForwardValidation, AcceptsStridedInputsWithContiguousLastDim) {
  ForwardArgs args = dense_forward();
  // q, k and v as slices of one packed qkv tensor (B, S, 3, H, D).
  const std::int64_t row = 3 * 8 * 64;
  args.q = TensorView(dummy_data(), DType::kFloat32, {2, 128, 8, 64}, {128 * row, row, 64, 1});
  args.k = args.q;
  args.v = args.q;
  EXPECT_NO_THROW(validate(args));
}

TEST_F(ForwardValidation, AcceptsEmptyProblems) {
  ForwardArgs args;
  args.q = TensorView(nullptr, DType::kFloat32, {0, 128, 8, 64});
  args.k = TensorView(nullptr, DType::kFloat32, {0, 128, 8, 64});
  args.v = TensorView(nullptr, DType::kFloat32, {0, 128, 8, 64});
  args.out = TensorView(nullptr, DType::kFloat32, {0, 128, 8, 64});
  EXPECT_NO_THROW(validate(args));
  // Empty tensors may report any strides (NumPy's DLPack export gives 0 for every dimension):
  // no element is read or written, so none is checked.
  for (TensorView* t : {&args.q, &args.k, &args.v, &args.out}) {
    *t = TensorView(nullptr, DType::kFloat32, {0, 128, 8, 64}, {0, 0, 0, 0});
  }
  EXPECT_NO_THROW(validate(args));
}

// --- Sanity -------------------------------------------------------------------------------

TEST_F(ForwardValidation, RejectsBrokenViews) {
  ForwardArgs args = dense_forward();
  args.q.data = nullptr;
  EXPECT_INVALID(validate(args), "q", "expected a data pointer for 131072 elements, got null");

  args = dense_forward();
  args.v.shape[1] = -5;
  EXPECT_INVALID(validate(args), "v", "expected non-negative sizes", "(2, -5, 8, 64)");

  args = dense_forward();
  args.out = TensorView();
  EXPECT_INVALID(validate(args), "out", "expected 1 to 6 dimensions, got 0");

  args = dense_forward();
  args.k.stride[0] = -1;
  EXPECT_INVALID(validate(args), "k", "expected non-negative strides");

  args = dense_forward();
  args.q.shape[1] = std::int64_t{1} << 32;
  EXPECT_INVALID(validate(args), "q", "expected every size to fit in int32");

  // Sizes that fit in int32 each but whose product (or the last element's offset) does not fit
  // in int64: refused before anything multiplies them.
  args = dense_forward();
  args.q.shape[1] = args.q.shape[2] = std::numeric_limits<std::int32_t>::max();
  for (int d = 0; d < 4; ++d) args.q.stride[d] = d == 3 ? 1 : 0;
  EXPECT_INVALID(validate(args), "q", "expected an element count and element offsets that fit in int64");
  args = dense_forward();
  args.k.stride[1] = std::int64_t{1} << 62;
  EXPECT_INVALID(validate(args), "k", "expected an element count and element offsets that fit in int64");

  args = dense_forward();
  for (auto* t : {&args.q, &args.out}) *t = tensor(DType::kFloat32, {2, 1 << 30, 8, 64});
  args.lse.reset();
  EXPECT_INVALID(validate(args), "q", "expected at most 2147483647 rows in all, got 2147483648");
}

TEST(TensorViewConstruction, RejectsMoreDimensionsThanItHolds) {
  float data[1] = {};
  // Seven sizes would be written past the six-entry shape array.
  expect_error(
      [&] {
        TensorView(data, DType::kFloat32, {1, 1, 1, 1, 1, 1, 1});
      },
      Error::Kind::kInvalidArgument, "shape", {"expected at most 6 dimensions, got 7"});
  expect_error(
      [&] {
        TensorView(data, DType::kFloat32, {1, 1}, {1, 1, 1});
      },
      Error::Kind::kInvalidArgument, "stride", {"expected one stride per dimension (2), got 3"});
  const TensorView ok(data, DType::kFloat32, {1, 2, 1, 1, 1, 1}, {2, 1, 1, 1, 1, 1});
  EXPECT_EQ(ok.ndim, 6);
  EXPECT_EQ(ok.stride[0], 2);
}

// --- Shapes -----------------------------------------------------------------------------------

TEST_F(ForwardValidation, NamesShapeMismatchWithExpectedAndActual) {
  ForwardArgs args = dense_forward();
  args.k = tensor(DType::kFloat32, {2, 128, 8, 32});
  try {
    validate(args);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), Error::Kind::kInvalidArgument);
    EXPECT_EQ(error.argument(), "k");
    EXPECT_STREQ(error.what(),
                 "k: expected shape (2, 128, 8, 64) (batch, seqlen_k, num_heads_kv, head_dim), "
                 "got (2, 128, 8, 32)");
  }
}

TEST_F(ForwardValidation, RejectsWrongShapes) {
  ForwardArgs args = dense_forward();
  args.q = tensor(DType::kFloat32, {256, 8, 64});
  EXPECT_INVALID(validate(args), "q",
                 "expected 4 dimensions (batch, seqlen_q, num_heads, head_dim), got 3",
                 "pass cu_seqlens_q");

  args = dense_forward();
  args.v = tensor(DType::kFloat32, {3, 128, 8, 64});
  EXPECT_INVALID(validate(args), "v", "expected shape (2, 128, 8, 64)",
                 "(batch, seqlen_k, num_heads_kv, head_dim_v)", "got (3, 128, 8, 64)");

  args = dense_forward();
  args.out = tensor(DType::kFloat32, {2, 128, 8, 32});
  EXPECT_INVALID(validate(args), "out", "expected shape (2, 128, 8, 64)",
                 "(batch, seqlen_q, num_heads, head_dim_v)", "got (2, 128, 8, 32)");

  args = dense_forward();
  args.lse = tensor(DType::kFloat32, {2, 128, 8});
  EXPECT_INVALID(validate(args), "lse", "expected shape (2, 8, 128) (batch, num_heads, seqlen_q)",
                 "got (2, 128, 8)");

  args = varlen_forward();
  args.lse = tensor(DType::kFloat32, {50, 4});
  EXPECT_INVALID(validate(args), "lse", "expected shape (4, 50) (num_heads, total_q)",
                 "got (50, 4)");

  args = varlen_forward();
  args.out = tensor(DType::kFloat32, {2, 25, 4, 64});
  EXPECT_INVALID(validate(args), "out",
                 "expected shape (50, 4, 64) (total_q, num_heads, head_dim_v)");
}

TEST_F(ForwardValidation, RejectsBadHeadDims) {
  ForwardArgs args = dense_forward();
  for (auto* t : {&args.q, &args.k, &args.v, &args.out})
    *t = tensor(DType::kFloat32, {2, 128, 8, 264});
  EXPECT_INVALID(validate(args), "q",
                 "expected head_dim (last dimension) to be a multiple of 8 in [8, 256], got 264");

  for (auto* t : {&args.q, &args.k, &args.v, &args.out})
    *t = tensor(DType::kFloat32, {2, 128, 8, 36});
  EXPECT_INVALID(validate(args), "q", "multiple of 8 in [8, 256], got 36");

  args = dense_forward();
  args.v = tensor(DType::kFloat32, {2, 128, 8, 20});
  args.out = tensor(DType::kFloat32, {2, 128, 8, 20});
  EXPECT_INVALID(validate(args), "v",
                 "expected head_dim_v (last dimension) to be a multiple of 8 in [8, 256], got 20");
}

TEST_F(ForwardValidation, RejectsHeadCountsThatDoNotDivide) {
  ForwardArgs args = dense_forward();
  args.k = tensor(DType::kFloat32, {2, 128, 3, 64});
  args.v = tensor(DType::kFloat32, {2, 128, 3, 64});
  EXPECT_INVALID(validate(args), "k",
                 "expected num_heads_kv to divide num_heads = 8, got num_heads_kv = 3");

  args.k = tensor(DType::kFloat32, {2, 128, 0, 64});
  args.v = tensor(DType::kFloat32, {2, 128, 0, 64});
  EXPECT_INVALID(validate(args), "k", "expected num_heads_kv >= 1");
}

// --- dtypes and devices ---------------------------------------------------------------------

TEST_F(ForwardValidation, RejectsWrongDtypes) {
  ForwardArgs args = dense_forward(DType::kInt32);
  EXPECT_INVALID(validate(args), "q",
                 "expected dtype float16, bfloat16 or float32 (CPU tensors), got int32");

  args = dense_forward(DType::kFloat32, kCuda0);
  EXPECT_INVALID(validate(args), "q",
                 "expected dtype float16 or bfloat16 (CUDA tensors), got float32");

  args = dense_forward(DType::kBFloat16);
  args.k.dtype = DType::kFloat16;
  EXPECT_INVALID(validate(args), "k", "expected dtype bfloat16 (the dtype of q), got float16");

  args = dense_forward(DType::kBFloat16);
  args.v.dtype = DType::kFloat32;
  EXPECT_INVALID(validate(args), "v", "expected dtype bfloat16 (the dtype of q), got float32");

  args = dense_forward(DType::kBFloat16);
  args.out.dtype = DType::kFloat32;
  EXPECT_INVALID(validate(args), "out", "expected dtype bfloat16 (the dtype of q), got float32");

  args = dense_forward(DType::kBFloat16);
  args.lse->dtype = DType::kBFloat16;
  EXPECT_INVALID(validate(args), "lse", "expected dtype float32, got bfloat16");
}

TEST_F(ForwardValidation, RejectsMixedDevices) {
  ForwardArgs args = dense_forward();
  args.k.device = kCuda0;
  EXPECT_INVALID(validate(args), "k", "expected device cpu (the device of q), got cuda:0");

  args = dense_forward(DType::kBFloat16, kCuda0);
  args.lse->device = Device{DeviceType::kCUDA, 1};
  EXPECT_INVALID(validate(args), "lse", "expected device cuda:0 (the device of q), got cuda:1");

  args = varlen_forward();
  args.seq.cu_seqlens_k->device = kCuda0;
  EXPECT_INVALID(validate(args), "cu_seqlens_k",
                 "expected device cpu (the device of q), got cuda:0");
}

TEST_F(ForwardValidation, RequiresContiguousLastDim) {
  for (const char* name : {"q", "k", "v", "out"}) {
    ForwardArgs args = dense_forward();
    TensorView& t = std::string(name) == "q"   ? args.q
                    : std::string(name) == "k" ? args.k
                    : std::string(name) == "v" ? args.v
                                               : args.out;
    t = TensorView(dummy_data(), DType::kFloat32, {2, 128, 8, 64},
                   {128 * 8 * 128, 8 * 128, 128, 2});
    EXPECT_INVALID(validate(args), name,
                   "expected the last dimension to be contiguous (stride 1), got strides (131072, "
                   "1024, 128, 2)");
  }
  ForwardArgs args = dense_forward();
  args.lse = TensorView(dummy_data(), DType::kFloat32, {2, 8, 128}, {1, 2, 16});
  EXPECT_INVALID(validate(args), "lse", "expected the last dimension to be contiguous");
}

// --- Output layouts -----------------------------------------------------------------------

TensorView strided(DType dtype, std::initializer_list<std::int64_t> shape,
                   std::initializer_list<std::int64_t> stride, Device device = kCpu) {
  return TensorView(dummy_data(), dtype, shape, stride, device);
}

TEST_F(ForwardValidation, RejectsOutputsWhoseElementsShareMemory) {
  // out (2, 128, 8, 64) broadcast over seqlen_q: 128 rows would be written to one address.
  ForwardArgs args = dense_forward();
  args.out = strided(DType::kFloat32, {2, 128, 8, 64}, {8 * 64, 0, 64, 1});
  EXPECT_INVALID(validate(args), "out",
                 "expected a non-zero stride on every dimension of size > 1 (an output's "
                 "elements must not share memory), got shape (2, 128, 8, 64) with strides (512, "
                 "0, 64, 1): dimension 1 has size 128 and stride 0");

  args = dense_forward();
  args.out = strided(DType::kFloat32, {2, 128, 8, 64}, {0, 8 * 64, 64, 1});
  EXPECT_INVALID(validate(args), "out", "dimension 0 has size 2 and stride 0");

  // Heads 32 elements apart with head_dim 64: head h's second half is head h + 1's first.
  args = dense_forward();
  args.out = strided(DType::kFloat32, {2, 128, 8, 64}, {128 * 8 * 32, 8 * 32, 32, 1});
  EXPECT_INVALID(validate(args), "out",
                 "expected strides under which distinct elements do not overlap",
                 "got shape (2, 128, 8, 64) with strides (32768, 256, 32, 1): dimension 2 "
                 "(stride 32) starts inside the span of dimension 3 (size 64 x stride 1)");

  // Two dimensions with one stride.
  args = dense_forward();
  args.out = strided(DType::kFloat32, {2, 128, 8, 64}, {128 * 64, 64, 64, 1});
  EXPECT_INVALID(validate(args), "out", "starts inside the span of dimension");

  // Batches 2^62 apart over rows 2^60 apart: 128 rows span 2^67, which would wrap to 0 in 64
  // bits; refused before the overlap check multiplies them.
  args = dense_forward();
  args.out = strided(DType::kFloat32, {2, 128, 8, 64},
                     {std::int64_t{1} << 62, std::int64_t{1} << 60, 64, 1});
  EXPECT_INVALID(validate(args), "out", "expected an element count and element offsets that fit in int64");

  args = dense_forward();
  args.lse = strided(DType::kFloat32, {2, 8, 128}, {128, 0, 1});
  EXPECT_INVALID(validate(args), "lse", "dimension 1 has size 8 and stride 0");

  args = dense_forward();
  args.lse = strided(DType::kFloat32, {2, 8, 128}, {8 * 64, 64, 1});
  EXPECT_INVALID(validate(args), "lse",
                 "dimension 1 (stride 64) starts inside the span of dimension 2 (size 128 x "
                 "stride 1)");

  ForwardArgs packed = varlen_forward();
  packed.out = strided(DType::kFloat32, {50, 4, 64}, {64, 64, 1});
  EXPECT_INVALID(validate(packed), "out", "starts inside the span of dimension");
}

TEST_F(ForwardValidation, AcceptsPaddedAndPermutedOutputs) {
  // Rows padded to 128 elements and heads padded to 2 * 8 rows.
  ForwardArgs args = dense_forward();
  args.out = strided(DType::kFloat32, {2, 128, 8, 64}, {128 * 16 * 128, 16 * 128, 128, 1});
  args.lse = strided(DType::kFloat32, {2, 8, 128}, {8 * 130, 130, 1});
  EXPECT_NO_THROW(validate(args));

  // out in (batch, num_heads, seqlen_q, head_dim) memory; lse in (num_heads, batch, seqlen_q).
  args = dense_forward();
  args.out = strided(DType::kFloat32, {2, 128, 8, 64}, {8 * 128 * 64, 64, 128 * 64, 1});
  args.lse = strided(DType::kFloat32, {2, 8, 128}, {128, 2 * 128, 1});
  EXPECT_NO_THROW(validate(args));

  // Dimensions of size 1 hold no second element, whatever their stride.
  args = dense_forward();
  for (auto* t : {&args.q, &args.k, &args.v}) *t = tensor(DType::kFloat32, {1, 128, 1, 64});
  args.out = strided(DType::kFloat32, {1, 128, 1, 64}, {0, 64, 0, 1});
  args.lse = strided(DType::kFloat32, {1, 1, 128}, {0, 0, 1});
  EXPECT_NO_THROW(validate(args));

  // An empty output has no element to share.
  args = dense_forward();
  for (auto* t : {&args.q, &args.out}) *t = strided(DType::kFloat32, {2, 0, 8, 64}, {0, 0, 0, 1});
  args.lse = strided(DType::kFloat32, {2, 8, 0}, {0, 0, 1});
  EXPECT_NO_THROW(validate(args));

  // Inputs may share memory: k and v broadcast over the batch.
  args = dense_forward();
  args.k = strided(DType::kFloat32, {2, 128, 8, 64}, {0, 8 * 64, 64, 1});
  args.v = args.k;
  EXPECT_NO_THROW(validate(args));
}

// --- Sequence layouts ---------------------------------------------------------------------

TEST_F(ForwardValidation, ChecksPackedSequences) {
  ForwardArgs args = varlen_forward();
  args.q = tensor(DType::kFloat32, {2, 25, 4, 64});
  EXPECT_INVALID(validate(args), "q",
                 "expected 3 dimensions (total_q, num_heads, head_dim) with cu_seqlens_q, got 4");

  std::vector<std::int32_t> long_cu{0, 10, 20, 30};
  args = varlen_forward();
  args.seq.cu_seqlens_k = int_tensor(long_cu, {4});
  EXPECT_INVALID(validate(args), "cu_seqlens_k", "expected shape (3,) (batch + 1,), got (4,)");

  args = varlen_forward();
  args.seq.cu_seqlens_q->dtype = DType::kFloat32;
  EXPECT_INVALID(validate(args), "cu_seqlens_q", "expected dtype int32, got float32");

  args = varlen_forward();
  args.seq.cu_seqlens_q->stride[0] = 2;
  EXPECT_INVALID(validate(args), "cu_seqlens_q", "expected a contiguous (row-major) tensor");

  args = varlen_forward();
  args.k = tensor(DType::kFloat32, {2, 50, 2, 64});
  EXPECT_INVALID(validate(args), "k", "expected 3 dimensions (total_k, num_heads_kv, head_dim)");

  std::vector<std::int32_t> decreasing{0, 30, 20};
  args = varlen_forward();
  args.seq.cu_seqlens_q = int_tensor(decreasing, {3});
  EXPECT_INVALID(validate(args), "cu_seqlens_q",
                 "expected non-decreasing offsets in [0, total_q = 50], got cu_seqlens_q[2] = 20 "
                 "after 30");

  std::vector<std::int32_t> beyond{0, 40, 120};
  args = varlen_forward();
  args.seq.cu_seqlens_k = int_tensor(beyond, {3});
  EXPECT_INVALID(validate(args), "cu_seqlens_k", "total_k = 100", "cu_seqlens_k[2] = 120");
}

TEST_F(ForwardValidation, ChecksSequsedAndLengthHints) {
  std::vector<std::int32_t> used{10, 20, 30};
  ForwardArgs args = dense_forward();
  args.seq.seqused_q = int_tensor(used, {3});
  EXPECT_INVALID(validate(args), "seqused_q", "expected shape (2,) (batch,), got (3,)");

  std::vector<std::int32_t> too_long{10, 129};
  args = dense_forward();
  args.seq.seqused_k = int_tensor(too_long, {2});
  EXPECT_INVALID(validate(args), "seqused_k", "expected seqused_k[1] in [0, 128]", "got 129");

  std::vector<std::int32_t> ok{10, 128};
  args = dense_forward();
  args.seq.seqused_q = int_tensor(ok, {2});
  args.seq.seqused_k = int_tensor(ok, {2});
  EXPECT_NO_THROW(validate(args));

  // A packed sequence's seqused is capped by its own segment, not by the rows after its start.
  std::vector<std::int32_t> past_segment{31, 20};
  args = varlen_forward();
  args.seq.seqused_q = int_tensor(past_segment, {2});
  EXPECT_INVALID(validate(args), "seqused_q", "expected seqused_q[0] in [0, 30]", "got 31");
  std::vector<std::int32_t> past_segment_k{41, 60};
  args = varlen_forward();
  args.seq.seqused_k = int_tensor(past_segment_k, {2});
  EXPECT_INVALID(validate(args), "seqused_k", "expected seqused_k[0] in [0, 40]", "got 41");
  std::vector<std::int32_t> within{30, 0};
  args = varlen_forward();
  args.seq.seqused_q = int_tensor(within, {2});
  EXPECT_NO_THROW(validate(args));

  args = varlen_forward();
  args.seq.max_seqlen_q = 20;
  EXPECT_INVALID(validate(args), "max_seqlen_q", "expected at least 30 (the longest segment of cu_seqlens_q",
                 "got 20");
  // The hints stand for whole segments, whatever seqused leaves of them: the kernels visit the
  // rows the hint counts and must write every row of a segment (0 and -inf past seqused).
  std::vector<std::int32_t> shortened{10, 5};
  args = varlen_forward();
  args.seq.seqused_q = int_tensor(shortened, {2});
  args.seq.max_seqlen_q = 10;
  EXPECT_INVALID(validate(args), "max_seqlen_q", "expected at least 30 (the longest segment of cu_seqlens_q",
                 "got 10");
  args = varlen_forward();
  args.seq.seqused_k = int_tensor(shortened, {2});
  args.seq.max_seqlen_k = 10;
  EXPECT_INVALID(validate(args), "max_seqlen_k", "expected at least", "got 10");

  args = varlen_forward();
  args.seq.max_seqlen_k = -1;
  EXPECT_INVALID(validate(args), "max_seqlen_k", "expected a length in [0, 2147483647], got -1");

  // The kernels take the hints as int32 lengths.
  args = varlen_forward();
  args.seq.max_seqlen_q = std::int64_t{1} << 32;
  EXPECT_INVALID(validate(args), "max_seqlen_q",
                 "expected a length in [0, 2147483647], got 4294967296");
  args = varlen_forward();
  args.seq.max_seqlen_k = std::int64_t{1} << 31;
  EXPECT_INVALID(validate(args), "max_seqlen_k",
                 "expected a length in [0, 2147483647], got 2147483648");

  args = varlen_forward();
  args.seq.max_seqlen_q = 30;
  args.seq.max_seqlen_k = 64;
  EXPECT_NO_THROW(validate(args));
}

TEST_F(ForwardValidation, ChecksPagedKV) {
  ForwardArgs args = paged_forward();
  args.seq.page_table->dtype = DType::kFloat32;
  EXPECT_INVALID(validate(args), "page_table", "expected dtype int32, got float32");

  std::vector<std::int32_t> table(9, 0);
  args = paged_forward();
  args.seq.page_table = int_tensor(table, {3, 3});
  EXPECT_INVALID(validate(args), "page_table",
                 "expected shape (2, 3) (batch, max_pages), got (3, 3)");

  args = paged_forward();
  args.seq.page_table = TensorView(page_table_.data(), DType::kInt32, {2, 3}, {1, 2});
  EXPECT_INVALID(validate(args), "page_table", "expected the last dimension to be contiguous");

  args = paged_forward();
  args.seq.cu_seqlens_k = int_tensor(cu_k_, {3});
  EXPECT_INVALID(validate(args), "page_table", "cannot be combined with cu_seqlens_k");

  args = paged_forward();
  args.v = tensor(DType::kFloat32, {6, 8, 2, 64});
  EXPECT_INVALID(validate(args), "v", "expected shape (6, 16, 2, 64)",
                 "(num_pages, page_size, num_heads_kv, head_dim_v)", "got (6, 8, 2, 64)");

  // seqused_k = 30 needs two pages; the second page of sequence 1 is 4, inside [0, 6).
  std::vector<std::int32_t> bad_table{0, 1, 2, 5, 6, -1};
  args = paged_forward();
  args.seq.page_table = int_tensor(bad_table, {2, 3});
  EXPECT_INVALID(validate(args), "page_table",
                 "expected page_table[1, 1] in [0, num_pages = 6), got 6");

  std::vector<std::int32_t> used{40, 49};
  args = paged_forward();
  args.seq.seqused_k = int_tensor(used, {2});
  EXPECT_INVALID(validate(args), "seqused_k", "expected seqused_k[1] in [0, 48]", "got 49");
}

// --- Options --------------------------------------------------------------------------------

TEST_F(ForwardValidation, ChecksScalarOptions) {
  ForwardArgs args = dense_forward();
  args.opts.softcap = -1.0f;
  EXPECT_INVALID(validate(args), "softcap", "expected a finite value >= 0 (0 disables it), got -1");

  args.opts.softcap = std::numeric_limits<float>::quiet_NaN();
  EXPECT_INVALID(validate(args), "softcap", "expected a finite value >= 0");

  args = dense_forward();
  args.opts.softmax_scale = std::numeric_limits<float>::infinity();
  EXPECT_INVALID(validate(args), "softmax_scale", "expected a finite value, got inf");

  args = dense_forward();
  args.opts.causal = true;
  args.opts.window_right = 3;
  EXPECT_INVALID(validate(args), "window_right",
                 "expected 0 or negative (unbounded) with causal = true", "got 3");

  args.opts.window_left = 16;
  args.opts.window_right = 0;
  EXPECT_NO_THROW(validate(args));
  args.opts.causal = false;
  args.opts.window_right = 4;
  EXPECT_NO_THROW(validate(args));

  args = dense_forward();
  args.num_splits = 257;
  EXPECT_INVALID(validate(args), "num_splits", "expected at most 256", "got 257");
  args.num_splits = 256;
  EXPECT_NO_THROW(validate(args));
  args.num_splits = 0;
  EXPECT_NO_THROW(validate(args));
}

TEST_F(ForwardValidation, AllowsSoftcapTogetherWithScoreMod) {
  ForwardArgs args = dense_forward();
  args.opts.softcap = 30.0f;
  args.opts.score_mod.kind = ScoreModKind::kAlibi;
  args.opts.score_mod.aux = {tensor(DType::kFloat32, {8})};
  EXPECT_NO_THROW(validate(args));
}

TEST_F(ForwardValidation, ChecksLearnableSink) {
  ForwardArgs args = dense_forward();
  args.learnable_sink = tensor(DType::kFloat32, {4});
  EXPECT_INVALID(validate(args), "learnable_sink", "expected shape (8,) (num_heads,), got (4,)");

  args.learnable_sink = tensor(DType::kInt32, {8});
  EXPECT_INVALID(validate(args), "learnable_sink",
                 "expected dtype float32, bfloat16 or float16, got int32");

  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    args.learnable_sink = tensor(dtype, {8});
    EXPECT_NO_THROW(validate(args));
  }
}

TEST_F(ForwardValidation, ChecksScoreMods) {
  ForwardArgs args = dense_forward();
  args.opts.score_mod.kind = ScoreModKind::kAlibi;
  EXPECT_INVALID(validate(args), "score_mod.aux",
                 "expected 1 aux tensor for alibi (slopes), got 0");

  args.opts.score_mod.aux = {tensor(DType::kFloat32, {4})};
  EXPECT_INVALID(validate(args), "score_mod.aux[0]", "expected shape (8,) (num_heads,), got (4,)");

  args.opts.score_mod.aux = {tensor(DType::kBFloat16, {8})};
  EXPECT_INVALID(validate(args), "score_mod.aux[0]",
                 "expected dtype float32 (alibi slopes), got bfloat16");

  args.opts.score_mod.aux = {tensor(DType::kFloat32, {8})};
  args.opts.score_mod.scalars = {1.0};
  EXPECT_INVALID(validate(args), "score_mod.scalars", "expected 0 scalars for alibi, got 1");

  args.opts.score_mod = {};
  args.opts.score_mod.kind = ScoreModKind::kRelativeBias;
  args.opts.score_mod.aux = {tensor(DType::kFloat32, {8, 16})};
  EXPECT_INVALID(validate(args), "score_mod.aux[0]",
                 "expected shape (8, 2 * max_distance + 1) (num_heads, an odd width), got (8, 16)");
  args.opts.score_mod.aux = {tensor(DType::kFloat32, {8, 17})};
  EXPECT_NO_THROW(validate(args));

  args.opts.score_mod.aux = {tensor(DType::kFloat32, {8, 17}, kCuda0)};
  EXPECT_INVALID(validate(args), "score_mod.aux[0]",
                 "expected device cpu (the device of q), got cuda:0");

  args.opts.score_mod = {};
  args.opts.score_mod.scalars = {2.0};
  EXPECT_INVALID(validate(args), "score_mod.scalars",
                 "expected 0 scalars for score_mod kind none, got 1");

  args.opts.score_mod = {};
  args.opts.score_mod.kind = static_cast<ScoreModKind>(9);
  EXPECT_INVALID(validate(args), "score_mod.kind", "expected none, alibi, relative_bias or expression, got 9");
}

TEST_F(ForwardValidation, ChecksMaskMods) {
  ForwardArgs args = dense_forward();
  args.opts.mask_mod.kind = MaskModKind::kSlidingWindow;
  args.opts.mask_mod.scalars = {16};
  EXPECT_INVALID(validate(args), "mask_mod.scalars",
                 "expected 2 scalars for sliding_window (left, right), got 1");

  args.opts.mask_mod.scalars = {16, -1};
  EXPECT_INVALID(validate(args), "mask_mod.scalars[1]",
                 "expected a whole number >= 0 for sliding_window, got -1");

  args.opts.mask_mod.scalars = {16, 0.5};
  EXPECT_INVALID(validate(args), "mask_mod.scalars[1]", "got 0.5");

  args.opts.mask_mod.scalars = {16, 0};
  EXPECT_NO_THROW(validate(args));

  args.opts.mask_mod = {};
  args.opts.mask_mod.kind = MaskModKind::kPrefixLM;
  EXPECT_INVALID(validate(args), "mask_mod.scalars",
                 "expected 1 scalar for prefix_lm (prefix length), got 0");

  args.opts.mask_mod = {};
  args.opts.mask_mod.kind = MaskModKind::kCausal;
  args.opts.mask_mod.aux = {tensor(DType::kInt32, {2, 128})};
  EXPECT_INVALID(validate(args), "mask_mod.aux", "expected 0 aux tensors for causal, got 1");

  args.opts.mask_mod = {};
  args.opts.mask_mod.kind = MaskModKind::kDocument;
  args.opts.mask_mod.aux = {tensor(DType::kInt32, {2, 100})};
  EXPECT_INVALID(
      validate(args), "mask_mod.aux[0]",
      "expected shape (2, L) with L >= 128 (batch, max(seqlen_q, seqlen_k)), got (2, 100)");

  args.opts.mask_mod.aux = {tensor(DType::kFloat32, {2, 128})};
  EXPECT_INVALID(validate(args), "mask_mod.aux[0]",
                 "expected dtype int32 (document ids), got float32");

  args.opts.mask_mod.aux = {tensor(DType::kInt32, {2, 128})};
  EXPECT_NO_THROW(validate(args));

  // Packed: the document ids cover the longest sequence (60 keys).
  args = varlen_forward();
  args.opts.mask_mod.kind = MaskModKind::kDocument;
  args.opts.mask_mod.aux = {tensor(DType::kInt32, {2, 59})};
  EXPECT_INVALID(validate(args), "mask_mod.aux[0]", "L >= 60", "got (2, 59)");
  args.opts.mask_mod.aux = {tensor(DType::kInt32, {2, 60})};
  EXPECT_NO_THROW(validate(args));

  // Packed in device memory without max_seqlen_*: the lengths cannot be read, so the ids
  // must cover their bounds total_q = 50 and total_k = 100.
  args = varlen_forward();
  for (TensorView* t : {&args.q, &args.k, &args.v, &args.out}) t->dtype = DType::kBFloat16;
  for (TensorView* t : {&args.q, &args.k, &args.v, &args.out, &*args.lse, &*args.seq.cu_seqlens_q,
                        &*args.seq.cu_seqlens_k}) {
    t->device = kCuda0;
  }
  args.opts.mask_mod.kind = MaskModKind::kDocument;
  args.opts.mask_mod.aux = {tensor(DType::kInt32, {2, 60}, kCuda0)};
  EXPECT_INVALID(validate(args), "mask_mod.aux[0]", "L >= 100", "got (2, 60)");
  args.seq.max_seqlen_q = 30;
  args.seq.max_seqlen_k = 60;
  EXPECT_NO_THROW(validate(args));

  args = dense_forward();
  args.opts.mask_mod.kind = static_cast<MaskModKind>(-2);
  EXPECT_INVALID(validate(args), "mask_mod.kind", "got -2");
}

// --- Block sparsity -------------------------------------------------------------------------

TEST_F(ForwardValidation, ChecksBlockSparseTensors) {
  ForwardArgs args = dense_forward();
  args.opts.block_sparse = block_mask();
  EXPECT_NO_THROW(validate(args));

  args.opts.block_sparse->mask_block_cnt = int_tensor(cnt_, {2, 1, 4});
  EXPECT_INVALID(validate(args), "mask_block_cnt",
                 "expected shape (2, 1, 2) (batch, num_heads or 1, ceil(seqlen_q / block_m)), got "
                 "(2, 1, 4)");

  args.opts.block_sparse = block_mask();
  args.opts.block_sparse->mask_block_idx = int_tensor(idx_, {2, 1, 2, 1});
  EXPECT_INVALID(validate(args), "mask_block_idx",
                 "expected shape (2, 1, 2, 2) (batch, num_heads or 1, ceil(seqlen_q / block_m), "
                 "ceil(seqlen_k / block_n)), got (2, 1, 2, 1)");

  std::vector<std::int32_t> cnt3(12, 0);
  args.opts.block_sparse = block_mask();
  args.opts.block_sparse->mask_block_cnt = int_tensor(cnt3, {2, 3, 2});
  EXPECT_INVALID(validate(args), "mask_block_cnt", "expected shape (2, 8, 2) or (2, 1, 2)",
                 "got (2, 3, 2)");

  args.opts.block_sparse = block_mask();
  args.opts.block_sparse->mask_block_cnt->dtype = DType::kFloat32;
  EXPECT_INVALID(validate(args), "mask_block_cnt", "expected dtype int32, got float32");

  args.opts.block_sparse = block_mask();
  args.opts.block_sparse->mask_block_idx.reset();
  EXPECT_INVALID(validate(args), "mask_block_idx", "required together with mask_block_cnt");

  args.opts.block_sparse = BlockSparseTensors{};
  EXPECT_INVALID(validate(args), "block_sparse",
                 "expected mask_block_cnt/idx or full_block_cnt/idx, got neither");

  // A full list with another head count than the mask list.
  std::vector<std::int32_t> full_cnt(32, 0), full_idx(64, 0);
  args.opts.block_sparse = block_mask();
  args.opts.block_sparse->full_block_cnt = int_tensor(full_cnt, {2, 8, 2});
  args.opts.block_sparse->full_block_idx = int_tensor(full_idx, {2, 8, 2, 2});
  EXPECT_INVALID(validate(args), "full_block_cnt",
                 "expected shape (2, 1, 2) (batch, num_heads_b as in mask_block_cnt");

  args.opts.block_sparse = block_mask();
  args.opts.block_sparse->block_m = 0;
  EXPECT_INVALID(validate(args), "block_sparse",
                 "expected block_m and block_n >= 1, got block_m = 0");
}

TEST_F(ForwardValidation, ChecksBlockSparseContents) {
  std::vector<std::int32_t> cnt{1, 3, 0, 0};
  ForwardArgs args = dense_forward();
  args.opts.block_sparse = block_mask();
  args.opts.block_sparse->mask_block_cnt = int_tensor(cnt, {2, 1, 2});
  EXPECT_INVALID(validate(args), "mask_block_cnt",
                 "expected mask_block_cnt[0, 0, 1] in [0, 2], got 3");

  std::vector<std::int32_t> idx{0, 0, 1, 2, 0, 1, 0, 0};
  args.opts.block_sparse = block_mask();
  args.opts.block_sparse->mask_block_idx = int_tensor(idx, {2, 1, 2, 2});
  EXPECT_INVALID(validate(args), "mask_block_idx",
                 "expected mask_block_idx[0, 0, 1, 1] in [0, 2), got 2");
}

// Block lists per sequence: with cu_seqlens sized by the longest sequence, with a page table by
// max_pages * page_size.
TEST_F(ForwardValidation, BlockSparsityWithPackedOrPagedSequences) {
  // cu_seqlens on the host: lengths 30 / 20 and 40 / 60, one 64-row and one 64-key block.
  std::vector<std::int32_t> cnt{1, 1}, idx{0, 0};
  ForwardArgs args = varlen_forward();
  args.opts.block_sparse = block_mask();
  EXPECT_INVALID(validate(args), "mask_block_cnt", "expected shape (2, 1, 1)",
                 "ceil(max_seqlen_q / block_m)");
  args.opts.block_sparse->mask_block_cnt = int_tensor(cnt, {2, 1, 1});
  args.opts.block_sparse->mask_block_idx = int_tensor(idx, {2, 1, 1, 1});
  EXPECT_NO_THROW(validate(args));
  // Hints count instead: 100 query rows are two row blocks.
  args.seq.max_seqlen_q = 100;
  EXPECT_INVALID(validate(args), "mask_block_cnt", "expected shape (2, 1, 2)");
  std::vector<std::int32_t> cnt2{1, 0, 1, 1}, idx2{0, 0, 0, 0};
  args.opts.block_sparse->mask_block_cnt = int_tensor(cnt2, {2, 1, 2});
  args.opts.block_sparse->mask_block_idx = int_tensor(idx2, {2, 1, 2, 1});
  EXPECT_NO_THROW(validate(args));

  // seqused does not change the count: the lists span the longest cu_seqlens segment with and
  // without a hint, so a 130-row segment of which 20 rows are used is three 64-row blocks (the
  // keys' 40 / 60 one 64-key block).
  std::vector<std::int32_t> cu_long{0, 130, 150}, used_q{20, 20};
  ForwardArgs used = varlen_forward();
  used.q = tensor(DType::kFloat32, {150, 4, 64});
  used.out = tensor(DType::kFloat32, {150, 4, 64});
  used.lse = tensor(DType::kFloat32, {4, 150});
  used.seq.cu_seqlens_q = int_tensor(cu_long, {3});
  used.seq.seqused_q = int_tensor(used_q, {2});
  std::vector<std::int32_t> cnt3(2 * 3, 0), idx3(2 * 3, 0);
  used.opts.block_sparse = block_mask();
  used.opts.block_sparse->mask_block_cnt = int_tensor(cnt3, {2, 1, 3});
  used.opts.block_sparse->mask_block_idx = int_tensor(idx3, {2, 1, 3, 1});
  EXPECT_NO_THROW(validate(used));
  used.seq.max_seqlen_q = 130;
  EXPECT_NO_THROW(validate(used));
  used.seq.max_seqlen_q.reset();
  used.opts.block_sparse->mask_block_cnt = int_tensor(cnt, {2, 1, 1});
  used.opts.block_sparse->mask_block_idx = int_tensor(idx, {2, 1, 1, 1});
  EXPECT_INVALID(validate(used), "mask_block_cnt", "expected shape (2, 1, 3)");

  // cu_seqlens in device memory: the lengths must be hinted.
  ForwardArgs device_args = varlen_forward();
  device_args.seq.cu_seqlens_q = TensorView(cu_q_.data(), DType::kInt32, {3}, kCuda0);
  device_args.q = tensor(DType::kFloat16, {50, 4, 64}, kCuda0);
  device_args.k = tensor(DType::kFloat16, {100, 2, 64}, kCuda0);
  device_args.v = tensor(DType::kFloat16, {100, 2, 64}, kCuda0);
  device_args.out = tensor(DType::kFloat16, {50, 4, 64}, kCuda0);
  device_args.lse = tensor(DType::kFloat32, {4, 50}, kCuda0);
  device_args.seq.cu_seqlens_k = TensorView(cu_k_.data(), DType::kInt32, {3}, kCuda0);
  BlockSparseTensors on_device;
  on_device.block_m = 64;
  on_device.block_n = 64;
  on_device.mask_block_cnt = TensorView(cnt.data(), DType::kInt32, {2, 1, 1}, kCuda0);
  on_device.mask_block_idx = TensorView(idx.data(), DType::kInt32, {2, 1, 1, 1}, kCuda0);
  device_args.opts.block_sparse = on_device;
  EXPECT_INVALID(validate(device_args), "max_seqlen_q", "needs max_seqlen_q");
  device_args.seq.max_seqlen_q = 30;
  EXPECT_INVALID(validate(device_args), "max_seqlen_k", "needs max_seqlen_k");
  device_args.seq.max_seqlen_k = 60;
  EXPECT_NO_THROW(validate(device_args));

  // Paged: 3 pages of 16 keys per sequence, one 64-key column block.
  args = paged_forward();
  args.opts.block_sparse = block_mask();
  EXPECT_INVALID(validate(args), "mask_block_cnt", "expected shape (2, 1, 1)");
  args.opts.block_sparse->mask_block_cnt = int_tensor(cnt, {2, 1, 1});
  args.opts.block_sparse->mask_block_idx = int_tensor(idx, {2, 1, 1, 1});
  EXPECT_NO_THROW(validate(args));
}

TEST_F(ForwardValidation, ForwardValidatesBeforeRunning) {
  ForwardArgs args = dense_forward();
  args.k = tensor(DType::kFloat32, {2, 128, 8, 32});
  EXPECT_INVALID(forward(args), "k", "expected shape (2, 128, 8, 64)");
  EXPECT_INVALID(forward_workspace_size(args), "k", "expected shape (2, 128, 8, 64)");
}

// --- Backward -------------------------------------------------------------------------------

class BackwardValidation : public ForwardValidation {};

TEST_F(BackwardValidation, AcceptsValidInputs) {
  EXPECT_NO_THROW(validate(dense_backward()));
  EXPECT_NO_THROW(validate(dense_backward(DType::kBFloat16, kCuda0)));

  BackwardArgs args = dense_backward();
  args.learnable_sink = tensor(DType::kBFloat16, {8});
  args.d_sink = tensor(DType::kFloat32, {8});
  EXPECT_NO_THROW(validate(args));
}

TEST_F(BackwardValidation, RejectsWrongShapesAndDtypes) {
  BackwardArgs args = dense_backward();
  args.dq = tensor(DType::kFloat32, {2, 128, 8, 32});
  EXPECT_INVALID(validate(args), "dq",
                 "expected shape (2, 128, 8, 64) (the shape of q), got (2, 128, 8, 32)");

  args = dense_backward(DType::kBFloat16);
  args.dk.dtype = DType::kFloat32;
  EXPECT_INVALID(validate(args), "dk", "expected dtype bfloat16 (the dtype of q), got float32");

  args = dense_backward();
  args.dv = TensorView(dummy_data(), DType::kFloat32, {2, 96, 2, 32}, {96 * 2 * 64, 2 * 64, 64, 2});
  EXPECT_INVALID(validate(args), "dv", "expected the last dimension to be contiguous");

  args = dense_backward();
  args.dout = tensor(DType::kFloat32, {2, 128, 8, 64});
  EXPECT_INVALID(validate(args), "dout", "expected shape (2, 128, 8, 32)",
                 "(batch, seqlen_q, num_heads, head_dim_v)", "got (2, 128, 8, 64)");

  args = dense_backward(DType::kFloat16);
  args.out.dtype = DType::kBFloat16;
  EXPECT_INVALID(validate(args), "out", "expected dtype float16 (the dtype of q), got bfloat16");

  args = dense_backward();
  args.lse = tensor(DType::kFloat32, {2, 128, 8});
  EXPECT_INVALID(validate(args), "lse", "expected shape (2, 8, 128) (batch, num_heads, seqlen_q)");

  args = dense_backward();
  args.lse.data = nullptr;
  EXPECT_INVALID(validate(args), "lse", "expected a data pointer");

  args = dense_backward();
  args.dk.device = kCuda0;
  EXPECT_INVALID(validate(args), "dk", "expected device cpu (the device of q), got cuda:0");

  args = dense_backward(DType::kFloat32, kCuda0);
  EXPECT_INVALID(validate(args), "q",
                 "expected dtype float16 or bfloat16 (CUDA tensors), got float32");
}

TEST_F(BackwardValidation, RejectsGradientsWhoseElementsShareMemory) {
  BackwardArgs args = dense_backward();
  args.dq = strided(DType::kFloat32, {2, 128, 8, 64}, {0, 8 * 64, 64, 1});
  EXPECT_INVALID(validate(args), "dq", "expected a non-zero stride on every dimension of size > 1",
                 "dimension 0 has size 2 and stride 0");

  // dk (2, 96, 2, 64) with rows 64 apart: the two kv heads of a row write one place.
  args = dense_backward();
  args.dk = strided(DType::kFloat32, {2, 96, 2, 64}, {96 * 64, 64, 64, 1});
  EXPECT_INVALID(validate(args), "dk",
                 "expected strides under which distinct elements do not overlap",
                 "with strides (6144, 64, 64, 1)");

  args = dense_backward();
  args.dv = strided(DType::kFloat32, {2, 96, 2, 32}, {96 * 2 * 32, 2 * 32, 16, 1});
  EXPECT_INVALID(validate(args), "dv",
                 "dimension 2 (stride 16) starts inside the span of dimension 3 (size 32 x "
                 "stride 1)");
}

TEST_F(BackwardValidation, AcceptsPaddedGradientsAndBroadcastInputs) {
  BackwardArgs args = dense_backward();
  args.dq = strided(DType::kFloat32, {2, 128, 8, 64}, {128 * 8 * 128, 8 * 128, 128, 1});
  // dk, dv as halves of one (B, Sk, 2, H_kv, D) buffer; dv's rows padded to D = 64.
  args.dk = strided(DType::kFloat32, {2, 96, 2, 64}, {96 * 2 * 2 * 64, 2 * 2 * 64, 64, 1});
  args.dv = strided(DType::kFloat32, {2, 96, 2, 32}, {96 * 2 * 2 * 64, 2 * 2 * 64, 64, 1});
  EXPECT_NO_THROW(validate(args));

  // dout is an input: the gradient of out.sum() is one value broadcast to every element.
  args = dense_backward();
  args.dout = strided(DType::kFloat32, {2, 128, 8, 32}, {0, 0, 0, 1});
  EXPECT_NO_THROW(validate(args));
}

TEST_F(BackwardValidation, ChecksPackedSequences) {
  BackwardArgs args;
  args.q = tensor(DType::kFloat32, {50, 4, 64});
  args.k = tensor(DType::kFloat32, {100, 2, 64});
  args.v = tensor(DType::kFloat32, {100, 2, 64});
  args.out = tensor(DType::kFloat32, {50, 4, 64});
  args.dout = tensor(DType::kFloat32, {50, 4, 64});
  args.lse = tensor(DType::kFloat32, {4, 50});
  args.dq = tensor(DType::kFloat32, {50, 4, 64});
  args.dk = tensor(DType::kFloat32, {100, 2, 64});
  args.dv = tensor(DType::kFloat32, {100, 2, 64});
  args.seq.cu_seqlens_q = int_tensor(cu_q_, {3});
  args.seq.cu_seqlens_k = int_tensor(cu_k_, {3});
  EXPECT_NO_THROW(validate(args));

  args.lse = tensor(DType::kFloat32, {2, 4, 25});
  EXPECT_INVALID(validate(args), "lse",
                 "expected shape (4, 50) (num_heads, total_q), got (2, 4, 25)");
}

TEST_F(BackwardValidation, RequiresSinkGradient) {
  BackwardArgs args = dense_backward();
  args.learnable_sink = tensor(DType::kFloat32, {8});
  EXPECT_INVALID(validate(args), "d_sink", "required when learnable_sink is given");

  args.d_sink = tensor(DType::kBFloat16, {8});
  EXPECT_INVALID(validate(args), "d_sink", "expected dtype float32, got bfloat16");

  args.d_sink = tensor(DType::kFloat32, {2});
  EXPECT_INVALID(validate(args), "d_sink", "expected shape (8,) (num_heads,), got (2,)");

  args = dense_backward();
  args.d_sink = tensor(DType::kFloat32, {8});
  EXPECT_INVALID(validate(args), "d_sink", "given without learnable_sink");
}

TEST_F(BackwardValidation, GradientOfLseLikeLse) {
  BackwardArgs args = dense_backward();
  args.dlse = tensor(DType::kFloat32, {2, 8, 128});
  EXPECT_NO_THROW(validate(args));
  args.dlse = tensor(DType::kBFloat16, {2, 8, 128});
  EXPECT_INVALID(validate(args), "dlse", "expected dtype float32, got bfloat16");
  args.dlse = tensor(DType::kFloat32, {2, 128, 8});
  EXPECT_INVALID(validate(args), "dlse",
                 "expected shape (2, 8, 128) (batch, num_heads, seqlen_q), got (2, 128, 8)");
  args.dlse = tensor(DType::kFloat32, {2, 8, 128}, kCuda0);
  EXPECT_INVALID(validate(args), "dlse", "expected device cpu (the device of q), got cuda:0");
}

TEST_F(BackwardValidation, TransposedBlockListsCoverTheForwardOnes) {
  BackwardArgs args = dense_backward();
  // Dense problem of dense_backward: Sq = 128, Sk = 96; blocks of 64: 2 row, 2 column blocks.
  // The forward lists alone serve the backward (tabulated on the GPU).
  args.opts.block_sparse = block_mask();
  EXPECT_NO_THROW(validate(args));
  BlockSparseTensors none;
  none.block_m = 64;
  none.block_n = 64;
  args.opts.block_sparse = none;
  EXPECT_INVALID(validate(args), "block_sparse", "expected the column-block lists",
                 "or the forward's mask_block_cnt/idx or full_block_cnt/idx, got neither");

  args.opts.block_sparse = block_mask();
  std::vector<std::int32_t> q_cnt{1, 1, 1, 1}, q_idx(8, 0);
  args.opts.block_sparse->q_full_block_cnt = int_tensor(q_cnt, {2, 1, 2});
  args.opts.block_sparse->q_full_block_idx = int_tensor(q_idx, {2, 1, 2, 2});
  EXPECT_INVALID(validate(args), "q_mask_block_cnt",
                 "required in backward because mask_block_cnt is given");

  args.opts.block_sparse->q_mask_block_cnt = int_tensor(q_cnt, {2, 1, 2});
  args.opts.block_sparse->q_mask_block_idx = int_tensor(q_idx, {2, 1, 2, 2});
  EXPECT_NO_THROW(validate(args));

  // The transposed lists are per column block: (B, H_b, ceil(Sk / block_n), ceil(Sq / block_m)).
  std::vector<std::int32_t> long_idx(12, 0);
  args.opts.block_sparse->q_mask_block_idx = int_tensor(long_idx, {2, 1, 2, 3});
  EXPECT_INVALID(validate(args), "q_mask_block_idx",
                 "expected shape (2, 1, 2, 2) (batch, num_heads_b as in mask_block_cnt, "
                 "ceil(seqlen_k / block_n), ceil(seqlen_q / block_m)), got (2, 1, 2, 3)");
}

TEST_F(BackwardValidation, ChecksPagedKV) {
  // Paged k/v in backward (past the seed): dk / dv have the shapes of the paged k / v.
  BackwardArgs args;
  const ForwardArgs fwd = paged_forward();
  args.q = fwd.q;
  args.k = fwd.k;
  args.v = fwd.v;
  args.out = fwd.out;
  args.dout = fwd.out;
  args.lse = tensor(DType::kFloat32, {2, 4, 10});
  args.dq = fwd.q;
  args.dk = fwd.k;
  args.dv = fwd.v;
  args.seq = fwd.seq;
  EXPECT_NO_THROW(validate(args));

  args.dk = tensor(DType::kFloat32, {2, 48, 2, 64});
  EXPECT_INVALID(validate(args), "dk",
                 "expected shape (6, 16, 2, 64) (the shape of k), got (2, 48, 2, 64)");

  args.dk = fwd.k;
  args.seq.cu_seqlens_k = int_tensor(cu_k_, {3});
  EXPECT_INVALID(validate(args), "page_table", "cannot be combined with cu_seqlens_k");

  // Block lists over the paged keys (3 pages of 16: one 64-key column block).
  args.seq.cu_seqlens_k.reset();
  std::vector<std::int32_t> cnt{1, 1}, idx{0, 0};
  args.opts.block_sparse = block_mask();
  args.opts.block_sparse->mask_block_cnt = int_tensor(cnt, {2, 1, 1});
  args.opts.block_sparse->mask_block_idx = int_tensor(idx, {2, 1, 1, 1});
  EXPECT_NO_THROW(validate(args));
}

TEST_F(BackwardValidation, BackwardValidatesBeforeRunning) {
  BackwardArgs args = dense_backward();
  args.dv = tensor(DType::kFloat32, {2, 96, 2, 64});
  EXPECT_INVALID(backward(args), "dv", "(the shape of v)");
  EXPECT_INVALID(backward_workspace_size(args), "dv", "(the shape of v)");
}

// --- Combine --------------------------------------------------------------------------------

CombineArgs dense_combine(Device device = kCpu) {
  CombineArgs args;
  args.out_partial = tensor(DType::kFloat32, {4, 2, 64, 8, 128}, device);
  args.lse_partial = tensor(DType::kFloat32, {4, 2, 64, 8}, device);
  args.out = tensor(DType::kBFloat16, {2, 64, 8, 128}, device);
  args.lse = tensor(DType::kFloat32, {2, 64, 8}, device);
  return args;
}

class CombineValidation : public ::testing::Test {
 protected:
  CombineArgs varlen_combine() {
    CombineArgs args;
    args.out_partial = tensor(DType::kFloat32, {3, 50, 8, 64});
    args.lse_partial = tensor(DType::kFloat32, {3, 50, 8});
    args.out = tensor(DType::kFloat32, {50, 8, 64});
    args.cu_seqlens = int_tensor(cu_, {3});
    args.seqused = int_tensor(used_, {2});
    return args;
  }
  std::vector<std::int32_t> cu_{0, 30, 50};
  std::vector<std::int32_t> used_{30, 10};
};

TEST_F(CombineValidation, AcceptsValidInputs) {
  EXPECT_NO_THROW(validate(dense_combine()));
  EXPECT_NO_THROW(validate(dense_combine(kCuda0)));
  EXPECT_NO_THROW(validate(varlen_combine()));
  // The lse of a forward (B, H, S) seen transposed as (B, S, H).
  CombineArgs args = dense_combine();
  args.lse = TensorView(dummy_data(), DType::kFloat32, {2, 64, 8}, {8 * 64, 1, 64});
  EXPECT_NO_THROW(validate(args));
}

TEST_F(CombineValidation, RejectsWrongShapes) {
  CombineArgs args = dense_combine();
  args.out_partial = tensor(DType::kFloat32, {4, 64, 8});
  EXPECT_INVALID(validate(args), "out_partial",
                 "expected 5 dimensions (num_splits, batch, seqlen, num_heads, head_dim) or 4 "
                 "(num_splits, total, num_heads, head_dim), got 3");

  args = dense_combine();
  args.lse_partial = tensor(DType::kFloat32, {4, 2, 8, 64});
  EXPECT_INVALID(validate(args), "lse_partial",
                 "expected shape (4, 2, 64, 8) (num_splits, batch, seqlen, num_heads)",
                 "got (4, 2, 8, 64)");

  args = dense_combine();
  args.out = tensor(DType::kBFloat16, {2, 64, 8, 64});
  EXPECT_INVALID(validate(args), "out",
                 "expected shape (2, 64, 8, 128) (batch, seqlen, num_heads, head_dim)");

  args = dense_combine();
  args.lse = tensor(DType::kFloat32, {2, 8, 64});
  EXPECT_INVALID(validate(args), "lse",
                 "expected shape (2, 64, 8) (batch, seqlen, num_heads), got (2, 8, 64)");

  args = dense_combine();
  args.out_partial = tensor(DType::kFloat32, {257, 2, 64, 8, 128});
  args.lse_partial = tensor(DType::kFloat32, {257, 2, 64, 8});
  EXPECT_INVALID(validate(args), "out_partial", "expected 1 to 256 splits (dimension 0), got 257");

  args = dense_combine();
  args.out_partial = tensor(DType::kFloat32, {0, 2, 64, 8, 128});
  EXPECT_INVALID(validate(args), "out_partial", "got 0");

  args = dense_combine();
  args.out_partial = tensor(DType::kFloat32, {4, 2, 64, 8, 100});
  EXPECT_INVALID(validate(args), "out_partial", "multiple of 8 in [8, 256], got 100");

  args = dense_combine();
  args.out_partial = TensorView(dummy_data(), DType::kFloat32, {4, 2, 64, 8, 128},
                                {2 * 64 * 8 * 256, 64 * 8 * 256, 8 * 256, 256, 2});
  EXPECT_INVALID(validate(args), "out_partial", "expected the last dimension to be contiguous");
}

TEST_F(CombineValidation, RejectsWrongDtypesAndDevices) {
  CombineArgs args = dense_combine();
  args.out_partial.dtype = DType::kBFloat16;
  EXPECT_INVALID(validate(args), "out_partial",
                 "expected dtype float32 (partial results are accumulated in fp32), got bfloat16");

  args = dense_combine();
  args.lse_partial.dtype = DType::kFloat16;
  EXPECT_INVALID(validate(args), "lse_partial", "expected dtype float32, got float16");

  args = dense_combine();
  args.out.dtype = DType::kInt32;
  EXPECT_INVALID(validate(args), "out", "expected dtype float16, bfloat16 or float32, got int32");

  args = dense_combine();
  args.lse->dtype = DType::kBFloat16;
  EXPECT_INVALID(validate(args), "lse", "expected dtype float32, got bfloat16");

  args = dense_combine();
  args.out.device = kCuda0;
  EXPECT_INVALID(validate(args), "out",
                 "expected device cpu (the device of out_partial), got cuda:0");
}

TEST_F(CombineValidation, RejectsOutputsWhoseElementsShareMemory) {
  CombineArgs args = dense_combine();
  args.out = strided(DType::kBFloat16, {2, 64, 8, 128}, {64 * 8 * 128, 0, 128, 1});
  EXPECT_INVALID(validate(args), "out", "dimension 1 has size 64 and stride 0");

  args = dense_combine();
  args.out = strided(DType::kBFloat16, {2, 64, 8, 128}, {64 * 8 * 64, 8 * 64, 64, 1});
  EXPECT_INVALID(validate(args), "out",
                 "dimension 2 (stride 64) starts inside the span of dimension 3 (size 128 x "
                 "stride 1)");

  args = dense_combine();
  args.lse = strided(DType::kFloat32, {2, 64, 8}, {64 * 8, 8, 0});
  EXPECT_INVALID(validate(args), "lse", "dimension 2 has size 8 and stride 0");

  // The transposed layout of AcceptsValidInputs with heads 32 apart: 64 rows overlap.
  args = dense_combine();
  args.lse = strided(DType::kFloat32, {2, 64, 8}, {8 * 64, 1, 32});
  EXPECT_INVALID(validate(args), "lse",
                 "dimension 2 (stride 32) starts inside the span of dimension 1 (size 64 x "
                 "stride 1)");

  CombineArgs packed = varlen_combine();
  packed.out = strided(DType::kFloat32, {50, 8, 64}, {0, 64, 1});
  EXPECT_INVALID(validate(packed), "out", "dimension 0 has size 50 and stride 0");
}

TEST_F(CombineValidation, AcceptsPaddedAndPermutedOutputs) {
  CombineArgs args = dense_combine();
  // out padded to 256 elements per head; lse padded to 16 heads per row.
  args.out = strided(DType::kBFloat16, {2, 64, 8, 128}, {64 * 8 * 256, 8 * 256, 256, 1});
  args.lse = strided(DType::kFloat32, {2, 64, 8}, {64 * 16, 16, 1});
  EXPECT_NO_THROW(validate(args));

  // out in (batch, num_heads, seqlen, head_dim) memory.
  args = dense_combine();
  args.out = strided(DType::kBFloat16, {2, 64, 8, 128}, {8 * 64 * 128, 128, 64 * 128, 1});
  EXPECT_NO_THROW(validate(args));
}

TEST_F(CombineValidation, ChecksSequenceTensors) {
  CombineArgs args = dense_combine();
  args.cu_seqlens = int_tensor(cu_, {3});
  EXPECT_INVALID(validate(args), "cu_seqlens", "expected none with the dense");

  args = varlen_combine();
  args.seqused = int_tensor(used_, {1});
  EXPECT_INVALID(validate(args), "seqused", "expected shape (2,) (batch,), got (1,)");

  args = varlen_combine();
  args.cu_seqlens->dtype = DType::kFloat32;
  EXPECT_INVALID(validate(args), "cu_seqlens", "expected dtype int32, got float32");

  std::vector<std::int32_t> beyond{0, 30, 60};
  args = varlen_combine();
  args.cu_seqlens = int_tensor(beyond, {3});
  EXPECT_INVALID(validate(args), "cu_seqlens", "total = 50", "cu_seqlens[2] = 60");

  std::vector<std::int32_t> past_segment{31, 10};
  args = varlen_combine();
  args.seqused = int_tensor(past_segment, {2});
  EXPECT_INVALID(validate(args), "seqused", "expected seqused[0] in [0, 30], got 31");

  std::vector<std::int32_t> too_many{30, 21};
  args = varlen_combine();
  args.seqused = int_tensor(too_many, {2});
  EXPECT_INVALID(validate(args), "seqused", "expected seqused[1] in [0, 20], got 21");
}

TEST_F(CombineValidation, CombineValidatesBeforeRunning) {
  CombineArgs args = dense_combine();
  args.out = tensor(DType::kBFloat16, {2, 64, 8, 64});
  EXPECT_INVALID(combine(args), "out", "expected shape (2, 64, 8, 128)");
}

// What a caller's workspace allocator returns is checked as a given workspace is, before any
// device work: no memory, too few bytes and a misaligned pointer are refused by name.
TEST(Dispatch, WorkspaceAllocatorResultChecked) {
#if CUFLASH_HAS_CUDA
  const auto with = [](Workspace returned) {
    return [returned] {
      const WorkspaceAllocator allocate = [returned](std::size_t) { return returned; };
      detail::DeviceWorkspace workspace(Workspace{}, &allocate, 1024, nullptr);
    };
  };
  alignas(256) static char memory[2048];
  expect_error(with(Workspace{}), Error::Kind::kInvalidArgument, "workspace",
               {"the allocator returned no memory for 1024 bytes"});
  expect_error(with(Workspace{memory, 512}), Error::Kind::kInvalidArgument, "workspace",
               {"expected at least 1024 bytes, got 512"});
  expect_error(with(Workspace{memory + 16, 1024}), Error::Kind::kInvalidArgument, "workspace",
               {"256-byte aligned pointer"});
#else
  GTEST_SKIP() << "this build has no CUDA (no device workspace)";
#endif
}

// --- Builds without CUDA ------------------------------------------------------------------

TEST(Dispatch, DeviceTensorsNeedACudaBuild) {
#if CUFLASH_HAS_CUDA
  GTEST_SKIP() << "this build has CUDA";
#else
  const auto expect_not_built = [](const std::function<void()>& call) {
    expect_error(call, Error::Kind::kNotBuilt, "device",
                 {"built without CUDA", "CUFLASH_ENABLE_CUDA=OFF"});
  };
  const ForwardArgs fwd = dense_forward(DType::kBFloat16, kCuda0);
  const BackwardArgs bwd = dense_backward(DType::kBFloat16, kCuda0);
  const CombineArgs cmb = dense_combine(kCuda0);
  expect_not_built([&] { forward(fwd); });
  expect_not_built([&] { backward(bwd); });
  expect_not_built([&] { combine(cmb); });
  expect_not_built([&] { forward_workspace_size(fwd); });
  expect_not_built([&] { backward_workspace_size(bwd); });
  EXPECT_FALSE(cuda_available());
  EXPECT_TRUE(built_kernels().empty());

  // Validation still comes first.
  ForwardArgs bad = dense_forward(DType::kBFloat16, kCuda0);
  bad.k = tensor(DType::kBFloat16, {2, 128, 8, 32}, kCuda0);
  EXPECT_INVALID(forward(bad), "k", "expected shape (2, 128, 8, 64)");
#endif
}

TEST(Dispatch, ReportsVersion) { EXPECT_STREQ(version(), CUFLASH_PROJECT_VERSION); }

}  // namespace
}  // namespace cuflash
