#!/usr/bin/env python3
"""Host cost of one tree decode step's sampler and commit: torch ops, kernel launches, syncs, uploads.

Usage, from the repository root:

    python3 bench/step_ops.py --label after [--out bench/results/step_ops_cpu.json] [--requests 1,8]
        [--budget 32] [--repeats 5] [--threads 1]
    # on the GPU host (real NVRTC kernels, real launches, host ms per stage):
    python3 bench/step_ops.py --device cuda --label gpu --out $OUT/step_ops_cuda.json

One step = what the runtime does between the target forward and the drafter for R requests with
Weaver trees of B draft nodes (``vllm_plugin.runtime.tree_builder_gpu.weaver_trees`` on the zoo
drafter's shapes with random weights and the spine-first marginals of acceptance replay, the
e2e bench's setting: trees of depth up to 15):

* ``prepare``: ``inputs.build_step_tree`` and the depth positions (``_prepare_inputs`` wrapper);
* ``sample``: ``TFMTreeSampler`` (the ``_sample`` stage) on random float32 logits of the zoo
  vocabulary, in three modes: ``greedy`` (temperature 0), ``sampled`` (temperature 1:
  target-only tree acceptance) and ``replay`` (temperature 1 plus acceptance replay, what the e2e
  bench runs);
* ``commit``: ``hooks.commit_step`` on a fake runner with the Qwen3.6-27B layer counts (16 full
  attention layers in one KV-cache group, 48 GDN layers in three groups of 16) and small tensors
  (GDN H 1, K 32, HV 2, V 16, conv width 4; KV 2 heads x 8 x 2, 16-token blocks), the accepted
  paths of the ``replay`` sampler run. Path ``kernels`` is the GPU's: the NVRTC kernels through
  their wrappers with the launches recorded and not run on the CPU (``--device cuda``: run);
  path ``kernels-batched`` the same with ``VLLM_TFM_BATCHED_COMMIT=1`` (one launch per kernel kind
  for all GDN layers, ``vllm_tfm.kernels.batched_commit``); path ``reference`` is the torch
  references (what a CPU runs).

Per (R, stage, mode) it reports:

* ``ops``: aten operators dispatched under inference_mode (a ``TorchDispatchMode`` counts them:
  the host-side torch calls), also by the innermost vllm_tfm function that issued them
  (``ops_by_function``); ``kernels``: the non-view, non-allocation operators of the same
  call under no_grad (composite operators decompose), about one device kernel each;
* ``launches``: NVRTC kernel launches (cuda-python ``cuLaunchKernel``, each with its ctypes
  argument packing), by kernel;
* ``syncs``: operations that make the host wait for the device on a GPU (``.item()`` / ``bool()``
  / ``int()`` of a tensor (``aten.item`` / ``aten.is_nonzero`` under inference_mode,
  ``_local_scalar_dense`` under no_grad), ``.tolist()``, ``.cpu()``, ``nonzero``, boolean-mask indexing,
  ``repeat_interleave`` without an output size, ...; see ``bench/tree_build_ops.py``), with the
  source line that issued each;
* ``uploads``: host data turned into tensors (``torch.tensor`` of a list, ``torch.from_numpy``,
  ``torch.as_tensor`` of an array: ``aten.lift_fresh``): each is one host-to-device copy on a GPU
  (a CPU run cannot see the copies themselves), with the source line;
* ``host_ms``: wall time of the stage without the counter, best and median of ``--repeats`` (CPU:
  the CPU kernels dominate; only the GPU run's numbers are launch costs; the GPU run synchronises
  before and after, so this is the stage's host time or its device time, whichever is longer);
  on CUDA also ``cuda_syncs``, the synchronisations PyTorch reports (``set_sync_debug_mode``);
* ``result_sha256``: digest of the outcome (sampled token ids, accepted nodes; commit: the KV
  caches and GDN states after it), equal across labels for the same inputs.

The JSON file keeps one entry per ``--label`` and a ``command`` field per entry.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, Self
from unittest import mock

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "bench", REPO / "tests" / "cpu"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from tree_build_ops import OpLog, cuda_syncs, make_inputs, save_labelled, zoo_shapes

from vllm_tfm.tree.weaver import default_weaver_width
from vllm_tfm.verify.acceptance_replay import spine_first_logits
from vllm_tfm.vllm_plugin.runtime.tree_builder_gpu import weaver_trees

DEFAULT_OUT = REPO / "bench" / "results" / "step_ops_cpu.json"
GDN = {"h": 1, "k": 32, "hv": 2, "v": 16, "width": 4}  # kernel-legal small shapes (K % 32, V % 16)
GDN_27B = {"h": 16, "k": 128, "hv": 48, "v": 128, "width": 4}  # Qwen3.6-27B GDN layer per tensor-parallel rank
NUM_GDN, GDN_GROUPS, NUM_ATTN = 48, 3, 16  # Qwen3.6-27B: 48 GDN + 16 attention layers
KV = {"heads": 2, "head2": 16, "block": 16}
SAMPLE_MODES = ("greedy", "sampled", "replay")
REPLAY_PMF = [0.1, 0.15, 0.15, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.03, 0.03, 0.02, 0.01, 0.005, 0.005]


# ---------------------------------------------------------------------------------------------
# counting


class StepOpLog(OpLog):
    """``OpLog`` plus the host reads that inference_mode dispatches without decomposing them
    (``item()`` / ``int()`` / ``float()`` as ``aten.item``, ``bool()`` as ``aten.is_nonzero``,
    ``repeat_interleave(x, repeats)`` as ``aten.repeat_interleave.self_Tensor``)."""

    READS: ClassVar[dict[str, str]] = {"aten.item.default": "item/int/float of a tensor", "aten.is_nonzero.default": "bool of a tensor"}

    def __init__(self) -> None:
        super().__init__()
        self.by_function: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.by_function[_function()] += 1
        what = self.READS.get(name)
        if what is not None:
            self.sync(what)
        elif name == "aten.repeat_interleave.self_Tensor" and (kwargs or {}).get("output_size") is None:
            self.sync("repeat_interleave without output_size")
        return super().__torch_dispatch__(func, types, args, kwargs)


class Watch(contextlib.AbstractContextManager):
    """A :class:`StepOpLog` plus ``.tolist()`` / ``.cpu()`` (not aten ops on the CPU) and the
    NVRTC launches (recorded by the launch stub of :func:`kernel_path`). Host data turned into a
    tensor (``torch.tensor``, ``torch.from_numpy``, ``torch.as_tensor``: ``aten.lift_fresh`` of a
    tensor with >= 1 dim) counts as an upload, not as a sync."""

    def __init__(self) -> None:
        self.log = StepOpLog()
        self.uploads: list[str] = []
        self.launches: Counter[str] = Counter()
        self._saved: list[tuple[Any, str, Any]] = []

    def _patch(self, owner: Any, name: str, new: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def __enter__(self) -> Self:
        log = self.log
        tolist, cpu = torch.Tensor.tolist, torch.Tensor.cpu

        def logged_tolist(t: torch.Tensor) -> Any:
            log.sync(".tolist()")
            return tolist(t)

        def logged_cpu(t: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            log.sync(".cpu()")
            return cpu(t, *a, **k)

        self._patch(torch.Tensor, "tolist", logged_tolist)
        self._patch(torch.Tensor, "cpu", logged_cpu)
        _LAUNCHES.append(self.launches)
        log.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.log.__exit__(*exc)
        _LAUNCHES.remove(self.launches)
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)
        kept = []
        for at, what, where in self.log.syncs:
            if what.startswith("torch.tensor(host list)"):
                self.uploads.append(f"host data -> tensor @ {where}")
            else:
                kept.append((at, what, where))
        self.log.syncs = kept

    def summary(self) -> dict[str, Any]:
        return {
            "ops": self.log.ops,
            "ops_by_function": dict(self.log.by_function.most_common()),
            "launches": {"total": sum(self.launches.values()), **dict(sorted(self.launches.items()))},
            "syncs": {"total": len(self.log.syncs),
                      "sites": dict(sorted(Counter(f"{w} @ {s}" for _, w, s in self.log.syncs).items()))},
            "uploads": {"total": len(self.uploads), "sites": dict(sorted(Counter(self.uploads).items()))},
        }


_LAUNCHES: list[Counter[str]] = []


def _function() -> str:
    """file (function) of the innermost frame in vllm_tfm (ops are attributed to it)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "/vllm_tfm/" in name:
            return f"{name.split('/vllm_tfm/')[-1]} ({f.f_code.co_name})"
        for helper in ("_step_before.py", "_gdn_before.py"):
            if name.endswith(helper):
                return f"{helper} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


