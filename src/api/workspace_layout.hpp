// Buffers laid out one after another in one device workspace, each starting at a 256-byte
// boundary: TMA and the kernels' vector accesses need 16 bytes, 256 keeps every buffer on its
// own cache lines, and the caller's workspace is checked for the same alignment
// (device_workspace.cpp), so an offset aligned here is an address aligned there.
#pragma once

#include <cstddef>

namespace cuflash {

constexpr std::size_t kWorkspaceAlignment = 256;

constexpr std::size_t workspace_aligned(std::size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

// Hands out aligned byte offsets in order; total() is the workspace size the buffers need.
class WorkspaceLayoutBuilder {
 public:
  std::size_t take(std::size_t bytes) {
    std::size_t const at = offset_;
    offset_ += workspace_aligned(bytes);
    return at;
  }
  std::size_t total() const { return offset_; }

 private:
  std::size_t offset_ = 0;
};

}  // namespace cuflash
