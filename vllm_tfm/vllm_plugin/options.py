"""Tree options of a tfm engine, resolved once in the process that builds the engine config.

The schema is ``vllm_tfm.models.tfm_config.TfmConfig`` (the ``tfm_config.json`` of a drafter
directory). Sources, later ones win:

1. the defaults: a drafter directory without ``tfm_config.json`` (a plain z-lab DFlash drafter)
   runs proposal ``ddtree``, which needs no extra weights;
2. ``tfm_config.json`` in the drafter directory;
3. environment variables ``VLLM_TFM_<KEY>`` (e.g. ``VLLM_TFM_PROPOSAL=chain``), read in the
   process that builds the config, as JSON when they parse as JSON and as a string otherwise
   (``none`` / ``null`` / empty = None);
4. the same keys inside the speculative config, e.g.
   ``{"method": "tfm", "model": DIR, "num_speculative_tokens": 64, "proposal": "ddtree"}``.

Keys settable from 3 and 4: :data:`OPTION_KEYS`. The ``weaver`` / ``treeflash`` sections describe
checkpoint shapes and come from the file only. The tree budget B is vLLM's
``num_speculative_tokens`` (range :data:`MIN_BUDGET` .. :data:`MAX_BUDGET`); when it is left out,
an explicit ``budget`` in ``tfm_config.json`` supplies it.

Every refusal is one line: ``<source>: <key>: <problem>``, where the source names the file, the
environment variable or ``speculative_config``.

The resolved options travel to every engine-core and worker process (and Ray actors) inside the
drafter's Hugging Face config, ``speculative_config.draft_model_config.hf_config``, as the plain
dict attributes :data:`HF_OPTIONS_ATTR` and :data:`HF_DRAFTER_DIR_ATTR`; read them there with
:func:`get_tfm_options` and :func:`get_drafter_dir` (never re-read files or the environment in a
worker: a Ray actor's environment and files may differ from the driver's).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vllm_tfm.models.io import read_json
from vllm_tfm.models.tfm_config import TFM_CONFIG_NAME, TREEFLASH_WEIGHTS_NAME, TfmConfig

__all__ = [
    "ENV_PREFIX",
    "OPTION_KEYS",
    "NON_OPTION_ENV_VARS",
    "VLLM_PROPOSALS",
    "DEFAULT_PROPOSAL_WITHOUT_FILE",
    "MIN_BUDGET",
    "MAX_BUDGET",
    "HF_OPTIONS_ATTR",
    "HF_DRAFTER_DIR_ATTR",
    "env_overrides",
    "resolve_tfm_options",
    "get_tfm_options",
    "get_drafter_dir",
    "draft_depth",
    "spec_draft_depth",
    "loads_treeflash",
    "LOAD_TREEFLASH_ENV",
    "hf_loads_treeflash",
]

ENV_PREFIX = "VLLM_TFM_"

OPTION_KEYS: tuple[str, ...] = tuple(k for k in TfmConfig.model_fields if k not in ("budget", "weaver", "treeflash"))
"""Tree options settable from the environment and the speculative config (proposal, width,
top_k, children_per_node, treeflash_top_m, sampling, gdn_state_slots)."""

NON_OPTION_ENV_VARS: frozenset[str] = frozenset(
    {
        "VLLM_TFM_SKIP_VERSION_CHECK",  # vllm_plugin/version.py
        "VLLM_TFM_FORCE_TREE_PATH",  # runtime: chains go through the tree path too
        "VLLM_TFM_BATCHED_COMMIT",  # runtime: one commit launch per kernel kind for all GDN layers (runtime/commit.py)
        "VLLM_TFM_GDN_METADATA_ONCE",  # runtime: 0 keeps vLLM's GDN metadata build per KV-cache group (runtime/gdn_metadata.py)
        "VLLM_TFM_GDN_METADATA_FAST",  # runtime: 0 runs vLLM's GDN metadata build on all-spec full-graph steps too (runtime/gdn_metadata.py)
        "VLLM_TFM_KV_COMPACT_KERNEL",  # runtime: 0 keeps the torch gather + scatter per attention layer for the K/V compaction (runtime/commit.py)
        "VLLM_TFM_CONTEXT_ORDER_KERNEL",  # runtime: 0 keeps the torch argsort for the drafter's context order (runtime/drafter_inputs.py)
        "VLLM_TFM_ONE_SLOT_COMMIT",  # runtime: 0 makes one-slot engines' commit indices by the general path (runtime/step_kernels.py)
        "VLLM_TFM_COMMIT_OVERLAP",  # runtime: 1 runs a tree step's commit on its own stream beside the drafting (runtime/commit_overlap.py)
        "VLLM_TFM_DRAFTER_GRAPHS",  # runtime: 1 replays full CUDA graphs of the DFlash drafter's query forward (runtime/drafter_graphs.py)
        "VLLM_TFM_GREEDY_ACCEPT_KERNEL",  # runtime: 0 keeps the torch path for all-greedy tree acceptance (runtime/sampler.py)
        "VLLM_TFM_WEAVER_LAZY_TAIL",  # runtime: 0 makes the forward wait for the Weaver graphs' tail check (runtime/weaver_graphs.py)
        "VLLM_TFM_DEFERRED_DRAFTS",  # runtime: 0 hands the scheduler the drafts' tokens and waits for the drafter (runtime/deferred_drafts.py)
        "VLLM_TFM_EARLY_SAMPLED_COPY",  # runtime: 0 queues the sampled tokens' copy after the commit, not before (runtime/deferred_drafts.py)
        "VLLM_TFM_COMMIT_REUSE",  # runtime: 0 rebuilds and uploads the batched commit's tables every full-graph step (runtime/step_kernels.py)
        "VLLM_TFM_DEVICE_TOPOLOGY",  # runtime: 0 builds a full-graph step's plans and depth positions on the host (runtime/device_topology.py)
        "VLLM_TFM_LOAD_TREEFLASH",  # runtime: load TreeFlash beside another proposal (in-process proposal switches)
        "VLLM_TFM_KERNELS",  # runtime: 0 forces the torch references instead of the kernels
        "VLLM_TFM_GDN_VERIFY",  # runtime: GDN tree verify version, auto (default) or 1-7 (runtime/settings.py)
        "VLLM_TFM_WEAVER_ROUND_KERNEL",  # kernels/weaver_round.py: 0 keeps the torch round of the Weaver growth
        "VLLM_TFM_WEAVER_LINEAR_KERNEL",  # kernels/weaver_linear.py: 0 keeps cuBLAS + torch norms / epilogues in the Weaver scorer
        "VLLM_TFM_TREE_CONV_UNROLLED",  # kernels/conv.py: 0 compiles the tree conv without its width (the loop build)
        "VLLM_TFM_WEAVER_LINEAR_PDL",  # kernels/weaver_linear.py: 0 launches the linear kernel without programmatic dependent launch
        "VLLM_TFM_WEAVER_CHAIN_PDL",  # kernels/weaver_attention.py: 0 launches the scorer's attention and candidate scores without programmatic dependent launch
        "VLLM_TFM_CANDIDATE_KERNEL",  # kernels/candidate_scores.py: 0 keeps the torch candidate scores of the Weaver scorer
        "VLLM_TFM_TOPK_KERNEL",  # runtime: 0 keeps torch.topk for the DFlash candidates of the Weaver build (runtime/tree_builder_gpu.py)
        "VLLM_TFM_WEAVER_PROMPT_OVERLAP",  # runtime: 1 runs the Weaver's prompt pass on a second stream beside the top-K (runtime/tree_builder_gpu.py)
        "VLLM_TFM_WEAVER_ATTENTION_KERNEL",  # kernels/weaver_attention.py: 0 keeps RoPE / scatter / SDPA in the Weaver scorer
        "VLLM_TFM_TREE_ATTENTION",  # runtime: "kernel" opts in to the one-launch tree attention, "triton" (default) one call per tree request
        "VLLM_TFM_PROFILE",  # runtime: per-stage CUDA-event timings (runtime/stage_timing.py)
        "VLLM_TFM_WEAVER_GRAPHS",  # runtime: CUDA graphs of the Weaver tree build (runtime/weaver_graphs.py)
        "VLLM_TFM_WEAVER_GRAPH_BUCKETS",  # runtime: their batch-size buckets
        "VLLM_TFM_CHECK_TP_TREES",  # runtime: all-gather and compare trees / accepted paths over the TP group (runtime/tensor_parallel.py)
        "VLLM_TFM_TRACE",  # runtime: per-request step records into a directory (runtime/trace.py)
        "VLLM_TFM_TRACE_MAX_MB",  # runtime: size bound of that trace per process
        "VLLM_TFM_BENCHMARK_ACCEPTANCE_REPLAY",  # benchmark_mode: replay a recorded acceptance profile
        "VLLM_TFM_I_AM_BENCHMARKING",  # benchmark_mode: required to allow the replay
        "VLLM_TFM_BENCHMARK_REPLAY_SEED",  # benchmark_mode: seed of the replay draws
        "VLLM_TFM_BENCHMARK_SPINE_TOP1",  # benchmark_mode: spine-first marginals in replay mode
        "VLLM_TFM_SYNC_LAUNCH",  # kernels: synchronous launches (debugging)
        "VLLM_TFM_CACHE",  # kernels: NVRTC cache directory
        "VLLM_TFM_CUDA_DIR",  # kernels: CUDA source directory
        "VLLM_TFM_ZOO",  # cli: toy zoo directory
    }
)
"""``VLLM_TFM_*`` variables that are switches, not tree options; any other ``VLLM_TFM_*`` name
that is not ``VLLM_TFM_<OPTION_KEY>`` is refused as a typo. A new switch must be added here
(tests/cpu/test_plugin_config.py scans the package for ``VLLM_TFM_*`` names and checks it)."""

VLLM_PROPOSALS: tuple[str, ...] = ("chain", "ddtree", "tfm", "treeflash")
"""Proposals the vLLM runtime builds: every proposal of ``TfmConfig``."""

DEFAULT_PROPOSAL_WITHOUT_FILE = "ddtree"

MIN_BUDGET = 1
MAX_BUDGET = 256
"""Tree budget B = num_speculative_tokens (draft nodes per request, root excluded). Each request
holds 1 + B GDN state slots per layer in vLLM 0.26 (one per speculative token; one with
``gdn_state_slots: "one"``), and the tree verify is dense in the n = 1 + B nodes, so B is capped at 256.

