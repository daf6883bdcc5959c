// XLA FFI handlers: cuflash::forward / cuflash::backward as JAX custom calls (jax.ffi), so that
// cuflash runs inside jax.jit and under jax.grad. Compiled when the jaxlib headers
// (xla/ffi/api/ffi.h, from jax.ffi.include_dir()) were found at configure time.
//
// One handler per pass and platform: "Host" handlers run the CPU reference on host buffers,
// "CUDA" handlers (CUDA builds only) run the sm_90a kernels on the stream that XLA gives, with
// their workspace from XLA's scratch allocator (no allocation of their own, no host sync).
//
// Operands: q, k, v (forward) or q, k, v, out, dout, lse (backward), then the optional operands
// whose bits are set in the `operands` attribute, in the order of the bits (kOperandNames; the
// q_ block lists and dlse only to the backward), then
// `score_mod_num_aux` score_mod aux tensors and `mask_mod_num_aux` mask_mod aux tensors.
// Traced callables come as `score_mod_program` / `mask_mod_program` (int32 arrays) with, for
// the GPU, `expression_module`: the path of the module compiled for them at run time
// (python/cuflash/_jit.py's on-disk cache), which the handler opens itself. A path, not the
// launcher's address: a compiled computation may outlive the process that traced it (JAX's
// persistent compilation cache), and the address would then point nowhere.
// Results: out, lse (forward) or dq, dk, dv and, with a learnable sink, d_sink (backward).
// python/cuflash/_jax.py builds the calls; it checks every argument first, as the eager path does.
#if CUFLASH_PYTHON_HAS_JAX_FFI

#include <nanobind/nanobind.h>

#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if CUFLASH_PYTHON_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

#include "cuflash/cuflash.hpp"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

// The optional operands, one bit each in the `operands` attribute (python/cuflash/_jax.py
// keeps the same order).
constexpr int kNumOptionalOperands = 15;
constexpr const char* kOperandNames[kNumOptionalOperands] = {
    "learnable_sink",   "cu_seqlens_q",     "cu_seqlens_k",     "seqused_q",       "seqused_k",
    "page_table",       "mask_block_cnt",   "mask_block_idx",   "full_block_cnt",  "full_block_idx",
    "q_mask_block_cnt", "q_mask_block_idx", "q_full_block_cnt", "q_full_block_idx", "dlse"};
enum OptionalOperand : int {
  kLearnableSink = 0,
  kCuSeqlensQ,
  kCuSeqlensK,
  kSequsedQ,
  kSequsedK,
  kPageTable,
  kBlockSparseFirst,  // 8 lists, in BlockSparseTensors order (mask, full, then the q_ lists)
  kDlse = kBlockSparseFirst + 8,  // backward: the gradient reaching lse
};
static_assert(kDlse + 1 == kNumOptionalOperands);

// A failure that becomes the handler's ffi::Error.
struct HandlerError {
  ffi::ErrorCode code;
  std::string message;
};

[[noreturn]] void fail(const std::string& message) {
  throw HandlerError{ffi::ErrorCode::kInvalidArgument, message};
}

cuflash::DType to_dtype(ffi::DataType dtype, const std::string& argument) {
  switch (dtype) {
    case ffi::DataType::F16:
      return cuflash::DType::kFloat16;
    case ffi::DataType::BF16:
      return cuflash::DType::kBFloat16;
    case ffi::DataType::F32:
      return cuflash::DType::kFloat32;
    case ffi::DataType::S32:
      return cuflash::DType::kInt32;
    default:
      fail(argument + ": unsupported dtype (XLA type " + std::to_string(static_cast<int>(dtype)) +
           "); expected float16, bfloat16, float32 or int32");
  }
}

// XLA buffers are dense and row-major (the default layout that ffi_call asks for).
cuflash::TensorView to_view(const ffi::AnyBuffer& buffer, cuflash::Device device,
                            const std::string& argument) {
  const auto dims = buffer.dimensions();
  const int ndim = static_cast<int>(dims.size());
  if (ndim > cuflash::kMaxDims) {
    fail(argument + ": at most " + std::to_string(cuflash::kMaxDims) +
         " dimensions are supported, got " + std::to_string(ndim));
  }
  cuflash::TensorView view;
  view.data = buffer.untyped_data();
  view.dtype = to_dtype(buffer.element_type(), argument);
  view.ndim = ndim;
  view.device = device;
  std::int64_t running = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    view.shape[d] = dims[d];
    view.stride[d] = running;
    running *= dims[d];
  }
  return view;
}

