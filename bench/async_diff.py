#!/usr/bin/env python3
"""Where a tfm engine with asynchronous scheduling departs from the synchronous one (a debugging tool).

On the toy zoo (bench/gpu_graphs_e2e.py's engines ``tfm-fullpw`` and ``tfm-fullpw-async``, the same
prompts, batch 8 then batch 1), each engine runs in its own process with probes on the model runner
that record, per step and request (the request keyed by its external id and the number of tokens
before the step, so that records of the two engines pair up whatever the batch composition):

* ``step`` (before the commit, after the sampler): the input ids and positions the forward saw,
  vLLM's device ``num_accepted_tokens`` (the GDN slot read), float64 sums of every GDN layer's S0
  (SSM slot ``a - 1``) and of the conv window it read, the prefix K/V of the attention layers, the
  per-layer sums of the GDN stash's inputs, the tree's parents, the sampled tokens (the state slot
  ids, ``host_slots`` / ``st_slots``, are recorded for reading but not compared: each engine allocates
  its own);
* ``draft`` (the drafter's inputs and outputs): ``next_token_ids``, the rejected counts, the seq
  lens, sums of the DFlash context's hidden-state rows (in the order the drafter takes them), the
  DFlash marginals' row sums and argmaxes, the Weaver's verifier-hidden rows, the trees returned.

The probes read the device each step (host syncs): timings mean nothing here, the arithmetic is
the engine's. The comparison lists, per request, the first record whose fields differ between the
engines; the earliest field to differ names the culprit (drafts -> the drafter's inputs or the
store; S0 / conv -> the GDN state slots; outputs with equal inputs -> the verify).

usage (GPU host, repository root, after ``source .gpu-bundle/install.sh``):
    python3 bench/async_diff.py --out OUT            # both engines, then the comparison
    python3 bench/async_diff.py --compare OUT        # the comparison of existing probe files
    python3 bench/async_diff.py --out OUT --engines tfm-eager,tfm-eager-async   # another pair: synchronous first
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for _p in (str(REPO), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

ENGINES = ("tfm-fullpw", "tfm-fullpw-async")
STEP_FIELDS = ("n", "ids", "pos", "parents", "seq_len", "a", "st_a", "s0_all", "conv_all", "kv_prefix", "x_sum", "out")
DRAFT_FIELDS = ("next", "rej", "seq_len", "ctx_ids", "ctx_pos", "ctx_h", "logit_sum", "logit_argmax", "verifier",
                "tokens", "parents")


def _ext(req_id: str) -> str:
    """The external request id (LLM.generate's counter) of vLLM's internal ``<id>-<8 hex>``."""
    return req_id.rsplit("-", 1)[0]


# ---------------------------------------------------------------------------------------- probes (child)
class Probe:
    def __init__(self, path: Path) -> None:
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - the child's life
        self.phase = ""
        self.step = 0

    def write(self, rec: dict[str, Any]) -> None:
        rec["phase"] = self.phase
        self.file.write(json.dumps(rec, separators=(",", ":")) + "\n")


def install_probes(probe: Probe) -> None:
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_tfm.vllm_plugin.runtime import hooks
    from vllm_tfm.vllm_plugin.runtime.gdn import _layer_states
    from vllm_tfm.vllm_plugin.runtime.proposer import TFMProposer
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    def rsum(x: Any) -> float:
        return round(float(x.double().sum()), 9)

    orig_after = GPUModelRunner._update_states_after_model_execute
    last_hooks: dict[str, int] = {}

    def after(self: Any, output_token_ids: Any, scheduler_output: Any) -> Any:
        try:
            step = STATE.step
            r = self.input_batch.num_reqs
            rids = list(self.input_batch.req_ids[:r])
            nst = [int(scheduler_output.num_scheduled_tokens[x]) for x in rids]
            t = sum(nst)
            ids = self.input_ids.gpu[:t].tolist()
            pos = self.positions[:t].tolist()
            seq = step.seq_positions.tolist() if step is not None and step.seq_positions is not None else pos
            acc = self.num_accepted_tokens.gpu[:r].tolist()
            out = output_token_ids.tolist()
            gid, _ = hooks._gdn_groups(self)[0]
            table = self.input_batch.block_table[gid].get_numpy_array()
            gdn_states = [(_layer_states(layer), int(layer.conv1d.weight.shape[-1])) for _, ls in hooks._gdn_groups(self)
                          for layer in ls]
            kv_groups = hooks._kv_groups(self)
            seq_lens = self.seq_lens[:r].tolist()
            stash_rows: dict[int, dict[str, Any]] = {}
            if step is not None and step.tree_active and step.gdn:
                stashes = list(step.gdn.values())
                cu = [int(v) for v in step.spec_cu]
                for j, bi in enumerate(step.spec_req_index.tolist()):
                    a0, a1 = cu[j], cu[j + 1]
                    stash_rows[int(bi)] = {
                        "st_a": [int(st.prev_accepted[j]) for st in stashes],
                        "st_slots": stashes[0].state_indices[j].tolist(),
                        "x_sum": [rsum(st.x[a0:a1]) for st in stashes],
                    }
            local_parent = getattr(step, "local_parent", None) if step is not None else None
            counts = dict(STATE.metrics.hooks) if STATE.metrics is not None else {}
            paths = sorted(k for k, v in counts.items() if v > last_hooks.get(k, 0) and k.startswith(("cudagraph.", "topology.",
                                                                                                    "attention.", "gdn.")))
            last_hooks.clear()
            last_hooks.update(counts)
            start = 0
            for i, rid in enumerate(rids):
                n = nst[i]
                a = int(acc[i]) if n > 1 else 1
                nc = int(seq[start])
                rec = {"k": "step", "s": probe.step, "r": _ext(rid), "row": i, "nc": nc, "n": n,
                       "ids": ids[start:start + n], "pos": pos[start:start + n], "a": a, "out": out[i],
                       "seq_len": int(seq_lens[i]), "paths": paths}
                if nc > 0:  # a request with a state (not its first prefill chunk)
                    rec["s0_all"] = [rsum(st[1][int(table[i, a - 1])]) for st, _ in gdn_states]
                    rec["conv_all"] = [rsum(st[0][int(table[i, 0])][:, a - 1:a - 1 + w - 1]) for st, w in gdn_states]
                    kv = []
                    for kgid, caches in kv_groups:
                        bt = torch.as_tensor(self.input_batch.block_table[kgid].get_numpy_array()[i], device=caches[0].device,
                                             dtype=torch.long)
                        bsz = int(caches[0].shape[2])
                        p = torch.arange(nc, device=caches[0].device)
                        blk, off = bt[p // bsz], p % bsz
                        kv.extend(rsum(c[blk, :, off, :]) for c in caches)
                    rec["kv_prefix"] = kv
                rec.update(stash_rows.get(i, {}))
                if local_parent is not None:
                    rec["parents"] = [int(v) for v in local_parent[start:start + n]]
                rec["host_slots"] = [int(v) for v in table[i, : max(a, 1) + 1]]
                probe.write(rec)
                start += n
        except Exception as e:  # noqa: BLE001 - a probe must not stop the engine
            probe.write({"k": "error", "where": "step", "error": repr(e)})
        probe.step += 1
        return orig_after(self, output_token_ids, scheduler_output)

    GPUModelRunner._update_states_after_model_execute = after

    orig_sample = TFMProposer._sample_draft_tokens
    orig_verifier = TFMProposer._verifier_hidden
    orig_propose = TFMProposer.propose
    cur: dict[str, Any] = {}

    def sample_draft(self: Any, hidden_states: Any, sampling_metadata: Any) -> Any:
        out = orig_sample(self, hidden_states, sampling_metadata)
        logits = self._marginal_logits
        if logits is not None:
            cur["logit_sum"] = [round(float(v), 6) for v in logits.double().sum(-1).tolist()]
            cur["logit_argmax"] = logits.argmax(-1).tolist()
        return out

    def verifier(self: Any, num_req: int, num_rejected: Any) -> Any:
        v = orig_verifier(self, num_req, num_rejected)
        cur["verifier"] = [round(float(x), 6) for x in v.double().sum(-1).tolist()]
        return v

    def propose(self: Any, num_speculative_tokens: int, target_token_ids: Any, target_positions: Any,
                target_hidden_states: Any, next_token_ids: Any, token_indices_to_sample: Any,
                common_attn_metadata: Any, sampling_metadata: Any, **kw: Any) -> Any:
        cur.clear()
        step = STATE.step
        try:
            ids, hid, posn = target_token_ids, target_hidden_states, target_positions
            if step is not None and step.tree_active and step.accept is not None:
                from vllm_tfm.vllm_plugin.runtime.drafter_inputs import dflash_context_order

                perm = dflash_context_order(step.dev("req_index"), step.dev("row_base"), step.dev("num_scheduled"),
                                            step.accept.accepted_nodes)
                ids, hid, posn = ids[perm], hid[perm], step.seq_positions
            qsl = common_attn_metadata.query_start_loc.tolist()
            rej = kw.get("num_rejected_tokens_gpu")
            rej = rej.tolist() if rej is not None else None
            snap = {"next": next_token_ids.tolist(), "rej": rej,
                    "seq_len": common_attn_metadata.seq_lens[: next_token_ids.shape[0]].tolist(), "qsl": qsl,
                    "ids": ids.tolist(), "pos": posn.tolist(), "h": [round(float(x), 5) for x in hid.double().sum(-1).tolist()]}
        except Exception as e:  # noqa: BLE001
            snap = {"error": repr(e)}
        tokens = orig_propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                              next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata, **kw)
        try:
            if "error" in snap:
                raise RuntimeError(snap["error"])
            r = int(next_token_ids.shape[0])
            rids = list(self._tfm_runner.input_batch.req_ids[:r])
            latest = STATE.store._latest
            parents = latest[2].tolist() if latest is not None else None
            toks = tokens.tolist()
            d = len(cur.get("logit_sum", [])) // max(r, 1)
            for i, rid in enumerate(rids):
                a, b = snap["qsl"][i], snap["qsl"][i + 1]
                rj = snap["rej"][i] if snap["rej"] is not None else 0
                valid = b - a - rj
                rec = {"k": "draft", "s": probe.step, "r": _ext(rid), "row": i,
                       "nc": int(snap["seq_len"][i]) - rj,
                       "next": snap["next"][i], "rej": rj, "seq_len": snap["seq_len"][i],
                       "ctx_ids": snap["ids"][a:a + valid], "ctx_pos": snap["pos"][a:a + valid],
                       "ctx_h": snap["h"][a:a + valid], "tokens": toks[i],
                       "parents": parents[i] if parents is not None else None}
                if d:
                    rec["logit_sum"] = cur["logit_sum"][i * d:(i + 1) * d]
                    rec["logit_argmax"] = cur["logit_argmax"][i * d:(i + 1) * d]
                if "verifier" in cur:
                    rec["verifier"] = cur["verifier"][i]
                probe.write(rec)
        except Exception as e:  # noqa: BLE001
            probe.write({"k": "error", "where": "draft", "error": repr(e)})
        return tokens

    TFMProposer._sample_draft_tokens = sample_draft
    TFMProposer._verifier_hidden = verifier
    TFMProposer.propose = propose


def run_child(name: str, out: Path, n_prompts: int, max_tokens: int, n_b1: int) -> int:
    import gpu_graphs_e2e as g

    os.environ.update(g.ENGINES[name].get("env") or {})
    from vllm import LLM, SamplingParams

    import vllm_tfm

    vllm_tfm.register()
    kw = g.engine_kwargs(name, str(g.ZOO / "target"), str(g.ZOO / "drafter"), g.BUDGET)
    llm = LLM(**kw)
    probe = Probe(out / f"{name}.probe.jsonl")
    install_probes(probe)
    ps = g.prompts(n_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    res: dict[str, Any] = {"engine": name, "kwargs": kw}
    for label, batches in (("b8", [ps]), ("b1", [[p] for p in ps[:n_b1]])):
        if not batches:
            continue
        probe.phase = label
        outs = [o.outputs[0] for b in batches for o in llm.generate([{"prompt_token_ids": p} for p in b], params,
                                                                     use_tqdm=False)]
        res[label] = [list(c.token_ids) for c in outs]
    probe.file.close()
    (out / f"{name}.tokens.json").write_text(json.dumps(res))
    return 0


# ---------------------------------------------------------------------------------------- comparison
def _load(path: Path) -> dict[tuple[str, str, str, int], dict[str, Any]]:
    recs: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("k") in ("step", "draft"):
            recs.setdefault((rec["phase"], rec["k"], rec["r"], rec["nc"]), rec)
    return recs


def _differs(x: Any, y: Any, rel: float) -> bool:
    if isinstance(x, float) or isinstance(y, float):
        if x is None or y is None:
            return x is not y
        return abs(x - y) > rel * max(1.0, abs(x), abs(y))
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        return any(_differs(a, b, rel) for a, b in zip(x, y))
    return x != y


def compare(out: Path, rel: float = 1e-3, engines: tuple[str, str] = ENGINES) -> dict[str, Any]:
    a, b = (_load(out / f"{n}.probe.jsonl") for n in engines)
    result: dict[str, Any] = {"engines": list(engines), "rel_tolerance": rel}
    for phase in ("b8", "b1"):
        firsts: list[dict[str, Any]] = []
        reqs = sorted({k[2] for k in a if k[0] == phase} | {k[2] for k in b if k[0] == phase}, key=lambda s: (len(s), s))
        only = {"sync_only": 0, "async_only": 0, "both": 0}
        for rid in reqs:
            keys = sorted({(k[3], k[1]) for k in (*a, *b) if k[0] == phase and k[2] == rid},
                          key=lambda kk: (kk[0], kk[1] == "step"))  # at one nc the draft came first
            for nc, kind in keys:
                ra, rb = a.get((phase, kind, rid, nc)), b.get((phase, kind, rid, nc))
                if ra is None or rb is None:
                    only["sync_only" if rb is None else "async_only"] += 1
                    continue
                only["both"] += 1
                fields = [f for f in (STEP_FIELDS if kind == "step" else DRAFT_FIELDS) if _differs(ra.get(f), rb.get(f), rel)]
                if fields:
                    firsts.append({"r": rid, "nc": nc, "kind": kind, "fields": fields,
                                   "sync": {f: ra.get(f) for f in fields[:3]}, "async": {f: rb.get(f) for f in fields[:3]},
                                   "sync_ctx": {k: ra.get(k) for k in ("s", "row", "n", "a", "rej", "seq_len")},
                                   "async_ctx": {k: rb.get(k) for k in ("s", "row", "n", "a", "rej", "seq_len")}})
                    break
        by_first: dict[str, int] = {}
        for f in firsts:
            key = f"{f['kind']}:{f['fields'][0]}"
            by_first[key] = by_first.get(key, 0) + 1
        result[phase] = {"requests": len(reqs), "requests_diverging": len(firsts), "first_field_counts": by_first,
                         "record_pairs": only, "first_divergences": firsts}
    toks = [json.loads((out / f"{n}.tokens.json").read_text()) for n in engines if (out / f"{n}.tokens.json").is_file()]
    if len(toks) == 2:
        result["tokens_equal"] = {ph: toks[0].get(ph) == toks[1].get(ph) for ph in ("b8", "b1")}
    return result


def engine_pair(text: str) -> tuple[str, str]:
    """``--engines``: two engines of bench/gpu_graphs_e2e.py, a synchronous tfm engine, then an asynchronous one."""
    import gpu_graphs_e2e as g

    names = [n.strip() for n in text.split(",")]
    if len(names) != 2 or not all(names):
        raise SystemExit(f"--engines {text!r}: two engine names, the synchronous one first")
    for n in names:
        if n not in g.ENGINES or not g.ENGINES[n]["spec"]:
            raise SystemExit(f"--engines: {n!r} is not a tfm engine of bench/gpu_graphs_e2e.py "
                             f"({', '.join(k for k, e in g.ENGINES.items() if e['spec'])})")
    if [bool(g.ENGINES[n].get("async_scheduling")) for n in names] != [False, True]:
        raise SystemExit(f"--engines {text!r}: the first must schedule synchronously and the second asynchronously")
    return names[0], names[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/tfm-async-diff"))
    ap.add_argument("--compare", help="compare the probe files in this directory and stop")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--b1-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help="the synchronous and the asynchronous engine of bench/gpu_graphs_e2e.py, comma-separated")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    engines = engine_pair(args.engines)
    if args.child:
        return run_child(args.child, Path(args.out), args.prompts, args.max_tokens, args.b1_prompts)
    out = Path(args.compare or args.out)
    if not args.compare:
        out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
        t0 = time.time()
        procs = [subprocess.Popen([sys.executable, __file__, "--child", n, "--out", str(out), "--prompts", str(args.prompts),
                                   "--b1-prompts", str(args.b1_prompts), "--max-tokens", str(args.max_tokens)],
                                  env=env, stdout=open(out / f"{n}.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
                 for n in engines]
        codes = [p.wait() for p in procs]
        print(f"engines done in {time.time() - t0:.0f} s, exit codes {codes}", flush=True)
    result = compare(out, engines=engines)
    result["command"] = " ".join(["python3 bench/async_diff.py", *(argv if argv is not None else sys.argv[1:])])
    (out / "async_diff.json").write_text(json.dumps(result, indent=1) + "\n")
    for phase in ("b8", "b1"):
        p = result[phase]
        print(f"{phase}: {p['requests_diverging']} of {p['requests']} requests diverge; first fields {p['first_field_counts']}; "
              f"pairs {p['record_pairs']}")
        for f in p["first_divergences"][:6]:
            print("  ", json.dumps(f)[:1500])
    print("tokens equal:", result.get("tokens_equal"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
