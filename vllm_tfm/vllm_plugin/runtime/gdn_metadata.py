"""One GDN attention-metadata build per step instead of one per GDN KV-cache group.

vLLM 0.26 builds attention metadata once per KV-cache group (``GPUModelRunner._build_attention_metadata``,
gpu_model_runner.py:2441-2520). A builder that sets ``supports_update_block_table`` builds only for the
first group of its kind and hands the later groups that metadata with their own block table
(``update_block_table``); ``GDNAttentionMetadataBuilder`` (v1/attention/backends/gdn_attn.py) does not,
so a Qwen3.6-27B-shaped hybrid (48 GDN layers in ten KV-cache groups) runs ten full builds per step,
identical but for the block table: host work on the critical path of a batch-1 step, after the one
read-back, with the GPU idle (bench/NOTES.md section 24: 4.5 of the 5.6 ms per step of
``_build_attention_metadata`` under cProfile).

This module gives the builders of a tfm engine that update:

* every GDN builder of one engine shares the persistent FULL-graph buffers that do not depend on the
  block table (``spec_sequence_masks``, ``spec_token_indx``, ``non_spec_token_indx``,
  ``spec_query_start_loc``, ``non_spec_query_start_loc``, ``num_accepted_tokens``): the first
  group's build writes them for all groups, whose captured graphs read them at the same addresses;
  each builder keeps its own ``spec_state_indices_tensor`` and ``non_spec_state_indices_tensor``;
* ``update_block_table`` derives exactly what ``build`` derives from the block table (the state
  indices of the spec, non-spec and prefill rows, from the build's own row split) and writes them
  into this builder's buffers when the build wrote its own (the FULL-graph branch).

Only for tfm engines with ``mamba_cache_mode`` "none" or "all" (the block table is the state table
as it is; "align" would need the sequence lengths, which the GDN metadata does not keep): other
engines, the no-spec baselines included, build as vLLM does. ``VLLM_TFM_GDN_METADATA_ONCE=0`` turns
it off (for before/after measurements). Tested against ten full builds field by field
(tests/cpu/test_gdn_metadata_once.py).

The build itself has a fast path for the step a tfm engine runs almost always: every row a spec decode
(padded rows at the back with no tokens) taking vLLM's FULL-graph branch. vLLM's build there spends ~20
small device operations and as many CPU tensor operations (0.59 ms of a batch-1 step's host time on the
H200 host, bench/NOTES.md section 44) to write buffers that hold the same values step after step: the
spec-row mask, ``arange`` token indices, the query start offsets. The fast path derives the same
metadata from the CPU tensors' values as Python integers, writes the per-step values (the accepted
counts, each group's state slots: one copy each) and rewrites the others only when their values
change: the engine remembers what it last wrote to each shared buffer, and a builder what it last
padded its own with. Any other build (vLLM's own code) forgets both, since it writes those buffers.
``VLLM_TFM_GDN_METADATA_FAST=0`` (or ``set_gdn_metadata_fast``) keeps vLLM's build with the reuse
above. Tested field by field against vLLM's build over sequences of steps whose shapes change.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .settings import RuntimeSwitch, env_on
from .state import STATE

__all__ = [
    "GDN_METADATA_FAST_ENV",
    "GDN_METADATA_ONCE_ENV",
    "SHARED_BUFFERS",
    "gdn_metadata_fast_enabled",
    "gdn_metadata_once_enabled",
    "install_gdn_metadata_patch",
    "set_gdn_metadata_fast",
]

GDN_METADATA_ONCE_ENV = "VLLM_TFM_GDN_METADATA_ONCE"
GDN_METADATA_FAST_ENV = "VLLM_TFM_GDN_METADATA_FAST"
_FAST = RuntimeSwitch(GDN_METADATA_FAST_ENV, "set_gdn_metadata_fast")

# Persistent FULL-graph buffers of GDNAttentionMetadataBuilder (gdn_attn.py:123-165) whose contents
# come from the step's common metadata only, the same for every KV-cache group.
SHARED_BUFFERS = (
    "spec_sequence_masks",
    "spec_token_indx",
    "non_spec_token_indx",
    "spec_query_start_loc",
    "non_spec_query_start_loc",
    "num_accepted_tokens",
)

_ROWS_ATTR = "_tfm_block_rows"  # set on the metadata a sharing builder built
_FAST_ATTR = "_tfm_fast_rows"  # set on the metadata of a fast build: (spec rows, batch rows)
_PAD_ATTR = "_tfm_state_pad"  # on a builder: (spec rows, batch rows, the two views) its slot buffer was last padded for
_ORIGINAL: dict[str, Any] = {}


@dataclass
class _Engine:
    """The GDN builders of one engine: their shared buffers, and what the fast build last wrote to each
    (buffer name -> the values' key; absent: unknown, write before use)."""

    buffers: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    written: dict[str, object] = dataclasses.field(default_factory=dict)


# id(vllm_config) -> (weak reference to it, that engine's GDN builders' shared state)
_SHARED: dict[int, tuple[weakref.ref, _Engine]] = {}


def gdn_metadata_once_enabled() -> bool:
    """``VLLM_TFM_GDN_METADATA_ONCE`` is unset or not 0 / false (default on)."""
    return env_on(GDN_METADATA_ONCE_ENV)


def gdn_metadata_fast_enabled() -> bool:
    """``VLLM_TFM_GDN_METADATA_FAST`` unset or not 0 / false (default on), unless ``set_gdn_metadata_fast``
    overrode it: all-spec FULL-graph steps take the fast build (module docstring)."""
    return _FAST.enabled()


def set_gdn_metadata_fast(on: bool | None) -> bool:
    """Override ``VLLM_TFM_GDN_METADATA_FAST`` in this process (None: back to the environment's); the
    setting now in force. For a same-engine A/B (bench/e2e.py --ab-switch gdn_metadata_fast)."""
    return _FAST.set(on)


@dataclass(frozen=True)
class _BlockRows:
    """What ``update_block_table`` needs of the build it reuses."""

    spec_mask: Tensor | None  # [num_reqs] bool on the CPU: rows that are spec decodes (None: none are)
    spec_prefix: int | None  # the mask is True on rows [0, spec_prefix) and False after (else None)
    num_reqs: int
    spec_in_buffer: bool  # the build's spec state indices are a view of its builder's buffer
    non_spec_in_buffer: bool  # likewise the non-spec state indices (FULL graph, plain decodes)


def _engine_is_tfm(vllm_config: Any) -> bool:
    from ..guards import TFM_METHOD

    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and getattr(spec, "method", None) == TFM_METHOD


def _eligible(builder: Any) -> bool:
    mode = builder.vllm_config.cache_config.mamba_cache_mode
    return (
        gdn_metadata_once_enabled()
        and builder.use_spec_decode
        and _engine_is_tfm(builder.vllm_config)
        and mode in ("none", "all")
        and not builder.vllm_config.parallel_config.use_ubatching  # one builder per micro-batch there
    )


def _engine(vllm_config: Any) -> _Engine:
    key = id(vllm_config)
    entry = _SHARED.get(key)
    if entry is None or entry[0]() is not vllm_config:
        for k in [k for k, (ref, _) in _SHARED.items() if ref() is None]:
            del _SHARED[k]
        entry = (weakref.ref(vllm_config), _Engine())
        _SHARED[key] = entry
    return entry[1]


def _share(builder: Any) -> None:
    """Point this builder's block-table-free buffers at its engine's shared ones (the first builder's)."""
    shared = _engine(builder.vllm_config).buffers
    for name in SHARED_BUFFERS:
        own: Tensor = getattr(builder, name)
        first = shared.setdefault(name, own)
        if first is own:
            continue
        if first.shape != own.shape or first.dtype != own.dtype or first.device != own.device:
            raise RuntimeError(
                f"vllm-tfm: GDN metadata builders of one engine disagree on {name} "
                f"({tuple(first.shape)} {first.dtype} vs {tuple(own.shape)} {own.dtype}); "
                f"set {GDN_METADATA_ONCE_ENV}=0"
            )
        setattr(builder, name, first)


def _same_storage(view: Tensor | None, buffer: Tensor) -> bool:
    return view is not None and view.numel() > 0 and view.data_ptr() == buffer.data_ptr()


def _block_rows(builder: Any, md: Any, num_decode_draft_tokens_cpu: Tensor | None, num_reqs: int) -> _BlockRows:
    mask = None
    prefix = None
    if md.spec_sequence_masks is not None:
        assert num_decode_draft_tokens_cpu is not None  # the build found spec rows in it
        mask = num_decode_draft_tokens_cpu >= 0
        k = int(mask.sum())
        prefix = k if bool(mask[:k].all()) else None
    return _BlockRows(
        spec_mask=mask,
        spec_prefix=prefix,
        num_reqs=num_reqs,
        spec_in_buffer=_same_storage(md.spec_state_indices_tensor, builder.spec_state_indices_tensor),
        non_spec_in_buffer=_same_storage(md.non_spec_state_indices_tensor, builder.non_spec_state_indices_tensor),
    )


@dataclass(frozen=True)
class _AllSpec:
    """An all-spec FULL-graph step as the fast build needs it, from the CPU tensors."""

    ns: int  # spec rows (a prefix of the batch)
    tokens: int  # query tokens of the step (vLLM's num_spec_decode_tokens)
    starts: tuple[int, ...]  # query start offsets of rows 0 .. ns


def _all_spec_rows(self: Any, m: Any, accepted: Tensor | None, drafts: Tensor | None) -> _AllSpec | None:
    """The step when vLLM's build would take its all-spec FULL-graph branch (gdn_attn.py: 189-204,
    224-270, 404-440) with the spec rows a prefix; None otherwise. From the CPU tensors only, a fixed
    number of numpy operations whatever the batch size."""
    if not self.use_full_cuda_graph or accepted is None or drafts is None:
        return None
    d = drafts.numpy()
    qsl = m.query_start_loc_cpu.numpy()
    if qsl.shape[0] != d.shape[0] + 1:
        return None
    spec = d >= 0
    ns = int(spec.sum())  # a prefix of spec rows iff no spec row lies past the first ns (checked below)
    # vLLM: no spec decodes when the spec rows' drafts sum to 0; later rows must be padding (no tokens),
    # never a spec, decode or prefill row
    if ns == 0 or not d[:ns].any() or spec[ns:].any() or (qsl[ns + 1 :] != qsl[ns]).any():
        return None
    tokens = int(qsl[-1] - qsl[0])
    if ns > self.decode_cudagraph_max_bs or tokens > self.decode_cudagraph_max_bs:
        return None
    return _AllSpec(ns, tokens, tuple(qsl[: ns + 1].tolist()))


def _state_slots(self: Any, ns: int, bs: int) -> tuple[Tensor, Tensor]:
    """This builder's state-slot buffer as (rows [0, ns), rows [0, bs)), with rows [ns, bs) holding the null
    block as vLLM's FULL-graph branch writes them (gdn_attn.py:425-427); the padding is written and the
    views made only when (ns, bs) changed since this builder last did."""
    pad: tuple[int, int, Tensor, Tensor] | None = getattr(self, _PAD_ATTR, None)
    if pad is None or pad[0] != ns or pad[1] != bs:
        buf: Tensor = self.spec_state_indices_tensor
        buf[ns:bs].fill_(_ORIGINAL["NULL_BLOCK_ID"])
        pad = (ns, bs, buf[:ns], buf[:bs])
        setattr(self, _PAD_ATTR, pad)
    return pad[2], pad[3]


def _fast_build(self: Any, m: Any, accepted: Tensor, step: _AllSpec) -> Any:
    """The metadata vLLM's all-spec FULL-graph branch returns, field for field, writing only what
    changed (module docstring). ``accepted`` is the runner's accepted counts per (padded) row."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    eng = _engine(self.vllm_config)
    written = eng.written
    ns, bs = step.ns, m.num_reqs
    rows = (ns, bs)
    if written.get("spec_sequence_masks") != rows:
        self.spec_sequence_masks[:ns].fill_(True)
        self.spec_sequence_masks[ns:bs].fill_(False)
        written["spec_sequence_masks"] = rows
    width = self.num_spec + 1
    n_idx = min(ns * width, step.starts[-1])
    size = self.spec_token_indx.numel()
    if written.get("spec_token_indx") != size:  # arange over the whole buffer: every prefix is vLLM's arange
        idx = self.spec_token_indx
        idx.copy_(torch.arange(size, dtype=idx.dtype, device=idx.device))
        written["spec_token_indx"] = size
    starts = (step.starts, bs)
    if written.get("spec_query_start_loc") != starts:
        self.spec_query_start_loc[: ns + 1].copy_(m.query_start_loc[: ns + 1], non_blocking=True)
        self.spec_query_start_loc[ns + 1 : bs + 1].fill_(step.starts[-1])
        written["spec_query_start_loc"] = starts
    self.num_accepted_tokens[:ns].copy_(accepted[:ns], non_blocking=True)
    if written.get("num_accepted_tokens") != rows:
        self.num_accepted_tokens[ns:bs].fill_(1)
        written["num_accepted_tokens"] = rows
    slots, slots_bs = _state_slots(self, ns, bs)
    slots.copy_(m.block_table_tensor[:ns, :width], non_blocking=True)
    if STATE.metrics is not None:
        STATE.metrics.hook("gdn.metadata_fast")
    md = GDNAttentionMetadata(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=0,
        num_decode_tokens=0,
        num_spec_decodes=ns,
        num_spec_decode_tokens=step.tokens,
        num_actual_tokens=m.num_actual_tokens,
        spec_query_start_loc=self.spec_query_start_loc[: bs + 1],
        spec_state_indices_tensor=slots_bs,
        spec_sequence_masks=self.spec_sequence_masks[:bs],
        spec_token_indx=self.spec_token_indx[:n_idx],
        non_spec_token_indx=self.non_spec_token_indx[:0],
        num_accepted_tokens=self.num_accepted_tokens[:bs],
    )
    object.__setattr__(md, _FAST_ATTR, rows)
    return md


def _build(
    self: Any,
    common_prefix_len: int,
    common_attn_metadata: Any,
    num_accepted_tokens: Tensor | None = None,
    num_decode_draft_tokens_cpu: Tensor | None = None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    sharing = getattr(self, "_tfm_update_block_table", False)
    if sharing and gdn_metadata_fast_enabled():
        step = _all_spec_rows(self, common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu)
        if step is not None:
            assert num_accepted_tokens is not None
            return _fast_build(self, common_attn_metadata, num_accepted_tokens, step)
    if sharing:  # vLLM's build writes the shared buffers and this builder's own
        _engine(self.vllm_config).written.clear()
        setattr(self, _PAD_ATTR, None)
    md = _ORIGINAL["build"](
        self, common_prefix_len, common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu, *args, **kwargs
    )
    if sharing:
        object.__setattr__(
            md, _ROWS_ATTR, _block_rows(self, md, num_decode_draft_tokens_cpu, common_attn_metadata.num_reqs)
        )
    return md


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    _ORIGINAL["__init__"](self, *args, **kwargs)
    if _eligible(self):
        _share(self)
        self._tfm_update_block_table = True
        self.supports_update_block_table = True  # read per instance by the runner


def _update_block_table(self: Any, metadata: Any, blk_table: Tensor, slot_mapping: Tensor) -> Any:
    """``metadata`` (built by another GDN builder of this engine, this step) with this group's block
    table: the state indices ``build`` would have derived from it, in this builder's buffers where
    the build used its own."""
    if not getattr(self, "_tfm_update_block_table", False):
        return _ORIGINAL["update_block_table"](self, metadata, blk_table, slot_mapping)
    fast: tuple[int, int] | None = getattr(metadata, _FAST_ATTR, None)
    if fast is not None:  # a fast build's metadata: this group's slots into this builder's buffer
        ns, bs = fast
        slots, slots_bs = _state_slots(self, ns, bs)
        slots.copy_(blk_table[:ns, : self.num_spec + 1], non_blocking=True)
        if STATE.metrics is not None:
            STATE.metrics.hook("gdn.metadata_reused")
        out = object.__new__(type(metadata))  # a shallow copy (GDNAttentionMetadata keeps its fields in __dict__)
        out.__dict__.update(metadata.__dict__)
        out.spec_state_indices_tensor = slots_bs
        return out
    rows: _BlockRows | None = getattr(metadata, _ROWS_ATTR, None)
    if rows is None:
        return _ORIGINAL["update_block_table"](self, metadata, blk_table, slot_mapping)
    null_block = _ORIGINAL["NULL_BLOCK_ID"]
    width = self.num_spec + 1
    spec: Tensor | None = None
    non_spec: Tensor | None = None
    if rows.spec_mask is None:  # no spec decodes: every row non-spec (gdn_attn.py:210-220)
        non_spec = blk_table[:, 0]
    else:
        if rows.spec_in_buffer and rows.spec_prefix is not None:
            spec = blk_table[: rows.spec_prefix, :width]  # == bt[mask] for a prefix mask; copied below
        else:
            spec = blk_table[rows.spec_mask, :width]  # gdn_attn.py:267-270, 288-290
        if metadata.num_prefills or metadata.num_decodes:  # mixed batch (gdn_attn.py:291-293)
            non_spec = blk_table[~rows.spec_mask, 0]
    if rows.spec_in_buffer:  # FULL-graph branch of the build (gdn_attn.py:420-434)
        assert spec is not None
        setattr(self, _PAD_ATTR, None)
        n = spec.size(0)
        self.spec_state_indices_tensor[:n].copy_(spec, non_blocking=True)
        spec = self.spec_state_indices_tensor[: rows.num_reqs]
        spec[n:].fill_(null_block)
    if rows.non_spec_in_buffer:  # FULL-graph branch for plain decodes (gdn_attn.py:468-478)
        assert non_spec is not None
        n = metadata.num_decodes
        self.non_spec_state_indices_tensor[:n].copy_(non_spec, non_blocking=True)
        non_spec = self.non_spec_state_indices_tensor[: rows.num_reqs]
        non_spec[n:].fill_(null_block)
    prefill = None
    if metadata.num_prefills > 0:  # gdn_attn.py:342-356
        assert non_spec is not None
        if rows.spec_mask is None and metadata.num_decodes > 0:
            prefill = non_spec[metadata.num_decodes :]
        else:
            prefill = non_spec
    if STATE.metrics is not None:
        STATE.metrics.hook("gdn.metadata_reused")
    return dataclasses.replace(
        metadata,
        spec_state_indices_tensor=spec,
        non_spec_state_indices_tensor=non_spec,
        prefill_state_indices=prefill,
    )


def install_gdn_metadata_patch() -> None:
    """Wrap ``GDNAttentionMetadataBuilder.__init__`` / ``build`` and give it ``update_block_table``,
    through the patch registry (idempotent). Builders made before the patch are unaffected."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    from ..patching import replace_attribute

    _ORIGINAL["NULL_BLOCK_ID"] = NULL_BLOCK_ID  # the padding slot id the build writes (gdn_attn.py:432, 478)

    def keep(name: str, replacement: Any) -> Any:
        def make(original: Any) -> Any:
            _ORIGINAL[name] = original
            return replacement

        return make

    why = "tfm: one GDN metadata build per step for all GDN KV-cache groups"
    replace_attribute(GDNAttentionMetadataBuilder, "__init__", keep("__init__", _init), reason=why)
    replace_attribute(GDNAttentionMetadataBuilder, "build", keep("build", _build), reason=why)
    replace_attribute(
        GDNAttentionMetadataBuilder, "update_block_table", keep("update_block_table", _update_block_table), reason=why
    )