template <typename T>
T attribute(const ffi::Dictionary& attrs, std::string_view name) {
  ffi::ErrorOr<T> value = attrs.get<T>(name);
  if (!value.has_value()) fail("attribute " + std::string(name) + ": " + value.error().message());
  return *value;
}

std::vector<double> scalars(const ffi::Dictionary& attrs, std::string_view name) {
  const auto span = attribute<ffi::Span<const double>>(attrs, name);
  return std::vector<double>(span.begin(), span.end());
}

// An expression program (a traced score_mod / mask_mod callable) as python/cuflash/_jax.py
// sends it: int32 [result, grad, code...], empty for none.
cuflash::ExprProgram program(const ffi::Dictionary& attrs, std::string_view name) {
  const auto span = attribute<ffi::Span<const std::int32_t>>(attrs, name);
  cuflash::ExprProgram result;
  if (span.size() == 0) return result;
  if (span.size() < 2) fail("attribute " + std::string(name) + ": expected [result, grad, code...]");
  result.result = span[0];
  result.grad = span[1];
  result.code.assign(span.begin() + 2, span.end());
  return result;
}

// The (forward, backward) launchers of a module compiled for callables, opened once per process
// and kept open; checked to be built against this library's parameter layouts.
std::pair<std::uintptr_t, std::uintptr_t> expression_launchers(const std::string& path) {
  static std::mutex mutex;
  static std::map<std::string, std::pair<std::uintptr_t, std::uintptr_t>> opened;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = opened.find(path);
  if (found != opened.end()) return found->second;
  void* module = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (module == nullptr) {
    const char* why = dlerror();
    fail("expression_module: cannot open " + path + " (" + (why ? why : "unknown error") +
         "): the module compiled for a score_mod / mask_mod callable; clear JAX's compilation cache if the "
         "cuflash kernel cache was removed");
  }
  using AbiFn = unsigned long long (*)();
  auto const abi = reinterpret_cast<AbiFn>(dlsym(module, "cuflash_expression_abi"));
  void* const forward = dlsym(module, "cuflash_expression_forward");
  void* const backward = dlsym(module, "cuflash_expression_backward");
  if (abi == nullptr || forward == nullptr || backward == nullptr || abi() != cuflash::kernel_params_abi()) {
    fail("expression_module: " + path + " is not a module built against this cuflash's parameter layouts");
  }
  auto const launchers = std::make_pair(reinterpret_cast<std::uintptr_t>(forward),
                                        reinterpret_cast<std::uintptr_t>(backward));
  opened.emplace(path, launchers);
  return launchers;
}

// The launcher for a call's callables on `device`: 0 on the host (the CPU reference runs the
// programs) or without callables.
std::uintptr_t expression_launcher(const ffi::Dictionary& attrs, const cuflash::AttentionOptions& opts,
                                   cuflash::Device device, bool forward) {
  if (device.type != cuflash::DeviceType::kCUDA) return 0;
  if (opts.score_mod.program.empty() && opts.mask_mod.program.empty()) return 0;
  const auto path = attribute<std::string_view>(attrs, "expression_module");
  if (path.empty()) {
    fail("score_mod / mask_mod: a Python callable reached the GPU without its compiled kernels: it was traced "
         "while jax.default_backend() was not 'gpu' (place the computation on the default backend)");
  }
  const auto launchers = expression_launchers(std::string(path));
  return forward ? launchers.first : launchers.second;
}

// Reads the operands in order.
class Operands {
 public:
  Operands(const ffi::RemainingArgs& args, cuflash::Device device) : args_(args), device_(device) {}

  cuflash::TensorView next(const std::string& argument) {
    ffi::ErrorOr<ffi::AnyBuffer> buffer = args_.get<ffi::AnyBuffer>(index_);
    if (!buffer.has_value()) fail(argument + ": missing operand " + std::to_string(index_));
    ++index_;
    return to_view(*buffer, device_, argument);
  }

