"""Accept ``{"method": "tfm", ...}`` in vLLM 0.26 speculative configs (shared/VLLM_HOOKS.md §3).

vLLM's ``SpeculativeConfig`` is a pydantic dataclass whose ``method`` is a Literal and which
forbids unknown keys, so "tfm" is refused without this module. A tfm config is built through
vLLM's own ``dflash`` branch (draft ModelConfig, EAGLEConfig wrap, ``parallel_drafting``, draft
TP), then its method is set to "tfm", and the resolved tree options are attached to the drafter's
Hugging Face config (``options.HF_OPTIONS_ATTR``), which reaches every process.

Patches (each applied once per process through ``patching.replace_attribute``):

* ``EngineArgs.create_speculative_config`` (process 0; the only ``SpeculativeConfig(...)`` call in
  vLLM 0.26): splits the tree options out of the speculative config, runs the config-time checks
  (``guards``, ``drafter_checks``, ``options``, ``cuda_graphs``), builds the config as dflash,
  sets "tfm".
* ``SpeculativeConfig.__post_init__`` plus a widened ``method`` Literal (schema rebuilt), so that
  ``SpeculativeConfig(method="tfm", model=DIR, num_speculative_tokens=B, target_model_config=...,
  target_parallel_config=...)`` also works (same checks, no engine-wide ones).
* Predicates, all processes: ``use_eagle()`` and ``use_dflash()`` are True for tfm (the V1
  runner's hidden-state drafter path, drafter attention groups, lookahead B + 1 slots, the
  DFlash proposer branch); ``compute_hash()`` hashes tfm as dflash (aux hidden states and the
  drafter config without the attributes tfm attaches to it) plus the method name; ``max_num_new_slots_for_drafting`` (the scheduler-budget
  reserve for the drafter's extra query tokens) is D - 1 per request with D = min(B, L - 1), the
  depths the tfm proposer drafts, instead of dflash's B - 1 (which would refuse B = 64 with
  vLLM's default max_num_seqs).

For every other method each wrapper calls vLLM's original and returns its result unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vllm_tfm.models.tfm_config import TFM_CONFIG_NAME, TfmConfig

from . import benchmark_mode, cuda_graphs, drafter_checks, guards
from .options import (
    HF_DRAFTER_DIR_ATTR,
    HF_OPTIONS_ATTR,
    OPTION_KEYS,
    draft_depth,
    hf_loads_treeflash,
    resolve_tfm_options,
    spec_draft_depth,
)
from .patching import record_patch, replace_attribute

__all__ = [
    "TFM_METHOD",
    "CARRIER_METHOD",
    "TfmPlan",
    "prepare_tfm",
    "finish_tfm",
    "install_config_patches",
    "install_predicate_patches",
    "install_direct_construction",
]

TFM_METHOD = guards.TFM_METHOD
CARRIER_METHOD = "dflash"
"""The vLLM method a tfm config is built as before its method is set to "tfm"."""

_LITERAL_PATCH_KEY = "vllm.config.speculative.SpeculativeConfig.method[Literal]"


@dataclass(frozen=True)
class TfmPlan:
    """The outcome of the config-time checks: the local drafter directory (for a hub id, the
    snapshot of its JSON files and Weaver / TreeFlash weights) and the resolved options."""

    drafter_dir: Path
    options: TfmConfig
    replay: benchmark_mode.ReplaySpec | None = None


def prepare_tfm(
    *,
    model: str | None,
    revision: str | None,
    num_speculative_tokens: int | None,
    inline: Mapping[str, Any],
    spec_values: Mapping[str, Any],
    target_model_config: Any,
    target_parallel_config: Any,
    engine_args: Any | None,
    load_format: str,
) -> TfmPlan:
    """Every config-time check of method 'tfm', cheapest first; returns the plan or raises
    ValueError (one line). ``spec_values``: vLLM SpeculativeConfig keys the user set."""
    guards.check_spec_keys(spec_values)
    if not model:
        raise ValueError("speculative_config: method 'tfm' needs 'model', the drafter directory")
    guards.check_model_runner_env()
    if target_model_config is None:
        raise ValueError("speculative_config: method 'tfm' needs target_model_config")
    guards.check_target(target_model_config, target_parallel_config)
    if engine_args is not None:
        guards.check_engine_args(engine_args, target_model_config)

    directory, is_local = drafter_checks.locate_drafter(model, revision)
    raw = drafter_checks.read_drafter_config(directory)
    hidden = target_model_config.get_hidden_size()
    block = drafter_checks.check_drafter_against_target(
        raw,
        str(directory / "config.json"),
        target_vocab_size=target_model_config.get_vocab_size(),
        target_hidden_size=hidden,
        target_num_layers=target_model_config.get_total_num_hidden_layers(),
    )
    drafter_checks.check_drafter_quantization(raw, str(directory / "config.json"), spec_values.get("quantization"),
                                              getattr(target_model_config, "dtype", None))
    if is_local and str(load_format) != "dummy":
        drafter_checks.check_drafter_weights(directory)
    options = resolve_tfm_options(directory, inline, num_speculative_tokens)
    drafter_checks.check_draft_lm_head(options, "speculative_config", getattr(target_model_config, "dtype", None),
                                       int(getattr(target_parallel_config, "tensor_parallel_size", 1) or 1))
    drafter_checks.check_draft_vocab(options, "speculative_config", directory, target_model_config.get_vocab_size(),
                                     int(getattr(target_parallel_config, "tensor_parallel_size", 1) or 1))
    if engine_args is not None:
        cuda_graphs.configure_engine_graphs(engine_args, target_model_config, options.budget)
    depth = draft_depth(options.budget, block)
    drafter_checks.check_weaver_shape(options, str(directory / TFM_CONFIG_NAME), hidden, depth)
    drafter_checks.check_treeflash_shape(options, str(directory / TFM_CONFIG_NAME), hidden)
    drafter_checks.check_proposal_files(directory, options)
    replay = benchmark_mode.resolve_acceptance_replay(options.proposal, options.budget, depth)
    if replay is not None:
        benchmark_mode.warn_replay(replay, "engine config")
    return TfmPlan(drafter_dir=directory, options=options, replay=replay)


def finish_tfm(spec_config: Any, plan: TfmPlan) -> None:
    """Turn a config built as dflash into a tfm config and attach the options for the workers."""
    spec_config.method = TFM_METHOD
    hf_config = spec_config.draft_model_config.hf_config
    setattr(hf_config, HF_OPTIONS_ATTR, plan.options.model_dump(mode="json"))
    setattr(hf_config, HF_DRAFTER_DIR_ATTR, str(plan.drafter_dir))
    setattr(hf_config, benchmark_mode.HF_REPLAY_ATTR, None if plan.replay is None else plan.replay.model_dump(mode="json"))


# --------------------------------------------------------------------------- EngineArgs


def _asks_for_tfm(engine_args: Any) -> bool:
    spec = engine_args.speculative_config
    return engine_args.spec_method == TFM_METHOD or (isinstance(spec, dict) and spec.get("method") == TFM_METHOD)


def _merged_user_spec(engine_args: Any) -> dict[str, Any]:
    """The speculative config with the --spec-* flags folded in, as vLLM 0.26 does it."""
    spec = dict(engine_args.speculative_config or {})
    for flag, key, value in (
        ("--spec-method", "method", engine_args.spec_method),
        ("--spec-model", "model", engine_args.spec_model),
        ("--spec-tokens", "num_speculative_tokens", engine_args.spec_tokens),
    ):
        if value is None:
            continue
        if key in spec:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        spec[key] = value
    return {k.replace("-", "_"): v for k, v in spec.items()}


def _speculative_config_fields() -> frozenset[str]:
    from vllm.config import SpeculativeConfig

    return frozenset(f.name for f in dataclasses.fields(SpeculativeConfig))


def _load_format(engine_args: Any, spec: Mapping[str, Any]) -> str:
    draft_load = spec.get("draft_load_config")
    if draft_load is not None:
        return str(getattr(draft_load, "load_format", "auto"))
    return str(engine_args.load_format)


def _make_create_speculative_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_speculative_config(self: Any, target_model_config: Any, target_parallel_config: Any) -> Any:
        if not _asks_for_tfm(self):
            return original(self, target_model_config, target_parallel_config)
        user_spec = _merged_user_spec(self)
        fields = _speculative_config_fields()
        unknown = sorted(k for k in user_spec if k not in fields and k not in OPTION_KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key {unknown[0]!r} for method 'tfm' "
                f"(neither a vLLM SpeculativeConfig field nor a tfm option: {', '.join(OPTION_KEYS)})"
            )
        inline = {k: v for k, v in user_spec.items() if k in OPTION_KEYS}
        vllm_spec = {k: v for k, v in user_spec.items() if k not in OPTION_KEYS}
        plan = prepare_tfm(
            model=vllm_spec.get("model"),
            revision=vllm_spec.get("revision"),
            num_speculative_tokens=vllm_spec.get("num_speculative_tokens"),
            inline=inline,
            spec_values=vllm_spec,
            target_model_config=target_model_config,
            target_parallel_config=target_parallel_config,
            engine_args=self,
            load_format=_load_format(self, vllm_spec),
        )
        vllm_spec.update(method=CARRIER_METHOD, num_speculative_tokens=plan.options.budget)
        flags = (self.spec_method, self.spec_model, self.spec_tokens)
        self.spec_method = self.spec_model = self.spec_tokens = None
        self.speculative_config = vllm_spec
        try:
            spec_config = original(self, target_model_config, target_parallel_config)
        finally:
            # leave EngineArgs as vLLM leaves it (flags kept, targets added), but still saying tfm
            self.spec_method, self.spec_model, self.spec_tokens = flags
            self.speculative_config = {
                **user_spec,
                "target_model_config": target_model_config,
                "target_parallel_config": target_parallel_config,
            }
        finish_tfm(spec_config, plan)
        return spec_config

    return create_speculative_config


def install_config_patches() -> None:
    """Process-0 patch: ``EngineArgs.create_speculative_config``."""
    from vllm.engine.arg_utils import EngineArgs

    replace_attribute(
        EngineArgs,
        "create_speculative_config",
        _make_create_speculative_config,
        reason="build {'method': 'tfm'} through the dflash branch, with tfm's config-time checks",
    )


# --------------------------------------------------------------------------- predicates


def _make_method_predicate(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    @functools.wraps(original)
    def predicate(self: Any) -> bool:
        if self.method == TFM_METHOD:
            return True
        return original(self)

    return predicate


HF_ATTRS_NOT_HASHED = (HF_OPTIONS_ATTR, HF_DRAFTER_DIR_ATTR, benchmark_mode.HF_REPLAY_ATTR)
"""What tfm attaches to the drafter's HF config; none of it changes a compiled graph (the one
option that does, a TreeFlash proposal's pre-norm output, is hashed on its own)."""


