"""Framework adapters: what cuflash needs to know about a tensor of torch, NumPy, CuPy or JAX.

No framework is imported here: a framework can only be in use if its module is already in
``sys.modules``, so that is where each adapter looks. Dtypes are handled by name
(``"float16"``, ``"bfloat16"``, ``"float32"``, ``"int32"``, ...), devices as
``("cpu", 0)`` or ``("cuda", index)``.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Tuple

import numpy as np

Device = Tuple[str, int]

_NUMPY_NAMES = {"float16", "float32", "float64", "int32", "int64", "uint16", "bool"}


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

    def empty(self, shape: Sequence[int], dtype: str, like: Any) -> Any:
        raise NotImplementedError

    def zeros(self, shape: Sequence[int], dtype: str, like: Any) -> Any:
        raise NotImplementedError

    def contiguous(self, x: Any) -> Any:
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

    def finish(self, outputs: Sequence[Any], stream: int) -> None:
        """Called after the extension has written `outputs` (e.g. to synchronise)."""


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

    def astype(self, x, dtype):
        return x.astype(self._np_dtype(dtype))

    def to_numpy(self, x):
        return x

    def from_numpy(self, array, like):
        return array

    def export(self, x):
        # NumPy's DLPack has no bfloat16: pass the bits as uint16 (read as bfloat16 by _C).
        if x.dtype.name == "bfloat16":
            return x.view(np.uint16)
        return x


class TorchFramework(Framework):
    name = "torch"

    @property
    def torch(self):
        return sys.modules["torch"]

    def matches(self, x):
        torch = sys.modules.get("torch")
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

    def _dtype(self, dtype):
        return getattr(self.torch, dtype)

    def empty(self, shape, dtype, like):
        return self.torch.empty(tuple(shape), dtype=self._dtype(dtype), device=like.device)

    def zeros(self, shape, dtype, like):
        return self.torch.zeros(tuple(shape), dtype=self._dtype(dtype), device=like.device)

    def contiguous(self, x):
        return x.contiguous()

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


class CupyFramework(Framework):
    name = "cupy"

    @property
    def cupy(self):
        return sys.modules["cupy"]

    def matches(self, x):
        cupy = sys.modules.get("cupy")
        return cupy is not None and isinstance(x, cupy.ndarray)

    def device(self, x):
        return ("cuda", int(x.device.id))

    def empty(self, shape, dtype, like):
        with like.device:
            return self.cupy.empty(tuple(shape), dtype=dtype)

    def zeros(self, shape, dtype, like):
        with like.device:
            return self.cupy.zeros(tuple(shape), dtype=dtype)

    def contiguous(self, x):
        with x.device:
            return self.cupy.ascontiguousarray(x)

    def astype(self, x, dtype):
        with x.device:
            return x.astype(dtype)

    def to_numpy(self, x):
        return self.cupy.asnumpy(x)

    def from_numpy(self, array, like):
        with like.device:
            return self.cupy.asarray(array)

    def stream(self, x):
        return int(self.cupy.cuda.get_current_stream().ptr)


class JaxFramework(Framework):
    """Eager JAX arrays. Outputs are fresh JAX buffers that the extension fills in place before
    they are returned, and the call is synchronous on the GPU (JAX exposes no stream to join);
    traced values inside jax.jit are refused."""

    name = "jax"

    @property
    def jnp(self):
        return sys.modules["jax"].numpy

    def matches(self, x):
        jax = sys.modules.get("jax")
        return jax is not None and isinstance(x, jax.Array)

    def device(self, x):
        devices = list(x.devices())
        if len(devices) != 1:
            raise ValueError("cuflash takes JAX arrays on a single device")
        platform = devices[0].platform
        return ("cuda" if platform == "gpu" else platform, int(devices[0].id) if platform == "gpu" else 0)

    def strides(self, x):
        # JAX arrays are always row-major.
        strides, running = [], 1
        for size in reversed(x.shape):
            strides.append(running)
            running *= size
        return tuple(reversed(strides))

    def _place(self, array, like):
        jax = sys.modules["jax"]
        return jax.device_put(array, list(like.devices())[0])

    def empty(self, shape, dtype, like):
        return self._place(self.jnp.zeros(tuple(shape), dtype=dtype), like)

    def zeros(self, shape, dtype, like):
        return self.empty(shape, dtype, like)

    def contiguous(self, x):
        return x

    def astype(self, x, dtype):
        return x.astype(dtype)

    def to_numpy(self, x):
        return np.asarray(x)

    def from_numpy(self, array, like):
        return self._place(self.jnp.asarray(array), like)

    def export(self, x):
        if self.device(x)[0] == "cuda":
            # The legacy default stream (DLPack's 1) waits for the producer's work on x.
            return x.__dlpack__(stream=1)
        return x

    def finish(self, outputs, stream):
        if outputs and self.device(outputs[0])[0] == "cuda":
            from . import _C

            _C.stream_synchronize(0)


_FRAMEWORKS = (NumpyFramework(), TorchFramework(), CupyFramework(), JaxFramework())


def framework_of(x: Any) -> Optional[Framework]:
    """The adapter for `x`, or None when `x` is no array cuflash knows."""
    for framework in _FRAMEWORKS:
        if framework.matches(x):
            return framework
    return None


def is_tensor(x: Any) -> bool:
    return framework_of(x) is not None
