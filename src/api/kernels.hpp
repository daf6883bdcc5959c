// Entry points into the device kernels (src/sm90), callable from host-only code.
// Defined by the CUDA part of the library; absent when cuflash is built without nvcc.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "api/params.hpp"
#include "cuflash/tensor.hpp"

namespace cuflash::sm90 {

// Throws cuflash::Error(kNotSupported) naming the argument the kernels cannot take, or
// kNotBuilt naming the CMake option when the configuration (dtype, head dims, features) was
// not compiled into this build. Called before the workspace is sized or allocated.
void check_forward_supported(const FwdParams& params);
// Launches the forward of params that passed check_forward_supported (with the workspace
// carved); a kernel not in the build still throws kNotBuilt.
void run_forward(FwdParams& params, StreamHandle stream);
// Whether the forward kernel that `params` (num_splits included) would launch is in this build.
bool forward_kernel_built(const FwdParams& params);
// after_forward: the combine of a split-KV forward just launched on the same stream, started as
// that kernel's programmatic dependent (its launch overlaps the forward's last CTAs).
void run_combine(const CombineParams& params, StreamHandle stream, bool after_forward = false);
void run_backward(BwdParams& params, StreamHandle stream);
std::size_t backward_workspace_bytes(const BwdParams& params);
// Whether the backward kernel that `params` would launch is in this build.
bool backward_kernel_built(const BwdParams& params);
// kNotBuilt naming the build options when it is not (dispatch calls it before the caller's
// allocator runs; a kernel module compiled at run time for expression mods stands in for it).
void check_backward_built(const BwdParams& params);
// The backward with paged k/v (params.page_table): the pages gathered into dense rows, the
// backward above on them, the gradients summed back into the pages (paged_bwd_sm90.cu).
void run_paged_backward(BwdParams& params, StreamHandle stream);
std::size_t paged_backward_workspace_bytes(const BwdParams& params);
// Block lists of a document mask (MaskModKind::kDocument, ids in mask_mod.aux[0]) built on the
// GPU into `workspace` (document_block_lists_bytes of it) for the block sizes and counts that
// `bs` holds; sets bs's list pointers. See document_block_lists_sm90.cu.
std::size_t document_block_lists_bytes(const BlockSparseParams& bs, int batch);
void build_document_block_lists(BlockSparseParams& bs, const ModParams& mask_mod, int batch, int seqlen_q,
                                int seqlen_k, void* workspace, StreamHandle stream);
std::vector<std::string> built_kernels();
// The backward ones, e.g. "bwd bf16 hdim128" (defined with the backward dispatch).
std::vector<std::string> built_backward_kernels();
// Whether some device is a Hopper GPU (sm_90); whether device `device_index` is one.
bool device_available();
bool device_is_hopper(int device_index);
int device_sm_count(int device_index);

}  // namespace cuflash::sm90
