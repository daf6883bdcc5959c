// cuflash._C: the nanobind extension under the Python package.
//
// Arrays of any framework cross by DLPack (nb::ndarray: torch, NumPy, CuPy, JAX) and become
// cuflash::TensorView without a copy. The Python layer (python/cuflash/interface.py) checks
// the arguments, allocates the outputs and passes the caller's stream as an integer handle.
// cuflash::Error becomes ValueError (bad argument), NotImplementedError (not built or not
// supported) or RuntimeError (CUDA), with the message kept and the argument name attached
// as the exception's `argument` attribute.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#if CUFLASH_PYTHON_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

#include "cuflash/cuflash.hpp"

namespace nb = nanobind;

#if CUFLASH_PYTHON_HAS_JAX_FFI
nb::dict jax_ffi_handlers();  // python/src/jax_ffi.cpp
#endif

namespace {

// Inputs may be read-only (e.g. NumPy views); outputs must be writable.
using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;
using OptIn = std::optional<InArray>;
using OptOut = std::optional<OutArray>;

[[noreturn]] void raise_type(const std::string& argument, const std::string& message) {
  throw nb::type_error((argument + ": " + message).c_str());
}

cuflash::DType to_dtype(nb::dlpack::dtype dtype, const std::string& argument) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(dtype.code);
  if (dtype.lanes == 1) {
    if (code == Code::Float && dtype.bits == 16) return cuflash::DType::kFloat16;
    if (code == Code::Bfloat && dtype.bits == 16) return cuflash::DType::kBFloat16;
    if (code == Code::Float && dtype.bits == 32) return cuflash::DType::kFloat32;
    if (code == Code::Int && dtype.bits == 32) return cuflash::DType::kInt32;
    // NumPy has no bfloat16 in DLPack: the Python layer passes ml_dtypes.bfloat16 arrays as
    // uint16 views of the same bits.
    if (code == Code::UInt && dtype.bits == 16) return cuflash::DType::kBFloat16;
  }
  raise_type(argument, "unsupported dtype (code " + std::to_string(dtype.code) + ", " +
                           std::to_string(dtype.bits) + " bits); expected float16, bfloat16, "
                           "float32 or int32");
}

cuflash::Device to_device(int device_type, int device_id, const std::string& argument) {
  switch (device_type) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:  // pinned host memory is host memory
      return {cuflash::DeviceType::kCPU, 0};
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      return {cuflash::DeviceType::kCUDA, device_id};
    default:
      throw nb::value_error((argument + ": unsupported device (DLPack device type " +
                             std::to_string(device_type) + "); expected CPU or CUDA")
                                .c_str());
  }
}

template <typename Array>
cuflash::TensorView to_view(const Array& array, const std::string& argument) {
  const int ndim = static_cast<int>(array.ndim());
  if (ndim > cuflash::kMaxDims) {
    throw nb::value_error((argument + ": at most " + std::to_string(cuflash::kMaxDims) +
                           " dimensions are supported, got " + std::to_string(ndim))
                              .c_str());
  }
  cuflash::TensorView view;
  view.data = const_cast<void*>(static_cast<const void*>(array.data()));
  view.dtype = to_dtype(array.dtype(), argument);
  view.ndim = ndim;
  view.device = to_device(array.device_type(), array.device_id(), argument);
  const std::int64_t* strides = array.stride_ptr();
  std::int64_t running = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    view.shape[d] = static_cast<std::int64_t>(array.shape(d));
    view.stride[d] = strides ? strides[d] : running;  // DLPack: null strides mean row-major
    running *= view.shape[d];
  }
  return view;
}

template <typename Array>
std::optional<cuflash::TensorView> to_view(const std::optional<Array>& array, const std::string& argument) {
  if (!array) return std::nullopt;
  return to_view(*array, argument);
}