  void expect_end() const {
    if (index_ != args_.size()) {
      fail("operands: expected " + std::to_string(index_) + ", got " +
           std::to_string(args_.size()));
    }
  }

 private:
  const ffi::RemainingArgs& args_;
  cuflash::Device device_;
  std::size_t index_ = 0;
};

class Results {
 public:
  Results(const ffi::RemainingRets& rets, cuflash::Device device) : rets_(rets), device_(device) {}

  cuflash::TensorView next(const std::string& argument) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> buffer = rets_.get<ffi::AnyBuffer>(index_);
    if (!buffer.has_value()) fail(argument + ": missing result " + std::to_string(index_));
    ++index_;
    return to_view(**buffer, device_, argument);
  }

  void expect_end() const {
    if (index_ != rets_.size()) {
      fail("results: expected " + std::to_string(index_) + ", got " + std::to_string(rets_.size()));
    }
  }

 private:
  const ffi::RemainingRets& rets_;
  cuflash::Device device_;
  std::size_t index_ = 0;
};

struct Optional {
  std::optional<cuflash::TensorView> views[kNumOptionalOperands];
};

// The optional operands and the attributes that forward and backward share.
Optional read_optional(Operands& operands, const ffi::Dictionary& attrs,
                       cuflash::SequenceLayout& seq, cuflash::AttentionOptions& opts) {
  const auto present = attribute<std::int64_t>(attrs, "operands");
  Optional optional;
  for (int i = 0; i < kNumOptionalOperands; ++i) {
    if (present & (std::int64_t{1} << i)) optional.views[i] = operands.next(kOperandNames[i]);
  }
  seq.cu_seqlens_q = optional.views[kCuSeqlensQ];
  seq.cu_seqlens_k = optional.views[kCuSeqlensK];
  seq.seqused_q = optional.views[kSequsedQ];
  seq.seqused_k = optional.views[kSequsedK];
  seq.page_table = optional.views[kPageTable];
  const auto max_seqlen_q = attribute<std::int64_t>(attrs, "max_seqlen_q");  // < 0: not given
  const auto max_seqlen_k = attribute<std::int64_t>(attrs, "max_seqlen_k");
  if (max_seqlen_q >= 0) seq.max_seqlen_q = max_seqlen_q;
  if (max_seqlen_k >= 0) seq.max_seqlen_k = max_seqlen_k;

  if (attribute<bool>(attrs, "has_softmax_scale"))
    opts.softmax_scale = attribute<float>(attrs, "softmax_scale");
  opts.causal = attribute<bool>(attrs, "causal");
  opts.window_left = static_cast<int>(attribute<std::int64_t>(attrs, "window_left"));
  opts.window_right = static_cast<int>(attribute<std::int64_t>(attrs, "window_right"));
  opts.softcap = attribute<float>(attrs, "softcap");
  opts.score_mod.kind =
      static_cast<cuflash::ScoreModKind>(attribute<std::int64_t>(attrs, "score_mod_kind"));
  opts.score_mod.scalars = scalars(attrs, "score_mod_scalars");
  opts.mask_mod.kind =
      static_cast<cuflash::MaskModKind>(attribute<std::int64_t>(attrs, "mask_mod_kind"));
  opts.mask_mod.scalars = scalars(attrs, "mask_mod_scalars");
  opts.score_mod.program = program(attrs, "score_mod_program");
  opts.mask_mod.program = program(attrs, "mask_mod_program");
  const auto num_score_aux = attribute<std::int64_t>(attrs, "score_mod_num_aux");
  const auto num_mask_aux = attribute<std::int64_t>(attrs, "mask_mod_num_aux");
  for (std::int64_t i = 0; i < num_score_aux; ++i) {
    opts.score_mod.aux.push_back(operands.next("score_mod aux[" + std::to_string(i) + "]"));
  }
  for (std::int64_t i = 0; i < num_mask_aux; ++i) {
    opts.mask_mod.aux.push_back(operands.next("mask_mod aux[" + std::to_string(i) + "]"));
  }
  operands.expect_end();

  bool any_block_list = false;
  for (int i = kBlockSparseFirst; i < kDlse; ++i) any_block_list |= optional.views[i].has_value();
  if (any_block_list) {
    cuflash::BlockSparseTensors tensors;
    tensors.mask_block_cnt = optional.views[kBlockSparseFirst + 0];
    tensors.mask_block_idx = optional.views[kBlockSparseFirst + 1];
    tensors.full_block_cnt = optional.views[kBlockSparseFirst + 2];
    tensors.full_block_idx = optional.views[kBlockSparseFirst + 3];
    tensors.q_mask_block_cnt = optional.views[kBlockSparseFirst + 4];
    tensors.q_mask_block_idx = optional.views[kBlockSparseFirst + 5];
    tensors.q_full_block_cnt = optional.views[kBlockSparseFirst + 6];
    tensors.q_full_block_idx = optional.views[kBlockSparseFirst + 7];
    tensors.block_m = static_cast<int>(attribute<std::int64_t>(attrs, "block_m"));
    tensors.block_n = static_cast<int>(attribute<std::int64_t>(attrs, "block_n"));
    opts.block_sparse = tensors;
  }
  return optional;
}

