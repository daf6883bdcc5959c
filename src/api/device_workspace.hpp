// Device-side helpers of dispatch (CUDA builds only): the current-device guard and the
// workspace that a call uses, the caller's or one allocated on the stream.
#pragma once

#include <cstddef>

#include "cuflash/cuflash.hpp"
#include "cuflash/tensor.hpp"

namespace cuflash::detail {

// Makes `device_index` current for its lifetime and restores the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device_index);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// `bytes` of device memory: the caller's workspace when it is given, else, with an allocator
// (not null, not empty), what it returns for `bytes` (either must be large enough and 256-byte
// aligned), else stream-ordered memory freed on the same stream afterwards.
class DeviceWorkspace {
 public:
  DeviceWorkspace(Workspace given, const WorkspaceAllocator* allocate, std::size_t bytes, StreamHandle stream);
  ~DeviceWorkspace();
  DeviceWorkspace(const DeviceWorkspace&) = delete;
  DeviceWorkspace& operator=(const DeviceWorkspace&) = delete;

  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  bool owned_ = false;
  StreamHandle stream_ = nullptr;
};

}  // namespace cuflash::detail