def _make_compute_hash(original: Callable[[Any], str]) -> Callable[[Any], str]:
    @functools.wraps(original)
    def compute_hash(self: Any) -> str:
        if self.method != TFM_METHOD:
            return original(self)
        # a drafter whose forward also returns its pre-norm residual stream (TreeFlash,
        # runtime/dflash_prenorm.py) compiles to another graph: never share its compile cache
        draft = getattr(self, "draft_model_config", None)
        hf = getattr(draft, "hf_config", None)
        prenorm = "|prenorm" if hf is not None and hf_loads_treeflash(hf) else ""
        # tfm returns the same aux hidden states as dflash: hash it as dflash, then add the name.
        # vLLM hashes the drafter's whole HF config (to_json_string), so the tree options, the
        # drafter directory and a benchmark replay profile attached to it would key the compile
        # cache although no compiled graph reads them: hashed without them, a change of width,
        # top_k, sampling or replay profile reuses the compiled target and drafter (the budget
        # still changes vLLM's cudagraph capture sizes, which it hashes itself)
        saved = {a: getattr(hf, a) for a in HF_ATTRS_NOT_HASHED if hf is not None and a in vars(hf)}
        for a in saved:
            delattr(hf, a)
        self.method = CARRIER_METHOD
        try:
            as_dflash = original(self)
        finally:
            self.method = TFM_METHOD
            for a, v in saved.items():
                setattr(hf, a, v)
        return hashlib.sha256(f"{as_dflash}|{TFM_METHOD}{prenorm}".encode()).hexdigest()

    return compute_hash


