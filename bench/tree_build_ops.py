#!/usr/bin/env python3
"""Host cost of one TfM (Weaver) tree build: aten ops dispatched, host syncs, wall time.

Usage, from the repository root:

    python3 bench/tree_build_ops.py --label after [--out bench/results/tree_build_ops_cpu.json]
        [--requests 1,8,32] [--budgets 16,32,64] [--repeats 5] [--threads 1]
    # on the GPU host (bench/run_gpu_tree_build_ops.sh runs both implementations and the graphs):
    python3 bench/tree_build_ops.py --device cuda --graphs --label after --out $OUT/tree_build_ops_cuda.json
    python3 bench/tree_build_ops.py --device cuda --impl before --label before --out $OUT/tree_build_ops_cuda.json

One build = the runtime's call ``vllm_plugin.runtime.tree_builder_gpu.weaver_trees`` (DFlash top-K
candidates, ``BatchedWeaverTreeScorer`` set-up, lockstep growth, ``fill_to_budget``) on random
inputs of the zoo drafter's shapes (``zoo/drafter/config.json`` and ``tfm_config.json``: d_model
256, Weaver d_rank 128 / 2 layers / 4 heads / d_mlp 384, vocabulary 8192, top_k 512,
children_per_node 8, D = min(block_size - 1, B), width = default_weaver_width(B) like the runtime's
default), float32, under ``torch.inference_mode`` like vLLM's model runner. ``--impl before``
runs the previous lockstep builder and scorer instead (the frozen copy in
``tests/cpu/_weaver_before.py``, on today's shared model code: its RMSNorm no longer dispatches
no-op casts, so it issues a few ops fewer than the original). ``--graphs`` (CUDA) also times the
same builds replayed as CUDA graphs (``runtime/weaver_graphs.py``, one bucket = R).

Per (R, B) it reports:

* ``ops``: aten operators dispatched under inference_mode (a ``TorchDispatchMode`` counts them:
  the host-side torch calls), split into ``setup`` (before the root scorer call), ``rounds``
  (everything after it) and per growth round (``per_round``: from one scorer call to the next;
  ``scorer_per_call``: inside the scorer; ``builder_per_round``: the rest);
* ``kernels``: the same count under no_grad, where composite operators decompose, without views
  and metadata / allocation-only operators: about one device kernel launch each on a GPU;
* ``syncs``: operations that make the host wait for the device on CUDA (``.item()`` / ``bool()``
  / ``int()`` of a tensor = ``aten._local_scalar_dense``, ``.tolist()``, ``nonzero``,
  ``masked_select``, boolean-mask indexing, ``unique``, ``repeat_interleave`` without an output
  size, ``torch.equal``), and host-to-device copies of Python lists (``torch.tensor(list)`` =
  ``aten.lift_fresh`` of a tensor with >= 1 dim: PyTorch synchronises the stream after a
  non-pinned copy, and a CUDA graph cannot hold it; the 0-dim ``lift_fresh`` of ``t[...] = 3`` is
  a fill, not counted), each with the source line that issued it and whether it ran inside the
  growth rounds; on CUDA also ``cuda_syncs``, the synchronisations PyTorch itself reports
  (``torch.cuda.set_sync_debug_mode``) during one build;
* ``host_ms``: wall time of the build without the counter, best and median of ``--repeats``
  after one warm-up (CUDA: synchronised before, and the build ends with its one host sync, so
  this is the time until the trees are known on the host); with ``--graphs`` also
  ``graph_host_ms`` (the capture is in the warm-up) and ``graph_equals_eager``;
* ``trees_sha256``: a digest of the trees (tokens, parents): equal digests across labels mean the
  same trees for the same inputs (CPU; CUDA kernels may round differently).

The JSON file keeps one entry per ``--label`` (running ``--label after`` leaves ``before`` in
place) and a ``command`` field per entry.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any, Self

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "tests" / "cpu"):  # tests/cpu: the frozen previous implementation
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from vllm_tfm.models import weaver as weaver_module
from vllm_tfm.models.proposal_trees import _candidates
from vllm_tfm.models.tfm_config import WeaverConfig
from vllm_tfm.models.weaver import Weaver
from vllm_tfm.tree.weaver import default_weaver_width
from vllm_tfm.vllm_plugin.runtime.tree_builder_gpu import weaver_trees

DEFAULT_OUT = REPO / "bench" / "results" / "tree_build_ops_cpu.json"

# aten ops that read device data on the host (CUDA: the host waits for the stream)
SYNC_OPS = {
    "aten._local_scalar_dense.default": "item/bool/int of a tensor",
    "aten.nonzero.default": "nonzero",
    "aten.masked_select.default": "masked_select",
    "aten._unique2.default": "unique",
    "aten.unique_dim.default": "unique",
    "aten.unique_consecutive.default": "unique_consecutive",
    "aten.repeat_interleave.Tensor": "repeat_interleave without output_size",
    "aten.equal.default": "torch.equal",
}
LIFT = "aten.lift_fresh.default"  # torch.tensor(host data); 0-dim also for ``t[...] = scalar`` (no copy)


def zoo_shapes() -> dict[str, Any]:
    """The zoo drafter's sizes (zoo/drafter/config.json, tfm_config.json)."""
    cfg = json.loads((REPO / "zoo" / "drafter" / "config.json").read_text())
    tfm = json.loads((REPO / "zoo" / "drafter" / "tfm_config.json").read_text())
    return {
        "vocab": cfg["vocab_size"],
        "block_size": cfg["block_size"],
        "top_k": tfm["top_k"],
        "children_per_node": tfm["children_per_node"],
        "width": tfm["width"],
        "weaver": tfm["weaver"],
    }


