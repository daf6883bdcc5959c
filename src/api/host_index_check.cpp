#if CUFLASH_HAS_CUDA

#include "api/host_index_check.hpp"

#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "api/validate.hpp"
#include "cuflash/error.hpp"

namespace cuflash::detail {
namespace {

// Host views of a call's tensors: int32 tensors in device memory are copied back (their whole
// span, strides kept), every other tensor is only relabelled as host memory, since validation
// reads no other values. The copies are queued on the call's stream; wait() makes them valid.
class HostMirror {
 public:
  explicit HostMirror(StreamHandle stream) : stream_(static_cast<cudaStream_t>(stream)) {}

  TensorView operator()(const TensorView& t) {
    TensorView host = t;
    host.device = Device{};
    if (t.device.type == DeviceType::kCPU || t.dtype != DType::kInt32 || t.numel() == 0) return host;
    // Strides are non-negative (validated): the elements span [0, 1 + sum (size - 1) * stride).
    std::int64_t span = 1;
    for (int d = 0; d < t.ndim; ++d) span += (t.shape[d] - 1) * t.stride[d];
    std::vector<std::int32_t>& buffer = storage_.emplace_back(static_cast<std::size_t>(span));
    check(cudaMemcpyAsync(buffer.data(), t.data, sizeof(std::int32_t) * buffer.size(), cudaMemcpyDeviceToHost,
                          stream_));
    host.data = buffer.data();
    return host;
  }

  std::optional<TensorView> operator()(const std::optional<TensorView>& t) {
    if (!t) return std::nullopt;
    return (*this)(*t);
  }

  // Relabelled as host memory only: a tensor whose values validation does not read.
  static TensorView relabel(const TensorView& t) {
    TensorView host = t;
    host.device = Device{};
    return host;
  }

  void wait() { check(cudaStreamSynchronize(stream_)); }

 private:
  static void check(cudaError_t status) {
    if (status != cudaSuccess) {
      throw Error(Error::Kind::kCuda, "device",
                  std::string("device: reading index tensors back for CUFLASH_CHECK_INPUTS failed: ") +
                      cudaGetErrorString(status));
    }
  }

  cudaStream_t stream_;
  std::deque<std::vector<std::int32_t>> storage_;  // a deque: earlier buffers keep their addresses
};

void mirror_sequences(SequenceLayout& seq, HostMirror& mirror) {
  seq.cu_seqlens_q = mirror(seq.cu_seqlens_q);
  seq.cu_seqlens_k = mirror(seq.cu_seqlens_k);
  seq.seqused_q = mirror(seq.seqused_q);
  seq.seqused_k = mirror(seq.seqused_k);
  seq.page_table = mirror(seq.page_table);
}

void mirror_options(AttentionOptions& opts, HostMirror& mirror) {
  // The mods' tensors are checked by shape only (their values are the mods' to use).
  for (TensorView& t : opts.score_mod.aux) t = HostMirror::relabel(t);
  for (TensorView& t : opts.mask_mod.aux) t = HostMirror::relabel(t);
  if (opts.block_sparse) {
    BlockSparseTensors& b = *opts.block_sparse;
    for (std::optional<TensorView>* list :
         {&b.mask_block_cnt, &b.mask_block_idx, &b.full_block_cnt, &b.full_block_idx, &b.q_mask_block_cnt,
          &b.q_mask_block_idx, &b.q_full_block_cnt, &b.q_full_block_idx}) {
      *list = mirror(*list);
    }
  }
}

// What forward and backward arguments share: q, k, v, out, lse, the sink, sequences, options.
template <class Args>
void mirror_attention(Args& host, HostMirror& mirror) {
  for (TensorView* t : {&host.q, &host.k, &host.v, &host.out}) *t = mirror(*t);
  host.lse = mirror(host.lse);
  host.learnable_sink = mirror(host.learnable_sink);
  mirror_sequences(host.seq, mirror);
  mirror_options(host.opts, mirror);
}

}  // namespace

void check_index_values_on_host(const ForwardArgs& args, StreamHandle stream) {
  HostMirror mirror(stream);
  ForwardArgs host = args;
  mirror_attention(host, mirror);
  mirror.wait();
  check_forward(host);
}

void check_index_values_on_host(const BackwardArgs& args, StreamHandle stream) {
  HostMirror mirror(stream);
  BackwardArgs host = args;
  mirror_attention(host, mirror);
  for (TensorView* t : {&host.dout, &host.dq, &host.dk, &host.dv}) *t = mirror(*t);
  host.dlse = mirror(host.dlse);
  host.d_sink = mirror(host.d_sink);
  mirror.wait();
  check_backward(host);
}

void check_index_values_on_host(const CombineArgs& args, StreamHandle stream) {
  HostMirror mirror(stream);
  CombineArgs host = args;
  host.out_partial = mirror(args.out_partial);
  host.lse_partial = mirror(args.lse_partial);
  host.out = mirror(args.out);
  host.lse = mirror(args.lse);
  host.cu_seqlens = mirror(args.cu_seqlens);
  host.seqused = mirror(args.seqused);
  mirror.wait();
  check_combine(host);
}

}  // namespace cuflash::detail

#endif  // CUFLASH_HAS_CUDA
