// Public entry points: validate, then run on the CPU reference (host tensors) or on the sm90
// kernels (device tensors). Device memory never falls back to the CPU.
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "api/params_builder.hpp"
#include "api/validate.hpp"
#include "cuflash/cuflash.hpp"
#include "reference/reference.hpp"

#if CUFLASH_HAS_CUDA
#include "api/device_workspace.hpp"
#include "api/host_index_check.hpp"
#include "api/kernels.hpp"
#endif

#ifndef CUFLASH_VERSION_STRING
#define CUFLASH_VERSION_STRING "0.1.0"  // keep in step with project(VERSION) in CMakeLists.txt
#endif

namespace cuflash {
namespace {

bool on_cpu(const Device& device) { return device.type == DeviceType::kCPU; }

#if CUFLASH_HAS_CUDA

// The tensors' device must be a Hopper GPU: another GPU of the same host would fail at the
// launch with a bare CUDA error.
void require_device(const Device& device) {
  if (!sm90::device_available()) {
    throw Error(Error::Kind::kCuda, "device",
                "device: CUDA tensors were passed but no usable Hopper (sm_90) CUDA device was "
                "found");
  }
  if (!sm90::device_is_hopper(device.index)) {
    throw Error(Error::Kind::kNotSupported, "q",
                "q: the tensors are on CUDA device " + std::to_string(device.index) +
                    ", which is not a Hopper (sm_90) GPU; cuflash's kernels run on sm_90 only");
  }
}

// Expression programs (score_mod / mask_mod callables) run on the GPU only through kernels
// compiled for them at run time (AttentionOptions::expression_*_kernel, python/cuflash/_jit.py):
// the library's own sm90 kernels hold only the built-in mods.
void refuse_expression_mods(const AttentionOptions& opts, std::uintptr_t expression_kernel) {
  if (expression_kernel != 0) return;
  auto refuse = [](const std::string& argument) {
    throw Error(Error::Kind::kNotSupported, argument,
                argument + ": expression programs (Python callables) run on the GPU only through a "
                           "kernel compiled for them (AttentionOptions::expression_forward_kernel / "
                           "expression_backward_kernel, as cuflash._jit builds); the library's sm90 "
                           "kernels take the built-in " + argument + "s");
  };
  if (opts.score_mod.kind == ScoreModKind::kExpression) refuse("score_mod");
  if (opts.mask_mod.kind == MaskModKind::kExpression) refuse("mask_mod");
}

// Forward parameters with the device facts: SM count and split count. `fold`: a causal /
// sliding-window mask_mod folded into the window where it is one (detail::fold_window_mask_mod).
FwdParams device_fwd_params(const ForwardArgs& args, const detail::AttentionShape& shape, bool fold) {
  refuse_expression_mods(args.opts, args.opts.expression_forward_kernel);
  FwdParams params = detail::make_fwd_params(args, shape);
  if (fold) detail::fold_window_mask_mod(params);
  params.num_sm = sm90::device_sm_count(shape.device.index);
  params.short_kernel = detail::fwd_short_kernel();
  params.row_block_list_mode = detail::fwd_row_block_list();
  params.row_block_list_order = detail::fwd_row_block_list_order();
  params.zero_v_tail = detail::fwd_zero_v_tail(params);
  params.num_splits = detail::choose_num_splits(params, args.num_splits, params.num_sm);
  // The heuristics may only pick kernels the build has; an explicit request that the build
  // cannot run still fails by name in run_forward. Splits left to the heuristic whose packed
  // kernel is missing (CUFLASH_FEATURES without packgqa, or a kernel set such as ci that keeps
  // the plain packed kernel only) first try unpacked tiles, for which the split count is
  // counted again, then one split.
  if (args.num_splits <= 0 && params.num_splits > 1 && !sm90::forward_kernel_built(params)) {
    if (params.pack_gqa && !params.pack_gqa_requested) {
      params.pack_gqa = false;
      params.num_splits = detail::choose_num_splits(params, args.num_splits, params.num_sm);
    }
    if (params.num_splits > 1 && !sm90::forward_kernel_built(params)) params.num_splits = 1;
  }
  // Likewise packed GQA left to the heuristic: unpacked where this build has no packed kernel
  // for the call.
  if (params.pack_gqa && !params.pack_gqa_requested && !sm90::forward_kernel_built(params))
    params.pack_gqa = false;
  // Document masks: block lists built from the ids (detail::document_lists_apply) where the call
  // runs unsplit (the split count is chosen from the keys each row block visits, which the host
  // cannot count through lists) and packed tiles, if any, can read them.
  if (params.num_splits == 1 &&
      detail::document_lists_apply(args.opts, args.seq, shape, args.opts.expression_forward_kernel)) {
    FwdParams listed = params;
    detail::plan_document_block_lists(listed.block_sparse, shape, /*backward=*/false);
    if (!listed.pack_gqa || detail::block_lists_refuse_packing(listed).empty()) params = listed;
  }
  params.stream_k_ctas = detail::fwd_stream_k_ctas(params);
  return params;
}

// Whether the call's mask_mod was folded into a window (it then runs on the plain kernels; a
// build without the plain kernel for the call, CUFLASH_FEATURES / CUFLASH_KERNEL_REGEX, runs the
// flex kernel as before). The kernel tables are searched only for folded calls.
bool mask_mod_folded(const AttentionOptions& opts, const ModParams& mask_mod) {
  return opts.mask_mod.kind != MaskModKind::kNone && mask_mod.kind == 0;
}

FwdParams device_fwd_params(const ForwardArgs& args, const detail::AttentionShape& shape) {
  FwdParams params = device_fwd_params(args, shape, /*fold=*/true);
  if (mask_mod_folded(args.opts, params.mask_mod) && !sm90::forward_kernel_built(params))
    params = device_fwd_params(args, shape, /*fold=*/false);
  return params;
}

BwdParams device_bwd_params(const BackwardArgs& args, const detail::AttentionShape& shape) {
  refuse_expression_mods(args.opts, args.opts.expression_backward_kernel);
  BwdParams params = detail::make_bwd_params(args, shape);
  BwdParams const unfolded = params;
  if (detail::fold_window_mask_mod(params) && !sm90::backward_kernel_built(params)) params = unfolded;
  params.num_sm = sm90::device_sm_count(shape.device.index);
  BwdLaunchChoice const launch = detail::bwd_launch_order();
  params.launch_order = static_cast<int>(launch.order);
  params.launch_head_group = launch.head_group;
  params.dq_path = static_cast<int>(detail::bwd_dq_path());
  params.det_walk = static_cast<int>(detail::bwd_det_walk());
  params.dq_convert = static_cast<int>(detail::bwd_dq_convert());
  params.dq_clear = static_cast<int>(detail::bwd_dq_clear());
  params.block_list = static_cast<int>(detail::bwd_block_list());
  params.dq_semaphore_stride = detail::dq_semaphore_stride(detail::bwd_dq_semaphores());
  if (detail::document_lists_apply(args.opts, args.seq, shape, args.opts.expression_backward_kernel))
    detail::plan_document_block_lists(params.block_sparse, shape, /*backward=*/true);
  return params;
}

// Bytes of the document block lists that dispatch builds at the start of the workspace, before
// the kernels' own buffers (0 where the call has none to build: no document mask, or the
// caller's lists).
std::size_t document_lists_bytes(const AttentionOptions& opts, const BlockSparseParams& bs, int batch) {
  return bs.enabled && !opts.block_sparse ? sm90::document_block_lists_bytes(bs, batch) : 0;
}

template <class Params>
void build_document_lists(Params& params, std::size_t bytes, void* workspace, StreamHandle stream) {
  if (bytes == 0) return;
  sm90::build_document_block_lists(params.block_sparse, params.mask_mod, params.batch, params.seqlen_q,
                                   params.seqlen_k, workspace, stream);
}

#else

[[noreturn]] void throw_not_built() {
  throw Error(Error::Kind::kNotBuilt, "device",
              "device: CUDA tensors were passed, but cuflash was built without CUDA (nvcc not "
              "found or CUFLASH_ENABLE_CUDA=OFF); rebuild with the CUDA toolkit and "
              "-DCUFLASH_ENABLE_CUDA=ON, or pass CPU tensors");
}

#endif

}  // namespace

std::size_t forward_workspace_size(const ForwardArgs& args) {
  const detail::AttentionShape shape = detail::check_forward(args);
  if (on_cpu(shape.device)) return 0;
#if CUFLASH_HAS_CUDA
  require_device(shape.device);
  detail::DeviceGuard guard(shape.device.index);
  const FwdParams params = device_fwd_params(args, shape);
  // Unsupported calls fail here already, as forward would (which has nothing to run without
  // query rows).
  if (args.out.numel() > 0) sm90::check_forward_supported(params);
  return document_lists_bytes(args.opts, params.block_sparse, params.batch) +
         detail::forward_workspace_bytes(params, detail::fwd_scheduler());
#else
  throw_not_built();
#endif
}

std::size_t backward_workspace_size(const BackwardArgs& args) {
  const detail::AttentionShape shape = detail::check_backward(args);
  if (on_cpu(shape.device)) return 0;
#if CUFLASH_HAS_CUDA
  require_device(shape.device);
  detail::DeviceGuard guard(shape.device.index);
  const BwdParams params = device_bwd_params(args, shape);
  return document_lists_bytes(args.opts, params.block_sparse, params.batch) +
         (shape.paged ? sm90::paged_backward_workspace_bytes(params) : sm90::backward_workspace_bytes(params));
#else
  throw_not_built();
#endif
}

namespace {

void run_forward_call(const ForwardArgs& args, StreamHandle stream, Workspace workspace,
                      const WorkspaceAllocator* allocate) {
  const detail::AttentionShape shape = detail::check_forward(args);
  if (on_cpu(shape.device)) {
    reference::forward(args);
    return;
  }
#if CUFLASH_HAS_CUDA
  require_device(shape.device);
  detail::DeviceGuard guard(shape.device.index);
  if (detail::check_inputs_on_host()) detail::check_index_values_on_host(args, stream);
  FwdParams params = device_fwd_params(args, shape);
  if (args.out.numel() == 0) return;  // no query rows: nothing to write
  // Before the caller's allocator and the document lists' kernel: an unsupported call fails
  // with nothing allocated or launched.
  sm90::check_forward_supported(params);
  detail::FwdScheduler const scheduler = detail::fwd_scheduler();
  std::size_t const list_bytes = document_lists_bytes(args.opts, params.block_sparse, params.batch);
  detail::DeviceWorkspace buffers(workspace, allocate,
                                  list_bytes + detail::forward_workspace_bytes(params, scheduler), stream);
  char* const base = static_cast<char*>(buffers.data());
  build_document_lists(params, list_bytes, base, stream);
  detail::assign_forward_workspace(params, base == nullptr ? nullptr : base + list_bytes, scheduler);
  sm90::run_forward(params, stream);
  if (params.num_splits > 1) {
    sm90::run_combine(detail::make_split_combine_params(params, args, shape), stream,
                      /*after_forward=*/true);
  }
#else
  (void)stream;
  (void)workspace;
  (void)allocate;
  throw_not_built();
#endif
}

void run_backward_call(const BackwardArgs& args, StreamHandle stream, Workspace workspace,
                       const WorkspaceAllocator* allocate) {
  const detail::AttentionShape shape = detail::check_backward(args);
  if (on_cpu(shape.device)) {
    reference::backward(args);
    return;
  }
#if CUFLASH_HAS_CUDA
  require_device(shape.device);
  detail::DeviceGuard guard(shape.device.index);
  if (detail::check_inputs_on_host()) detail::check_index_values_on_host(args, stream);
  BwdParams params = device_bwd_params(args, shape);
  // Before the caller's allocator (as the forward): a kernel not in the build fails with nothing
  // allocated or launched.
  sm90::check_backward_built(params);
  // Paged k/v: gathered into dense rows in the workspace, the gradients summed back into pages.
  const std::size_t list_bytes = document_lists_bytes(args.opts, params.block_sparse, params.batch);
  const std::size_t bytes =
      shape.paged ? sm90::paged_backward_workspace_bytes(params) : sm90::backward_workspace_bytes(params);
  detail::DeviceWorkspace buffers(workspace, allocate, list_bytes + bytes, stream);
  char* const base = static_cast<char*>(buffers.data());
  build_document_lists(params, list_bytes, base, stream);
  params.workspace = base == nullptr ? nullptr : base + list_bytes;
  params.workspace_bytes = bytes;
  if (shape.paged) {
    sm90::run_paged_backward(params, stream);
  } else {
    sm90::run_backward(params, stream);
  }
#else
  (void)stream;
  (void)workspace;
  (void)allocate;
  throw_not_built();
#endif
}

}  // namespace

void forward(const ForwardArgs& args, StreamHandle stream, Workspace workspace) {
  run_forward_call(args, stream, workspace, nullptr);
}

void forward(const ForwardArgs& args, StreamHandle stream, const WorkspaceAllocator& allocate) {
  run_forward_call(args, stream, {}, &allocate);
}

void backward(const BackwardArgs& args, StreamHandle stream, Workspace workspace) {
  run_backward_call(args, stream, workspace, nullptr);
}

void backward(const BackwardArgs& args, StreamHandle stream, const WorkspaceAllocator& allocate) {
  run_backward_call(args, stream, {}, &allocate);
}

void combine(const CombineArgs& args, StreamHandle stream) {
  const detail::CombineShape shape = detail::check_combine(args);
  if (on_cpu(shape.device)) {
    reference::combine(args);
    return;
  }
#if CUFLASH_HAS_CUDA
  require_device(shape.device);
  detail::DeviceGuard guard(shape.device.index);
  if (detail::check_inputs_on_host()) detail::check_index_values_on_host(args, stream);
  if (args.out.numel() == 0) return;
  sm90::run_combine(detail::make_combine_params(args, shape), stream);
#else
  (void)stream;
  throw_not_built();
#endif
}

std::uint64_t kernel_params_abi() { return params_abi_tag(); }

std::vector<std::string> built_kernels() {
#if CUFLASH_HAS_CUDA
  std::vector<std::string> names = sm90::built_kernels();
  for (std::string& name : sm90::built_backward_kernels()) names.push_back(std::move(name));
  return names;
#else
  return {};
#endif
}

bool cuda_available() {
#if CUFLASH_HAS_CUDA
  return sm90::device_available();
#else
  return false;
#endif
}

const char* version() { return CUFLASH_VERSION_STRING; }

}  // namespace cuflash
