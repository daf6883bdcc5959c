"""Kernels compiled at run time for score_mod / mask_mod callables on the GPU.

A traced callable (cuflash.mods.TracedMod) becomes a C++ functor (cuflash._codegen); this module
puts it into the library's flex kernel templates (variants::FlexVariantOf, the same templates the
built-in mods are compiled from), compiles forward and backward for the call's dtype and head
dims into a shared library with nvcc, caches it, and hands the extension the addresses of its two
`extern "C"` launchers, which dispatch runs in place of the built-in flex kernels (after the same
checks and workspace set-up).

The generated source depends only on the structure of the programs (constants and tensors come
from the call's parameters), so one compiled module serves every call with the same structure,
dtype and head dims. Modules are cached in memory and on disk, under $CUFLASH_CACHE_DIR or
~/.cache/cuflash/kernels, keyed by a hash of the source, the compiler and its flags.

What is needed at run time: nvcc (CUDA_HOME/bin or PATH), the CUTLASS headers ($CUTLASS_DIR or
the nvidia-cutlass wheel) and the cuflash kernel headers (installed with the package under
cuflash/_kernels, or a source tree: $CUFLASH_SOURCE_DIR, or the checkout the package runs from).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
from typing import Dict, List, Tuple

from . import _C, _codegen

_ELEMENTS = {"float16": "cutlass::half_t", "bfloat16": "cutlass::bfloat16_t"}

_FLAGS = [
    "-O3", "-std=c++17", "-shared", "-Xcompiler=-fPIC", "-gencode=arch=compute_90a,code=sm_90a",
    "--expt-relaxed-constexpr", "--expt-extended-lambda", "-DCUFLASH_HAS_CUDA=1",
    "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED", "-DCUTLASS_ENABLE_GDC_FOR_SM90", "-DNDEBUG",
    "-Xcompiler=-Wno-unused-parameter",
]

_lock = threading.Lock()
_loaded: Dict[str, Tuple[ctypes.CDLL, int, int]] = {}


class JitError(RuntimeError):
    """A kernel for a callable could not be built (no compiler, headers, or a compile error)."""


def kernel_head_dims(head_dim: int, head_dim_v: int) -> Tuple[int, int]:
    """The compiled (head_dim, head_dim_v) that run a call's, as dispatch picks them.

    The rule is the library's own (cuflash::kernel_head_dims): a module built here stands in for
    the kernel dispatch would have picked, so it must instantiate the same dims."""
    dims = tuple(_C.kernel_head_dims(head_dim, head_dim_v))
    if dims == (0, 0):
        raise JitError(f"no kernel holds head dims {head_dim} / {head_dim_v} (at most 256)")
    return dims


def kernel_source(score, mask, dtype: str, head_dim: int, head_dim_v: int, split: bool = False,
                  paged: bool = False, pack_gqa: bool = False) -> str:
    """The module for TracedMods `score` / `mask` (either may be None: the built-in switch then
    serves the other side, holding a built-in mod or none). `split` / `paged` / `pack_gqa`: the
    forward launcher is the split-KV (num_splits > 1) / paged-KV (page_table) / packed-GQA
    (pack_gqa) form of the flex kernel, as the library's flex_split / flex_paged / flex_packgqa
    kernels; it refuses a call of another form. The backward is the same for all: paged calls run
    it on the gathered rows, and split and packing are forward options."""
    if dtype not in _ELEMENTS:
        raise JitError(f"callables on the GPU take float16 or bfloat16 inputs, got {dtype}")
    hdim, hdim_v = kernel_head_dims(head_dim, head_dim_v)
    parts = ['#include "sm90/flash_fwd_launch_sm90.hpp"', '#include "sm90/flash_bwd_launch_sm90.hpp"']
    score_switch, mask_switch = "cuflash::variants::ScoreModSwitch", "cuflash::variants::MaskModSwitch"
    if score is not None:
        parts.append(_codegen.functor_source(score, "CuflashExprScore"))
        score_switch = "CuflashExprScoreSwitch"
    if mask is not None:
        parts.append(_codegen.functor_source(mask, "CuflashExprMask"))
        mask_switch = "CuflashExprMaskSwitch"
    element = _ELEMENTS[dtype]
    flag = lambda on: "true" if on else "false"  # noqa: E731
    form = ", ".join([("split-KV" if split else "one-split"), ("paged" if paged else "unpaged"),
                      ("packed-GQA" if pack_gqa else "unpacked")])
    parts.append(f"""