cuflash::ForwardArgs forward_args(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                                  const ffi::Dictionary& attrs, cuflash::Device device) {
  cuflash::ForwardArgs forward;
  Operands operands(args, device);
  forward.q = operands.next("q");
  forward.k = operands.next("k");
  forward.v = operands.next("v");
  const Optional optional = read_optional(operands, attrs, forward.seq, forward.opts);
  forward.learnable_sink = optional.views[kLearnableSink];
  if (optional.views[kDlse]) fail("dlse: a backward operand, passed to the forward");
  Results results(rets, device);
  forward.out = results.next("out");
  forward.lse = results.next("lse");
  results.expect_end();
  forward.opts.expression_forward_kernel = expression_launcher(attrs, forward.opts, device, /*forward=*/true);
  forward.num_splits = static_cast<int>(attribute<std::int64_t>(attrs, "num_splits"));
  const auto pack_gqa = attribute<std::int64_t>(attrs, "pack_gqa");  // < 0: default
  if (pack_gqa >= 0) forward.pack_gqa = pack_gqa != 0;
  return forward;
}

cuflash::BackwardArgs backward_args(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                                    const ffi::Dictionary& attrs, cuflash::Device device) {
  cuflash::BackwardArgs backward;
  Operands operands(args, device);
  backward.q = operands.next("q");
  backward.k = operands.next("k");
  backward.v = operands.next("v");
  backward.out = operands.next("out");
  backward.dout = operands.next("dout");
  backward.lse = operands.next("lse");
  const Optional optional = read_optional(operands, attrs, backward.seq, backward.opts);
  backward.learnable_sink = optional.views[kLearnableSink];
  backward.dlse = optional.views[kDlse];
  Results results(rets, device);
  backward.dq = results.next("dq");
  backward.dk = results.next("dk");
  backward.dv = results.next("dv");
  if (backward.learnable_sink) backward.d_sink = results.next("d_sink");
  results.expect_end();
  backward.opts.expression_backward_kernel = expression_launcher(attrs, backward.opts, device, /*forward=*/false);
  backward.deterministic = attribute<bool>(attrs, "deterministic");
  return backward;
}

ffi::ErrorCode error_code(cuflash::Error::Kind kind) {
  switch (kind) {
    case cuflash::Error::Kind::kInvalidArgument:
      return ffi::ErrorCode::kInvalidArgument;
    case cuflash::Error::Kind::kNotBuilt:
    case cuflash::Error::Kind::kNotSupported:
      return ffi::ErrorCode::kUnimplemented;
    case cuflash::Error::Kind::kCuda:
      return ffi::ErrorCode::kInternal;
  }
  return ffi::ErrorCode::kInternal;
}

// Runs `body`, turning every failure into the handler's error (exceptions must not cross XLA).
template <typename Body>
ffi::Error guarded(Body&& body) {
  try {
    body();
    return ffi::Error::Success();
  } catch (const HandlerError& error) {
    return ffi::Error(error.code, "cuflash: " + error.message);
  } catch (const cuflash::Error& error) {
    return ffi::Error(error_code(error.kind()), std::string("cuflash: ") + error.what());
  } catch (const std::exception& error) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("cuflash: ") + error.what());
  }
}

