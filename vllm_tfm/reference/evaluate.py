"""Acceptance and drafter-quality evaluation of the reference decoder (``vllm-tfm eval``).

Two measurements over the same prompts (windows of held-out code files, or seeded random token
ids with random models):

* **Acceptance**: for every (method, budget B, temperature T) cell, :class:`SpeculativeDecoder`
  generates ``max_new_tokens`` tokens after each prompt; the cell's mean accepted length
  MAL = (sum over steps of accepted drafts + 1) / steps (steps pooled over prompts) and its
  acceptance by depth (fraction of steps whose accepted path reached depth d). The per-step
  accepted counts are kept in the results so both can be recomputed.
* **Drafter quality by depth** (the marginal-vs-transition analysis of the TreeFlash paper and
  repository, re-implemented here from its description): at each anchor position a of the true
  text (teacher forcing), for every depth d = 1..gamma-1, the proposal's distribution of the
  token at a + d given the true prefix x_<=a (and, for TreeFlash / Weaver, the true tokens
  x_a..x_{a+d-1} on the path) is compared with the target's next-token distribution at position
  a + d - 1 (temperature 1): total-variation distance 0.5 * sum |p - q| and top-k coverage
  (the target's probability mass on the proposal's k most likely tokens; tokens with proposal
  probability 0, e.g. outside Weaver's candidate pool, are never counted). Proposals: the DFlash
  marginals, the TreeFlash transitions (given the true previous token) and Weaver (its
  distribution over the DFlash top-K pool given the true path, zero outside the pool).

Prompts of held-out files use the trainer's split (``vllm_tfm.train.data``): a file is held out
iff sha1(relative path) % eval_modulus == 0; files are visited in the trainer's (sha1) reading
order, the first ``count`` long enough are used, one window each at an offset drawn from
``numpy.random.default_rng(seed)``.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from vllm_tfm.models import DrafterBundle, TreeFlashTransitionScorer, drafter_logits

from .decoder import SamplingConfig, SpeculativeDecoder
from .drafters import METHODS, DraftInputs, ProposalBias, make_proposer
from .hf_compat import capture_final_hidden, capture_layer_outputs
from .replay import acceptance_record, replay_cells

__all__ = [
    "EvalConfig",
    "PromptSet",
    "acceptance_cells",
    "compact_cells",
    "drafter_quality",
    "environment_info",
    "evaluate",
    "finite_or_none",
    "held_out_prompts",
    "markdown_tables",
    "random_prompts",
    "recorded_data_roots",
    "topk_coverage",
    "total_variation",
    "write_plots",
]

DEFAULT_BUDGETS = (16, 32, 64, 128)
DEFAULT_TEMPERATURES = (0.0, 1.0)
DEFAULT_KS = (1, 8, 64)
DRAFTERS = ("dflash", "treeflash", "weaver")
MODES = ("replay", "decode")
"""Acceptance modes: ``replay`` reads each step's accepted path off the target's own continuation
(``vllm_tfm.reference.replay``: the decoder's numbers without its verify passes, batched over
prompts); ``decode`` runs :class:`SpeculativeDecoder` prompt by prompt (tree verify included)."""


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate. ``gamma`` None = the drafter's block size."""

    methods: tuple[str, ...] = METHODS
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES
    max_new_tokens: int = 64
    seed: int = 0
    gamma: int | None = None
    coverage_ks: tuple[int, ...] = DEFAULT_KS
    mode: str = "replay"
    quality_anchors: int | None = None  # anchors per prompt for drafter quality (None: max_new_tokens)
    deadline_s: float | None = None  # replay: skip the cells that would start later than this many seconds
    width: int | None = None  # TfM Weaver nodes per scorer call (None: the drafter's tfm_config.json / default_weaver_width(B))

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown acceptance mode {self.mode!r}; choose from {', '.join(MODES)}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"unknown method {bad[0] if bad else '(none)'!r}; choose from {', '.join(METHODS)}")
        if not self.budgets or min(self.budgets) < 1:
            raise ValueError(f"budgets must be >= 1, got {list(self.budgets)}")
        if not self.temperatures or min(self.temperatures) < 0:
            raise ValueError(f"temperatures must be >= 0, got {list(self.temperatures)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.quality_anchors is not None and self.quality_anchors < 1:
            raise ValueError(f"quality_anchors must be >= 1, got {self.quality_anchors}")
        if self.width is not None and self.width < 1:
            raise ValueError(f"width must be >= 1, got {self.width}")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")
        if not self.coverage_ks or min(self.coverage_ks) < 1:
            raise ValueError(f"coverage ks must be >= 1, got {list(self.coverage_ks)}")


@dataclass
class PromptSet:
    """``windows``: token-id lists of prompt_len + max_new_tokens + gamma - 1 tokens of true text;
    a prompt is ``window[:prompt_len]``. ``info``: where they came from (JSON-able)."""

    windows: list[list[int]]
    prompt_len: int
    info: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------- distribution metrics


def total_variation(p: Tensor, q: Tensor) -> Tensor:
    """0.5 * sum_v |p - q| over the last dim: p, q [..., V] probabilities -> [...]."""
    return 0.5 * (p - q).abs().sum(-1)


def topk_coverage(proposal: Tensor, target: Tensor, ks: Sequence[int]) -> dict[int, Tensor]:
    """Target mass on the proposal's top-k tokens, for each k: proposal, target [N, V] -> {k: [N]}.

    Only tokens with proposal probability > 0 count (a proposal over a pool never covers tokens
    outside it). Ties are broken by ``torch.topk`` (lowest-index-first is not guaranteed)."""
    kmax = min(max(ks), proposal.shape[-1])
    vals, idx = torch.topk(proposal, kmax, dim=-1)
    mass = torch.gather(target, -1, idx) * (vals > 0)
    csum = mass.cumsum(-1)
    return {int(k): csum[..., min(k, kmax) - 1] for k in ks}


# ---------------------------------------------------------------------- prompts


def random_prompts(vocab_size: int, count: int, prompt_len: int, window_len: int, seed: int) -> PromptSet:
    """``count`` windows of uniform random token ids (seeded): prompts for random models."""
    if count < 1 or prompt_len < 1:
        raise ValueError(f"need >= 1 prompt of >= 1 token, got {count} prompts of {prompt_len}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (count, window_len), generator=gen)
    info = {"kind": "random token ids", "seed": seed, "vocab_size": vocab_size}
    return PromptSet(ids.tolist(), prompt_len, info)


def recorded_data_roots(zoo: str | Path) -> tuple[list[str], int | None]:
    """(existing data roots, eval_modulus) recorded in the zoo's training cards ([] / None if none)."""
    zoo = Path(zoo)
    for card in (zoo / "target" / "training_target.json", zoo / "drafter" / "training_dflash.json"):
        if card.is_file():
            try:
                data = json.loads(card.read_text()).get("data", {})
            except json.JSONDecodeError:
                continue
            roots = [r for r in data.get("roots", []) if Path(r).is_dir()]
            modulus = data.get("config", {}).get("eval_modulus")
            if roots:
                return roots, modulus
    return [], None


def held_out_prompts(
    data_roots: Sequence[str],
    tokenizer_dir: str | Path,
    count: int,
    prompt_len: int,
    window_len: int,
    seed: int,
    eval_modulus: int | None = None,
) -> PromptSet:
    """Windows of held-out files (the trainer's split), tokenized with the zoo's data tokenizer."""
    from vllm_tfm.train.data import DataConfig, build_manifest
    from vllm_tfm.train.tokenizer import data_tokenizer, load_tokenizer

    if count < 1 or prompt_len < 1:
        raise ValueError(f"need >= 1 prompt of >= 1 token, got {count} prompts of {prompt_len}")
    cfg = DataConfig() if eval_modulus is None else DataConfig(eval_modulus=eval_modulus)
    manifest = build_manifest(list(data_roots), cfg)
    tok = data_tokenizer(load_tokenizer(tokenizer_dir))
    rng = np.random.default_rng(seed)
    windows, files = [], []
    for f in manifest.eval:
        try:
            text = f.path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = tok.encode(text, add_special_tokens=False).ids
        if len(ids) < window_len:
            continue
        start = int(rng.integers(0, len(ids) - window_len + 1))
        windows.append([int(t) for t in ids[start : start + window_len]])
        files.append({"relpath": f.relpath, "root": manifest.roots[f.root_index], "token_offset": start, "tokens": len(ids)})
        if len(windows) == count:
            break
    if len(windows) < count:
        raise ValueError(
            f"only {len(windows)} held-out files have >= {window_len} tokens (wanted {count} prompts); "
            "lower --prompts, --max-new-tokens or --prompt-len"
        )
    info = {
        "kind": "held-out code files",
        "data_roots": list(manifest.roots),
        "split_rule": manifest.summary()["split_rule"],
        "manifest_sha1": manifest.sha1,
        "tokenizer_dir": str(tokenizer_dir),
        "seed": seed,
        "files": files,
    }
    return PromptSet(windows, prompt_len, info)


# ---------------------------------------------------------------------- acceptance


def acceptance_cells(
    target: nn.Module,
    bundle: DrafterBundle,
    prompts: PromptSet,
    config: EvalConfig,
    proposal_bias: ProposalBias | None = None,
    progress=None,
) -> list[dict[str, Any]]:
    """One record per (method, budget, temperature): MAL, acceptance by depth, per-step counts.

    Sampling uses ``torch.Generator(device).manual_seed(seed + prompt index)`` per generation."""
    device = next(target.parameters()).device
    cells = []
    for method in config.methods:
        for budget in config.budgets:
            proposer = make_proposer(method, bundle, target, gamma=config.gamma, proposal_bias=proposal_bias,
                                     width=config.width)
            dec = SpeculativeDecoder(target, proposer, budget)
            for temp in config.temperatures:
                sampling = SamplingConfig(temperature=temp)
                accepted, nodes, seconds, tokens = [], [], 0.0, 0
                for i, window in enumerate(prompts.windows):
                    gen = torch.Generator(device=device).manual_seed(config.seed + i)
                    res = dec.generate(window[: prompts.prompt_len], config.max_new_tokens, sampling=sampling, generator=gen)
                    accepted.append([s.accepted for s in res.steps])
                    nodes.append([s.tree_nodes for s in res.steps])
                    seconds += res.total_s
                    tokens += len(res.tokens)
                cells.append(acceptance_record(method, budget, temp, proposer.max_depth, accepted, nodes, tokens, seconds))
                if progress is not None:
                    c = cells[-1]
                    progress(f"{method:<10} B={budget:<4} T={temp:g}: MAL {c['mal']:.3f} over {c['steps']} steps")
    return cells


# ---------------------------------------------------------------------- drafter quality


@torch.no_grad()
def _target_pass(target: nn.Module, ids: Tensor, taps: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    """(logits [L, V], final hidden [L, H], taps [L, n_tap * H]) of one full forward over ids [L]."""
    with capture_layer_outputs(target, list(taps)) as cap, capture_final_hidden(target) as fin:
        out = target(input_ids=ids[None], use_cache=False)
    tapped = torch.cat([cap[t][0] for t in taps], dim=-1)
    return out.logits[0], fin["final"][0], tapped


@torch.no_grad()
def drafter_quality(
    target: nn.Module,
    bundle: DrafterBundle,
    prompts: PromptSet,
    num_anchors: int,
    gamma: int | None = None,
    ks: Sequence[int] = DEFAULT_KS,
    proposal_bias: ProposalBias | None = None,
) -> dict[str, Any]:
    """Per drafter and depth d = 1..gamma-1: mean TVD to the target and mean top-k coverage.

    Anchors a = prompt_len .. prompt_len + num_anchors - 1 of every window (teacher forcing on
    the window's true tokens). Returns {"anchors": count, "depths": D, "<drafter>": {"tvd":
    [D], "coverage": {k: [D]}}} for the drafters present (dflash always; treeflash / weaver when
    the bundle has them).
    """
    drafter = bundle.dflash
    block = drafter.config.block_size
    gamma = block if gamma is None else int(gamma)
    depth = gamma - 1
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    dtype = next(drafter.parameters()).dtype
    device = next(target.parameters()).device
    top_k = bundle.tfm.top_k if bundle.tfm is not None else 512
    present = ["dflash"] + [n for n in ("treeflash", "weaver") if getattr(bundle, n) is not None]
    sums = {n: {"tvd": torch.zeros(depth, dtype=torch.float64), "cov": {k: torch.zeros(depth, dtype=torch.float64) for k in ks}} for n in present}
    count = 0

    def add(name: str, proposal: Tensor, tprobs: Tensor) -> None:
        s = sums[name]
        s["tvd"] += total_variation(proposal.double(), tprobs).cpu()
        for k, v in topk_coverage(proposal.double(), tprobs, ks).items():
            s["cov"][k] += v.cpu()

    for window in prompts.windows:
        ids = torch.tensor(window, dtype=torch.long, device=device)
        if ids.numel() < prompts.prompt_len + num_anchors + depth - 1:
            raise ValueError(f"a window of {ids.numel()} tokens is too short for {num_anchors} anchors at depth {depth}")
        logits, final, taps = _target_pass(target, ids, drafter.config.target_layer_ids)
        tprobs_all = torch.softmax(logits.double(), dim=-1)
        ctx_all = drafter.context_kv(taps.to(dtype), torch.arange(ids.numel(), device=device))
        for a in range(prompts.prompt_len, prompts.prompt_len + num_anchors):
            ctx = [(k[:a], v[:a]) for k, v in ctx_all]
            blk = drafter.block_tokens(ids[a : a + 1])[0, :gamma]
            pos = torch.arange(a, a + gamma, device=device)
            cu = torch.tensor([0, a], dtype=torch.long, device=device)
            prenorm = drafter.forward_batch_prenorm(ctx, cu, blk[None], pos[None], embed)[0]
            hidden = drafter.norm(prenorm)
            mlog = drafter_logits(drafter, hidden, lm_head).double()  # [D, V]
            bias = None
            if proposal_bias is not None:
                inputs = DraftInputs(root=int(ids[a]), position=a, verifier_hidden=final[a - 1], tokens=ids[: a + 1])
                bias = proposal_bias(inputs, depth).to(mlog)
                mlog = mlog + bias
            tprobs = tprobs_all[a : a + depth]  # row d-1: the target's distribution of x_{a+d}
            add("dflash", torch.softmax(mlog, -1), tprobs)
            if "treeflash" in present:
                scorer = TreeFlashTransitionScorer(bundle.treeflash, drafter.norm, prenorm, embed, lm_head)
                rows = []
                for d in range(1, depth + 1):
                    lp = scorer(d, ids[a + d - 1 : a + d]).double()[0]
                    if bias is not None:
                        lp = torch.log_softmax(lp + bias[d - 1], -1)
                    rows.append(lp.exp())
                add("treeflash", torch.stack(rows), tprobs)
            if "weaver" in present:
                k = min(top_k, mlog.shape[-1])
                cand_logits, cand_ids = torch.topk(mlog, k, dim=-1)  # [D, K]
                logp = bundle.weaver.score_paths(
                    final[a - 1][None].to(dtype), hidden[1:][None], ids[a : a + depth][None], embed, lm_head,
                    cand_ids[None], cand_logits[None],
                )[0]  # [D, K]
                full = torch.zeros_like(mlog).scatter_(1, cand_ids, logp.double().exp())
                add("weaver", full, tprobs)
            count += 1
    out: dict[str, Any] = {"anchors": count, "depths": depth, "target_temperature": 1.0, "coverage_ks": list(ks)}
    for n in present:
        out[n] = {
            "tvd": (sums[n]["tvd"] / count).tolist(),
            "coverage": {str(k): (v / count).tolist() for k, v in sums[n]["cov"].items()},
        }
    return out


# ---------------------------------------------------------------------- whole evaluation


def environment_info(device: torch.device | str) -> dict[str, Any]:
    """Machine and library versions for the results file."""
    import transformers

    import vllm_tfm

    dev = torch.device(device)
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm_tfm": vllm_tfm.__version__,
        "device": str(dev),
        "torch_threads": torch.get_num_threads(),
    }
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["cuda"] = torch.version.cuda
    return info


def evaluate(
    target: nn.Module,
    bundle: DrafterBundle,
    prompts: PromptSet,
    config: EvalConfig,
    proposal_bias: ProposalBias | None = None,
    progress=None,
) -> dict[str, Any]:
    """Acceptance cells and drafter quality: {"config", "prompts", "acceptance", "drafter_quality"}."""
    config.validate()
    need = {"tfm": "weaver", "treeflash": "treeflash"}
    for m in config.methods:
        if m in need and getattr(bundle, need[m]) is None:
            raise ValueError(f"method {m!r} needs a {need[m]} model, which the drafter directory does not have")
    t0 = time.monotonic()
    anchors = config.max_new_tokens if config.quality_anchors is None else min(config.quality_anchors, config.max_new_tokens)
    quality = drafter_quality(target, bundle, prompts, anchors, config.gamma, config.coverage_ks, proposal_bias)
    if progress is not None:
        progress(f"drafter quality over {quality['anchors']} anchors in {time.monotonic() - t0:.1f} s")
    skipped: list[dict[str, Any]] = []
    if config.mode == "replay":
        deadline = None if config.deadline_s is None else t0 + config.deadline_s
        cells = replay_cells(
            target, bundle, prompts.windows, prompts.prompt_len, config.methods, config.budgets, config.temperatures,
            config.max_new_tokens, config.seed, config.gamma, proposal_bias, progress, deadline=deadline, skipped=skipped,
            width=config.width,
        )
    else:
        cells = acceptance_cells(target, bundle, prompts, config, proposal_bias, progress)
    cfg = asdict(config)
    cfg["gamma"] = cells[0]["max_depth"] + 1 if cells else config.gamma
    cfg["prompts"] = len(prompts.windows)
    cfg["prompt_len"] = prompts.prompt_len
    cfg["sampling_seeds"] = f"torch.Generator(device).manual_seed(seed + prompt index), seed {config.seed}"
    cfg["acceptance"] = (
        "replay: accepted paths read off the target's continuation (greedy, or an ancestral sample at T > 0, "
        "which gives target-only tree acceptance's law)" if config.mode == "replay"
        else "decode: SpeculativeDecoder with tree verify, target-only acceptance when sampling"
    )
    out = {"config": cfg, "prompts": prompts.info, "acceptance": cells, "drafter_quality": quality}
    if skipped:
        out["skipped_cells"] = skipped
    return out


def compact_cells(results: dict[str, Any]) -> dict[str, Any]:
    """The results with each acceptance cell's per-step lists replaced by what the numbers need:
    ``accepted_histogram`` (steps with 0, 1, ..., max_depth accepted drafts; MAL and acceptance by
    depth follow from it), ``steps_per_prompt`` and ``tree_nodes_mean``. A copy; the input is kept."""
    out = dict(results)
    cells = []
    for c in results["acceptance"]:
        c = dict(c)
        per = c.pop("accepted_per_step", None)
        nodes = c.pop("tree_nodes_per_step", None)
        if per is not None:
            hist = [0] * (int(c["max_depth"]) + 1)
            for a in (a for p in per for a in p):
                hist[a] += 1
            c["accepted_histogram"] = hist
            c["steps_per_prompt"] = [len(p) for p in per]
        if nodes is not None:
            flat = [n for p in nodes for n in p]
            c["tree_nodes_mean"] = sum(flat) / len(flat) if flat else float("nan")
        cells.append(c)
    out["acceptance"] = cells
    return out


def markdown_tables(results: dict[str, Any]) -> str:
    """MAL per method x budget (one column per temperature), acceptance by depth, drafter quality."""
    cells = results["acceptance"]
    temps = sorted({c["temperature"] for c in cells})
    lines = ["| method | B | " + " | ".join(f"MAL T={t:g}" for t in temps) + " |", "| --- | ---: |" + " ---: |" * len(temps)]
    keys = list(dict.fromkeys((c["method"], c["budget"]) for c in cells))
    by = {(c["method"], c["budget"], c["temperature"]): c for c in cells}
    for m, b in keys:
        lines.append(f"| {m} | {b} | " + " | ".join(f"{by[(m, b, t)]['mal']:.3f}" if (m, b, t) in by else "-" for t in temps) + " |")
    depth = max(c["max_depth"] for c in cells)
    lines += ["", "acceptance by depth (fraction of steps reaching d):", "",
              "| method | B | T | " + " | ".join(f"d{d}" for d in range(1, depth + 1)) + " |",
              "| --- | ---: | ---: |" + " ---: |" * depth]
    for c in cells:
        lines.append(f"| {c['method']} | {c['budget']} | {c['temperature']:g} | " + " | ".join(f"{v:.2f}" for v in c["acceptance_by_depth"]) + " |")
    q = results["drafter_quality"]
    d = q["depths"]
    lines += ["", f"drafter quality by depth vs the target (T=1, {q['anchors']} anchors, true prefix):", "",
              "| drafter | metric | " + " | ".join(f"d{i}" for i in range(1, d + 1)) + " |",
              "| --- | --- |" + " ---: |" * d]
    for name in DRAFTERS:
        if name not in q:
            continue
        lines.append(f"| {name} | TVD | " + " | ".join(f"{v:.3f}" for v in q[name]["tvd"]) + " |")
        for k, vals in q[name]["coverage"].items():
            lines.append(f"| {name} | top-{k} cov | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return "\n".join(lines)


def write_plots(results: dict[str, Any], plots_dir: str | Path) -> list[str] | str:
    """MAL vs budget per method, one PNG per temperature; the paths, or a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: plots skipped"
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    cells = results["acceptance"]
    written = []
    tag = " (RANDOM models)" if results.get("models") == "random" else ""
    for t in sorted({c["temperature"] for c in cells}):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for m in dict.fromkeys(c["method"] for c in cells):
            pts = sorted((c["budget"], c["mal"]) for c in cells if c["method"] == m and c["temperature"] == t)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget B (draft nodes)")
        ax.set_ylabel("mean accepted length")
        ax.set_title(f"MAL vs budget, temperature {t:g}{tag}")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = plots_dir / f"acceptance_mal_T{t:g}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written


def finite_or_none(x: Any) -> Any:
    """JSON helper: NaN/inf floats become None (recursively)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite_or_none(v) for v in x]
    return x