using CuflashExprVariant = cuflash::variants::FlexVariantOf<{score_switch}, {mask_switch}>;

extern "C" unsigned long long cuflash_expression_abi() {{ return cuflash::params_abi_tag(); }}

extern "C" void cuflash_expression_forward(cuflash::FwdParams* params, cudaStream_t stream) {{
  constexpr bool kSplit = {flag(split)}, kPaged = {flag(paged)}, kPackGqa = {flag(pack_gqa)};
  char const* other = (params->num_splits > 1) != kSplit          ? "num_splits"
                      : (params->page_table != nullptr) != kPaged ? "page_table"
                      : params->pack_gqa != kPackGqa              ? "pack_gqa"
                                                                  : nullptr;
  if (other != nullptr) {{
    throw cuflash::Error(cuflash::Error::Kind::kNotSupported, other,
                         "the kernel compiled for this score_mod / mask_mod callable is the "
                         "{form} form; the call needs another (cuflash._jit.kernel_source's "
                         "split / paged / pack_gqa)");
  }}
  cuflash::sm90::run_flash_fwd_sm90<{element}, {hdim}, {hdim_v}, /*kHasSoftcap=*/false,
                                    kSplit, CuflashExprVariant, kPaged, kPackGqa>(*params, stream);
}}

extern "C" void cuflash_expression_backward(cuflash::BwdParams* params, cudaStream_t stream) {{
  cuflash::sm90::bwd::run_bwd_flex<{element}, {hdim}, {hdim_v}, CuflashExprVariant>(*params, stream);
}}
""")
    return "\n".join(parts)


def _nvcc() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (pathlib.Path(home) / "bin" / "nvcc").exists():
        return str(pathlib.Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if found is None:
        raise JitError("nvcc not found (set CUDA_HOME or put it on PATH): score_mod / mask_mod callables "
                       "are compiled into kernels at run time on the GPU")
    return found


def _cutlass_include() -> str:
    candidates: List[pathlib.Path] = []
    if os.environ.get("CUTLASS_DIR"):
        root = pathlib.Path(os.environ["CUTLASS_DIR"])
        candidates += [root / "include", root]
    try:
        import cutlass_library  # the nvidia-cutlass wheel ships the headers

        candidates.append(pathlib.Path(cutlass_library.__file__).parent / "source" / "include")
    except ImportError:
        pass
    for path in candidates:
        if (path / "cute" / "tensor.hpp").exists():
            return str(path)
    raise JitError("CUTLASS headers not found (set CUTLASS_DIR or `pip install nvidia-cutlass`): "
                   "score_mod / mask_mod callables are compiled into kernels at run time on the GPU")


def _kernel_includes() -> List[str]:
    """[include, src] of the cuflash kernel headers."""
    package = pathlib.Path(__file__).resolve().parent
    roots = []
    if os.environ.get("CUFLASH_SOURCE_DIR"):
        roots.append(pathlib.Path(os.environ["CUFLASH_SOURCE_DIR"]))
    roots += [package / "_kernels", package.parent.parent]  # installed; or the source checkout
    for root in roots:
        if (root / "src" / "sm90" / "flash_fwd_launch_sm90.hpp").exists() and \
                (root / "include" / "cuflash" / "options.hpp").exists():
            return [str(root / "include"), str(root / "src")]
    raise JitError("the cuflash kernel headers were not found (a package built without CUDA, or set "
                   "CUFLASH_SOURCE_DIR to a cuflash source tree)")


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("CUFLASH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cuflash")
    path = pathlib.Path(root) / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


# The compiler's version and the kernel headers' stamps enter the cache key; both are read once
# per process (a call with a callable would otherwise run nvcc and walk the headers every time).
@functools.lru_cache(maxsize=None)
def _compiler_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout


@functools.lru_cache(maxsize=None)
def _headers_stamp(includes: Tuple[str, ...]) -> str:
    return "".join(f"{p}:{p.stat().st_mtime_ns}" for inc in includes for p in sorted(pathlib.Path(inc).rglob("*.hpp")))


def build(source: str) -> pathlib.Path:
    """Compiles `source` (kernel_source) into a cached shared library; returns its path."""
    nvcc = _nvcc()
    includes = [_cutlass_include()] + _kernel_includes()
    key = hashlib.sha256("\0".join([source, _compiler_version(nvcc), " ".join(_FLAGS), *includes,
                                    _headers_stamp(tuple(includes[1:]))]).encode()).hexdigest()[:32]
    target = _cache_dir() / f"cuflash_expr_{key}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(prefix="cuflash_jit_") as work:
        src = pathlib.Path(work) / "module.cu"
        src.write_text(source)
        out = pathlib.Path(work) / "module.so"
        command = [nvcc, *_FLAGS, *[f"-I{inc}" for inc in includes], "-o", str(out), str(src)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise JitError("compiling the kernel for a score_mod / mask_mod callable failed:\n"
                           + result.stderr[-4000:])
        # Rename into place: another process building the same module meanwhile loses nothing.
        staged = target.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(out, staged)
        os.replace(staged, target)
    return target


def load(path: pathlib.Path, expected_abi: int) -> Tuple[int, int]:
    """Loads a built module (once per process): the addresses of its forward and backward
    launchers, after checking that it was built against the extension's parameter layouts."""
    key = str(path)
    with _lock:
        if key not in _loaded:
            library = ctypes.CDLL(key)
            library.cuflash_expression_abi.restype = ctypes.c_ulonglong
            abi = int(library.cuflash_expression_abi())
            if abi != expected_abi:
                raise JitError(f"the kernel module {path} was built against other parameter layouts "
                               f"({abi:#x}, this extension has {expected_abi:#x}); remove it from the cache")
            address = lambda name: ctypes.cast(getattr(library, name), ctypes.c_void_p).value  # noqa: E731
            _loaded[key] = (library, address("cuflash_expression_forward"), address("cuflash_expression_backward"))
        _, forward, backward = _loaded[key]
    return forward, backward