def _make_new_slots_property(original: property) -> property:
    fget = original.fget

    @functools.wraps(fget)
    def max_num_new_slots_for_drafting(self: Any) -> int:
        if self.method != TFM_METHOD:
            return fget(self)
        # the tfm proposer runs the DFlash forward with D = min(B, L - 1) masks, not B
        return spec_draft_depth(self) - 1

    return property(max_num_new_slots_for_drafting)


def install_predicate_patches() -> None:
    """All-process patches of ``SpeculativeConfig`` predicates (vLLM 0.26 ``config/speculative.py``)."""
    from vllm.config import SpeculativeConfig

    for name, why in (
        ("use_eagle", "tfm drafts from target hidden states (V1 drafter path, drafter attention, cudagraph keys)"),
        ("use_dflash", "tfm runs the DFlash proposer branch and needs its B + 1 lookahead slots"),
    ):
        replace_attribute(SpeculativeConfig, name, _make_method_predicate, reason=why)
    replace_attribute(
        SpeculativeConfig,
        "compute_hash",
        _make_compute_hash,
        reason="tfm returns aux hidden states like dflash; keep compile caches apart from dflash",
    )
    replace_attribute(
        SpeculativeConfig,
        "max_num_new_slots_for_drafting",
        _make_new_slots_property,
        reason="tfm drafts D = min(B, L - 1) DFlash depths: reserve D - 1 slots per request, not B - 1",
    )


