"""One GDN metadata build per step (vllm_plugin/runtime/gdn_metadata.py) against vLLM's per-group builds.

Ten builders as vLLM 0.26 makes them for ten GDN KV-cache groups, each with its own block table:
vLLM's way (a full ``build`` per group, patch off) and ours (the first group builds, the other nine
``update_block_table``) must give the same metadata field by field, for all-spec, mixed, padded,
scattered-spec and spec-free batches, with and without FULL CUDA graphs; with FULL graphs each
group's state indices must sit in that group's own buffer (the address its captured graph reads)
and the block-table-free buffers must be the same tensors for all groups.
"""

from __future__ import annotations

import dataclasses
import zlib
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_tfm.vllm_plugin import patching
from vllm_tfm.vllm_plugin.guards import TFM_METHOD
from vllm_tfm.vllm_plugin.runtime import gdn_metadata

GROUPS = 10
S = 4  # num_speculative_tokens: 1 + S state slots per spec request
MAX_SEQS = 8


@pytest.fixture
def patched(monkeypatch):
    import vllm.v1.attention.backends.utils as backend_utils
    from vllm.utils import torch_utils

    for module in (torch_utils, backend_utils):  # CPU-only host: no pinned host memory
        monkeypatch.setattr(module, "PIN_MEMORY", False)
    before = set(patching.installed_patches())
    gdn_metadata.install_gdn_metadata_patch()
    yield
    patching.restore([k for k in patching.installed_patches() if k not in before])


class FakeVllmConfig(SimpleNamespace):
    """The VllmConfig fields the GDN builder reads (weak-referenceable like VllmConfig)."""


def make_config(full_graphs: bool, method: str = TFM_METHOD, mode: str = "none", dbo: bool = False) -> FakeVllmConfig:
    mode_obj = SimpleNamespace(has_full_cudagraphs=lambda: full_graphs)
    return FakeVllmConfig(
        compilation_config=SimpleNamespace(cudagraph_mode=mode_obj, max_cudagraph_capture_size=None),
        speculative_config=SimpleNamespace(num_speculative_tokens=S, method=method, parallel_drafting=False),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS),
        cache_config=SimpleNamespace(mamba_cache_mode=mode),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, use_ubatching=dbo),
        additional_config={},
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(linear_key_head_dim=128)),
    )


def make_builders(config: FakeVllmConfig, device: str = "cpu") -> list[GDNAttentionMetadataBuilder]:
    spec = MambaSpec(
        block_size=1024, shapes=((3, 64), (4, 16, 16)), dtypes=(torch.float32, torch.float32),
        num_speculative_blocks=S,
    )
    return [GDNAttentionMetadataBuilder(spec, [f"layer{g}"], config, torch.device(device)) for g in range(GROUPS)]


