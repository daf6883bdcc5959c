#include <sstream>
#include <string>

#include "cuflash/error.hpp"
#include "cuflash/tensor.hpp"

namespace cuflash {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kInt32: return "int32";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32: return 4;
  }
  return 0;
}

std::string device_name(const Device& device) {
  return device.type == DeviceType::kCPU ? std::string("cpu") : "cuda:" + std::to_string(device.index);
}

namespace {

// The shape and stride arrays hold kMaxDims entries: longer lists would be written past them.
void check_dims(std::size_t shape_size, std::size_t stride_size) {
  if (shape_size > static_cast<std::size_t>(kMaxDims)) {
    throw Error(Error::Kind::kInvalidArgument, "shape",
                "shape: expected at most " + std::to_string(kMaxDims) + " dimensions, got " +
                    std::to_string(shape_size));
  }
  if (stride_size != shape_size) {
    throw Error(Error::Kind::kInvalidArgument, "stride",
                "stride: expected one stride per dimension (" + std::to_string(shape_size) +
                    "), got " + std::to_string(stride_size));
  }
}

}  // namespace

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<std::int64_t> shape_, Device device_)
    : data(data_), dtype(dtype_), ndim(static_cast<int>(shape_.size())), device(device_) {
  check_dims(shape_.size(), shape_.size());
  int i = 0;
  for (std::int64_t s : shape_) shape[i++] = s;
  std::int64_t running = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    stride[d] = running;
    running *= shape[d];
  }
}

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<std::int64_t> shape_,
                       std::initializer_list<std::int64_t> stride_, Device device_)
    : data(data_), dtype(dtype_), ndim(static_cast<int>(shape_.size())), device(device_) {
  check_dims(shape_.size(), stride_.size());
  int i = 0;
  for (std::int64_t s : shape_) shape[i++] = s;
  i = 0;
  for (std::int64_t s : stride_) stride[i++] = s;
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  // No element, no layout to check (NumPy's DLPack export gives an empty array's strides as 0).
  if (numel() == 0) return true;
  std::int64_t running = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != running) return false;
    running *= shape[d];
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::ostringstream os;
  os << "(";
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
  if (ndim == 1) os << ",";
  os << ")";
  return os.str();
}

}  // namespace cuflash