std::vector<cuflash::TensorView> to_views(const std::vector<InArray>& arrays, const std::string& argument) {
  std::vector<cuflash::TensorView> views;
  views.reserve(arrays.size());
  for (std::size_t i = 0; i < arrays.size(); ++i) {
    views.push_back(to_view(arrays[i], argument + "[" + std::to_string(i) + "]"));
  }
  return views;
}

cuflash::StreamHandle to_stream(std::uintptr_t stream) { return reinterpret_cast<cuflash::StreamHandle>(stream); }

// Everything that forward and backward share: sequence layout and attention options.
struct CommonArgs {
  cuflash::SequenceLayout seq;
  cuflash::AttentionOptions opts;
};

// An expression program as the Python side sends it: [result, grad, code...] (empty: none).
cuflash::ExprProgram to_program(const std::vector<std::int32_t>& packed, const char* name) {
  cuflash::ExprProgram program;
  if (packed.empty()) return program;
  if (packed.size() < 2) throw nb::value_error((std::string(name) + ": expected [result, grad, code...]").c_str());
  program.result = packed[0];
  program.grad = packed[1];
  program.code.assign(packed.begin() + 2, packed.end());
  return program;
}

CommonArgs make_common(const OptIn& cu_seqlens_q, const OptIn& cu_seqlens_k, const OptIn& seqused_q,
                       const OptIn& seqused_k, std::optional<std::int64_t> max_seqlen_q,
                       std::optional<std::int64_t> max_seqlen_k, const OptIn& page_table,
                       std::optional<double> softmax_scale, bool causal, int window_left, int window_right,
                       double softcap, int score_mod_kind, const std::vector<double>& score_mod_scalars,
                       const std::vector<InArray>& score_mod_aux, int mask_mod_kind,
                       const std::vector<double>& mask_mod_scalars, const std::vector<InArray>& mask_mod_aux,
                       const std::vector<OptIn>& block_sparse, int block_m, int block_n,
                       const std::vector<std::int32_t>& score_mod_program,
                       const std::vector<std::int32_t>& mask_mod_program) {
  CommonArgs common;
  common.seq.cu_seqlens_q = to_view(cu_seqlens_q, "cu_seqlens_q");
  common.seq.cu_seqlens_k = to_view(cu_seqlens_k, "cu_seqlens_k");
  common.seq.seqused_q = to_view(seqused_q, "seqused_q");
  common.seq.seqused_k = to_view(seqused_k, "seqused_k");
  common.seq.max_seqlen_q = max_seqlen_q;
  common.seq.max_seqlen_k = max_seqlen_k;
  common.seq.page_table = to_view(page_table, "page_table");

  cuflash::AttentionOptions& opts = common.opts;
  if (softmax_scale) opts.softmax_scale = static_cast<float>(*softmax_scale);
  opts.causal = causal;
  opts.window_left = window_left;
  opts.window_right = window_right;
  opts.softcap = static_cast<float>(softcap);
  opts.score_mod.kind = static_cast<cuflash::ScoreModKind>(score_mod_kind);
  opts.score_mod.scalars = score_mod_scalars;
  opts.score_mod.aux = to_views(score_mod_aux, "score_mod aux");
  opts.mask_mod.kind = static_cast<cuflash::MaskModKind>(mask_mod_kind);
  opts.mask_mod.scalars = mask_mod_scalars;
  opts.mask_mod.aux = to_views(mask_mod_aux, "mask_mod aux");
  opts.score_mod.program = to_program(score_mod_program, "score_mod_program");
  opts.mask_mod.program = to_program(mask_mod_program, "mask_mod_program");

  // Order: mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx, then the q_ lists.
  static const char* const kBlockSparseNames[] = {
      "mask_block_cnt",   "mask_block_idx",   "full_block_cnt",   "full_block_idx",
      "q_mask_block_cnt", "q_mask_block_idx", "q_full_block_cnt", "q_full_block_idx"};
  if (!block_sparse.empty()) {
    if (block_sparse.size() != 8) throw nb::value_error("block_sparse: expected 8 entries (None allowed)");
    std::optional<cuflash::TensorView> views[8];
    bool any = false;
    for (int i = 0; i < 8; ++i) {
      views[i] = to_view(block_sparse[i], kBlockSparseNames[i]);
      any = any || views[i].has_value();
    }
    if (any) {
      cuflash::BlockSparseTensors tensors;
      tensors.mask_block_cnt = views[0];
      tensors.mask_block_idx = views[1];
      tensors.full_block_cnt = views[2];
      tensors.full_block_idx = views[3];
      tensors.q_mask_block_cnt = views[4];
      tensors.q_mask_block_idx = views[5];
      tensors.q_full_block_cnt = views[6];
      tensors.q_full_block_idx = views[7];
      tensors.block_m = block_m;
      tensors.block_n = block_n;
      opts.block_sparse = tensors;
    }
  }
  return common;
}