# --------------------------------------------------------------------------- direct construction


def _make_post_init(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(original)
    def __post_init__(self: Any) -> Any:
        if self.method != TFM_METHOD:
            return original(self)
        draft_load = self.draft_load_config
        plan = prepare_tfm(
            model=self.model,
            revision=self.revision,
            num_speculative_tokens=self.num_speculative_tokens,
            inline={},
            spec_values={k: getattr(self, k) for k in guards.REFUSED_SPEC_KEYS},
            target_model_config=self.target_model_config,
            target_parallel_config=self.target_parallel_config,
            engine_args=None,
            load_format=str(draft_load.load_format) if draft_load is not None else "auto",
        )
        self.num_speculative_tokens = plan.options.budget
        self.method = CARRIER_METHOD
        try:
            result = original(self)
        finally:
            self.method = TFM_METHOD
        finish_tfm(self, plan)
        return result

    return __post_init__


def _literal_values(tp: Any) -> tuple[Any, ...]:
    """Flatten ``Literal[...] | None`` (nested Literals included) into its values."""
    out: list[Any] = []
    for arg in typing.get_args(tp):
        if typing.get_origin(arg) is Literal:
            out.extend(_literal_values(arg))
        elif arg is type(None):
            continue
        else:
            out.append(arg)
    return tuple(out)


def install_direct_construction() -> None:
    """``SpeculativeConfig(method="tfm", ...)``: wrap ``__post_init__``, widen the Literal, rebuild.

    The rebuild keeps every other field, validator and ``extra="forbid"``; ``restore_all`` puts
    the original annotation back and rebuilds again.
    """
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config import SpeculativeConfig

    replace_attribute(
        SpeculativeConfig,
        "__post_init__",
        _make_post_init,
        reason="build a direct SpeculativeConfig(method='tfm') through the dflash branch",
    )
    field = SpeculativeConfig.__dataclass_fields__["method"]
    old_type = field.type
    old_annotation = SpeculativeConfig.__annotations__["method"]
    values = _literal_values(old_type)
    if TFM_METHOD in values:
        return
    new_type = Literal[(*values, TFM_METHOD)] | None  # type: ignore[valid-type]

    def apply(tp: Any, annotation: Any) -> None:
        field.type = tp
        SpeculativeConfig.__annotations__["method"] = annotation
        rebuild_dataclass(SpeculativeConfig, force=True)

    apply(new_type, new_type)
    record_patch(
        _LITERAL_PATCH_KEY,
        old_type,
        new_type,
        reason="let pydantic accept method='tfm'",
        undo=lambda: apply(old_type, old_annotation),
    )
