// Non-owning tensor view: the only way tensors cross the cuflash API.
// Host-only header: no CUDA, CuTe or framework types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace cuflash {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kInt32 = 3 };

enum class DeviceType : int { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool operator==(const Device& other) const { return type == other.type && index == other.index; }
  bool operator!=(const Device& other) const { return !(*this == other); }
};

const char* dtype_name(DType dtype);
std::size_t dtype_size(DType dtype);
std::string device_name(const Device& device);

constexpr int kMaxDims = 6;

// Strides are in elements, not bytes. Shape entries may be zero (empty tensor,
// data may then be null).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int ndim = 0;
  std::int64_t shape[kMaxDims] = {};
  std::int64_t stride[kMaxDims] = {};
  Device device{};

  TensorView() = default;
  // Both constructors throw cuflash::Error for more than kMaxDims sizes or, in the strided
  // one, a stride count that differs from the size count.
  // Contiguous (row-major) view.
  TensorView(void* data_, DType dtype_, std::initializer_list<std::int64_t> shape_, Device device_ = {});
  // Strided view.
  TensorView(void* data_, DType dtype_, std::initializer_list<std::int64_t> shape_,
             std::initializer_list<std::int64_t> stride_, Device device_ = {});

  std::int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  std::int64_t stride_of(int dim) const { return stride[dim < 0 ? dim + ndim : dim]; }
  std::int64_t numel() const;
  bool is_contiguous() const;
  bool is_cuda() const { return device.type == DeviceType::kCUDA; }
  // "(2, 128, 8, 64)"
  std::string shape_string() const;
};

// Workspace the caller may hand in (device memory of at least forward_workspace_size /
// backward_workspace_size bytes, 256-byte aligned); when empty, cuflash allocates on the stream.
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

// An opaque cudaStream_t (null means the legacy default stream).
using StreamHandle = void*;

}  // namespace cuflash