# ops that launch nothing on the device: metadata, allocation, CPU scalars (``where(c, x, 0)``)
NO_KERNEL = {"aten._unsafe_view.default", "aten.detach.default", "aten.alias.default", "aten.empty.memory_format",
             "aten.empty_like.default", "aten.empty_strided.default", "aten.lift_fresh.default",
             "aten.scalar_tensor.default"}


class OpLog(TorchDispatchMode):
    """Counts aten ops (and those that launch work: not views, not metadata or allocation only);
    records host syncs with the line of vllm_tfm code that issued them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.kernels = 0
        self.syncs: list[tuple[int, str, str]] = []  # (op index, what, where)

    def sync(self, what: str) -> None:
        self.syncs.append((self.ops, what, _site()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = str(func)
        if not func.is_view and name not in NO_KERNEL:
            self.kernels += 1
        if name in SYNC_OPS:
            self.sync(SYNC_OPS[name])
        elif name == LIFT and args[0].dim() >= 1:
            self.sync("torch.tensor(host list): host-to-device copy")
        elif name in ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default"):
            idx = args[1] if len(args) > 1 else []
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx):
                self.sync("boolean-mask indexing")
        return func(*args, **(kwargs or {}))


def _site() -> str:
    """file:line (function) of the innermost frame in vllm_tfm."""
    for fr in reversed(traceback.extract_stack()):
        if "/vllm_tfm/" in fr.filename:
            return f"{fr.filename.split('/vllm_tfm/')[-1]}:{fr.lineno} ({fr.name})"
    return "?"


def _scorer_classes() -> list[type]:
    import _weaver_before

    return [weaver_module.BatchedWeaverTreeScorer, _weaver_before.BatchedWeaverTreeScorerBefore]


class Instrumented:
    """Within the block: ``Tensor.tolist`` (not an aten op on CPU) is logged as a sync and every
    batched Weaver scorer call records the op counts at its start and end."""

    def __init__(self, log: OpLog) -> None:
        self.log = log
        self.calls: list[tuple[tuple[int, int], tuple[int, int]]] = []  # (ops, kernels) at start, end

    def __enter__(self) -> Self:
        log, calls = self.log, self.calls
        self._tolist = torch.Tensor.tolist
        self._calls = {cls: cls.__call__ for cls in _scorer_classes()}
        tolist = self._tolist

        def logged_tolist(t: torch.Tensor) -> Any:
            log.sync(".tolist()")
            return tolist(t)

        def logged(call: Any) -> Any:
            def logged_call(scorer: Any, *args: Any, **kwargs: Any) -> Any:
                start = (log.ops, log.kernels)
                out = call(scorer, *args, **kwargs)
                calls.append((start, (log.ops, log.kernels)))
                return out

            return logged_call

        torch.Tensor.tolist = logged_tolist  # type: ignore[method-assign]
        for cls, call in self._calls.items():
            cls.__call__ = logged(call)  # type: ignore[method-assign]
        log.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.log.__exit__(*exc)
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        for cls, call in self._calls.items():
            cls.__call__ = call  # type: ignore[method-assign]


def cuda_syncs(fn: Any) -> list[str]:
    """The synchronisations PyTorch reports while ``fn`` runs (CUDA)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message).splitlines()[0] for w in rec if "synchroniz" in str(w.message).lower()]