// The workspace through the caller's allocator, a Python callable (bytes) -> a DLPack array of
// at least that many bytes (None: the call takes stream-ordered memory of its own). Called with
// the GIL, which the call has released around it; the array is kept until the call returns.
class PythonWorkspace {
 public:
  explicit PythonWorkspace(nb::object allocator) : allocator_(std::move(allocator)) {}
  // The allocator for cuflash::forward / backward; empty without a callable.
  cuflash::WorkspaceAllocator get() {
    if (allocator_.is_none()) return {};
    return [this](std::size_t bytes) {
      nb::gil_scoped_acquire acquire;
      array_ = allocator_(bytes);
      OutArray const view = nb::cast<OutArray>(array_);
      std::size_t const given = view.nbytes();
      if (given < bytes) {
        throw nb::value_error(("workspace_allocator: asked for " + std::to_string(bytes) + " bytes, returned " +
                               std::to_string(given)).c_str());
      }
      return cuflash::Workspace{view.data(), given};
    };
  }

 private:
  nb::object allocator_;
  nb::object array_;
};

void forward(const InArray& q, const InArray& k, const InArray& v, const OutArray& out, const OptOut& lse,
             const OptIn& learnable_sink, const OptIn& cu_seqlens_q, const OptIn& cu_seqlens_k,
             const OptIn& seqused_q, const OptIn& seqused_k, std::optional<std::int64_t> max_seqlen_q,
             std::optional<std::int64_t> max_seqlen_k, const OptIn& page_table,
             std::optional<double> softmax_scale, bool causal, int window_left, int window_right, double softcap,
             int score_mod_kind, const std::vector<double>& score_mod_scalars,
             const std::vector<InArray>& score_mod_aux, int mask_mod_kind,
             const std::vector<double>& mask_mod_scalars, const std::vector<InArray>& mask_mod_aux,
             const std::vector<OptIn>& block_sparse, int block_m, int block_n, int num_splits,
             std::optional<bool> pack_gqa, std::uintptr_t stream,
             const std::vector<std::int32_t>& score_mod_program,
             const std::vector<std::int32_t>& mask_mod_program, std::uintptr_t expression_kernel,
             nb::object workspace_allocator) {
  cuflash::ForwardArgs args;
  args.q = to_view(q, "q");
  args.k = to_view(k, "k");
  args.v = to_view(v, "v");
  args.out = to_view(out, "out");
  args.lse = to_view(lse, "lse");
  args.learnable_sink = to_view(learnable_sink, "learnable_sink");
  CommonArgs common = make_common(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                                  page_table, softmax_scale, causal, window_left, window_right, softcap,
                                  score_mod_kind, score_mod_scalars, score_mod_aux, mask_mod_kind,
                                  mask_mod_scalars, mask_mod_aux, block_sparse, block_m, block_n,
                                  score_mod_program, mask_mod_program);
  args.seq = std::move(common.seq);
  args.opts = std::move(common.opts);
  args.opts.expression_forward_kernel = expression_kernel;
  args.num_splits = num_splits;
  args.pack_gqa = pack_gqa;
  PythonWorkspace workspace(std::move(workspace_allocator));  // outlives the released GIL below
  cuflash::WorkspaceAllocator const allocate = workspace.get();
  nb::gil_scoped_release release;
  cuflash::forward(args, to_stream(stream), allocate);
}

