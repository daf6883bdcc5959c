"""Framework adapters: what cuflash needs to know about a tensor of torch, NumPy, CuPy or JAX.

No framework is imported here: a framework can only be in use if its module is already in
``sys.modules``, so that is where each adapter looks. Dtypes are handled by name
(``"float16"``, ``"bfloat16"``, ``"float32"``, ``"int32"``, ...), devices as
``("cpu", 0)`` or ``("cuda", index)``.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

Device = Tuple[str, int]

# The device of a traced JAX value (inside jax.jit or jax.grad): XLA places it, so it matches
# every device.
TRACED: Device = ("traced", 0)

_NUMPY_NAMES = {"float16", "float32", "float64", "int32", "int64", "uint16", "bool"}

# The framework modules once seen in sys.modules. torch.compile traces the adapters' lookups:
# a lookup in sys.modules makes dynamo wrap the whole (large, changing) dict, which fails when
# another thread imports meanwhile ("dictionary changed size during iteration"); this small dict
# is what it reads once the module has been seen.
_LOADED: dict = {}


def loaded_module(name: str) -> Any:
    """The module `name` if it has been imported, else None (never imports it)."""
    module = _LOADED.get(name)
    if module is None:
        module = sys.modules.get(name)
        if module is not None:
            _LOADED[name] = module
    return module


def note_loaded_modules() -> None:
    """Record the frameworks imported so far (called when cuflash is imported and when its torch
    ops are registered, before any trace)."""
    for name in ("torch", "cupy", "jax"):
        loaded_module(name)


def _dtype_name(dtype: Any) -> str:
    """'float16' for torch.float16, numpy.float16, cupy/jax dtypes, strings and ml_dtypes."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = str(dtype)
        if name.startswith("torch."):
            name = name[len("torch."):]
        else:
            try:
                name = np.dtype(dtype).name
            except TypeError:
                pass
    return {"half": "float16", "float": "float32", "int": "int32"}.get(name, name)


