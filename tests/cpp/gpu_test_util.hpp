// Helpers for the GPU tests: device buffers, 16-bit conversions, poisoned outputs, the accuracy
// rule, test names, which kernels this build has and the skip where a kernel is not in it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuflash/cuflash.hpp"

namespace cuflash::gpu_testing {

inline const Device kCpu{};
inline const Device kCuda{DeviceType::kCUDA, 0};
inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// An environment setting for one scope (a per-call switch such as CUFLASH_FWD_ZERO_V_TAIL), put
// back as it was afterwards.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) saved_ = old;
    setenv(name, value, 1);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), saved_.c_str(), 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_, saved_;
  bool had_ = false;
};

// The dtype as test names spell it.
inline const char* dtype_name(DType dtype) { return dtype == DType::kBFloat16 ? "bf16" : "fp16"; }

// The test name of a case: label, dtype and head dims, e.g. "causal_bf16_d192x128".
inline std::string case_name(const std::string& label, DType dtype, int head_dim, int head_dim_v) {
  std::ostringstream name;
  name << label << "_" << gpu_testing::dtype_name(dtype) << "_d" << head_dim;
  if (head_dim_v != head_dim) name << "x" << head_dim_v;
  return name.str();
}

// Name generator for INSTANTIATE_TEST_SUITE_P: the case_name() of the case's own type, found by
// argument-dependent lookup in the test file.
struct CaseName {
  template <class Case>
  std::string operator()(const ::testing::TestParamInfo<Case>& info) const {
    return case_name(info.param);
  }
};

// Whether built_kernels() lists this description (a kernel this build compiled).
inline bool is_built(const std::string& description) {
  const std::vector<std::string> built = built_kernels();
  return std::find(built.begin(), built.end(), description) != built.end();
}

inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// Owning device allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) check_cuda(cudaMalloc(&data_, bytes_), "cudaMalloc");
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  void* data() const { return data_; }

  template <class T>
  static DeviceBuffer from(const std::vector<T>& host) {
    DeviceBuffer buffer(host.size() * sizeof(T));
    if (!host.empty())
      check_cuda(cudaMemcpy(buffer.data_, host.data(), buffer.bytes_, cudaMemcpyHostToDevice),
                 "cudaMemcpy");
    return buffer;
  }

  template <class T>
  std::vector<T> to_host() const {
    std::vector<T> host(bytes_ / sizeof(T));
    if (!host.empty())
      check_cuda(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy");
    return host;
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

inline std::uint16_t to_bits(float x, DType dtype) {
  if (dtype == DType::kBFloat16) return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(x)).x;
  return static_cast<__half_raw>(__float2half_rn(x)).x;
}

inline float from_bits(std::uint16_t bits, DType dtype) {
  if (dtype == DType::kBFloat16) {
    __nv_bfloat16_raw raw;
    raw.x = bits;
    return __bfloat162float(__nv_bfloat16(raw));
  }
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}

inline float round_to(float x, DType dtype) { return from_bits(to_bits(x, dtype), dtype); }

// values rounded to the dtype, as 16-bit elements in device memory.
inline DeviceBuffer to_device_16bit(const std::vector<float>& values, DType dtype) {
  std::vector<std::uint16_t> bits(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) bits[i] = to_bits(values[i], dtype);
  return DeviceBuffer::from(bits);
}

// values in device memory as `dtype`: fp32 as they are, a 16-bit dtype rounded.
inline DeviceBuffer to_device_as(const std::vector<float>& values, DType dtype) {
  return dtype == DType::kFloat32 ? DeviceBuffer::from(values) : to_device_16bit(values, dtype);
}

// 16-bit elements in device memory, widened.
inline std::vector<double> from_device_16bit(const DeviceBuffer& buffer, DType dtype) {
  std::vector<double> values;
  for (std::uint16_t bits : buffer.to_host<std::uint16_t>())
    values.push_back(from_bits(bits, dtype));
  return values;
}

// A quiet NaN in both float16 and bfloat16: outputs start as this, so an element the kernel
// never writes shows up as NaN.
constexpr std::uint16_t kPoison16 = 0xffff;

// count 16-bit outputs, every one kPoison16.
inline DeviceBuffer poisoned_16bit(std::size_t count) {
  return DeviceBuffer::from(std::vector<std::uint16_t>(count, kPoison16));
}

// The backward on a workspace of the caller's that starts as 0xff bytes (NaN floats, -1 ints):
// a workspace row the kernels read without writing or clearing it first shows up as NaN.
inline void backward_on_poisoned_workspace(const BackwardArgs& args) {
  const std::size_t bytes = backward_workspace_size(args);
  DeviceBuffer workspace(bytes);
  if (bytes > 0) check_cuda(cudaMemset(workspace.data(), 0xff, bytes), "cudaMemset (workspace poison)");
  backward(args, nullptr, Workspace{workspace.data(), bytes});
  check_cuda(cudaDeviceSynchronize(), "backward kernels");
}

// count fp32 outputs (lse, d_sink), every one NaN.
inline DeviceBuffer poisoned_fp32(std::size_t count) {
  return DeviceBuffer::from(std::vector<float>(count, std::nanf("")));
}

// vectors head vectors of dim values each, rounded to the dtype, with `pad` elements of
// kPoison16 after each: a strided layout whose gaps show whether a kernel wrote into them.
inline DeviceBuffer to_device_16bit_padded(const std::vector<float>& values, std::size_t vectors,
                                           int dim, int pad, DType dtype) {
  std::vector<std::uint16_t> bits(vectors * (dim + pad), kPoison16);
  for (std::size_t i = 0; i < vectors; ++i) {
    for (int d = 0; d < dim; ++d) bits[i * (dim + pad) + d] = to_bits(values[i * dim + d], dtype);
  }
  return DeviceBuffer::from(bits);
}

// run()'s result, or nullopt with the test marked skipped (the error's message as the reason)
// where the build does not have the kernel the call needs. The caller returns on nullopt.
template <class Run>
auto run_if_built(Run&& run) -> std::optional<decltype(run())> {
  try {
    return run();
  } catch (const Error& error) {
    if (error.kind() != Error::Kind::kNotBuilt) throw;
    // GTEST_SKIP returns from the function it is in, hence the lambda.
    [&] { GTEST_SKIP() << error.what(); }();
    return std::nullopt;
  }
}

inline void call(const ForwardArgs& args) { forward(args); }
inline void call(const BackwardArgs& args) { backward(args); }

// The call is refused as not supported, naming `argument`.
template <class Args>
void expect_not_supported(const Args& args, const std::string& argument) {
  try {
    call(args);
    ADD_FAILURE() << "the call ran";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), Error::Kind::kNotSupported) << error.what();
    EXPECT_EQ(error.argument(), argument) << error.what();
  }
}