void backward(const InArray& q, const InArray& k, const InArray& v, const InArray& out, const InArray& dout,
              const InArray& lse, const OutArray& dq, const OutArray& dk, const OutArray& dv,
              const OptIn& learnable_sink, const OptOut& d_sink, const OptIn& dlse, const OptIn& cu_seqlens_q,
              const OptIn& cu_seqlens_k, const OptIn& seqused_q, const OptIn& seqused_k,
              std::optional<std::int64_t> max_seqlen_q, std::optional<std::int64_t> max_seqlen_k,
              const OptIn& page_table, std::optional<double> softmax_scale, bool causal, int window_left,
              int window_right, double softcap, int score_mod_kind, const std::vector<double>& score_mod_scalars,
              const std::vector<InArray>& score_mod_aux, int mask_mod_kind,
              const std::vector<double>& mask_mod_scalars, const std::vector<InArray>& mask_mod_aux,
              const std::vector<OptIn>& block_sparse, int block_m, int block_n, bool deterministic,
              std::uintptr_t stream, const std::vector<std::int32_t>& score_mod_program,
              const std::vector<std::int32_t>& mask_mod_program, std::uintptr_t expression_kernel,
              nb::object workspace_allocator) {
  cuflash::BackwardArgs args;
  args.q = to_view(q, "q");
  args.k = to_view(k, "k");
  args.v = to_view(v, "v");
  args.out = to_view(out, "out");
  args.dout = to_view(dout, "dout");
  args.lse = to_view(lse, "lse");
  args.dq = to_view(dq, "dq");
  args.dk = to_view(dk, "dk");
  args.dv = to_view(dv, "dv");
  args.learnable_sink = to_view(learnable_sink, "learnable_sink");
  args.d_sink = to_view(d_sink, "d_sink");
  args.dlse = to_view(dlse, "dlse");
  CommonArgs common = make_common(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                                  page_table, softmax_scale, causal, window_left, window_right, softcap,
                                  score_mod_kind, score_mod_scalars, score_mod_aux, mask_mod_kind,
                                  mask_mod_scalars, mask_mod_aux, block_sparse, block_m, block_n,
                                  score_mod_program, mask_mod_program);
  args.seq = std::move(common.seq);
  args.opts = std::move(common.opts);
  args.opts.expression_backward_kernel = expression_kernel;
  args.deterministic = deterministic;
  PythonWorkspace workspace(std::move(workspace_allocator));  // outlives the released GIL below
  cuflash::WorkspaceAllocator const allocate = workspace.get();
  nb::gil_scoped_release release;
  cuflash::backward(args, to_stream(stream), allocate);
}

void combine(const InArray& out_partial, const InArray& lse_partial, const OutArray& out, const OptOut& lse,
             const OptIn& cu_seqlens, const OptIn& seqused, std::uintptr_t stream) {
  cuflash::CombineArgs args;
  args.out_partial = to_view(out_partial, "out_partial");
  args.lse_partial = to_view(lse_partial, "lse_partial");
  args.out = to_view(out, "out");
  args.lse = to_view(lse, "lse");
  args.cu_seqlens = to_view(cu_seqlens, "cu_seqlens");
  args.seqused = to_view(seqused, "seqused");
  nb::gil_scoped_release release;
  cuflash::combine(args, to_stream(stream));
}

// Waits for the work queued on `stream` (for frameworks that expose no stream of their own).
void stream_synchronize(std::uintptr_t stream) {
#if CUFLASH_PYTHON_HAS_CUDA
  cudaError_t status;
  {
    nb::gil_scoped_release release;
    status = cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
  }
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("cudaStreamSynchronize: ") + cudaGetErrorString(status));
  }