No bound ties B to the DFlash block size L: a tree of B nodes is at most B deep, so the runtime
asks the drafter for D = min(B, L - 1) depths of marginals, and its query [bonus, MASK x D] fits
the B + 1 lookahead KV slots vLLM reserves for ``use_dflash()`` methods whatever B is (this is
the condition "drafter block <= B" of shared/VLLM_HOOKS.md §8 step 2, met by construction)."""

HF_OPTIONS_ATTR = "tfm_options"
HF_DRAFTER_DIR_ATTR = "tfm_drafter_dir"


def _parse_env_value(raw: str) -> Any:
    text = raw.strip()
    if text.lower() in ("", "none", "null"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def env_overrides(environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Tree options from ``VLLM_TFM_<KEY>`` variables: (values by key, source by key).

    Raises ValueError for a ``VLLM_TFM_*`` name that is neither an option nor a known switch.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in NON_OPTION_ENV_VARS:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in OPTION_KEYS:
            valid = ", ".join(ENV_PREFIX + k.upper() for k in OPTION_KEYS)
            raise ValueError(f"unknown environment variable {name}: neither a tfm option nor a vllm-tfm switch, unset it "
                             f"(tfm options from the environment are {valid})")
        values[key] = _parse_env_value(env[name])
        sources[key] = f"environment {name}={env[name]!r}"
    return values, sources


def _one_line(error: ValidationError, sources: Mapping[str, str], default_source: str) -> ValueError:
    err = error.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "<root>"
    source = sources.get(str(err["loc"][0]), default_source) if err["loc"] else default_source
    if err["type"] == "extra_forbidden":
        msg = f"unknown key (valid keys: {', '.join(TfmConfig.model_fields)})"
    else:
        msg = err["msg"].removeprefix("Value error, ")
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return ValueError(f"{source}: {loc}: {msg}{more}")


def _load_file(path: Path) -> TfmConfig:
    data = read_json(path.parent, path.name)
    try:
        return TfmConfig.model_validate(data)
    except ValidationError as e:
        raise _one_line(e, {}, str(path)) from None


def resolve_tfm_options(
    drafter_dir: str | Path | None,
    inline: Mapping[str, Any],
    num_speculative_tokens: int | None,
    environ: Mapping[str, str] | None = None,
) -> TfmConfig:
    """Merge defaults, ``tfm_config.json``, ``VLLM_TFM_*`` and ``inline``; set ``budget`` = B.

    ``inline`` holds the tree-option keys found in the speculative config (already split from
    vLLM's own keys). Returns a validated TfmConfig whose ``budget`` is the tree budget B.
    """
    unknown = sorted(set(inline) - set(OPTION_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config: unknown tfm option {unknown[0]!r} (tree options are {', '.join(OPTION_KEYS)})"
        )
    file_path = Path(drafter_dir) / TFM_CONFIG_NAME if drafter_dir is not None else None
    file_cfg: TfmConfig | None = None
    if file_path is not None and file_path.is_file():
        file_cfg = _load_file(file_path)
    base: dict[str, Any] = (
        file_cfg.model_dump(mode="json") if file_cfg is not None else {"proposal": DEFAULT_PROPOSAL_WITHOUT_FILE}
    )
    default_source = str(file_path) if file_cfg is not None else "tfm defaults"
    env_values, sources = env_overrides(environ)
    merged = {**base, **env_values, **dict(inline)}
    sources = {**sources, **{k: f"speculative_config {k}={v!r}" for k, v in inline.items()}}

    proposal = merged.get("proposal")
    for name, section in (("tfm", "weaver"), ("treeflash", "treeflash")):
        if proposal == name and merged.get(section) is None:
            where = f"{drafter_dir}" if drafter_dir is not None else "the drafter directory"
            raise ValueError(
                f"{sources.get('proposal', default_source)}: proposal '{name}' needs {TFM_CONFIG_NAME} with a "
                f"'{section}' section in {where} (use proposal 'ddtree' or 'chain' for a plain DFlash drafter)"
            )

    if num_speculative_tokens is None:
        if file_cfg is None or "budget" not in file_cfg.model_fields_set:
            raise ValueError(
                "speculative_config: num_speculative_tokens (the tree budget B, "
                f"{MIN_BUDGET}..{MAX_BUDGET}) is required for method 'tfm'"
            )
        budget = file_cfg.budget
        budget_source = f"{file_path}: budget"
    else:
        budget = num_speculative_tokens
        budget_source = "speculative_config: num_speculative_tokens"
    if isinstance(budget, bool) or not isinstance(budget, int) or not MIN_BUDGET <= budget <= MAX_BUDGET:
        raise ValueError(
            f"{budget_source} (the tree budget B) must be an integer in [{MIN_BUDGET}, {MAX_BUDGET}], got {budget!r}"
        )
    merged["budget"] = budget
    try:
        return TfmConfig.model_validate(merged)
    except ValidationError as e:
        raise _one_line(e, sources, default_source) from None


def _hf_config(config: Any) -> Any:
    spec = getattr(config, "speculative_config", config)
    draft = getattr(spec, "draft_model_config", None)
    if draft is None:
        raise ValueError("no speculative draft model config: this engine does not use method 'tfm'")
    return draft.hf_config


def get_tfm_options(config: Any) -> TfmConfig:
    """The resolved options of a tfm engine, from a VllmConfig or a SpeculativeConfig."""
    data = getattr(_hf_config(config), HF_OPTIONS_ATTR, None)
    if data is None:
        raise ValueError(f"the drafter config carries no {HF_OPTIONS_ATTR}: the speculative config was not built by vllm-tfm")
    return TfmConfig.model_validate(data)


def get_drafter_dir(config: Any) -> str:
    """The local drafter directory (holds tfm_config.json and the Weaver / TreeFlash weights).

    For a Hugging Face repository id this is the local snapshot of its JSON files; the weights
    land in the same snapshot when vLLM downloads them.
    """
    value = getattr(_hf_config(config), HF_DRAFTER_DIR_ATTR, None)
    if value is None:
        raise ValueError(f"the drafter config carries no {HF_DRAFTER_DIR_ATTR}: the speculative config was not built by vllm-tfm")
    return str(value)


def draft_depth(budget: int, block_size: int | None) -> int:
    """D = min(B, L - 1): the depths of marginals one DFlash forward gives a tfm engine.

    A tree of B nodes is at most B deep, and a DFlash block of L slots predicts depths 1..L-1;
    without a block size in the drafter config, D = B. The runtime's proposer runs the DFlash
    forward with D mask queries, and ``SpeculativeConfig.max_num_new_slots_for_drafting`` counts
    D - 1 extra slots per request for tfm (vLLM's DFlash count with K = D).
    """
    return budget if block_size is None else max(1, min(budget, block_size - 1))


def spec_draft_depth(spec_config: Any) -> int:
    """:func:`draft_depth` of a built tfm SpeculativeConfig (block size from the drafter config)."""
    hf = spec_config.draft_model_config.hf_config
    dfc = getattr(hf, "dflash_config", None) or {}
    block = dfc.get("block_size", getattr(hf, "block_size", None))
    return draft_depth(int(spec_config.num_speculative_tokens), block)


LOAD_TREEFLASH_ENV = "VLLM_TFM_LOAD_TREEFLASH"


def loads_treeflash(options: TfmConfig, drafter_dir: str | Path | None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a tfm engine loads the TreeFlash AR approximator (and its drafter forward returns
    the pre-norm residual stream, ``runtime/dflash_prenorm.py``): for proposal ``treeflash``; for
    another proposal only with ``VLLM_TFM_LOAD_TREEFLASH=1`` and the section and weights in the
    drafter directory (so that the in-process proposal override,
    ``runtime.settings.set_proposal_override``, can switch to it: the GPU test harness). Engines of
    other proposals keep vLLM's drafter forward untouched by default."""
    if options.treeflash is None:
        return False
    if options.proposal == "treeflash":
        return True
    env = os.environ if environ is None else environ
    if env.get(LOAD_TREEFLASH_ENV, "0") in ("", "0", "false", "False"):
        return False
    return drafter_dir is not None and (Path(drafter_dir) / TREEFLASH_WEIGHTS_NAME).is_file()


def hf_loads_treeflash(hf_config: Any) -> bool:
    """:func:`loads_treeflash` of the options a drafter's Hugging Face config carries (False when
    it carries none)."""
    data = getattr(hf_config, HF_OPTIONS_ATTR, None)
    if data is None:
        return False
    return loads_treeflash(TfmConfig.model_validate(data), getattr(hf_config, HF_DRAFTER_DIR_ATTR, None))
