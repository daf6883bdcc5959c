#if CUFLASH_HAS_CUDA

#include "api/device_workspace.hpp"

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "api/workspace_layout.hpp"
#include "cuflash/error.hpp"

namespace cuflash::detail {
namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(Error::Kind::kCuda, "device",
                std::string("device: ") + what + " failed: " + cudaGetErrorString(status));
  }
}

}  // namespace

DeviceGuard::DeviceGuard(int device_index) {
  check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device_index) {
    check_cuda(cudaSetDevice(device_index),
               ("cudaSetDevice(" + std::to_string(device_index) + ")").c_str());
  }
}

DeviceGuard::~DeviceGuard() {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
}

DeviceWorkspace::DeviceWorkspace(Workspace given, const WorkspaceAllocator* allocate, std::size_t bytes,
                                 StreamHandle stream)
    : stream_(stream) {
  if (bytes == 0) return;
  if (given.data == nullptr && allocate != nullptr && *allocate) {
    given = (*allocate)(bytes);
    if (given.data == nullptr) {
      throw Error(Error::Kind::kInvalidArgument, "workspace",
                  "workspace: the allocator returned no memory for " + std::to_string(bytes) + " bytes");
    }
  }
  if (given.data != nullptr) {
    if (given.bytes < bytes) {
      throw Error(Error::Kind::kInvalidArgument, "workspace",
                  "workspace: expected at least " + std::to_string(bytes) + " bytes, got " +
                      std::to_string(given.bytes));
    }
    if (reinterpret_cast<std::uintptr_t>(given.data) % kWorkspaceAlignment != 0) {
      throw Error(
          Error::Kind::kInvalidArgument, "workspace",
          "workspace: expected a 256-byte aligned pointer, got an offset of " +
              std::to_string(reinterpret_cast<std::uintptr_t>(given.data) % kWorkspaceAlignment) +
              " bytes");
    }
    data_ = given.data;
    return;
  }
  check_cuda(cudaMallocAsync(&data_, bytes, static_cast<cudaStream_t>(stream)),
             ("cudaMallocAsync of " + std::to_string(bytes) + " workspace bytes").c_str());
  owned_ = true;
}

DeviceWorkspace::~DeviceWorkspace() {
  if (owned_) cudaFreeAsync(data_, static_cast<cudaStream_t>(stream_));
}

}  // namespace cuflash::detail

#endif  // CUFLASH_HAS_CUDA