#else
  (void)stream;
#endif
}

// A row-major CUDA allocation that other frameworks import by DLPack (JAX's arrays are
// immutable, so cuflash writes its outputs into one of these and then hands it to JAX). Each
// __dlpack__() call exports a new capsule that shares ownership of the memory.
namespace dl {  // the DLPack ABI (dlpack.h, unversioned)
struct Device {
  std::int32_t device_type;
  std::int32_t device_id;
};
struct DataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  std::int32_t ndim;
  DataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor*);
};
}  // namespace dl

class CudaBuffer {
 public:
  CudaBuffer(const std::vector<std::int64_t>& shape, const std::string& dtype, int device_id, bool zero);

  const std::vector<std::int64_t>& shape() const { return shape_; }
  int device_id() const { return device_id_; }
  nb::capsule dlpack() const;

 private:
  struct Export {
    dl::ManagedTensor managed;
    std::shared_ptr<void> memory;
    std::vector<std::int64_t> shape;
  };
  std::shared_ptr<void> memory_;
  std::vector<std::int64_t> shape_;
  dl::DataType dtype_{};
  int device_id_ = 0;
};

CudaBuffer::CudaBuffer(const std::vector<std::int64_t>& shape, const std::string& dtype, int device_id, bool zero)
    : shape_(shape), device_id_(device_id) {
  using Code = nb::dlpack::dtype_code;
  if (dtype == "float16") {
    dtype_ = {static_cast<std::uint8_t>(Code::Float), 16, 1};
  } else if (dtype == "bfloat16") {
    dtype_ = {static_cast<std::uint8_t>(Code::Bfloat), 16, 1};
  } else if (dtype == "float32") {
    dtype_ = {static_cast<std::uint8_t>(Code::Float), 32, 1};
  } else if (dtype == "int32") {
    dtype_ = {static_cast<std::uint8_t>(Code::Int), 32, 1};
  } else {
    throw nb::type_error(("dtype: expected float16, bfloat16, float32 or int32, got " + dtype).c_str());
  }
  std::size_t bytes = dtype_.bits / 8;
  for (std::int64_t extent : shape) {
    if (extent < 0) throw nb::value_error("shape: negative extent");
    bytes *= static_cast<std::size_t>(extent);
  }
#if CUFLASH_PYTHON_HAS_CUDA
  int previous_device = 0;
  void* data = nullptr;
  cudaError_t status = cudaGetDevice(&previous_device);
  if (status == cudaSuccess) status = cudaSetDevice(device_id);
  if (status == cudaSuccess) status = cudaMalloc(&data, bytes > 0 ? bytes : 1);
  if (status == cudaSuccess && zero) status = cudaMemset(data, 0, bytes);
  cudaSetDevice(previous_device);
  if (status != cudaSuccess) {
    if (data) cudaFree(data);
    throw std::runtime_error(std::string("CudaBuffer: ") + cudaGetErrorString(status));
  }
  memory_ = std::shared_ptr<void>(data, [](void* pointer) { cudaFree(pointer); });
#else
  (void)zero;
  throw nb::value_error("device: this cuflash build has no CUDA support");
#endif
}

nb::capsule CudaBuffer::dlpack() const {
  auto* exported = new Export{{}, memory_, shape_};
  dl::Tensor& tensor = exported->managed.dl_tensor;
  tensor.data = memory_.get();
  tensor.device = {static_cast<std::int32_t>(nb::device::cuda::value), device_id_};
  tensor.ndim = static_cast<std::int32_t>(shape_.size());
  tensor.dtype = dtype_;
  tensor.shape = exported->shape.data();
  tensor.strides = nullptr;  // row-major
  tensor.byte_offset = 0;
  exported->managed.manager_ctx = exported;
  exported->managed.deleter = [](dl::ManagedTensor* managed) { delete static_cast<Export*>(managed->manager_ctx); };
  // A capsule that no consumer took (still named "dltensor") frees its export itself.
  PyObject* capsule = PyCapsule_New(&exported->managed, "dltensor", [](PyObject* object) {
    if (PyCapsule_IsValid(object, "dltensor")) {
      auto* managed = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(object, "dltensor"));
      managed->deleter(managed);
    }
  });
  if (!capsule) {
    delete exported;
    throw nb::python_error();
  }
  return nb::steal<nb::capsule>(capsule);
}