@contextlib.contextmanager
def kernel_path(device: torch.device) -> Iterator[None]:
    """Make the runtime take its NVRTC kernel path. On a GPU nothing is patched but the launch
    counter; on the CPU the kernel wrappers run with a stub ``get_kernel`` and a ``launch`` that
    packs the arguments like the real one (``loader.param_array``) and records the launch without
    running it."""
    from vllm_tfm.kernels import batched_commit as kbatch
    from vllm_tfm.kernels import conv as kconv
    from vllm_tfm.kernels import gdn as kgdn
    from vllm_tfm.kernels import loader
    from vllm_tfm.vllm_plugin.runtime import step_kernels as sk

    real_launch = loader.launch

    def counted_launch(kernel: Any, grid: Any, block: Any, args: Any, shared_mem: int = 0) -> None:
        for c in _LAUNCHES:
            c[kernel.name] += 1
        if device.type == "cuda":
            real_launch(kernel, grid, block, args, shared_mem)
            return
        loader.param_array(kernel, args)  # the host work of a launch (argument packing), without the driver call

    with contextlib.ExitStack() as stack:
        for mod in (kgdn, kconv, kbatch):
            stack.enter_context(mock.patch.object(mod, "launch", counted_launch))
        if device.type != "cuda":
            loaded: dict[tuple, Any] = {}

            def get_kernel(source: str, name: str, options: Any, device_index: int = 0) -> Any:
                key = (source, tuple(options), device_index, name)  # the loader's cache key: one object per kernel
                if key not in loaded:
                    loaded[key] = SimpleNamespace(name=name, max_dynamic_smem=227 * 1024, static_smem=0, device_index=0)
                return loaded[key]

            for mod in (kgdn, kconv, kbatch):
                stack.enter_context(mock.patch.object(mod, "get_kernel", get_kernel))
            none = lambda *a, **k: None
            for mod, name in ((kgdn, "commit_unsupported_reason"), (kgdn, "verify_unsupported_reason"),
                              (kconv, "conv_unsupported_reason")):
                stack.enter_context(mock.patch.object(mod, name, none))
            stack.enter_context(mock.patch.object(loader, "device_smem_optin", lambda i: 227 * 1024))
            stack.enter_context(mock.patch("torch.cuda.current_device", lambda: 0))
            stack.enter_context(mock.patch("torch.cuda.get_device_properties",
                                           lambda i: SimpleNamespace(multi_processor_count=132)))
            tables: dict[int, Any] = {}

            def step_kernels(step: Any, dev: torch.device) -> Any:
                t = tables.get(id(step))
                if t is None or t.step is not step:
                    t = tables[id(step)] = sk.StepKernels(step, dev)
                return t

            from vllm_tfm.vllm_plugin.runtime import gdn as gdn_mod
            from vllm_tfm.vllm_plugin.runtime import hooks

            for mod in (hooks, gdn_mod):
                stack.enter_context(mock.patch.object(mod, "step_kernels", step_kernels))
        yield