def expression_module(score, mask, dtype: str, head_dim: int, head_dim_v: int, split: bool = False,
                      paged: bool = False, pack_gqa: bool = False) -> pathlib.Path:
    """The compiled module for traced `score` / `mask` (None: not a callable), built if it is not
    in the cache; split / paged / pack_gqa as kernel_source."""
    return build(kernel_source(score, mask, dtype, head_dim, head_dim_v, split, paged, pack_gqa))


def expression_kernels(score, mask, dtype: str, head_dim: int, head_dim_v: int, expected_abi: int,
                       split: bool = False, paged: bool = False, pack_gqa: bool = False) -> Tuple[int, int]:
    """(forward, backward) launcher addresses of expression_module's module, loaded into this
    process; found by structure after the first call (every call with a callable asks)."""
    key = (None if score is None else score.structure_key(), None if mask is None else mask.structure_key(), dtype,
           head_dim, head_dim_v, expected_abi, split, paged, pack_gqa, str(_cache_dir()))
    kernels = _kernels_by_structure.get(key)
    if kernels is None:
        kernels = load(expression_module(score, mask, dtype, head_dim, head_dim_v, split, paged, pack_gqa),
                       expected_abi)
        _kernels_by_structure[key] = kernels
    return kernels


_kernels_by_structure: Dict[tuple, Tuple[int, int]] = {}


def enabled() -> bool:
    """Callables on the GPU through kernels compiled at run time: on unless CUFLASH_JIT_CALLABLES=0
    (for a deployment that must not run nvcc; such calls then raise an error that says so)."""
    return os.environ.get("CUFLASH_JIT_CALLABLES", "1").strip().lower() not in ("0", "false", "off", "no")

