"""Run-time compilation and launch of the CUDA sources in ``cuda/`` (NVRTC through cuda-python).

Flow: read a ``.cu`` source and every ``.cuh`` header beside it; compile with NVRTC for the running
device's real architecture (``--gpu-architecture=sm_90`` on H100/H200) to a cubin; cache the cubin
on disk under ``$VLLM_TFM_CACHE`` (default ``~/.cache/vllm_tfm/kernels``) keyed by
sha256(source + headers + options + arch + NVRTC version); load it with ``cuModuleLoadData`` into
the device's primary context (the one torch uses); launch with ``cuLaunchKernel`` on
``torch.cuda.current_stream()`` with torch-allocated buffers passed by ``data_ptr()``.

Every driver and NVRTC call's status is checked; an NVRTC failure raises :class:`KernelCompileError`
carrying the full compile log. When cuda-python (or NVRTC, or a CUDA device, or the sources) is
missing, :func:`kernels_available` returns False and :func:`warn_fallback` tells the user once;
the torch-facing wrappers then call the torch reference in ``vllm_tfm.verify`` instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import tempfile
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "KernelCompileError",
    "KernelLaunchError",
    "aligned_rows",
    "CompiledKernel",
    "cache_dir",
    "cache_key",
    "compile_cubin",
    "cuda_source_dir",
    "device_arch",
    "device_smem_optin",
    "get_cubin",
    "get_kernel",
    "kernels_available",
    "kernels_unavailable_reason",
    "launch",
    "needs_smem_optin",
    "param_array",
    "nvrtc_version",
    "read_sources",
    "tensor_device_index",
    "warn_fallback",
]

MIN_COMPUTE_CAPABILITY = (7, 0)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a source; ``log`` holds the compiler's full output."""

    def __init__(self, source_name: str, options: Sequence[str], log: str) -> None:
        self.source_name = source_name
        self.options = list(options)
        self.log = log
        super().__init__(f"NVRTC failed to compile {source_name} with {' '.join(self.options)}:\n{log}")


class KernelLaunchError(RuntimeError):
    """A CUDA driver call failed (module load, function lookup, launch)."""


# ---------------------------------------------------------------------------------------------
# cuda-python import (lazy, so that importing vllm_tfm never needs CUDA)

_cuda_modules: tuple[Any, Any] | None = None
_cuda_import_error: str | None = None


def _import_cuda() -> tuple[Any, Any]:
    """(driver, nvrtc) from ``cuda.bindings``; raises ImportError with the reason."""
    global _cuda_modules, _cuda_import_error
    if _cuda_modules is not None:
        return _cuda_modules
    if _cuda_import_error is not None:
        raise ImportError(_cuda_import_error)
    try:
        from cuda.bindings import driver, nvrtc  # type: ignore[import-not-found]
    except ImportError as exc:
        try:  # cuda-python < 12.6 exposes the same calls as cuda.cuda / cuda.nvrtc
            from cuda import cuda as driver  # type: ignore[import-not-found,no-redef]
            from cuda import nvrtc  # type: ignore[import-not-found,no-redef]
        except ImportError:
            _cuda_import_error = f"cuda-python (cuda.bindings) is not importable: {exc}"
            raise ImportError(_cuda_import_error) from exc
    _cuda_modules = (driver, nvrtc)
    return _cuda_modules