// DESIGN.md section 5: the GPU error against the fp32 reference may be at most twice the error
// of the same computation done naively in the input dtype, plus a small absolute slack for
// shapes where the naive computation happens to be exact (e.g. a single key).
struct ErrorStats {
  double max_error = 0.0;
  bool has_nan = false;
  bool inf_mismatch = false;
  bool reference_nan = false;  // a NaN in the reference would compare with nothing
};

inline void accumulate_error(ErrorStats& stats, double actual, double expected) {
  if (std::isnan(expected)) {
    stats.reference_nan = true;
    return;
  }
  if (std::isnan(actual)) {
    stats.has_nan = true;
    return;
  }
  if (std::isinf(expected) || std::isinf(actual)) {
    if (actual != expected) stats.inf_mismatch = true;
    return;
  }
  stats.max_error = std::max(stats.max_error, std::fabs(actual - expected));
}

// The rule's tolerance comes from the naive computation's error: a naive computation that is
// itself wrong would widen it without bound. Its error must stay within a quarter of the
// reference's largest finite magnitude (low-precision rounding is a few percent at most).
inline void expect_naive_sane(const char* what, const ErrorStats& naive, const std::vector<double>& ref) {
  double scale = 0.0;
  for (double x : ref)
    if (std::isfinite(x)) scale = std::max(scale, std::fabs(x));
  EXPECT_LE(naive.max_error, 0.25 * scale + 1e-3)
      << what << ": the naive computation is off by " << naive.max_error << " (reference magnitude " << scale
      << "): the test's own check is broken";
}

// The rule for forward outputs (out, lse): the naive computation must also agree with the
// reference on which elements are -inf.
inline void expect_output_close(const char* what, const std::vector<double>& gpu,
                                const std::vector<double>& naive, const std::vector<double>& ref) {
  ASSERT_EQ(gpu.size(), ref.size()) << what;
  ErrorStats gpu_stats, naive_stats;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    accumulate_error(gpu_stats, gpu[i], ref[i]);
    accumulate_error(naive_stats, naive[i], ref[i]);
  }
  EXPECT_FALSE(gpu_stats.reference_nan) << what << ": NaN in the reference";
  EXPECT_FALSE(gpu_stats.has_nan) << what << ": NaN or unwritten element";
  EXPECT_FALSE(gpu_stats.inf_mismatch)
      << what << ": -inf where the reference is finite, or the reverse";
  EXPECT_FALSE(naive_stats.inf_mismatch)
      << what << ": the naive check disagrees with the reference on -inf";
  expect_naive_sane(what, naive_stats, ref);
  const double slack = 1e-4;
  EXPECT_LE(gpu_stats.max_error, 2.0 * naive_stats.max_error + slack)
      << what << ": max error " << gpu_stats.max_error << ", naive " << naive_stats.max_error;
}

// The rule for gradients (dq, dk, dv, d_sink).
inline void expect_grad_close(const char* what, const std::vector<double>& gpu,
                              const std::vector<double>& naive, const std::vector<double>& ref) {
  ASSERT_EQ(gpu.size(), ref.size()) << what;
  ASSERT_EQ(naive.size(), ref.size()) << what;
  ErrorStats gpu_stats, naive_stats;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    accumulate_error(gpu_stats, gpu[i], ref[i]);
    accumulate_error(naive_stats, naive[i], ref[i]);
  }
  EXPECT_FALSE(gpu_stats.reference_nan) << what << ": NaN in the reference";
  EXPECT_FALSE(gpu_stats.has_nan) << what << ": NaN or unwritten element";
  EXPECT_FALSE(gpu_stats.inf_mismatch)
      << what << ": inf where the reference is finite, or the reverse";
  expect_naive_sane(what, naive_stats, ref);
  const double slack = 1e-4;
  EXPECT_LE(gpu_stats.max_error, 2.0 * naive_stats.max_error + slack)
      << what << ": max error " << gpu_stats.max_error << ", naive " << naive_stats.max_error;
}

}  // namespace cuflash::gpu_testing