@contextlib.contextmanager
def batched_commit(on: bool) -> Iterator[None]:
    """``VLLM_TFM_BATCHED_COMMIT`` set to 1 (on) or 0 for the duration."""
    with mock.patch.dict("os.environ", {"VLLM_TFM_BATCHED_COMMIT": "1" if on else "0"}):
        yield


@contextlib.contextmanager
def reference_path() -> Iterator[None]:
    """Make the runtime take the torch references (what a CPU-only process runs)."""
    from vllm_tfm.vllm_plugin.runtime.kernels_or_reference import set_kernels_enabled

    set_kernels_enabled(False)
    try:
        yield
    finally:
        set_kernels_enabled(True)


# ---------------------------------------------------------------------------------------------
# one step


def draft_trees(r: int, budget: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weaver trees (tokens [R, B], parents [R, 1 + B]) on spine-first marginals (the e2e setting)."""
    zoo = zoo_shapes()
    depth = min(zoo["block_size"] - 1, budget)
    width = zoo["width"] if zoo["width"] is not None else default_weaver_width(budget)
    x = make_inputs(r, depth, zoo, seed=seed, device=torch.device("cpu"))
    with torch.inference_mode():
        tokens, parents = weaver_trees(x["weaver"], spine_first_logits(x["logits"]), x["hidden"], x["verifier"],
                                       x["roots"], x["embed"], x["head"], budget, zoo["top_k"], width,
                                       zoo["children_per_node"])
    return tokens.clone(), parents.clone()


def chains_only_reason(parents: torch.Tensor, budget: int) -> str | None:
    """Why a step of these drafts would not be tree-active (every request's draft a chain: the runtime then
    verifies them on vLLM's own chain path, which this bench does not measure), or None when one is a tree."""
    chain = torch.arange(-1, parents.shape[1] - 1)
    if bool((parents == chain).all()):
        return (f"--budget {budget}: every request's Weaver draft is a chain (spine-first marginals, depth "
                f"min(block size - 1, B) = {parents.shape[1] - 1}), which the runtime verifies on vLLM's chain path, "
                "not the tree path this bench measures; take a larger budget, or --force-tree-path for the tree path")
    return None


class StepInputs:
    """Everything one step needs, drawn once per (R, B) on the CPU; ``force_tree_path``: the step takes the tree
    path even when every draft is a chain (the runtime's VLLM_TFM_FORCE_TREE_PATH=1)."""

    def __init__(self, r: int, budget: int, device: torch.device, seed: int, force_tree_path: bool = False) -> None:
        self.r, self.budget, self.device, self.force_tree_path = r, budget, device, force_tree_path
        self.tokens, self.parents = draft_trees(r, budget, seed)
        self.req_ids = [f"req{i}" for i in range(r)]
        self.spec = {rid: self.tokens[i].tolist() for i, rid in enumerate(self.req_ids)}
        g = torch.Generator().manual_seed(seed + 7)
        vocab = zoo_shapes()["vocab"]
        n = r * (budget + 1)
        self.logits = (torch.randn(n, vocab, generator=g) * 2).to(device)
        self.positions = torch.arange(n, dtype=torch.long).to(device) + 100
        # GDN layers: 3 KV-cache groups of 16 layers; each group has its own slot table
        h, k, hv, v, w = GDN["h"], GDN["k"], GDN["hv"], GDN["v"], GDN["width"]
        self.conv_dim = 2 * h * k + hv * v
        s = budget
        slots = r * (1 + s) + 2
        self.group_slots = [torch.randperm(slots, generator=g)[: r * (1 + s)].view(r, 1 + s).to(torch.int32).to(device)
                            for _ in range(GDN_GROUPS)]
        self.prev_accepted = torch.randint(1, s + 2, (r,), generator=g).to(torch.int32).to(device)
        self.ssm = [torch.randn(slots, hv, v, k, generator=g).to(device) for _ in range(NUM_GDN)]
        self.conv = [torch.randn(slots, w - 1 + s, self.conv_dim, generator=g).to(device).transpose(-1, -2)
                     for _ in range(NUM_GDN)]
        self.mixed = torch.randn(n, self.conv_dim, generator=g).to(device)
        self.a = torch.randn(n, hv, generator=g).to(device)
        self.b = torch.randn(n, hv, generator=g).to(device)
        self.weight = (0.5 * torch.randn(self.conv_dim, w, generator=g)).to(device)
        self.A_log = torch.rand(hv, generator=g).log().to(device)
        self.dt_bias = torch.randn(hv, generator=g).to(device)
        # attention: one group of 16 layers, TRITON_ATTN logical [blocks, H, block, 2 hs], NHD storage
        blocks = -(-2 * n // KV["block"]) + 2
        self.kv = [torch.randn(blocks, KV["block"], KV["heads"], KV["head2"], generator=g).to(device).permute(0, 2, 1, 3)
                   for _ in range(NUM_ATTN)]
        self.slot_mapping = torch.randperm(blocks * KV["block"], generator=g)[:n].to(device)
        self.kv0 = [c.clone() for c in self.kv]
        self.ssm0 = [c.clone() for c in self.ssm]
        self.conv0 = [c.clone() for c in self.conv]

    def reset_caches(self) -> None:
        for cur, orig in ((self.kv, self.kv0), (self.ssm, self.ssm0), (self.conv, self.conv0)):
            for c, o in zip(cur, orig):
                c.copy_(o)


def proposals(x: StepInputs) -> Any:
    """The previous step's proposals, read back (what the next step's lookup finds)."""
    from vllm_tfm.vllm_plugin.runtime.state import ProposalStore

    store = ProposalStore()
    store.put(x.req_ids, x.tokens, x.parents)
    store._ingest()
    return store


def prepare(x: StepInputs, store: Any) -> Any:
    """``_prepare_inputs`` wrapper's tree work: the step metadata and the depth positions."""
    from vllm_tfm.vllm_plugin.runtime.inputs import build_step_tree, tree_positions
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    step = build_step_tree(x.req_ids, np.full(x.r, x.budget + 1), x.spec, store, allow_trees=True,
                           force_tree_path=x.force_tree_path, device=x.device)
    assert step.tree_active  # main() refuses drafts that are all chains unless the tree path is forced
    _ = step.attn_plan  # built on first read: a piecewise step's first attention layer does it (counted here, as before)
    pos = x.positions.clone()
    pos.copy_(tree_positions(pos, step.dev("query_start"), step.dev("req_index"), step.dev("depth")))
    STATE.step = step
    return step


def forward_gdn(x: StepInputs, step: Any) -> None:
    """The GDN layers' tree verify of the step (fills the stashes the commit reads)."""
    from vllm_tfm.vllm_plugin.runtime import gdn as gdn_mod

    h, k, hv, v = GDN["h"], GDN["k"], GDN["hv"], GDN["v"]
    for i in range(NUM_GDN):
        _, stash = gdn_mod.spec_tree_gdn(
            x.mixed, x.a, x.b, step.dev("spec_parents"), step.dev("spec_cu"), x.conv[i], x.ssm[i],
            x.group_slots[i // (NUM_GDN // GDN_GROUPS)], x.prev_accepted, x.weight, None, "silu", x.A_log, x.dt_bias,
            h, k, hv, v, kernels=gdn_mod.step_kernels(step, x.device),
        )
        step.gdn[f"model.layers.{i}.linear_attn"] = stash


def make_sampler(x: StepInputs, mode: str) -> tuple[Any, Any, Any]:
    from vllm_tfm.vllm_plugin.benchmark_mode import ReplaySpec
    from vllm_tfm.vllm_plugin.runtime.replay import AcceptanceReplayer
    from _sampling_fakes import sampling_metadata  # tests/cpu: a batch that needs no vLLM sampler

    from vllm_tfm.vllm_plugin.runtime.sampler import TFMTreeSampler

    temp = 0.0 if mode == "greedy" else 1.0
    batch = SimpleNamespace(temperature_cpu=np.full(x.r, temp, dtype=np.float32), top_k_cpu=np.full(x.r, 0),
                            top_p_cpu=np.ones(x.r, dtype=np.float32), req_ids=x.req_ids)
    runner = SimpleNamespace(input_batch=batch)
    replay = None
    if mode == "replay":
        spec = ReplaySpec(profile="bench", profile_source="bench/step_ops.py", measured=False, entry="bench",
                          accepted_pmf=REPLAY_PMF, profile_mean_accepted_length=1.0, seed=5, spine_top1=0.9)
        replay = AcceptanceReplayer(spec, x.device)
    sampler = TFMTreeSampler(torch.nn.Identity(), runner, replay=replay)
    md = SimpleNamespace(num_draft_tokens=[x.budget] * x.r, draft_token_ids=x.tokens.reshape(-1).to(torch.int32).to(x.device),
                         max_spec_len=x.budget)
    return sampler, md, sampling_metadata()


def commit_runner(x: StepInputs) -> Any:
    ctx = {f"attn{i}": SimpleNamespace(kv_cache=c) for i, c in enumerate(x.kv)}
    return SimpleNamespace(
        _tfm_kv_groups=[(0, list(x.kv))], _tfm_num_gdn=NUM_GDN,
        compilation_config=SimpleNamespace(static_forward_context=ctx),
        input_batch=SimpleNamespace(block_table=[SimpleNamespace(slot_mapping=SimpleNamespace(gpu=x.slot_mapping))]),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _ms(times: list[float]) -> dict[str, float]:
    return {"best": 1e3 * min(times), "median": 1e3 * statistics.median(times)}


def measure_stage(run: Callable[[], Any], fresh: Callable[[], Any], repeats: int, device: torch.device) -> tuple[dict, Any]:
    """Counts of ``run(state)`` on a fresh state (inference_mode: ops; no_grad: kernels) and its time."""
    state = fresh()
    with torch.inference_mode():
        run(state)  # warm-up
    state = fresh()
    with Watch() as w, torch.inference_mode():
        out = run(state)
    state = fresh()
    with Watch() as wk, torch.no_grad():
        run(state)
    res = w.summary()
    res["kernels"] = wk.log.kernels
    times = []
    for _ in range(repeats):
        state = fresh()
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            run(state)
        _sync(device)
        times.append(time.perf_counter() - t0)
    res["host_ms"] = _ms(times)
    if device.type == "cuda":  # the synchronisations PyTorch itself reports during one call
        state = fresh()
        with torch.inference_mode():
            res["cuda_syncs"] = cuda_syncs(lambda: run(state))
    return res, out


def _impl(impl: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(sample(sampler, md, logits, smd), commit(runner, step)) of the implementation measured."""
    if impl == "before":
        import _step_before

        return _step_before.sample_before, _step_before.commit_step_before
    from vllm_tfm.vllm_plugin.runtime import hooks

    return (lambda sampler, md, logits, smd: sampler(md, None, logits, smd)), hooks.commit_step


def sample_case(x: StepInputs, mode: str, repeats: int, impl: str) -> dict[str, Any]:
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    sample_fn, _ = _impl(impl)
    sampler, md, smd = make_sampler(x, mode)

    def fresh() -> Any:
        torch.manual_seed(1234)  # target-only uniforms come from the default generator
        if sampler.replay is not None:
            sampler.replay.generator.manual_seed(sampler.replay.spec.seed)
        return prepare(x, proposals(x))

    def run(step: Any) -> Any:
        STATE.step = step
        out = sample_fn(sampler, md, x.logits, smd)
        return out.sampled_token_ids, step.accept.accepted_nodes

    res, (ids, acc) = measure_stage(run, fresh, repeats, x.device)
    return {"stage": "sample", "mode": mode, **res, "result_sha256": _digest([ids, acc]),
            "accepted_mean": float((acc >= 0).sum(dim=1).double().mean())}


def commit_case(x: StepInputs, path: str, repeats: int, impl: str) -> dict[str, Any]:
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    sample_fn, commit_fn = _impl(impl)
    runner = commit_runner(x)
    sampler, md, smd = make_sampler(x, "replay")

    def fresh() -> Any:
        x.reset_caches()
        step = prepare(x, proposals(x))
        torch.manual_seed(1234)
        sampler.replay.generator.manual_seed(sampler.replay.spec.seed)
        with torch.inference_mode():
            forward_gdn(x, step)
            STATE.step = step
            sample_fn(sampler, md, x.logits, smd)
        return step

    with kernel_path(x.device) if path.startswith("kernels") else reference_path(), \
            batched_commit(path == "kernels-batched"):
        res, _ = measure_stage(lambda step: commit_fn(runner, step), fresh, repeats, x.device)
        step = fresh()
        with torch.inference_mode():
            commit_fn(runner, step)
    # the kernel path's launches do not run on the CPU: no outcome to compare there
    digest = _digest(x.kv + x.ssm + x.conv) if path == "reference" or x.device.type == "cuda" else None
    return {"stage": "commit", "mode": path, **res, "result_sha256": digest}


class LayerInputs:
    """One GDN layer at the 27B shape (``GDN_27B``, bf16 activations and conv window, float32 SSM
    state, conv without bias as in the checkpoint) and the forward context a tree-active step gives
    it: every row a spec decode, piecewise CUDA graphs (so the pre-conv rows are copied for the
    commit, as in the e2e runs)."""

    def __init__(self, x: StepInputs, step: Any) -> None:
        h, k, hv, v, w = (GDN_27B[n] for n in ("h", "k", "hv", "v", "width"))
        g = torch.Generator().manual_seed(300 + x.r)
        dev, bf16 = x.device, torch.bfloat16
        t, s = x.r * (x.budget + 1), x.budget
        conv_dim = 2 * h * k + hv * v
        pool = 2 * x.r + 2  # slots the table points into (the forward only reads them)
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        conv = torch.randn(pool, w - 1 + s, conv_dim, generator=g).to(bf16).to(dev)  # [slots, L, D] storage
        self.layer = SimpleNamespace(
            prefix="model.layers.0.linear_attn",
            kv_cache=(conv.transpose(-1, -2) if is_conv_state_dim_first() else conv,
                      torch.randn(pool, hv, v, k, generator=g).to(dev)),
            conv1d=SimpleNamespace(weight=(0.5 * torch.randn(conv_dim, 1, w, generator=g)).to(bf16).to(dev), bias=None),
            activation="silu",
            A_log=torch.rand(hv, generator=g).log().to(dev),  # float32, as vLLM allocates it
            dt_bias=torch.randn(hv, generator=g).to(bf16).to(dev),  # the model dtype
            num_k_heads=h, num_v_heads=hv, head_k_dim=k, head_v_dim=v, tp_size=1,
        )
        self.mixed = torch.randn(t, conv_dim, generator=g).to(bf16).to(dev)
        self.a = torch.randn(t, hv, generator=g).to(bf16).to(dev)
        self.b = torch.randn(t, hv, generator=g).to(bf16).to(dev)
        self.out = torch.zeros(t, hv, v, dtype=bf16, device=dev)
        self.md = SimpleNamespace(
            spec_sequence_masks=torch.ones(x.r, dtype=torch.bool, device=dev), num_spec_decodes=x.r,
            num_spec_decode_tokens=t, num_actual_tokens=t, num_prefills=0, num_decodes=0, num_prefill_tokens=0,
            num_decode_tokens=0, spec_token_indx=None, non_spec_token_indx=None,
            spec_state_indices_tensor=torch.randint(0, pool, (x.r, 1 + s), generator=g).to(torch.int32).to(dev),
            num_accepted_tokens=torch.randint(1, s + 2, (x.r,), generator=g).to(torch.int32).to(dev),
        )
        assert step.num_spec_reqs == x.r and step.num_spec_tokens == t

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """vLLM's forward context of a piecewise-graph decode step holding this layer's metadata."""
        import vllm.forward_context as vfc
        from vllm.config import CUDAGraphMode

        fc = SimpleNamespace(attn_metadata={self.layer.prefix: self.md}, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE)
        with mock.patch.object(vfc, "get_forward_context", lambda: fc), \
                mock.patch.object(vfc, "is_forward_context_available", lambda: True):
            yield


def _layer_fn(impl: str) -> Callable[..., Any]:
    """The tree-active ``_forward_core`` body of one GDN layer of the implementation measured."""
    if impl == "before":
        import _gdn_before

        return _gdn_before.tree_step_forward_core_before
    from vllm_tfm.vllm_plugin.runtime import gdn as gdn_mod

    return gdn_mod._tree_step_forward_core


def gdn_layer_case(x: StepInputs, path: str, repeats: int, impl: str) -> dict[str, Any]:
    """One GDN layer's tree path at the 27B shape, as the runtime runs it in a tree-active step."""
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    forward = _layer_fn(impl)
    step = prepare(x, proposals(x))
    li = LayerInputs(x, step)

    def fresh() -> Any:
        STATE.step = step
        step.gdn.clear()
        return step

    def run(st: Any) -> Any:
        forward(li.layer, st, None, li.mixed, li.b, li.a, li.out)
        return st.gdn[li.layer.prefix]

    with kernel_path(x.device) if path == "kernels" else reference_path(), li.forward_context():
        res, stash = measure_stage(run, fresh, repeats, x.device)
    # the kernel path's launches do not run on the CPU: no outcome to compare there
    digest = (_digest([li.out, stash.x, stash.k, stash.g, stash.delta])
              if path == "reference" or x.device.type == "cuda" else None)
    return {"stage": "gdn_layer", "mode": path, **res, "result_sha256": digest}


def measure(x: StepInputs, repeats: int, impl: str, commit_paths: tuple[str, ...], stages: tuple[str, ...],
            layer_paths: tuple[str, ...]) -> list[dict[str, Any]]:
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    STATE.metrics = Metrics(max_depth=x.budget, device=x.device)
    base = {"requests": x.r, "budget": x.budget, "nodes": x.r * (x.budget + 1)}
    res, step = measure_stage(lambda store: prepare(x, store), lambda: proposals(x), repeats, x.device)
    base["tree_depths"] = step.sample_depth.reshape(x.r, -1).max(axis=1).tolist()
    cases = [{**base, "stage": "prepare", "mode": "-", **res}] if "prepare" in stages else []
    if "sample" in stages:
        cases += [{**base, **sample_case(x, mode, repeats, impl)} for mode in SAMPLE_MODES]
    if "commit" in stages:
        cases += [{**base, **commit_case(x, path, repeats, impl)} for path in commit_paths]
    if "gdn_layer" in stages:
        cases += [{**base, **gdn_layer_case(x, path, repeats, impl)} for path in layer_paths]
    STATE.step = None
    return cases


def fresh_param_array(kernel: Any, args: Any) -> Any:
    """The launch parameter array packed afresh at every launch (``loader.launch`` before it kept
    each kernel's last array): ``--impl before`` measures with it."""
    from vllm_tfm.kernels import loader

    values = [loader._ctype_arg(a) for a in args]
    params = (ctypes.c_void_p * max(len(values), 1))(*map(ctypes.addressof, values))
    params.values = values  # the array holds their addresses only: keep them alive until the launch
    return params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True, help="key of this run in the JSON file (e.g. before, after)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadier timings on a shared machine)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--impl", choices=("current", "before"), default="current",
                    help="before: the previous sampler and commit (tests/cpu/_step_before.py) and GDN layer "
                         "(tests/cpu/_gdn_before.py)")
    ap.add_argument("--stages", default="prepare,sample,commit,gdn_layer",
                    help="stages to measure, of prepare,sample,commit,gdn_layer")
    ap.add_argument("--layer-paths", default=None,
                    help="gdn_layer paths, of kernels,reference (default: both on the CPU, kernels on CUDA)")
    ap.add_argument("--commit-paths", default=None,
                    help="commit paths to measure, of kernels,kernels-batched,reference (default: all three on the CPU, "
                         "the kernel paths on CUDA, where the references take seconds per step; kernels-batched only "
                         "with the current implementation)")
    ap.add_argument("--note", default="", help="appended to the recorded command (e.g. the machine)")
    ap.add_argument("--force-tree-path", action="store_true",
                    help="measure the tree path even where every draft is a chain (small budgets; the runtime's "
                         "VLLM_TFM_FORCE_TREE_PATH=1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    default_paths = "kernels,kernels-batched" if device.type == "cuda" else "kernels,kernels-batched,reference"
    if args.impl == "before":  # the previous commit has no batched path
        default_paths = default_paths.replace("kernels-batched,", "").replace(",kernels-batched", "")
    commit_paths = tuple((args.commit_paths or default_paths).split(","))
    layer_paths = tuple((args.layer_paths or ("kernels" if device.type == "cuda" else "kernels,reference")).split(","))
    stages = tuple(args.stages.split(","))
    cases = []
    from vllm_tfm.kernels import loader

    packing = mock.patch.object(loader, "param_array", fresh_param_array) if args.impl == "before" else contextlib.nullcontext()
    for r in (int(v) for v in args.requests.split(",")):
        x = StepInputs(r, args.budget, device, seed=100 + r, force_tree_path=args.force_tree_path)
        reason = None if args.force_tree_path else chains_only_reason(x.parents, args.budget)
        if reason is not None:
            ap.error(reason)
        with packing:
            results = measure(x, args.repeats, args.impl, commit_paths, stages, layer_paths)
        for res in results:
            print(
                f"R={r} B={args.budget} {res['stage']:7s} {res['mode']:15s} ops={res['ops']:5d} kernels={res['kernels']:5d} "
                f"launches={res['launches']['total']:3d} syncs={res['syncs']['total']:3d} uploads={res['uploads']['total']:3d} "
                f"host={res['host_ms']['best']:.2f} ms" + (f" digest {res['result_sha256']}" if res.get("result_sha256") else ""),
                flush=True,
            )
            cases.append(res)
    cmd = "python3 bench/step_ops.py " + " ".join(sys.argv[1:])
    shapes = {"gdn": GDN, "gdn_layer": {**GDN_27B, "dtype": "bfloat16", "state": "float32"}, "gdn_layers": NUM_GDN, "gdn_groups": GDN_GROUPS, "attention_layers": NUM_ATTN, "kv": KV,
              "vocab": zoo_shapes()["vocab"], "replay_pmf": REPLAY_PMF}
    save_labelled(args.out, args.label, cmd, args.note, device, args.impl, shapes, cases)


if __name__ == "__main__":
    main()