class Framework:
    """Operations on one framework's arrays. Subclasses fill them in."""

    name = "?"

    def matches(self, x: Any) -> bool:
        raise NotImplementedError

    def dtype(self, x: Any) -> str:
        return _dtype_name(x.dtype)

    def device(self, x: Any) -> Device:
        return ("cpu", 0)

    def strides(self, x: Any) -> Tuple[int, ...]:
        """Strides in elements."""
        return tuple(s // x.itemsize for s in x.strides)

    def address(self, x: Any) -> Optional[int]:
        """The address of the first element, where the framework says it (None: unknown, or
        always aligned, as JAX's own buffers)."""
        return None

    def empty(self, shape: Sequence[int], dtype: str, like: Any) -> Any:
        raise NotImplementedError

    def zeros(self, shape: Sequence[int], dtype: str, like: Any) -> Any:
        raise NotImplementedError

    def contiguous(self, x: Any) -> Any:
        raise NotImplementedError

    def broadcast_first(self, x: Any, size: int) -> Any:
        """x, whose first dimension is 1, repeated `size` times along it (a contiguous array)."""
        raise NotImplementedError

    def astype(self, x: Any, dtype: str) -> Any:
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        """A host copy (or view) as a NumPy array."""
        raise NotImplementedError

    def from_numpy(self, array: np.ndarray, like: Any) -> Any:
        """`array` on `like`'s device, as this framework's array."""
        raise NotImplementedError

    def stream(self, x: Any) -> int:
        """The handle of the stream to run on for `x` (0: the default stream, or CPU)."""
        return 0

    def export(self, x: Any) -> Any:
        """What crosses to the extension module by DLPack."""
        return x

    def workspace_allocator(self, like: Any) -> Optional[Callable[[int], Any]]:
        """A callable (bytes) -> an exported device array of that many bytes on `like`'s device,
        stream-ordered on `stream(like)`, for the extension's workspace; None: the extension
        takes stream-ordered memory of its own (CUDA's default pool)."""
        return None

    def finish(self, outputs: Sequence[Any], stream: int, like: Any) -> List[Any]:
        """The outputs as returned to the caller (on `like`'s device), once the extension has
        written them."""
        return list(outputs)

    def requires_grad(self, x: Any) -> bool:
        """Whether writing `x` in place would go behind an autograd graph's back."""
        return False

    def mark_written(self, buffers: Sequence[Any]) -> None:
        """The caller's buffers the extension wrote in place (through DLPack, unseen by the
        framework): told to the framework where it tracks writes."""


class NumpyFramework(Framework):
    name = "numpy"

    def matches(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def _np_dtype(self, dtype: str) -> Any:
        if dtype == "bfloat16":
            import ml_dtypes  # only reachable when bfloat16 arrays already exist

            return ml_dtypes.bfloat16
        return np.dtype(dtype)

    def empty(self, shape, dtype, like):
        return np.empty(tuple(shape), dtype=self._np_dtype(dtype))

    def zeros(self, shape, dtype, like):
        return np.zeros(tuple(shape), dtype=self._np_dtype(dtype))

    def contiguous(self, x):
        return np.ascontiguousarray(x)

    def broadcast_first(self, x, size):
        return np.ascontiguousarray(np.broadcast_to(x, (size,) + tuple(x.shape[1:])))

    def astype(self, x, dtype):
        return x.astype(self._np_dtype(dtype))

    def to_numpy(self, x):
        return x

    def from_numpy(self, array, like):
        return array

    def address(self, x):
        return int(x.__array_interface__["data"][0])

    def export(self, x):
        # NumPy's DLPack has no bfloat16: pass the bits as uint16 (read as bfloat16 by _C).
        if x.dtype.name == "bfloat16":
            return x.view(np.uint16)
        return x


class TorchFramework(Framework):
    name = "torch"

    @property
    def torch(self):
        return loaded_module("torch")

    def matches(self, x):
        torch = loaded_module("torch")
        return torch is not None and isinstance(x, torch.Tensor)

    def device(self, x):
        device = x.device
        if device.type == "cpu":
            return ("cpu", 0)
        if device.type == "cuda":
            return ("cuda", device.index if device.index is not None else 0)
        return (device.type, device.index or 0)

    def strides(self, x):
        return tuple(x.stride())

    def address(self, x):
        compiler = getattr(self.torch, "compiler", None)
        if compiler is not None and getattr(compiler, "is_compiling", lambda: False)():
            # torch.compile cannot read an address while it traces the call: unknown (the C++ API
            # refuses an unaligned start by name when the graph runs).
            return None
        return int(x.data_ptr())

    def _dtype(self, dtype):
        return getattr(self.torch, dtype)

    def empty(self, shape, dtype, like):
        return self.torch.empty(tuple(shape), dtype=self._dtype(dtype), device=like.device)

    def zeros(self, shape, dtype, like):
        return self.torch.zeros(tuple(shape), dtype=self._dtype(dtype), device=like.device)

    def contiguous(self, x):
        return x.contiguous()

    def broadcast_first(self, x, size):
        return x.expand(size, *x.shape[1:]).contiguous()

    def astype(self, x, dtype):
        return x.to(self._dtype(dtype))

    def to_numpy(self, x):
        return x.detach().cpu().numpy()

    def from_numpy(self, array, like):
        return self.torch.from_numpy(np.ascontiguousarray(array)).to(like.device)

    def stream(self, x):
        if x.device.type == "cuda":
            return self.torch.cuda.current_stream(x.device).cuda_stream
        return 0

    def export(self, x):
        # DLPack export refuses tensors that require grad; autograd is handled above this layer.
        return x.detach()

    def requires_grad(self, x):
        return self.torch.is_grad_enabled() and x.requires_grad

    def mark_written(self, buffers):
        # A write through DLPack leaves the version counter as it was: bumped here, so that an
        # autograd node that saved the buffer fails its version check rather than reading the
        # new contents as if they were the saved ones.
        buffers = [x for x in buffers if x is not None]
        if buffers:
            self.torch.autograd.graph.increment_version(buffers)

    def workspace_allocator(self, like):
        # From the caching allocator, on the current stream (the one the call runs on): counted
        # in torch.cuda.memory_allocated, reused across calls, never a driver allocation per call.
        if like.device.type != "cuda":
            return None
        torch, device = self.torch, like.device
        return lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, device=device)


def _on_device(cupy: Any, device: Any, nbytes: int) -> Any:
    with device:
        return cupy.empty(nbytes, dtype=cupy.uint8)


class CupyFramework(Framework):
    name = "cupy"

    @property
    def cupy(self):
        return loaded_module("cupy")

    def matches(self, x):
        cupy = loaded_module("cupy")
        return cupy is not None and isinstance(x, cupy.ndarray)

    def device(self, x):
        return ("cuda", int(x.device.id))

    def address(self, x):
        return int(x.data.ptr)

    def empty(self, shape, dtype, like):
        with like.device:
            return self.cupy.empty(tuple(shape), dtype=dtype)

    def zeros(self, shape, dtype, like):
        with like.device:
            return self.cupy.zeros(tuple(shape), dtype=dtype)

    def contiguous(self, x):
        with x.device:
            return self.cupy.ascontiguousarray(x)

    def broadcast_first(self, x, size):
        with x.device:
            return self.cupy.ascontiguousarray(self.cupy.broadcast_to(x, (size,) + tuple(x.shape[1:])))

    def astype(self, x, dtype):
        with x.device:
            return x.astype(dtype)

    def to_numpy(self, x):
        return self.cupy.asnumpy(x)

    def from_numpy(self, array, like):
        with like.device:
            return self.cupy.asarray(array)

    def stream(self, x):
        # The current stream of x's device (each device has its own), not of the current device.
        with x.device:
            return int(self.cupy.cuda.get_current_stream().ptr)

    def workspace_allocator(self, like):
        # From CuPy's memory pool, whose blocks are kept per stream: the call runs on the
        # current stream, where the block is allocated and, once the call returns, freed.
        cupy, device = self.cupy, like.device
        return lambda nbytes: _on_device(cupy, device, nbytes)


class JaxFramework(Framework):
    """JAX arrays. Where the extension has the XLA FFI handlers, attention runs as XLA custom
    calls (python/cuflash/_jax.py), for eager and traced (jax.jit, jax.grad) values alike, and
    only the checks below are used. Otherwise, and for flash_attn_combine, eager arrays cross
    by DLPack: JAX arrays are immutable, so outputs are first allocated as buffers that cuflash
    owns (NumPy on the CPU, a CUDA allocation on the GPU), filled, and then handed to JAX (a
    copy on the CPU, zero-copy by DLPack on the GPU); that call is synchronous on the GPU, as
    JAX exposes no stream to join."""

    name = "jax"

    @property
    def jax(self):
        return loaded_module("jax")

    def matches(self, x):
        jax = loaded_module("jax")
        return jax is not None and isinstance(x, jax.Array)

    def _is_jax(self, x):
        return isinstance(x, self.jax.Array)

    def _is_tracer(self, x):
        tracer = getattr(getattr(self.jax, "core", None), "Tracer", None)
        return tracer is not None and isinstance(x, tracer)

    def device(self, x):
        if not self._is_jax(x):  # a buffer of our own, before it becomes a JAX array
            return ("cpu", 0) if isinstance(x, np.ndarray) else ("cuda", int(x.__dlpack_device__()[1]))
        if self._is_tracer(x):
            return TRACED
        # An array over several devices (sharded: the XLA custom calls partition over its mesh)
        # stands for its mesh's first device.
        devices = sorted(x.devices(), key=lambda d: d.id)
        platform = devices[0].platform
        if platform == "gpu":
            return ("cuda", int(getattr(devices[0], "local_hardware_id", devices[0].id)))
        return (platform, 0)

    def dtype(self, x):
        return _dtype_name(x.dtype)

    def strides(self, x):
        if isinstance(x, np.ndarray):
            return super().strides(x)
        # JAX arrays (and our CUDA buffers) are row-major.
        strides, running = [], 1
        for size in reversed(tuple(x.shape)):
            strides.append(running)
            running *= size
        return tuple(reversed(strides))

    def _buffer(self, shape, dtype, like, zero):
        device = self.device(like)
        if device[0] == "cuda":
            from . import _C

            return _C.CudaBuffer([int(s) for s in shape], dtype, device[1], zero)
        return NumpyFramework().zeros(shape, dtype, None) if zero else NumpyFramework().empty(shape, dtype, None)

    def empty(self, shape, dtype, like):
        return self._buffer(shape, dtype, like, zero=False)

    def zeros(self, shape, dtype, like):
        return self._buffer(shape, dtype, like, zero=True)

    def contiguous(self, x):
        return x

    def broadcast_first(self, x, size):
        return self.jax.numpy.broadcast_to(x, (size,) + tuple(x.shape[1:]))

    def astype(self, x, dtype):
        return x.astype(dtype)

    def to_numpy(self, x):
        return np.asarray(x)

    def from_numpy(self, array, like):
        if self._is_tracer(like):
            return self.jax.numpy.asarray(array)
        return self.jax.device_put(array, list(like.devices())[0])

    def export(self, x):
        if not self._is_jax(x):
            return NumpyFramework().export(x) if isinstance(x, np.ndarray) else x
        if self.device(x)[0] == "cuda":
            # The legacy default stream (DLPack's 1), where cuflash runs, waits for x.
            return x.__dlpack__(stream=1)
        return x

    def finish(self, outputs, stream, like):
        outputs = list(outputs)
        if any(not isinstance(o, np.ndarray) for o in outputs if o is not None):
            from . import _C

            _C.stream_synchronize(stream)
        device = list(like.devices())[0]
        return [None if o is None else self.jax.device_put(o, device) if isinstance(o, np.ndarray)
                else self.jax.numpy.from_dlpack(o) for o in outputs]


_FRAMEWORKS = (NumpyFramework(), TorchFramework(), CupyFramework(), JaxFramework())


def framework_of(x: Any) -> Optional[Framework]:
    """The adapter for `x`, or None when `x` is no array cuflash knows."""
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes, tuple, list, dict)):
        return None  # answered without looking a framework up (a torch.compile trace reads this)
    for framework in _FRAMEWORKS:
        if framework.matches(x):
            return framework
    return None


def is_tensor(x: Any) -> bool:
    return framework_of(x) is not None
