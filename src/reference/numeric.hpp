// Scalar conversions and strided element access for the CPU reference. No CUDA headers:
// fp16 / bf16 are handled as raw 16-bit patterns.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "cuflash/tensor.hpp"

namespace cuflash::reference {

inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in float.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  std::uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// Round to nearest even, overflow to infinity, NaN stays NaN.
inline std::uint16_t float_to_half(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) {
    return sign | (magnitude > 0x7f800000u ? 0x7e00u : 0x7c00u);
  }
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (magnitude < 0x38800000u) {
    // Below 2^-14: a subnormal half, in units of 2^-24. The scaling is exact and
    // nearbyint rounds half to even in the default rounding mode.
    float abs_value;
    std::memcpy(&abs_value, &magnitude, sizeof(abs_value));
    const float units = std::nearbyint(abs_value * 16777216.0f);
    return sign | static_cast<std::uint16_t>(units);
  }
  std::uint32_t half = ((((magnitude >> 23) - 112u) << 10) | ((magnitude >> 13) & 0x3ffu));
  const std::uint32_t rest = magnitude & 0x1fffu;
  // A carry out of the mantissa correctly bumps the exponent.
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return sign | static_cast<std::uint16_t>(half);
}

inline float bfloat16_to_float(std::uint16_t h) {
  const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

inline std::uint16_t float_to_bfloat16(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}

// Element `offset` (in elements, from t.data) of a floating-point or int32 tensor.
inline double load(const TensorView& t, std::int64_t offset) {
  switch (t.dtype) {
    case DType::kFloat16:
      return half_to_float(static_cast<const std::uint16_t*>(t.data)[offset]);
    case DType::kBFloat16:
      return bfloat16_to_float(static_cast<const std::uint16_t*>(t.data)[offset]);
    case DType::kFloat32:
      return static_cast<const float*>(t.data)[offset];
    case DType::kInt32:
      return static_cast<const std::int32_t*>(t.data)[offset];
  }
  return 0.0;
}

inline void store(const TensorView& t, std::int64_t offset, double value) {
  const float f = static_cast<float>(value);
  switch (t.dtype) {
    case DType::kFloat16:
      static_cast<std::uint16_t*>(t.data)[offset] = float_to_half(f);
      return;
    case DType::kBFloat16:
      static_cast<std::uint16_t*>(t.data)[offset] = float_to_bfloat16(f);
      return;
    case DType::kFloat32:
      static_cast<float*>(t.data)[offset] = f;
      return;
    case DType::kInt32:
      static_cast<std::int32_t*>(t.data)[offset] = static_cast<std::int32_t>(value);
      return;
  }
}

inline std::int64_t load_int(const TensorView& t, std::int64_t offset) {
  return static_cast<const std::int32_t*>(t.data)[offset];
}

inline std::int64_t offset_of(const TensorView& t, std::initializer_list<std::int64_t> index) {
  std::int64_t offset = 0;
  int dim = 0;
  for (std::int64_t i : index) offset += i * t.stride[dim++];
  return offset;
}

// The view of t[index] (drops the leading dimension).
inline TensorView select_first(const TensorView& t, std::int64_t index) {
  TensorView result = t;
  result.data = static_cast<char*>(t.data) +
                index * t.stride[0] * static_cast<std::int64_t>(dtype_size(t.dtype));
  result.ndim = t.ndim - 1;
  for (int d = 0; d < result.ndim; ++d) {
    result.shape[d] = t.shape[d + 1];
    result.stride[d] = t.stride[d + 1];
  }
  return result;
}

// The view with dimensions a and b exchanged (no data movement).
inline TensorView swap_dims(const TensorView& t, int a, int b) {
  TensorView result = t;
  result.shape[a] = t.shape[b];
  result.shape[b] = t.shape[a];
  result.stride[a] = t.stride[b];
  result.stride[b] = t.stride[a];
  return result;
}

}  // namespace cuflash::reference