def before_trees(weaver, logits, hidden, verifier, roots, embed, head, budget, top_k, width, cpn):
    """The previous implementation end to end, like the runtime called it then."""
    from _weaver_before import BatchedWeaverTreeScorerBefore, build_weaver_padded_before

    cand_logits, cand_ids = _candidates(logits, top_k)
    scorer = BatchedWeaverTreeScorerBefore(
        weaver, verifier, hidden, cand_ids, cand_logits.to(hidden.dtype), embed, head, max_nodes=1 + budget
    )
    trees = build_weaver_padded_before(roots, cand_ids, scorer, budget, logits.shape[1], width, cpn, check=False)
    return trees.draft_layout(cand_ids[:, 0, 0])


def make_inputs(r: int, depth: int, zoo: dict[str, Any], seed: int, device: torch.device) -> dict[str, Any]:
    """Random Weaver weights, target embedding / lm_head, DFlash logits and hidden states (drawn
    on the CPU, so the inputs do not depend on the device)."""
    cfg = WeaverConfig(**zoo["weaver"])
    h, vocab = cfg.d_model, zoo["vocab"]
    torch.manual_seed(seed)
    weaver = Weaver(cfg).eval()
    with torch.no_grad():  # the default init leaves norms at 1 / 0: give every weight some spread
        for p in weaver.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    gen = torch.Generator().manual_seed(seed + 1)
    embed = torch.randn(vocab, h, generator=gen)
    head = torch.randn(vocab, h, generator=gen) * 0.05
    hidden = torch.randn(r, depth, h, generator=gen)
    x = {
        "logits": (hidden @ head.T) * 3,
        "hidden": hidden,
        "verifier": torch.randn(r, h, generator=gen),
        "roots": torch.randint(0, vocab, (r,), generator=gen),
        "embed": embed,
        "head": head,
    }
    return {"weaver": weaver.to(device), **{k: v.to(device) for k, v in x.items()}}


def _phases(log: OpLog, calls: list[tuple[tuple[int, int], tuple[int, int]]], which: int) -> dict[str, Any]:
    """Counts of one counter (0: ops, 1: kernels) split at the scorer calls."""
    total = (log.ops, log.kernels)[which]
    starts = [s[which] for s, _ in calls]
    loop_start = starts[0] if starts else total
    rounds = [b - a for a, b in pairwise(starts[1:])]
    inside = [e[which] - s[which] for s, e in calls]
    return {
        "total": total,
        "setup": loop_start,
        "rounds": total - loop_start,
        "per_round": statistics.median(rounds) if rounds else None,
        "scorer_per_call": statistics.median(inside[1:]) if len(inside) > 1 else None,
        "builder_per_round": statistics.median(rounds) - statistics.median(inside[1:]) if rounds and len(inside) > 1 else None,
    }


def _timed(fn: Any, repeats: int, device: torch.device) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"best": 1e3 * min(times), "median": 1e3 * statistics.median(times)}


