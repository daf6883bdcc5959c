// cuflash public C++ API. Host-only: includes no CUDA, CuTe or framework header.
//
// CPU tensors run on the reference implementation; CUDA tensors run on the sm_90a
// kernels. All arguments are validated before any work starts; a bad argument or
// a configuration this build does not contain throws cuflash::Error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cuflash/error.hpp"
#include "cuflash/options.hpp"
#include "cuflash/tensor.hpp"

namespace cuflash {

// Bytes of device workspace each call needs (0 on CPU).
std::size_t forward_workspace_size(const ForwardArgs& args);
std::size_t backward_workspace_size(const BackwardArgs& args);

void forward(const ForwardArgs& args, StreamHandle stream = nullptr, Workspace workspace = {});
void backward(const BackwardArgs& args, StreamHandle stream = nullptr, Workspace workspace = {});

// The workspace from the caller's allocator: called once per call that needs workspace, with
// the bytes (> 0), on the calling thread after the arguments are checked and before any launch.
// It returns memory of at least that many bytes, 256-byte aligned, that work queued on `stream`
// may use until it completes: a stream-ordered allocator (PyTorch's caching allocator on the
// current stream, as the Python package passes) whose block the caller frees when the call
// returns. Without workspace to give (or with an empty allocator) a call takes stream-ordered
// memory of its own, as above.
using WorkspaceAllocator = std::function<Workspace(std::size_t bytes)>;
void forward(const ForwardArgs& args, StreamHandle stream, const WorkspaceAllocator& allocate);
void backward(const BackwardArgs& args, StreamHandle stream, const WorkspaceAllocator& allocate);
void combine(const CombineArgs& args, StreamHandle stream = nullptr);

// Check arguments only (what forward/backward/combine do first).
void validate(const ForwardArgs& args);
void validate(const BackwardArgs& args);
void validate(const CombineArgs& args);

// The head dims of the compiled sm90 kernel that runs a call with these (forward and backward):
// the smallest of 64, 96, 128, 192, 256 that holds both, except that a head_dim in (128, 192]
// with head_dim_v <= 128 runs the 192x128 kernel. Dispatch picks kernels by this rule, and
// kernel modules compiled at run time must instantiate the same dims to stand in for them, so
// it lives in one place. {0, 0} when either is over 256 (no kernel holds it).
struct KernelHeadDims {
  int head_dim = 0;
  int head_dim_v = 0;
};
KernelHeadDims kernel_head_dims(int head_dim, int head_dim_v);

// Which kernel configurations this build holds, e.g. "fwd bf16 hdim128".
std::vector<std::string> built_kernels();
bool cuda_available();  // a CUDA device is present and usable
// A tag of the kernel parameter layouts: kernel modules compiled at run time for expression
// mods (AttentionOptions::expression_*_kernel) must have been built against the same one.
std::uint64_t kernel_params_abi();
const char* version();

}  // namespace cuflash