void translate_error(const std::exception_ptr& pointer, void*) {
  try {
    std::rethrow_exception(pointer);
  } catch (const cuflash::Error& error) {
    PyObject* type = PyExc_RuntimeError;
    switch (error.kind()) {
      case cuflash::Error::Kind::kInvalidArgument: type = PyExc_ValueError; break;
      case cuflash::Error::Kind::kNotBuilt:
      case cuflash::Error::Kind::kNotSupported: type = PyExc_NotImplementedError; break;
      case cuflash::Error::Kind::kCuda: type = PyExc_RuntimeError; break;
    }
    PyObject* instance = PyObject_CallFunction(type, "s", error.what());
    if (!instance) return;  // the Python error from the call stays set
    PyObject* argument = PyUnicode_FromString(error.argument().c_str());
    if (argument) {
      PyObject_SetAttrString(instance, "argument", argument);
      Py_DECREF(argument);
    }
    PyErr_Clear();  // a failed attribute assignment must not replace the real error
    PyErr_SetObject(type, instance);
    Py_DECREF(instance);
  }
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "cuflash C++ extension: attention forward, backward and combine over DLPack arrays";
  nb::register_exception_translator(translate_error);

  using namespace nb::literals;
  m.def("forward", &forward, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none() = nb::none(),
        "learnable_sink"_a.none() = nb::none(), "cu_seqlens_q"_a.none() = nb::none(),
        "cu_seqlens_k"_a.none() = nb::none(), "seqused_q"_a.none() = nb::none(),
        "seqused_k"_a.none() = nb::none(), "max_seqlen_q"_a.none() = nb::none(),
        "max_seqlen_k"_a.none() = nb::none(), "page_table"_a.none() = nb::none(),
        "softmax_scale"_a.none() = nb::none(), "causal"_a = false, "window_left"_a = -1, "window_right"_a = -1,
        "softcap"_a = 0.0, "score_mod_kind"_a = 0, "score_mod_scalars"_a = std::vector<double>{},
        "score_mod_aux"_a = std::vector<InArray>{}, "mask_mod_kind"_a = 0,
        "mask_mod_scalars"_a = std::vector<double>{}, "mask_mod_aux"_a = std::vector<InArray>{},
        "block_sparse"_a = std::vector<OptIn>{}, "block_m"_a = 128, "block_n"_a = 128, "num_splits"_a = 1,
        "pack_gqa"_a.none() = nb::none(), "stream"_a = 0,
        "score_mod_program"_a = std::vector<std::int32_t>{}, "mask_mod_program"_a = std::vector<std::int32_t>{},
        "expression_kernel"_a = 0, "workspace_allocator"_a = nb::none(),
        "Runs cuflash::forward, writing out (and lse when given). Arguments are unchecked views; "
        "expression_kernel: a launcher compiled at run time for expression mods (cuflash._jit); "
        "workspace_allocator: (bytes) -> a device array of at least that many bytes, usable on the "
        "stream (None: stream-ordered memory of the call's own).");
  m.def("backward", &backward, "q"_a, "k"_a, "v"_a, "out"_a, "dout"_a, "lse"_a, "dq"_a, "dk"_a, "dv"_a,
        "learnable_sink"_a.none() = nb::none(), "d_sink"_a.none() = nb::none(), "dlse"_a.none() = nb::none(),
        "cu_seqlens_q"_a.none() = nb::none(), "cu_seqlens_k"_a.none() = nb::none(),
        "seqused_q"_a.none() = nb::none(), "seqused_k"_a.none() = nb::none(),
        "max_seqlen_q"_a.none() = nb::none(), "max_seqlen_k"_a.none() = nb::none(),
        "page_table"_a.none() = nb::none(), "softmax_scale"_a.none() = nb::none(), "causal"_a = false,
        "window_left"_a = -1, "window_right"_a = -1, "softcap"_a = 0.0, "score_mod_kind"_a = 0,
        "score_mod_scalars"_a = std::vector<double>{}, "score_mod_aux"_a = std::vector<InArray>{},
        "mask_mod_kind"_a = 0, "mask_mod_scalars"_a = std::vector<double>{},
        "mask_mod_aux"_a = std::vector<InArray>{}, "block_sparse"_a = std::vector<OptIn>{}, "block_m"_a = 128,
        "block_n"_a = 128, "deterministic"_a = false, "stream"_a = 0,
        "score_mod_program"_a = std::vector<std::int32_t>{}, "mask_mod_program"_a = std::vector<std::int32_t>{},
        "expression_kernel"_a = 0, "workspace_allocator"_a = nb::none(),
        "Runs cuflash::backward, writing dq, dk, dv (and d_sink when given); dlse: the gradient reaching lse, "
        "if any; expression_kernel and "
        "workspace_allocator as for forward."); 
  m.def("combine", &combine, "out_partial"_a, "lse_partial"_a, "out"_a, "lse"_a.none() = nb::none(),
        "cu_seqlens"_a.none() = nb::none(), "seqused"_a.none() = nb::none(), "stream"_a = 0,
        "Runs cuflash::combine: merges split-KV partial results by their log-sum-exp.");
  m.def("stream_synchronize", &stream_synchronize, "stream"_a,
        "Waits for the work queued on a CUDA stream (no-op in a CPU-only build).");
  nb::class_<CudaBuffer>(m, "CudaBuffer",
                         "A row-major CUDA allocation, exported by DLPack (freed with its last user).")
      .def(nb::init<const std::vector<std::int64_t>&, const std::string&, int, bool>(), "shape"_a, "dtype"_a,
           "device"_a = 0, "zero"_a = false)
      .def_prop_ro("shape", [](const CudaBuffer& buffer) { return nb::tuple(nb::cast(buffer.shape())); })
      .def("__dlpack__", [](const CudaBuffer& buffer, nb::kwargs) { return buffer.dlpack(); })
      .def("__dlpack_device__", [](const CudaBuffer& buffer) {
        return nb::make_tuple(static_cast<int>(nb::device::cuda::value), buffer.device_id());
      });
  m.def("built_kernels", &cuflash::built_kernels, "Kernel configurations this build holds.");
  m.def(
      "kernel_head_dims",
      [](int head_dim, int head_dim_v) {
        cuflash::KernelHeadDims const dims = cuflash::kernel_head_dims(head_dim, head_dim_v);
        return nb::make_tuple(dims.head_dim, dims.head_dim_v);
      },
      "head_dim"_a, "head_dim_v"_a,
      "(head_dim, head_dim_v) of the compiled kernel that runs a call with these; (0, 0) over 256.");
  m.def("kernel_params_abi", &cuflash::kernel_params_abi,
        "The kernel parameter layout tag that kernel modules compiled at run time must match.");
  m.def("cuda_available", &cuflash::cuda_available, "Whether a usable CUDA device is present.");
  m.def("version", &cuflash::version, "Version of the C++ library.");
  m.attr("built_with_cuda") = bool(CUFLASH_PYTHON_HAS_CUDA);
#if CUFLASH_PYTHON_HAS_JAX_FFI
  m.def("jax_ffi_handlers", &jax_ffi_handlers,
        "XLA FFI handlers of forward and backward, name -> capsule (for jax.ffi.register_ffi_target).");
#endif
}