def measure(r: int, b: int, zoo: dict[str, Any], repeats: int, device: torch.device, impl: str, graphs: bool) -> dict[str, Any]:
    depth = min(zoo["block_size"] - 1, b)
    width = zoo["width"] if zoo["width"] is not None else default_weaver_width(b)
    x = make_inputs(r, depth, zoo, seed=1000 * r + b, device=device)
    args = (x["weaver"], x["logits"], x["hidden"], x["verifier"], x["roots"], x["embed"], x["head"],
            b, zoo["top_k"], width, zoo["children_per_node"])
    fn = weaver_trees if impl == "current" else before_trees

    def build(inference: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode() if inference else torch.no_grad():
            return fn(*args)

    tokens, parents = build()  # warm-up
    # pass 1, under inference_mode like vLLM: host-side torch calls (composite ops count once)
    log = OpLog()
    with Instrumented(log) as inst:
        tok2, par2 = build()
    # pass 2, under no_grad: composite ops decompose, so non-view ops ~ device kernels
    klog = OpLog()
    with Instrumented(klog) as kinst:
        tok3, par3 = build(inference=False)
    for t, p in ((tok2, par2), (tok3, par3)):
        assert torch.equal(tokens, t) and torch.equal(parents, p)
    loop_start = inst.calls[0][0][0] if inst.calls else log.ops
    sites: Counter[str] = Counter()
    loop_sites: Counter[str] = Counter()
    for at, what, where in log.syncs:
        sites[f"{what} @ {where}"] += 1
        if at >= loop_start:
            loop_sites[f"{what} @ {where}"] += 1
    digest = hashlib.sha256(tokens.cpu().numpy().tobytes() + parents.cpu().numpy().tobytes()).hexdigest()[:16]
    res: dict[str, Any] = {
        "requests": r,
        "budget": b,
        "depth": depth,
        "width": width,
        "scorer_calls": len(inst.calls),
        "ops": _phases(log, inst.calls, 0),
        "kernels": _phases(klog, kinst.calls, 1),
        "syncs": {
            "total": len(log.syncs),
            "in_rounds": sum(loop_sites.values()),
            "sites": dict(sorted(sites.items())),
        },
        "host_ms": _timed(build, repeats, device),
        "trees_sha256": digest,
    }
    if device.type == "cuda":
        res["cuda_syncs"] = cuda_syncs(build)
    if graphs:
        from vllm_tfm.vllm_plugin.runtime.weaver_graphs import WeaverGraphs

        g = WeaverGraphs((r,))
        with torch.inference_mode():
            gtok, gpar = g.weaver_trees(*args)  # captures
            res["graph_equals_eager"] = bool(torch.equal(gtok, tokens) and torch.equal(gpar, parents))
            res["graph_host_ms"] = _timed(lambda: g.weaver_trees(*args), repeats, device)
            res["graph_cuda_syncs"] = cuda_syncs(lambda: g.weaver_trees(*args))
        res["graph_replays"] = g.replays
    return res


def save_labelled(out_path: str, label: str, cmd: str, note: str | None, device: torch.device, impl: str,
                  shapes: dict[str, Any], cases: list[dict[str, Any]]) -> None:
    """Write one labelled run ("before", "after", ...) into the results JSON at ``out_path``,
    keeping the other labels, with the machine it ran on and the command that re-runs it."""
    entry = {
        "command": cmd + (f"  ({note})" if note else ""),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "device": str(device), "impl": impl,
                    **({"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {})},
        "shapes": shapes,
        "cases": cases,
    }
    out = Path(out_path)
    data = json.loads(out.read_text()) if out.is_file() else {}
    data[label] = entry
    data["command"] = cmd
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out} [{label}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True, help="key of this run in the JSON file (e.g. before, after)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--requests", default="1,8,32")
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadier timings on a shared machine)")
    ap.add_argument("--note", default="", help="appended to the recorded command (e.g. the machine)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--impl", choices=("current", "before"), default="current",
                    help="before: the previous builder and scorer (tests/cpu/_weaver_before.py)")
    ap.add_argument("--graphs", action="store_true", help="CUDA: also time the builds replayed as CUDA graphs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.graphs and device.type != "cuda":
        ap.error("--graphs needs --device cuda")
    zoo = zoo_shapes()
    cases = []
    for r in (int(v) for v in args.requests.split(",")):
        for b in (int(v) for v in args.budgets.split(",")):
            res = measure(r, b, zoo, args.repeats, device, args.impl, args.graphs)
            ops, ker, syn = res["ops"], res["kernels"], res["syncs"]
            print(
                f"R={r:3d} B={b:3d} w={res['width']} calls={res['scorer_calls']:3d} ops={ops['total']:6d} "
                f"(setup {ops['setup']}, per round {ops['per_round']} = builder {ops['builder_per_round']} "
                f"+ scorer {ops['scorer_per_call']}) kernels={ker['total']} (per round {ker['per_round']}) "
                f"syncs={syn['total']} (in rounds {syn['in_rounds']}) host={res['host_ms']['best']:.1f} ms "
                f"trees {res['trees_sha256']}"
                + (f" graph={res['graph_host_ms']['best']:.2f} ms same={res['graph_equals_eager']}" if args.graphs else ""),
                flush=True,
            )
            cases.append(res)
    cmd = "python3 bench/tree_build_ops.py " + " ".join(sys.argv[1:])
    save_labelled(args.out, args.label, cmd, args.note, device, args.impl, dict(zoo), cases)


if __name__ == "__main__":
    main()
