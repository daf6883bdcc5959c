// Helpers for the GPU tests: device buffers, 16-bit conversions, the accuracy rule, test names
// and which kernels this build has.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuflash/cuflash.hpp"

namespace cuflash::gpu_testing {

inline const Device kCpu{};
inline const Device kCuda{DeviceType::kCUDA, 0};
inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The dtype as test names spell it.
inline const char* dtype_name(DType dtype) { return dtype == DType::kBFloat16 ? "bf16" : "fp16"; }

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

// DESIGN.md section 5: the GPU error against the fp32 reference may be at most twice the error
// of the same computation done naively in the input dtype, plus a small absolute slack for
// shapes where the naive computation happens to be exact (e.g. a single key).
struct ErrorStats {
  double max_error = 0.0;
  bool has_nan = false;
  bool inf_mismatch = false;
};

inline void accumulate_error(ErrorStats& stats, double actual, double expected) {
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
  EXPECT_FALSE(gpu_stats.has_nan) << what << ": NaN or unwritten element";
  EXPECT_FALSE(gpu_stats.inf_mismatch)
      << what << ": -inf where the reference is finite, or the reverse";
  EXPECT_FALSE(naive_stats.inf_mismatch)
      << what << ": the naive check disagrees with the reference on -inf";
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
  EXPECT_FALSE(gpu_stats.has_nan) << what << ": NaN or unwritten element";
  EXPECT_FALSE(gpu_stats.inf_mismatch)
      << what << ": inf where the reference is finite, or the reverse";
  const double slack = 1e-4;
  EXPECT_LE(gpu_stats.max_error, 2.0 * naive_stats.max_error + slack)
      << what << ": max error " << gpu_stats.max_error << ", naive " << naive_stats.max_error;
}

}  // namespace cuflash::gpu_testing