def _check_nvrtc(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings.nvrtc return tuple, raising on a non-success status."""
    _, nvrtc = _import_cuda()
    err = result[0] if isinstance(result, tuple) else result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        name = nvrtc.nvrtcGetErrorString(err)
        name = name[1] if isinstance(name, tuple) else name
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        raise KernelLaunchError(f"{what} failed: {name}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


def _check_cu(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings.driver return tuple, raising KernelLaunchError on an error status."""
    driver, _ = _import_cuda()
    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        name = driver.cuGetErrorName(err)
        text = name[1].decode(errors="replace") if isinstance(name, tuple) and name[1] else str(err)
        raise KernelLaunchError(f"{what} failed: {text}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library cuda-python loads."""
    _, nvrtc = _import_cuda()
    major, minor = _check_nvrtc(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


def nvrtc_supported_archs() -> list[int]:
    _, nvrtc = _import_cuda()
    return [int(a) for a in _check_nvrtc(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")]


# ---------------------------------------------------------------------------------------------
# sources and cache


def _out_buffer(size: int) -> bytes:
    """A fresh writable buffer of at least ``size`` bytes for an NVRTC "get" call.

    cuda-python writes into the bytes object it is given. ``b" " * n`` for n <= 1 returns one of
    CPython's shared, interned single-byte objects: NVRTC writing its NUL into that corrupts
    ``b" "`` for the whole interpreter (seen: a later torch.load failed). Two bytes or more are
    always a new object.
    """
    return b"\x01" * max(size, 2)


def cuda_source_dir() -> Path:
    """Directory holding the ``.cu``/``.cuh`` sources.

    ``$VLLM_TFM_CUDA_DIR`` if set, else ``vllm_tfm/kernels/cuda`` inside the installed package
    when present, else the repository's top-level ``cuda/`` (a source checkout).
    """
    env = os.environ.get("VLLM_TFM_CUDA_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    for cand in (here / "cuda", here.parent.parent / "cuda"):
        if (cand / "tfm_common.cuh").is_file():
            return cand
    return here.parent.parent / "cuda"


def cache_dir() -> Path:
    """``$VLLM_TFM_CACHE`` or ``~/.cache/vllm_tfm/kernels``."""
    env = os.environ.get("VLLM_TFM_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vllm_tfm" / "kernels"


def read_sources(source_name: str, source_dir: Path | None = None) -> tuple[str, dict[str, str]]:
    """(source text, {header name: text}) for ``source_name`` and every ``.cuh`` beside it."""
    root = source_dir or cuda_source_dir()
    path = root / source_name
    if not path.is_file():
        raise FileNotFoundError(f"CUDA source {path} not found (set VLLM_TFM_CUDA_DIR to the cuda/ folder)")
    headers = {p.name: p.read_text() for p in sorted(root.glob("*.cuh"))}
    return path.read_text(), headers


def cache_key(
    source: str, headers: dict[str, str], options: Sequence[str], arch: str, nvrtc_ver: tuple[int, int]
) -> str:
    """sha256 over everything that determines the cubin: source, headers, options, arch, NVRTC."""
    h = hashlib.sha256()
    for part in (source, *(f"{name}\0{text}" for name, text in sorted(headers.items())), *options, arch,
                 f"nvrtc {nvrtc_ver[0]}.{nvrtc_ver[1]}"):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def compile_cubin(
    source: str, source_name: str, headers: dict[str, str], options: Sequence[str], arch: str
) -> bytes:
    """Compile one CUDA C++ source with NVRTC for ``arch`` (e.g. "sm_90"); return the cubin.

    Raises KernelCompileError with the compile log when NVRTC rejects the source.
    """
    _, nvrtc = _import_cuda()
    names = list(headers)
    prog = _check_nvrtc(
        nvrtc.nvrtcCreateProgram(
            source.encode(), source_name.encode(), len(names),
            [headers[n].encode() for n in names], [n.encode() for n in names],
        ),
        "nvrtcCreateProgram",
    )
    try:
        opts = [f"--gpu-architecture={arch}", *options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        log_size = _check_nvrtc(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = _out_buffer(int(log_size))
        _check_nvrtc(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        log_text = bytes(log[: int(log_size)]).rstrip(b"\0 ").decode(errors="replace")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(source_name, opts, log_text or str(err))
        if log_text.strip():
            logger.debug("NVRTC log for %s: %s", source_name, log_text)
        size = _check_nvrtc(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = _out_buffer(int(size))
        _check_nvrtc(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return bytes(cubin[: int(size)])
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def get_cubin(source_name: str, options: Sequence[str], arch: str, source_dir: Path | None = None) -> bytes:
    """The cubin for (source, options, arch): from the disk cache, else compiled and cached."""
    source, headers = read_sources(source_name, source_dir)
    key = cache_key(source, headers, options, arch, nvrtc_version())
    folder = cache_dir()
    path = folder / f"{Path(source_name).stem}-{arch}-{key[:32]}.cubin"
    if path.is_file():
        return path.read_bytes()
    cubin = compile_cubin(source, source_name, headers, options, arch)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)  # atomic: concurrent processes never read a partial file
    except OSError as exc:  # a read-only cache is not fatal, only slower
        logger.warning("could not write the kernel cache %s: %s", path, exc)
    return cubin


# ---------------------------------------------------------------------------------------------
# device, modules, launch


def device_arch(device_index: int) -> str:
    """"sm_XY" for a CUDA device (torch's view of it)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


@dataclass(frozen=True)
class CompiledKernel:
    """A loaded kernel: its CUfunction, the device it lives on and the source it came from."""

    function: Any
    device_index: int
    name: str
    max_dynamic_smem: int
    static_smem: int = 0  # the kernel's own __shared__ arrays; static + dynamic > 48 KB needs the opt-in


_lock = threading.Lock()
_modules: dict[tuple[str, tuple[str, ...], int], Any] = {}
_kernels: dict[tuple[str, tuple[str, ...], int, str], CompiledKernel] = {}
_smem_set: dict[tuple[int, str, int], int] = {}


def _ensure_context(device_index: int) -> None:
    """Make the device's primary context (torch's) current on this thread."""
    driver, _ = _import_cuda()
    import torch

    torch.cuda.init()
    _check_cu(driver.cuInit(0), "cuInit")
    dev = _check_cu(driver.cuDeviceGet(device_index), "cuDeviceGet")
    ctx = _check_cu(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    current = _check_cu(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if current is None or int(current) != int(ctx):
        _check_cu(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def get_kernel(source_name: str, kernel_name: str, options: Sequence[str], device_index: int) -> CompiledKernel:
    """Compile (or fetch from cache), load and look up ``kernel_name`` on ``device_index``."""
    opts = tuple(options)
    kkey = (source_name, opts, device_index, kernel_name)
    found = _kernels.get(kkey)
    if found is not None:
        return found
    driver, _ = _import_cuda()
    with _lock:
        found = _kernels.get(kkey)
        if found is not None:
            return found
        _ensure_context(device_index)
        mkey = (source_name, opts, device_index)
        module = _modules.get(mkey)
        if module is None:
            cubin = get_cubin(source_name, opts, device_arch(device_index))
            module = _check_cu(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({source_name})")
            _modules[mkey] = module
        func = _check_cu(driver.cuModuleGetFunction(module, kernel_name.encode()), f"cuModuleGetFunction({kernel_name})")
        optin = device_smem_optin(device_index)
        static = _check_cu(
            driver.cuFuncGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func),
            f"cuFuncGetAttribute({kernel_name}, SHARED_SIZE_BYTES)",
        )
        kernel = CompiledKernel(func, device_index, kernel_name, int(optin) - int(static), int(static))
        _kernels[kkey] = kernel
        return kernel


_smem_optin: dict[int, int] = {}


def device_smem_optin(device_index: int) -> int:
    """Largest dynamic shared memory one block may opt into on the device (bytes; cached)."""
    found = _smem_optin.get(device_index)
    if found is not None:
        return found
    driver, _ = _import_cuda()
    _ensure_context(device_index)
    dev = _check_cu(driver.cuDeviceGet(device_index), "cuDeviceGet")
    value = int(
        _check_cu(
            driver.cuDeviceGetAttribute(
                driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev
            ),
            "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)",
        )
    )
    _smem_optin[device_index] = value
    return value


_TENSOR: list[type] = []  # torch.Tensor, looked up once (the loader imports torch lazily)


def _ctype_arg(value: Any) -> ctypes._SimpleCData:
    """Kernel argument -> ctypes value. Tensors and None become pointers; ints must be wrapped.

    Called for every argument of every launch (about 20 per launch, hundreds of launches per
    decode step): the common cases are tested first, without an import per call."""
    if not _TENSOR:
        import torch

        _TENSOR.append(torch.Tensor)
    if isinstance(value, _TENSOR[0]):
        return ctypes.c_void_p(value.data_ptr())
    if isinstance(value, ctypes._SimpleCData):
        return value
    if value is None:
        return ctypes.c_void_p(0)
    raise TypeError(
        f"kernel argument {value!r}: pass a tensor, None, or a ctypes value (c_int, c_longlong, c_float)"
    )


DEFAULT_SMEM_LIMIT = 48 * 1024  # what a block may use without cuFuncSetAttribute


def needs_smem_optin(kernel: CompiledKernel, shared_mem: int) -> bool:
    """True when the launch needs MAX_DYNAMIC_SHARED_SIZE_BYTES raised: the block's static plus
    dynamic shared memory passes 48 KB (the dynamic part alone may not: 46 KB dynamic + 2 KB
    static fails with CUDA_ERROR_INVALID_VALUE without the opt-in)."""
    return shared_mem > 0 and shared_mem + kernel.static_smem > DEFAULT_SMEM_LIMIT


_FLOAT_ARGS = (ctypes.c_float, ctypes.c_double)
_packs = threading.local()  # per thread: {id(kernel): (values, parameter array)} of its last launch


def param_array(kernel: CompiledKernel, args: Sequence[Any]) -> ctypes.Array:
    """The ``kernelParams`` array of a launch of ``kernel`` with ``args`` (as :func:`launch` takes them).

    Packing builds one ctypes value per argument and an array of their addresses (about 1 us per
    argument, hundreds of launches per decode step). Consecutive launches of one kernel mostly
    differ in their tensors only (the GDN layers of a step: same shapes, other buffers), so the
    kernel's previous array on this thread is kept: when the new arguments have the same kinds
    (pointer or scalar) at the same positions and equal scalars (type and value; floating-point
    scalars bit for bit), its pointer values are overwritten in place and it is returned;
    otherwise a new array replaces it. Either way the array holds exactly what packing ``args``
    afresh would. The driver copies the values at the launch, so the next launch may overwrite them.
    """
    packs = getattr(_packs, "by_kernel", None)
    if packs is None:
        packs = _packs.by_kernel = {}
    tensor = _TENSOR[0] if _TENSOR else None
    found = packs.get(id(kernel))
    if found is not None and tensor is not None and len(found[0]) == len(args):
        values = found[0]
        for a, v in zip(args, values):
            if a is None:
                if type(v) is not _Pointer:
                    break
                v.value = None
            elif isinstance(a, tensor):
                if type(v) is not _Pointer:
                    break
                v.value = a.data_ptr()
            elif type(a) is not type(v) or a.value != v.value or (type(a) in _FLOAT_ARGS and bytes(a) != bytes(v)):
                break
        else:
            return found[1]
    values = []
    for a in args:
        value = _ctype_arg(a)
        if value is a:  # a caller's ctypes scalar: copied, so that overwriting a pointer never touches it
            value = type(a).from_buffer_copy(a)
        elif type(value) is ctypes.c_void_p:
            value = _Pointer(value.value)
        values.append(value)
    params = (ctypes.c_void_p * max(len(values), 1))(*map(ctypes.addressof, values))
    packs[id(kernel)] = (values, params)
    return params


def _launch_config(driver: Any, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int,
                   stream: int, programmatic: bool, cluster: int) -> Any:
    """``CUlaunchConfig`` of a launch with the programmatic stream serialization attribute and / or a
    cluster dimension (``cluster`` CTAs along x)."""
    attrs = []
    if programmatic:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    if cluster > 1:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = int(cluster), 1, 1
        attrs.append(attr)
    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(x) for x in grid)
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(x) for x in block)
    cfg.sharedMemBytes = int(shared_mem)
    cfg.hStream = driver.CUstream(stream)
    cfg.attrs = attrs
    cfg.numAttrs = len(attrs)
    return cfg


def _raise_smem_limit(driver: Any, kernel: CompiledKernel, shared_mem: int) -> None:
    """Raise the kernel's dynamic shared-memory limit to ``shared_mem`` where the launch needs the opt-in
    (once per kernel and size)."""
    skey = (id(kernel.function), kernel.name, kernel.device_index)
    if needs_smem_optin(kernel, shared_mem) and _smem_set.get(skey, 0) < shared_mem:
        _check_cu(
            driver.cuFuncSetAttribute(
                kernel.function,
                driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                int(shared_mem),
            ),
            f"cuFuncSetAttribute({kernel.name}, MAX_DYNAMIC_SHARED_SIZE_BYTES={shared_mem})",
        )
        _smem_set[skey] = shared_mem


def max_active_clusters(kernel: CompiledKernel, grid: tuple[int, int, int], block: tuple[int, int, int],
                        shared_mem: int, cluster: int) -> int:
    """How many clusters of ``cluster`` CTAs of this launch the device can hold at once
    (``cuOccupancyMaxActiveClusters``): a grid of more clusters runs in several waves."""
    driver, _ = _import_cuda()
    import torch

    _raise_smem_limit(driver, kernel, shared_mem)
    stream = torch.cuda.current_stream(kernel.device_index)
    cfg = _launch_config(driver, grid, block, shared_mem, stream.cuda_stream, False, cluster)
    return int(_check_cu(driver.cuOccupancyMaxActiveClusters(kernel.function, cfg), "cuOccupancyMaxActiveClusters"))


class _Pointer(ctypes.c_void_p):
    """A pointer argument's slot in a kept parameter array (a tensor or None at that position)."""


def launch(
    kernel: CompiledKernel,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    args: Sequence[Any],
    shared_mem: int = 0,
    programmatic: bool = False,
    cluster: int = 1,
) -> None:
    """Launch ``kernel`` on torch's current stream of its device.

    args: tensors (passed as device pointers), None (null pointer) and ctypes scalars, in the
    kernel's parameter order. ``shared_mem`` bytes of dynamic shared memory (the limit is raised
    once per kernel when static + dynamic pass 48 KB). ``programmatic``: launch with programmatic
    stream serialization (``cuLaunchKernelEx``), so that the kernel may start while the previous
    kernel of the stream, if it executes ``griddepcontrol.launch_dependents``, still runs; the
    kernel must ``griddepcontrol.wait`` before it reads that kernel's outputs (GDN verify version 5).
    ``cluster``: CTAs per thread block cluster along x (sm_90; grid x a multiple of it), for kernels
    that share work through distributed shared memory (GDN verify version 6 with ``G6_CLUSTER``).
    With ``VLLM_TFM_SYNC_LAUNCH=1`` the stream is synchronised after the launch so that an
    asynchronous fault is reported at its launch.
    """
    driver, _ = _import_cuda()
    import torch

    if shared_mem > kernel.max_dynamic_smem:
        raise KernelLaunchError(
            f"{kernel.name} needs {shared_mem} bytes of shared memory; the device allows {kernel.max_dynamic_smem}"
        )
    _raise_smem_limit(driver, kernel, shared_mem)
    if min(grid) <= 0:
        return  # nothing to do (empty batch)
    current = _check_cu(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if current is None or int(current) == 0:  # a thread torch has not used yet
        _ensure_context(kernel.device_index)
    pointers = param_array(kernel, args)
    stream = torch.cuda.current_stream(kernel.device_index)
    if cluster > 1 and grid[0] % cluster:
        raise KernelLaunchError(f"{kernel.name}: grid {tuple(grid)} is not a multiple of the cluster size {cluster}")
    if programmatic or cluster > 1:
        cfg = _launch_config(driver, grid, block, shared_mem, stream.cuda_stream, programmatic, cluster)
        result = driver.cuLaunchKernelEx(cfg, kernel.function, ctypes.addressof(pointers), 0)
    else:
        result = driver.cuLaunchKernel(
            kernel.function, *grid, *block, int(shared_mem), driver.CUstream(stream.cuda_stream),
            ctypes.addressof(pointers), 0,
        )
    if (result[0] if isinstance(result, tuple) else result) != driver.CUresult.CUDA_SUCCESS:
        # the message is formatted only on failure (this runs hundreds of times per decode step)
        call = "cuLaunchKernelEx" if programmatic or cluster > 1 else "cuLaunchKernel"
        _check_cu(result, f"{call}({kernel.name}, grid={grid}, block={block}, smem={shared_mem})")
    if os.environ.get("VLLM_TFM_SYNC_LAUNCH") == "1":
        _check_cu(driver.cuStreamSynchronize(driver.CUstream(stream.cuda_stream)), f"after {kernel.name}")


# ---------------------------------------------------------------------------------------------
# availability and the one-time fallback warning

_available: dict[int, str | None] = {}
_warned: set[str] = set()


def aligned_rows(t: Any) -> bool:
    """A tensor of at least 2 dimensions whose last one has unit stride and whose rows (along the
    second to last) start on 16-byte boundaries: what the kernels' 16-byte vector loads of a row need."""
    return (t.dim() >= 2 and t.stride(-1) == 1 and (t.stride(-2) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)


def tensor_device_index(t: Any) -> int:
    """The CUDA device index of tensor ``t`` (the current device when its device has no index)."""
    import torch

    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def kernels_unavailable_reason(device_index: int | None = None) -> str | None:
    """None when the CUDA kernels can run on ``device_index`` (default: the current device), else why not."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a hard dependency
        return f"torch is not importable: {exc}"
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    if device_index is None:
        device_index = torch.cuda.current_device()
    if device_index in _available:
        return _available[device_index]
    reason: str | None = None
    try:
        _import_cuda()
        ver = nvrtc_version()
        cc = torch.cuda.get_device_capability(device_index)
        arch_num = cc[0] * 10 + cc[1]
        if cc < MIN_COMPUTE_CAPABILITY:
            reason = f"compute capability {cc[0]}.{cc[1]} is below the kernels' minimum 7.0"
        elif arch_num not in nvrtc_supported_archs():
            reason = f"NVRTC {ver[0]}.{ver[1]} cannot compile for sm_{arch_num}"
        elif not (cuda_source_dir() / "tfm_common.cuh").is_file():
            reason = f"the CUDA sources are not at {cuda_source_dir()} (set VLLM_TFM_CUDA_DIR)"
    except (ImportError, KernelLaunchError, OSError, RuntimeError) as exc:
        reason = str(exc)
    _available[device_index] = reason
    return reason


def kernels_available(device_index: int | None = None) -> bool:
    """True when NVRTC, a CUDA device of a supported architecture, and the sources are all there."""
    return kernels_unavailable_reason(device_index) is None


def warn_fallback(op: str, reason: str) -> None:
    """Warn once per (op, reason) that ``op`` runs the torch reference instead of the CUDA kernel."""
    key = f"{op}\0{reason}"
    if key in _warned:
        return
    _warned.add(key)
    msg = f"vllm_tfm: {op} falls back to the torch reference (same math, slower): {reason}"
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _reset_for_tests() -> None:
    """Forget cached availability, warnings and import state (tests only)."""
    global _cuda_modules, _cuda_import_error
    _available.clear()
    _warned.clear()
    _smem_optin.clear()
    _cuda_modules = None
    _cuda_import_error = None