def batch(
    query_lens: list[int], drafts: list[int], seed: int, device: str = "cpu"
) -> tuple[list[CommonAttentionMetadata], torch.Tensor]:
    """One step's common metadata for every group (only the block table and slots differ) and
    vLLM's ``num_decode_draft_tokens`` (>= 0: a spec decode; -1: not). The device tensors on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    n = len(query_lens)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    seq_lens = torch.tensor(query_lens, dtype=torch.int32) + torch.randint(0, 50, (n,), generator=gen, dtype=torch.int32)
    tokens = int(qsl[-1])
    out = []
    for _ in range(GROUPS):
        blocks = torch.randperm(4096, generator=gen)[: n * (1 + S)].view(n, 1 + S).to(torch.int32) + 1
        out.append(
            CommonAttentionMetadata(
                query_start_loc=qsl.to(device), query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens.to(device),
                num_reqs=n, num_actual_tokens=tokens, max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
                block_table_tensor=blocks.to(device),
                slot_mapping=torch.randint(0, 10**6, (tokens,), generator=gen).to(device),
            )
        )
    return out, torch.tensor(drafts, dtype=torch.int32)


def accepted_for(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, S + 2, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def per_group_vllm(builders, commons, drafts, accepted) -> list:
    """vLLM 0.26 without the patch: one build per group, each copied out (later builds of the same
    builder would overwrite its buffers, so compare values now)."""
    return [
        snapshot(b.build(common_prefix_len=0, common_attn_metadata=c, num_accepted_tokens=accepted.clone(),
                         num_decode_draft_tokens_cpu=drafts.clone()))
        for b, c in zip(builders, commons)
    ]


def as_runner(builders, commons, drafts, accepted) -> list:
    """What GPUModelRunner._build_attention_metadata does with ``supports_update_block_table``."""
    out = []
    cached = None
    for b, c in zip(builders, commons):
        if cached is not None and b.supports_update_block_table:
            md = b.update_block_table(cached, c.block_table_tensor, c.slot_mapping)
        else:
            md = b.build(common_prefix_len=0, common_attn_metadata=c, num_accepted_tokens=accepted.clone(),
                         num_decode_draft_tokens_cpu=drafts.clone())
            if b.supports_update_block_table:
                cached = md
        out.append(md)
    return out


def copied(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: copied(x) for k, x in v.items()}
    return v


def snapshot(md) -> dict:
    return {f.name: copied(getattr(md, f.name)) for f in dataclasses.fields(md)}


def assert_same(o, r, where: str) -> None:
    if isinstance(r, torch.Tensor):
        assert isinstance(o, torch.Tensor), f"{where} is {o!r}, vLLM's is a tensor"
        assert o.dtype == r.dtype and o.shape == r.shape and torch.equal(o, r), f"{where} differs"
    elif isinstance(r, dict):
        assert isinstance(o, dict) and o.keys() == r.keys(), f"{where}: keys {list(o)} != {list(r)}"
        for k in r:
            assert_same(o[k], r[k], f"{where}.{k}")
    else:
        assert o == r, f"{where}: {o!r} != {r!r}"


CASES = {
    # name: (query lengths, num_decode_draft_tokens)
    "all spec": ([S + 1] * 5, [S] * 5),
    "all spec, one request": ([S + 1], [S]),
    "all spec, padded rows at the back": ([S + 1] * 3 + [0, 0], [S] * 3 + [-1, -1]),
    "mixed: spec, prefill, plain decode": ([S + 1, 17, S + 1, 1, 9], [S, -1, S, -1, -1]),
    "mixed: spec rows not a prefix": ([23, S + 1, 1, S + 1], [-1, S, -1, S]),
    "no spec: prefills and decodes": ([1, 1, 12, 30], [-1, -1, -1, -1]),
    "no spec: plain decodes only": ([1] * 6, [-1] * 6),
}


@pytest.mark.parametrize("full_graphs", [True, False], ids=["full graphs", "no full graphs"])
@pytest.mark.parametrize("case", list(CASES))
def test_update_block_table_equals_a_build_per_group(patched, monkeypatch, case, full_graphs):
    query_lens, drafts = CASES[case]
    seed = zlib.crc32(f"{case}|{full_graphs}".encode())
    commons, drafts_t = batch(query_lens, drafts, seed)
    accepted = accepted_for(len(query_lens), seed)

    monkeypatch.setenv(gdn_metadata.GDN_METADATA_ONCE_ENV, "0")
    ref = per_group_vllm(make_builders(make_config(full_graphs)), commons, drafts_t, accepted)
    monkeypatch.delenv(gdn_metadata.GDN_METADATA_ONCE_ENV)
    builders = make_builders(make_config(full_graphs))
    assert all(b.supports_update_block_table for b in builders)
    ours = as_runner(builders, commons, drafts_t, accepted)
    for g in range(GROUPS):
        assert_same(snapshot(ours[g]), ref[g], f"{case}, group {g}: metadata")

    first = builders[0]
    for g, (b, md) in enumerate(zip(builders, ours)):
        for name in gdn_metadata.SHARED_BUFFERS:
            assert getattr(b, name) is getattr(first, name), f"group {g}: {name} not shared"
        assert b.spec_state_indices_tensor.data_ptr() != first.spec_state_indices_tensor.data_ptr() or g == 0
        spec = md.spec_state_indices_tensor
        if full_graphs and spec is not None and md.num_prefills == 0 and md.num_decodes == 0:
            # the address group g's captured graph reads holds group g's slots
            assert spec.data_ptr() == b.spec_state_indices_tensor.data_ptr(), f"group {g}: not in its own buffer"
            assert torch.equal(b.spec_state_indices_tensor[: spec.size(0)], ref[g]["spec_state_indices_tensor"])
        non_spec = md.non_spec_state_indices_tensor
        if full_graphs and non_spec is not None and md.num_prefills == 0 and md.num_spec_decodes == 0:
            assert non_spec.data_ptr() == b.non_spec_state_indices_tensor.data_ptr(), f"group {g}: not in its own buffer"


def test_buffers_after_capture_builds_then_a_step(patched):
    """The FULL-graph capture builds every group (``build_for_cudagraph_capture``, no reuse); a later
    step builds once and updates: every group's buffers then hold what its own build would write."""
    builders = make_builders(make_config(True))
    commons, _ = batch([S + 1] * 4, [S] * 4, 11)
    for b, c in zip(builders, commons):
        b.build_for_cudagraph_capture(c)
    captured = [b.spec_state_indices_tensor.data_ptr() for b in builders]
    commons, drafts = batch([S + 1] * 3, [S] * 3, 12)
    accepted = accepted_for(3, 12)
    ours = as_runner(builders, commons, drafts, accepted)
    for g, (b, c, md) in enumerate(zip(builders, commons, ours)):
        assert md.spec_state_indices_tensor.data_ptr() == captured[g]
        assert torch.equal(b.spec_state_indices_tensor[:3], c.block_table_tensor[:, : S + 1]), f"group {g}"
        assert torch.equal(b.num_accepted_tokens[:3], accepted), f"group {g}"
        assert torch.equal(b.spec_query_start_loc[:4], c.query_start_loc[:4]), f"group {g}"


