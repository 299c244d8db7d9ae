"""Run the CUDA kernels of cuda/ on the CPU through cuda_host_emu.h, behind the real wrappers.

Usage (a CPU check of kernel logic, no GPU needed; g++ >= 11 with C++20):

    from emulate import emulated_kernels
    with emulated_kernels():
        o = vllm_tfm.kernels.gdn.gdn_tree_verify_planned(plan, q, k, v, ...)   # CPU tensors

Inside the context, ``vllm_tfm.kernels.loader.get_kernel`` compiles the requested source with
g++ (same -D options as NVRTC gets, plus TFM_HOST_EMU) into a shared library, and ``launch``
calls its ``emu_<kernel>`` entry with the very parameter array cuLaunchKernel would get; CPU
tensors' data_ptr()s are host pointers, so the wrappers run unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

HERE = Path(__file__).resolve().parent
CUDA_DIR = HERE.parent
KERNELS = {
    "gdn_tree_verify.cu": ["gdn_tree_pairs", "gdn_tree_verify_main"],
    "gdn_tree_verify_grouped.cu": ["gdn_tree_verify_grouped"],
    "gdn_tree_verify_small.cu": ["gdn_tree_verify_small"],
    "gdn_tree_verify_paths.cu": ["gdn_tree_verify_paths", "gdn_tree_paths_solve"],
    "gdn_tree_commit.cu": ["gdn_tree_commit", "gdn_tree_commit_layers"],
    "tree_conv.cu": ["tree_conv1d", "tree_conv_commit", "tree_conv_commit_layers"],
    "tree_attention.cu": ["tree_attention", "tree_attention_merge", "tree_attention_merge_many"],
    "tfm_mma_check.cu": ["tfm_mma_tf32_check"],
    "weaver_round.cu": ["weaver_round"],
    "candidate_scores.cu": ["candidate_scores"],
    "weaver_linear.cu": ["weaver_linear"],
    "weaver_attention.cu": ["weaver_node_attention"],
    "tree_step_topology.cu": ["tree_step_topology"],
    "kv_compact.cu": ["kv_compact_layers"],
    "topk_rows.cu": ["topk_rows"],
    "tree_greedy_accept.cu": ["tree_greedy_accept"],
    "context_order.cu": ["dflash_context_order"],
}
WRAPPERS = ("gdn", "conv", "tree_attention", "batched_commit", "weaver_round", "candidate_scores", "weaver_linear",
            "weaver_attention", "step_topology", "kv_compact", "topk_rows", "greedy_accept",
            "context_order")  # vllm_tfm.kernels modules that launch kernels


def build(source: str, options: list[str], out_dir: Path, sanitize: bool = False) -> Path:
    """Compile ``source`` (from cuda/) with its -D options into a shared library; cached by content."""
    defines = [o for o in options if o.startswith("-D")]
    headers = "".join(p.read_text() for p in sorted(CUDA_DIR.glob("*.cuh")))
    text = (CUDA_DIR / source).read_text() + headers + (HERE / "cuda_host_emu.h").read_text()
    key = hashlib.sha256((text + " ".join(defines) + str(sanitize)).encode()).hexdigest()[:20]
    lib = out_dir / f"{Path(source).stem}-{key}.so"
    if lib.is_file():
        return lib
    wrapper = out_dir / f"{Path(source).stem}-{key}.cpp"
    exports = "\n".join(f"TFM_EMU_EXPORT({k})" for k in KERNELS[source])
    wrapper.write_text(f'#include "{CUDA_DIR / source}"\n{exports}\n')
    cmd = ["g++", "-std=c++20", "-O1", "-g", "-shared", "-fPIC", "-pthread", "-DTFM_HOST_EMU",
           "-include", str(HERE / "cuda_host_emu.h"), f"-I{CUDA_DIR}", *defines, str(wrapper), "-o", str(lib)]
    if sanitize:
        cmd[1:1] = ["-fsanitize=address", "-fno-omit-frame-pointer"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return lib


class _EmuKernel:
    def __init__(self, fn: Any, name: str, set_cluster: Any) -> None:
        self.function = fn
        self.set_cluster = set_cluster
        self.name = name
        self.device_index = 0
        self.max_dynamic_smem = 227 * 1024  # an H100/H200 block's opt-in limit


class _Launches(list):
    """(kernel name, grid, shared memory bytes) of each launch; ``clusters``: each one's cluster size;
    ``programmatic``: whether each was launched with programmatic dependent launch."""

    def __init__(self) -> None:
        super().__init__()
        self.clusters: list[int] = []
        self.programmatic: list[bool] = []

    def clear(self) -> None:
        super().clear()
        self.clusters.clear()
        self.programmatic.clear()


@contextlib.contextmanager
def emulated_kernels(out_dir: Path | None = None, sanitize: bool = False) -> Iterator[_Launches]:
    """Patch the loader so that kernels run on the CPU; yields the list of launches made."""
    from vllm_tfm.kernels import loader

    work = out_dir or Path(os.environ.get("TFM_EMU_BUILD", tempfile.gettempdir())) / "tfm_host_emu"
    work.mkdir(parents=True, exist_ok=True)
    libs: dict[str, ctypes.CDLL] = {}
    launches = _Launches()

    def get_kernel(source_name: str, kernel_name: str, options, device_index: int = 0):
        path = build(source_name, list(options), work, sanitize)
        lib = libs.setdefault(str(path), ctypes.CDLL(str(path)))
        fn = getattr(lib, f"emu_{kernel_name}")
        fn.argtypes = [ctypes.c_uint] * 7 + [ctypes.c_void_p]
        fn.restype = None
        set_cluster = lib.tfm_emu_set_cluster
        set_cluster.argtypes = [ctypes.c_uint]
        set_cluster.restype = None
        return _EmuKernel(fn, kernel_name, set_cluster)

    def launch(kernel, grid, block, args, shared_mem: int = 0, programmatic: bool = False, cluster: int = 1) -> None:
        # programmatic (dependent launch): the emulation runs kernels one after the other, which is
        # the ordering griddepcontrol.wait guarantees; cluster: CTAs per cluster along x, run together
        if shared_mem > kernel.max_dynamic_smem:
            raise loader.KernelLaunchError(f"{kernel.name} needs {shared_mem} bytes of shared memory")
        if cluster < 1 or grid[0] % cluster:
            raise loader.KernelLaunchError(f"{kernel.name}: grid {tuple(grid)} is not a multiple of cluster {cluster}")
        if min(grid) <= 0:
            return
        values = [loader._ctype_arg(a) for a in args]
        ptrs = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
        launches.append((kernel.name, tuple(grid), int(shared_mem)))
        launches.clusters.append(int(cluster))
        launches.programmatic.append(bool(programmatic))
        kernel.set_cluster(int(cluster))
        kernel.function(*grid, *block, int(shared_mem), ctypes.addressof(ptrs))

    class _Props:
        multi_processor_count = 132
        major, minor = 9, 0

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(loader, "get_kernel", get_kernel))
        stack.enter_context(mock.patch.object(loader, "launch", launch))
        for mod in WRAPPERS:
            stack.enter_context(mock.patch(f"vllm_tfm.kernels.{mod}.get_kernel", get_kernel))
            stack.enter_context(mock.patch(f"vllm_tfm.kernels.{mod}.launch", launch))
        stack.enter_context(mock.patch("vllm_tfm.kernels.gdn.device_smem_optin", lambda i: 227 * 1024))
        stack.enter_context(mock.patch("vllm_tfm.kernels.tree_attention.device_smem_optin", lambda i: 227 * 1024))
        stack.enter_context(mock.patch("vllm_tfm.kernels.weaver_round.device_smem_optin", lambda i: 227 * 1024))
        stack.enter_context(mock.patch("vllm_tfm.kernels.weaver_attention.device_smem_optin", lambda i: 227 * 1024))
        stack.enter_context(mock.patch("torch.cuda.current_device", lambda: 0))
        stack.enter_context(mock.patch("torch.cuda.get_device_properties", lambda i: _Props()))
        yield launches