constexpr cuflash::Device kHost{cuflash::DeviceType::kCPU, 0};

ffi::Error forward_host(ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  return guarded([&] { cuflash::forward(forward_args(args, rets, attrs, kHost)); });
}

ffi::Error backward_host(ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  return guarded([&] { cuflash::backward(backward_args(args, rets, attrs, kHost)); });
}

#if CUFLASH_PYTHON_HAS_CUDA
// The workspace: from XLA's scratch allocator (stream-ordered on XLA's stream, released when the
// handler returns, after the work queued on that stream) when it has one to give; jitted calls
// on the GPU may find it without memory (its pool is the compiled program's, sized before this
// call asked), and then the workspace comes from CUDA's stream-ordered pool on the same stream
// and goes back to it, ordered after the call's kernels: no host synchronisation either way.
class CallWorkspace {
 public:
  CallWorkspace(ffi::ScratchAllocator& scratch, cudaStream_t stream, std::size_t bytes)
      : stream_(stream) {
    if (bytes == 0) return;
    std::optional<void*> data = scratch.Allocate(bytes, 256);
    if (data.has_value()) {
      workspace_ = {*data, bytes};
      return;
    }
    void* pooled = nullptr;
    const cudaError_t status = cudaMallocAsync(&pooled, bytes, stream);
    if (status != cudaSuccess) {
      cudaGetLastError();
      throw HandlerError{ffi::ErrorCode::kResourceExhausted,
                         "workspace: neither XLA nor the CUDA memory pool could give " +
                             std::to_string(bytes) + " bytes: " + cudaGetErrorString(status)};
    }
    pooled_ = pooled;
    workspace_ = {pooled, bytes};
  }
  ~CallWorkspace() {
    if (pooled_ != nullptr) cudaFreeAsync(pooled_, stream_);
  }
  CallWorkspace(const CallWorkspace&) = delete;
  CallWorkspace& operator=(const CallWorkspace&) = delete;
  const cuflash::Workspace& get() const { return workspace_; }

 private:
  cudaStream_t stream_;
  void* pooled_ = nullptr;
  cuflash::Workspace workspace_{};
};

ffi::Error forward_cuda(cudaStream_t stream, ffi::ScratchAllocator scratch, std::int32_t device,
                        ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  return guarded([&] {
    const cuflash::ForwardArgs forward =
        forward_args(args, rets, attrs, {cuflash::DeviceType::kCUDA, device});
    const CallWorkspace workspace(scratch, stream, cuflash::forward_workspace_size(forward));
    cuflash::forward(forward, stream, workspace.get());
  });
}

ffi::Error backward_cuda(cudaStream_t stream, ffi::ScratchAllocator scratch, std::int32_t device,
                         ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  return guarded([&] {
    const cuflash::BackwardArgs backward =
        backward_args(args, rets, attrs, {cuflash::DeviceType::kCUDA, device});
    const CallWorkspace workspace(scratch, stream, cuflash::backward_workspace_size(backward));
    cuflash::backward(backward, stream, workspace.get());
  });
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CuflashForwardHost, forward_host,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CuflashBackwardHost, backward_host,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());
#if CUFLASH_PYTHON_HAS_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(CuflashForwardCuda, forward_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CuflashBackwardCuda, backward_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs());
#endif

// name -> capsule of the handler, for jax.ffi.register_ffi_target. Names end in the platform
// ("_cpu", "_cuda") that each is registered for.
nb::dict jax_ffi_handlers() {
  nb::dict handlers;
  handlers["forward_cpu"] = nb::capsule(reinterpret_cast<void*>(&CuflashForwardHost));
  handlers["backward_cpu"] = nb::capsule(reinterpret_cast<void*>(&CuflashBackwardHost));
#if CUFLASH_PYTHON_HAS_CUDA
  handlers["forward_cuda"] = nb::capsule(reinterpret_cast<void*>(&CuflashForwardCuda));
  handlers["backward_cuda"] = nb::capsule(reinterpret_cast<void*>(&CuflashBackwardCuda));
#endif
  return handlers;
}

#endif  // CUFLASH_PYTHON_HAS_JAX_FFI