@pytest.mark.parametrize(
    "config, why",
    [
        (make_config(True, method="dflash"), "not a tfm engine"),
        (make_config(True, mode="align"), "align mode needs sequence lengths"),
        (make_config(True, dbo=True), "micro-batching: a builder per micro-batch"),
    ],
    ids=["dflash", "align", "dbo"],
)
def test_other_engines_build_per_group_as_vllm_does(patched, config, why):
    builders = make_builders(config)
    assert not any(b.supports_update_block_table for b in builders), why
    assert builders[1].num_accepted_tokens is not builders[0].num_accepted_tokens, why


def test_switch_off_builds_per_group(patched, monkeypatch):
    monkeypatch.setenv(gdn_metadata.GDN_METADATA_ONCE_ENV, "0")
    builders = make_builders(make_config(True))
    assert not any(b.supports_update_block_table for b in builders)


def test_engines_do_not_share_buffers(patched):
    a = make_builders(make_config(True))
    b = make_builders(make_config(True))
    assert a[1].num_accepted_tokens is a[0].num_accepted_tokens
    assert b[0].num_accepted_tokens is not a[0].num_accepted_tokens


def test_patch_is_idempotent_and_registered(patched):
    gdn_metadata.install_gdn_metadata_patch()  # second call: no-op
    for name in ("__init__", "build", "update_block_table"):
        assert patching.is_patched(GDNAttentionMetadataBuilder, name)


# ---- the fast build of all-spec FULL-graph steps (gdn_metadata._fast_build)

# A sequence of steps on the same builders: (query lengths, drafts, fast build expected). The shapes
# repeat and change so that every "write only what changed" shortcut meets a step where its buffer
# must be rewritten; the non-prefix step takes vLLM's FULL-graph branch and writes the shared buffers
# with other values, which the next fast step (same shape as before it) must not trust.
STEPS = [
    ([S + 1] * 4, [S] * 4, True),
    ([S + 1] * 4, [S] * 4, True),  # same shape, new slots and accepted counts
    ([S + 1] * 3 + [0], [S] * 3 + [-1], True),  # a padded row
    ([S + 1, S + 1, 3, 0], [S, S, 2, -1], True),  # fewer drafts on one row: other start offsets
    ([S + 1] * 2 + [0], [S] * 2 + [-1], True),
    ([S + 1, 0, S + 1], [S, -1, S], False),  # spec rows not a prefix: vLLM's FULL-graph branch
    ([S + 1] * 2 + [0], [S] * 2 + [-1], True),  # the shape before it again
    ([S + 1, 17, S + 1], [S, -1, S], False),  # a prefill: vLLM's mixed branch
    ([S + 1, S + 1, 9], [S, S, -1], False),  # a prefill after the spec rows (not padding: it has tokens)
    ([S + 1] * 4, [S] * 4, True),
    ([1] * 3, [0] * 3, False),  # drafts that sum to 0: no spec decodes (vLLM)
    ([S + 1] * 4, [S] * 4, True),
    ([S + 1] * 2 + [0, 0], [S] * 2 + [-1, -1], True),
    ([S + 1, 0, S + 1, S + 1], [S, -1, S, S], False),  # vLLM's branch writes row 2 of each group's slots
    ([S + 1] * 2 + [0, 0], [S] * 2 + [-1, -1], True),  # row 2 is padding again: the null block
]


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a CUDA device")])],
)
def test_fast_build_equals_vllm_over_a_sequence_of_steps(patched, monkeypatch, device):
    """On the GPU host also with CUDA buffers: the device copies and fills queued on the stream."""
    monkeypatch.setenv(gdn_metadata.GDN_METADATA_ONCE_ENV, "0")
    vllm_builders = make_builders(make_config(True), device)
    monkeypatch.delenv(gdn_metadata.GDN_METADATA_ONCE_ENV)
    builders = make_builders(make_config(True), device)
    for step, (query_lens, drafts, fast) in enumerate(STEPS):
        commons, drafts_t = batch(query_lens, drafts, 100 + step, device)
        accepted = accepted_for(len(query_lens), 100 + step).to(device)
        ref = per_group_vllm(vllm_builders, commons, drafts_t, accepted)
        ours = as_runner(builders, commons, drafts_t, accepted)
        for g in range(GROUPS):
            took = getattr(ours[g], "_tfm_fast_rows", None) is not None
            assert took == fast, f"step {step}, group {g}: fast build {took}, expected {fast}"
            assert_same(snapshot(ours[g]), ref[g], f"step {step}, group {g}: metadata")
            if fast:
                assert ours[g].spec_state_indices_tensor.data_ptr() == builders[g].spec_state_indices_tensor.data_ptr()


def test_fast_build_after_capture_builds(patched):
    """Capture builds (every group builds, ``build_for_cudagraph_capture``) at other batch sizes, then steps."""
    builders = make_builders(make_config(True))
    for n in (MAX_SEQS, 1, 2):
        commons, _ = batch([S + 1] * n, [S] * n, 30 + n)
        for b, c in zip(builders, commons):
            b.build_for_cudagraph_capture(c)
    for step, n in enumerate((2, 2, 1)):
        commons, drafts = batch([S + 1] * n, [S] * n, 40 + step)
        accepted = accepted_for(n, 40 + step)
        ours = as_runner(builders, commons, drafts, accepted)
        for g, (b, c, md) in enumerate(zip(builders, commons, ours)):
            assert getattr(md, "_tfm_fast_rows", None) == (n, n), f"step {step}, group {g}: not the fast build"
            assert torch.equal(md.spec_state_indices_tensor, c.block_table_tensor[:, : S + 1]), f"step {step}, group {g}"
            assert torch.equal(md.num_accepted_tokens, accepted), f"step {step}, group {g}"
            assert torch.equal(md.spec_query_start_loc, c.query_start_loc), f"step {step}, group {g}"
            assert bool(md.spec_sequence_masks.all()) and torch.equal(
                md.spec_token_indx, torch.arange(n * (S + 1), dtype=torch.int32)
            ), f"step {step}, group {g}"


class _Writes(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the in-place tensor operations (what becomes a device launch on the GPU) under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if func._schema.is_mutable or name.endswith("_"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_fast_build_writes_only_the_step_values_when_the_shape_repeats(patched):
    builders = make_builders(make_config(True))
    for step in range(2):
        commons, drafts = batch([S + 1] * 3 + [0], [S] * 3 + [-1], 50 + step)
        accepted = accepted_for(4, 50 + step)
        with _Writes() as w:
            as_runner(builders, commons, drafts, accepted)
        if step == 0:
            assert len(w.ops) > GROUPS + 1  # first step: the shared buffers and every group's padding
        else:
            # the accepted counts once, each group's state slots once: nothing else
            assert sorted(w.ops) == ["aten::copy_"] * (GROUPS + 1), w.ops


def test_switch_keeps_vllms_build(patched, monkeypatch):
    builders = make_builders(make_config(True))
    commons, drafts = batch([S + 1] * 3, [S] * 3, 60)
    accepted = accepted_for(3, 60)
    try:
        gdn_metadata.set_gdn_metadata_fast(False)
        assert not gdn_metadata.gdn_metadata_fast_enabled()
        off = as_runner(builders, commons, drafts, accepted)
        assert all(getattr(md, "_tfm_fast_rows", None) is None for md in off)
        gdn_metadata.set_gdn_metadata_fast(None)
        monkeypatch.setenv(gdn_metadata.GDN_METADATA_FAST_ENV, "0")
        assert not gdn_metadata.gdn_metadata_fast_enabled()
        monkeypatch.delenv(gdn_metadata.GDN_METADATA_FAST_ENV)
        on = as_runner(builders, commons, drafts, accepted)
        assert all(getattr(md, "_tfm_fast_rows", None) == (3, 3) for md in on)
        for g in range(GROUPS):
            assert_same(snapshot(on[g]), snapshot(off[g]), f"group {g}")
    finally:
        gdn_metadata.set_gdn_metadata_fast(None)
    with pytest.raises(ValueError, match="set_gdn_metadata_fast takes True, False or None"):
        gdn_metadata.set_gdn_metadata_fast("yes")  # type: ignore[arg-type]
