"""Method "tfm" in vLLM 0.26 speculative configs: acceptance, tree options, config-time errors.

On CPU vLLM builds model and speculative configs (``EngineArgs.create_model_config`` and
``create_speculative_config(model_config, ParallelConfig())``) but not engine configs, so every
test goes through those two calls, with tiny config-only models in a temporary directory.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _vllm_plugin_env import (
    HIDDEN,
    TREEFLASH_SECTION,
    VOCAB,
    WEAVER_SECTION,
    drafter_config,
    vllm_cpu_session,
    write_drafter,
    write_plain_target,
    write_qwen35_target,
)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("plugin_config")
    with vllm_cpu_session(root / "vllm-cache"):
        from vllm.engine.arg_utils import EngineArgs

        target = write_qwen35_target(root / "target")
        model_config = EngineArgs(model=str(target), skip_tokenizer_init=True).create_model_config()
        yield {"root": root, "target": target, "model_config": model_config}


@pytest.fixture(autouse=True)
def _no_tfm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("VLLM_TFM_") or name == "VLLM_USE_V2_MODEL_RUNNER":
            monkeypatch.delenv(name)


def build(env: Any, spec: dict[str, Any] | None, *, parallel: dict[str, Any] | None = None, model_config: Any = None, **engine: Any) -> Any:
    """``EngineArgs(..., speculative_config=spec).create_speculative_config(model_config, ParallelConfig())``."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    engine.setdefault("load_format", "auto")
    args = EngineArgs(model=str(env["target"]), skip_tokenizer_init=True, speculative_config=spec, **engine)
    mc = model_config if model_config is not None else env["model_config"]
    return args.create_speculative_config(mc, ParallelConfig(**(parallel or {})))


def drafter(env: Any, name: str, **kwargs: Any) -> Path:
    return write_drafter(env["root"] / name, **kwargs)


def tfm(model: Path, b: int | None = 7, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"method": "tfm", "model": str(model), **extra}
    if b is not None:
        spec["num_speculative_tokens"] = b
    return spec


def raises(env: Any, spec: dict[str, Any], match: str, **kw: Any) -> str:
    with pytest.raises(ValueError, match=match) as info:
        build(env, spec, **kw)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --------------------------------------------------------------------------- acceptance


def test_tfm_builds_through_the_dflash_branch_and_carries_its_options(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import SpeculativeConfig
    from vllm_tfm.vllm_plugin.options import get_drafter_dir, get_tfm_options

    d = drafter(
        env,
        "full",
        tfm_config={"proposal": "tfm", "top_k": 64, "weaver": WEAVER_SECTION},
        weaver_weights=True,
    )
    monkeypatch.setenv("VLLM_TFM_TOP_K", "32")  # the environment beats the file
    cfg = build(env, tfm(d, 12, sampling="traversal", children_per_node=3))  # the spec beats both

    assert isinstance(cfg, SpeculativeConfig)
    assert cfg.method == "tfm"
    assert cfg.num_speculative_tokens == 12
    assert cfg.parallel_drafting is True  # set by vLLM's dflash branch
    assert cfg.draft_model_config.architectures == ["DFlashDraftModel"]
    assert cfg.use_eagle() and cfg.use_dflash() and not cfg.use_dspark()
    assert cfg.draft_model_config.hf_config.dflash_config["target_layer_ids"] == [1, 2]
    # the drafter runs D = min(B, block 8 - 1) = 7 DFlash queries: 6 extra slots, not B - 1 = 11
    assert cfg.max_num_new_slots_for_drafting == 6

    opts = get_tfm_options(cfg)
    assert (opts.proposal, opts.budget, opts.top_k, opts.sampling, opts.children_per_node) == ("tfm", 12, 32, "traversal", 3)
    assert opts.weaver is not None and opts.weaver.d_model == HIDDEN
    assert get_drafter_dir(cfg) == str(d)

    # what workers receive: the pickled config keeps the method and the options
    clone = pickle.loads(pickle.dumps(cfg))
    assert clone.method == "tfm" and clone.use_dflash()
    assert get_tfm_options(clone) == opts


def test_plain_dflash_directory_runs_ddtree_and_hashes_apart_from_dflash(env: Any) -> None:
    from vllm.config import SpeculativeConfig
    from vllm_tfm.vllm_plugin import patching
    from vllm_tfm.vllm_plugin.options import get_tfm_options

    d = drafter(env, "plain")
    tfm_cfg = build(env, tfm(d, 7))
    dflash_cfg = build(env, {"method": "dflash", "model": str(d), "num_speculative_tokens": 7})

    assert get_tfm_options(tfm_cfg).proposal == "ddtree"
    assert dflash_cfg.method == "dflash"
    assert not hasattr(dflash_cfg.draft_model_config.hf_config, "tfm_options")

    original_hash = patching.original(SpeculativeConfig, "compute_hash")
    # dflash hashes exactly as without the plugin; tfm includes the aux-hidden-state factors of
    # dflash (the same drafter config) but never collides with it
    assert dflash_cfg.compute_hash() == original_hash(dflash_cfg)
    original_slots = patching.original(SpeculativeConfig, "max_num_new_slots_for_drafting")
    assert dflash_cfg.max_num_new_slots_for_drafting == original_slots.fget(dflash_cfg) == 6
    assert tfm_cfg.compute_hash() != dflash_cfg.compute_hash()
    assert tfm_cfg.method == "tfm"  # hashing restored the method
    # the aux-hidden-state factors matter: tfm with another drafter hashes differently
    other = drafter(env, "plain-other", config=drafter_config(dflash_config={"mask_token_id": 3, "target_layer_ids": [0, 3], "block_size": 8}))
    assert build(env, tfm(other, 7)).compute_hash() != tfm_cfg.compute_hash()


def test_tree_options_and_replay_profile_do_not_key_the_compile_cache(env: Any) -> None:
    """vLLM hashes the drafter's whole HF config into the torch.compile cache key; the tree options,
    drafter directory and replay profile tfm attaches to it change no compiled graph, so configs
    that differ only there hash alike (and the attributes are back after hashing)."""
    from vllm_tfm.vllm_plugin import benchmark_mode
    from vllm_tfm.vllm_plugin.config_patch import HF_ATTRS_NOT_HASHED
    from vllm_tfm.vllm_plugin.options import HF_OPTIONS_ATTR, get_tfm_options

    d = drafter(env, "plain-hash")
    base = build(env, tfm(d, 7))
    other = build(env, tfm(d, 7, top_k=4, width=3, children_per_node=2))
    assert get_tfm_options(other) != get_tfm_options(base)
    assert getattr(other.draft_model_config.hf_config, HF_OPTIONS_ATTR) != getattr(base.draft_model_config.hf_config, HF_OPTIONS_ATTR)
    assert other.compute_hash() == base.compute_hash()
    hf = other.draft_model_config.hf_config
    before = {a: getattr(hf, a) for a in HF_ATTRS_NOT_HASHED}
    setattr(hf, benchmark_mode.HF_REPLAY_ATTR, {"profile": [0.9, 0.5], "path": "/tmp/x.json"})
    assert other.compute_hash() == base.compute_hash()
    assert getattr(hf, benchmark_mode.HF_REPLAY_ATTR) == {"profile": [0.9, 0.5], "path": "/tmp/x.json"}
    setattr(hf, benchmark_mode.HF_REPLAY_ATTR, before[benchmark_mode.HF_REPLAY_ATTR])
    assert {a: getattr(hf, a) for a in HF_ATTRS_NOT_HASHED} == before and get_tfm_options(other).top_k == 4
    # what the drafter's graph does depend on still keys it: another drafter config
    hf.dflash_config = {**hf.dflash_config, "target_layer_ids": [0, 3]}
    assert other.compute_hash() != base.compute_hash()


def test_spec_flags_and_budget_from_tfm_config(env: Any) -> None:
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm_tfm.vllm_plugin.options import get_tfm_options

    d = drafter(env, "budget", tfm_config={"proposal": "chain", "budget": 5})
    args = EngineArgs(model=str(env["target"]), skip_tokenizer_init=True, spec_method="tfm", spec_model=str(d))
    cfg = args.create_speculative_config(env["model_config"], ParallelConfig())
    assert cfg.method == "tfm" and cfg.num_speculative_tokens == 5
    assert cfg.max_num_new_slots_for_drafting == 4  # D = min(5, 7) = 5
    assert get_tfm_options(cfg).proposal == "chain"
    # EngineArgs still says tfm afterwards, so a second engine config is tfm again
    assert args.speculative_config["method"] == "tfm"


def test_direct_speculative_config_construction(env: Any) -> None:
    from vllm.config import LoadConfig, ParallelConfig, SpeculativeConfig
    from vllm_tfm.vllm_plugin.options import get_tfm_options

    d = drafter(env, "direct", weights=False)
    cfg = SpeculativeConfig(
        method="tfm",
        model=str(d),
        num_speculative_tokens=9,
        target_model_config=env["model_config"],
        target_parallel_config=ParallelConfig(),
        draft_load_config=LoadConfig(load_format="dummy"),
    )
    assert cfg.method == "tfm" and cfg.parallel_drafting and cfg.use_eagle()
    assert get_tfm_options(cfg).budget == 9
    with pytest.raises(ValueError, match="has no DFlash weights"):
        SpeculativeConfig(
            method="tfm",
            model=str(d),
            num_speculative_tokens=9,
            target_model_config=env["model_config"],
            target_parallel_config=ParallelConfig(),
        )


def test_piecewise_default_and_triton_attention_are_selected(env: Any) -> None:
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    d = drafter(env, "eager")
    args = EngineArgs(model=str(env["target"]), skip_tokenizer_init=True, speculative_config=tfm(d))
    mc = args.create_model_config()
    assert mc.enforce_eager is False and args.attention_backend is None
    first = args.create_speculative_config(mc, ParallelConfig())
    assert mc.enforce_eager is False and args.enforce_eager is False  # CUDA graphs by default
    assert args.compilation_config.cudagraph_mode.name == "FULL_AND_PIECEWISE"  # (cuda_graphs.DEFAULT_MODE; test_cuda_graphs.py)
    assert args.attention_backend is AttentionBackendEnum.TRITON_ATTN
    # EngineArgs still asks for tfm: a second engine config gets a second tfm config
    second = args.create_speculative_config(mc, ParallelConfig())
    assert first.method == second.method == "tfm" and second is not first
    raises(env, tfm(d), r"needs attention_backend=TRITON_ATTN for the target \(tree-masked attention\), got FLASH_ATTN", attention_backend="FLASH_ATTN")
    raises(env, tfm(d), r"got FLEX_ATTENTION", attention_config={"backend": "FLEX_ATTENTION"})


# --------------------------------------------------------------------------- errors


def test_unknown_keys(env: Any) -> None:
    d = drafter(env, "keys")
    raises(env, tfm(d, beam_width=4), r"unknown key 'beam_width' for method 'tfm'")
    bad = drafter(env, "keys-file", tfm_config={"proposal": "ddtree", "widht": 3})
    msg = raises(env, tfm(bad), r"tfm_config.json: widht: unknown key")
    assert str(bad) in msg


def test_bad_values_name_their_source(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    d = drafter(env, "values")
    raises(env, tfm(d, top_k=0), r"speculative_config top_k=0: top_k: Input should be greater than 0")
    raises(env, tfm(d, sampling="nucleus"), r"sampling: Input should be 'target_only' or 'traversal'")
    raises(env, tfm(d, proposal="treeflash"), r"proposal 'treeflash' needs tfm_config.json with a 'treeflash' section")
    monkeypatch.setenv("VLLM_TFM_PROPOSAL", "beam")
    raises(env, tfm(d), r"environment VLLM_TFM_PROPOSAL='beam': proposal: Input should be 'tfm', 'ddtree', 'treeflash' or 'chain'")
    monkeypatch.delenv("VLLM_TFM_PROPOSAL")
    monkeypatch.setenv("VLLM_TFM_PROPSAL", "chain")
    raises(env, tfm(d), r"unknown environment variable VLLM_TFM_PROPSAL: neither a tfm option nor a vllm-tfm switch, "
                        r"unset it \(tfm options from the environment are VLLM_TFM_PROPOSAL, ")
    monkeypatch.delenv("VLLM_TFM_PROPSAL")
    monkeypatch.setenv("VLLM_TFM_ASYNC_SCHEDULING", "1")  # the retired switch: --async-scheduling alone now
    raises(env, tfm(d), r"unknown environment variable VLLM_TFM_ASYNC_SCHEDULING: neither a tfm option nor a vllm-tfm switch")


@pytest.mark.parametrize("b", [0, 257])
def test_budget_out_of_range(env: Any, b: int) -> None:
    d = drafter(env, "budget-range")
    raises(env, tfm(d, b), rf"num_speculative_tokens \(the tree budget B\) must be an integer in \[1, 256\], got {b}")


def test_budget_required(env: Any) -> None:
    d = drafter(env, "no-budget")
    raises(env, tfm(d, None), r"num_speculative_tokens \(the tree budget B, 1..256\) is required")


def test_missing_drafter_files(env: Any) -> None:
    missing = env["root"] / "nowhere"
    raises(env, tfm(missing), rf"drafter directory {missing} does not exist")
    empty = env["root"] / "empty"
    empty.mkdir()
    raises(env, tfm(empty), rf"{empty}: missing config.json")
    raises(env, tfm(drafter(env, "no-weights", weights=False)), r"has no DFlash weights")
    raises(env, tfm(drafter(env, "no-tfm-config"), proposal="tfm"), r"proposal 'tfm' needs tfm_config.json with a 'weaver' section")
    no_weaver = drafter(env, "no-weaver", tfm_config={"proposal": "tfm", "weaver": WEAVER_SECTION})
    raises(env, tfm(no_weaver), r"has no tfm/weaver.safetensors, which proposal 'tfm' loads")
    no_section = drafter(env, "no-treeflash-section", tfm_config={"proposal": "ddtree"})
    msg = raises(env, tfm(no_section, proposal="treeflash"), r"speculative_config proposal='treeflash': proposal 'treeflash' needs tfm_config.json with a 'treeflash' section")
    assert str(no_section) in msg
    no_weights = drafter(env, "no-treeflash", tfm_config={"proposal": "treeflash", "treeflash": TREEFLASH_SECTION})
    raises(env, tfm(no_weights), r"has no tfm/treeflash.safetensors, which proposal 'treeflash' loads")
    width = drafter(env, "treeflash-width", tfm_config={"proposal": "treeflash", "treeflash": {**TREEFLASH_SECTION, "hidden_size": 96}}, treeflash_weights=True)
    raises(env, tfm(width), r"treeflash.hidden_size 96 does not match the target's hidden_size 64")


def test_treeflash_is_accepted_and_its_prenorm_drafter_hashes_apart(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_tfm.models.tfm_config import TfmConfig
    from vllm_tfm.vllm_plugin.options import HF_OPTIONS_ATTR, get_tfm_options, hf_loads_treeflash, loads_treeflash

    d = drafter(env, "treeflash", tfm_config={"proposal": "treeflash", "treeflash": TREEFLASH_SECTION}, treeflash_weights=True)
    cfg = build(env, tfm(d, 7))
    opts = get_tfm_options(cfg)
    assert opts.proposal == "treeflash" and opts.budget == 7 and opts.treeflash.hidden_size == HIDDEN
    # a directory offering TreeFlash besides its configured proposal: selectable inline, loaded for overrides
    both = drafter(
        env, "tfm-and-treeflash",
        tfm_config={"proposal": "tfm", "weaver": WEAVER_SECTION, "treeflash": TREEFLASH_SECTION},
        weaver_weights=True, treeflash_weights=True,
    )
    assert get_tfm_options(build(env, tfm(both, 7, proposal="treeflash"))).proposal == "treeflash"
    tfm_cfg = build(env, tfm(both, 7))
    hf_tfm = tfm_cfg.draft_model_config.hf_config
    monkeypatch.delenv("VLLM_TFM_LOAD_TREEFLASH", raising=False)
    assert get_tfm_options(tfm_cfg).proposal == "tfm" and not hf_loads_treeflash(hf_tfm)  # vLLM's drafter untouched
    monkeypatch.setenv("VLLM_TFM_LOAD_TREEFLASH", "1")  # the harness's in-process proposal switches
    assert hf_loads_treeflash(hf_tfm)
    monkeypatch.delenv("VLLM_TFM_LOAD_TREEFLASH")
    section_only = TfmConfig(proposal="ddtree", treeflash=TREEFLASH_SECTION)
    on, off = {"VLLM_TFM_LOAD_TREEFLASH": "1"}, {"VLLM_TFM_LOAD_TREEFLASH": "0"}
    assert loads_treeflash(section_only, d, on) and not loads_treeflash(section_only, env["root"] / "nowhere", on)
    assert not loads_treeflash(section_only, d, off) and not loads_treeflash(section_only, d, {})
    assert loads_treeflash(TfmConfig(proposal="treeflash", treeflash=TREEFLASH_SECTION), None)
    assert not loads_treeflash(TfmConfig(proposal="ddtree"), d)
    # the compile-cache hash tells a drafter that returns its pre-norm stream from one that does not
    hf = cfg.draft_model_config.hf_config
    with_prenorm = cfg.compute_hash()
    monkeypatch.setattr(hf, HF_OPTIONS_ATTR, {**getattr(hf, HF_OPTIONS_ATTR), "proposal": "ddtree", "treeflash": None})
    assert not hf_loads_treeflash(hf) and cfg.compute_hash() != with_prenorm
    monkeypatch.undo()
    assert hf_loads_treeflash(hf) and cfg.compute_hash() == with_prenorm


def test_drafter_target_mismatch(env: Any) -> None:
    vocab = drafter(env, "vocab", config=drafter_config(vocab_size=VOCAB * 2))
    raises(env, tfm(vocab), rf"drafter vocab_size {VOCAB * 2} does not match the target's vocab_size {VOCAB}")
    width = drafter(env, "width", config=drafter_config(target_hidden_size=2 * HIDDEN))
    raises(env, tfm(width), rf"drafter target_hidden_size {2 * HIDDEN} does not match the target's hidden_size {HIDDEN}")
    layers = drafter(env, "layers", config=drafter_config(dflash_config={"mask_token_id": 5, "target_layer_ids": [1, 4]}))
    raises(env, tfm(layers), r"target_layer_ids has layer 4, but the target has layers 0..3")
    not_dflash = drafter(env, "not-dflash", config=drafter_config(architectures=["Qwen3ForCausalLM"]))
    raises(env, tfm(not_dflash), r"is not a DFlash drafter")
    swa = drafter_config(layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2, sliding_window=64)
    raises(env, tfm(drafter(env, "swa", config=swa)), r"mixes sliding-window and full-attention layers")
    weaver = drafter(env, "weaver-width", tfm_config={"proposal": "tfm", "weaver": {**WEAVER_SECTION, "d_model": 96}}, weaver_weights=True)
    raises(env, tfm(weaver), r"weaver.d_model 96 does not match the target's hidden_size 64")
    shallow = drafter(env, "weaver-depth", tfm_config={"proposal": "tfm", "weaver": {**WEAVER_SECTION, "max_depth": 3}}, weaver_weights=True)
    raises(env, tfm(shallow, 5), r"weaver.max_depth 3 is below the 5 depths drafted per step")
    assert build(env, tfm(shallow, 3)).method == "tfm"  # D = min(3, 8 - 1) = 3


def test_drafter_quantized_at_load_by_online_methods_only(env: Any) -> None:
    """``quantization: "fp8"`` on an unquantized drafter: the config is accepted and the worker's quantization
    config resolves to vLLM's online FP8 through the plugin's patch (vLLM 0.26's own get_quant_config refuses the
    draft's callable hf_overrides); a method that needs a checkpoint config file is refused at config time in one
    line; the target's quantization is untouched."""
    from vllm.config import LoadConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.model_loader import weight_utils

    from vllm_tfm.vllm_plugin.draft_quantization import is_tfm_draft_config
    from vllm_tfm.vllm_plugin.patching import is_patched, original

    d = drafter(env, "quant")
    message = raises(env, tfm(d, quantization="awq"), r"quantization='awq' needs a drafter checkpoint quantized with it")
    assert message.startswith(f"{d / 'config.json'}: ")
    assert build(env, tfm(d)).draft_model_config.quantization is None
    float32 = EngineArgs(model=str(env["target"]), skip_tokenizer_init=True, dtype="float32").create_model_config()
    raises(env, tfm(d, quantization="fp8"), r"quantization='fp8' runs the drafter in bfloat16, float16, not the "
           r"model's float32; set dtype to one of them", model_config=float32)

    bf16 = EngineArgs(model=str(env["target"]), skip_tokenizer_init=True, dtype="bfloat16").create_model_config()
    cfg = build(env, tfm(d, quantization="fp8"), model_config=bf16)
    draft = cfg.draft_model_config
    assert draft.quantization == "fp8" and callable(draft.hf_overrides) and is_tfm_draft_config(draft)
    assert is_patched(weight_utils, "get_quant_config")
    quant = VllmConfig.get_quantization_config(draft, LoadConfig())
    assert isinstance(quant, Fp8Config) and not quant.is_checkpoint_fp8_serialized
    assert callable(draft.hf_overrides)  # the caller's config keeps its callable
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        original(weight_utils, "get_quant_config")(draft, LoadConfig())
    assert not is_tfm_draft_config(env["model_config"])


def test_fp8_draft_lm_head_needs_one_gpu_and_a_16_bit_model(env: Any) -> None:
    """``draft_lm_head: "fp8"`` (runtime/draft_head.py): carried to the workers with the other options, refused in
    one line with tensor parallelism (the copy is not vocabulary-split) and with a float32 model."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_tfm.vllm_plugin.options import get_tfm_options

    d = drafter(env, "fp8head")
    raises(env, tfm(d, draft_lm_head="fp4"), r"draft_lm_head: Input should be 'model' or 'fp8'")
    float32 = EngineArgs(model=str(env["target"]), skip_tokenizer_init=True, dtype="float32").create_model_config()
    raises(env, tfm(d, draft_lm_head="fp8"), r"draft_lm_head='fp8' needs a bfloat16 or float16 model, not float32",
           model_config=float32)
    bf16 = EngineArgs(model=str(env["target"]), skip_tokenizer_init=True, dtype="bfloat16").create_model_config()
    raises(env, tfm(d, draft_lm_head="fp8"), r"draft_lm_head='fp8' runs on one GPU; this engine has "
           r"tensor_parallel_size 2", model_config=bf16, parallel={"tensor_parallel_size": 2})
    cfg = build(env, tfm(d, draft_lm_head="fp8"), model_config=bf16)
    assert get_tfm_options(cfg).draft_lm_head == "fp8"
    assert get_tfm_options(build(env, tfm(d), model_config=bf16)).draft_lm_head == "model"


def test_weaver_weights_reach_the_workers(env: Any) -> None:
    """``weaver_weights`` (models/weaver_step.py): 'model' by default, 'fp8' carried to the workers from the speculative
    config or VLLM_TFM_WEAVER_WEIGHTS, anything else refused in one line."""
    from vllm_tfm.vllm_plugin.options import get_tfm_options

    d = drafter(env, "fp8weaver")
    raises(env, tfm(d, weaver_weights="int8"), r"weaver_weights: Input should be 'model' or 'fp8'")
    assert get_tfm_options(build(env, tfm(d))).weaver_weights == "model"
    assert get_tfm_options(build(env, tfm(d, weaver_weights="fp8"))).weaver_weights == "fp8"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_TFM_WEAVER_WEIGHTS", "fp8")
        assert get_tfm_options(build(env, tfm(d))).weaver_weights == "fp8"


def test_draft_vocab_is_checked_where_the_config_is_built(env: Any) -> None:
    """``draft_vocab`` (runtime/draft_head.py): a file in the drafter directory (or an absolute path) of this
    vocabulary, holding draft_vocab_size and at least top_k ids, on one GPU; every refusal one line."""
    from vllm_tfm.models.draft_vocab import write_draft_vocab
    from vllm_tfm.vllm_plugin.options import get_tfm_options

    d = drafter(env, "dvocab")
    vocab = env["model_config"].get_vocab_size()
    counts = np.arange(vocab, dtype=np.int64)  # id v occurs v times: the ranking is vocab-1, vocab-2, ...
    write_draft_vocab(d / "dv.json", counts, "test", "test")
    write_draft_vocab(env["root"] / "other.json", np.ones(vocab + 1, dtype=np.int64), "test", "test")
    cfg = build(env, tfm(d, draft_vocab="dv.json", draft_vocab_size=4, top_k=4))
    assert (get_tfm_options(cfg).draft_vocab, get_tfm_options(cfg).draft_vocab_size) == ("dv.json", 4)
    assert build(env, tfm(d, draft_vocab=str(d / "dv.json"), top_k=4)).method == "tfm"  # absolute: as it is
    raises(env, tfm(d, draft_vocab_size=4, top_k=4), r"draft_vocab_size needs draft_vocab, the file it counts from")
    raises(env, tfm(d, draft_vocab="dv.json", draft_vocab_size=3, top_k=4),
           r"draft_vocab_size 3 is smaller than top_k 4, the candidates kept per depth")
    raises(env, tfm(d, draft_vocab="dv.json", draft_vocab_size=vocab + 1, top_k=4),
           rf"draft_vocab: draft vocabulary {d / 'dv.json'}: holds {vocab} token ids, cannot take the first {vocab + 1}")
    raises(env, tfm(d, draft_vocab="missing.json", top_k=4), r"draft_vocab: draft vocabulary .*missing.json: no such file")
    raises(env, tfm(d, draft_vocab=str(env["root"] / "other.json"), top_k=4),
           rf"made for a vocabulary of {vocab + 1} tokens, the model has {vocab}")
    raises(env, tfm(d, draft_vocab="dv.json", top_k=4), r"draft_vocab runs on one GPU; this engine has "
           r"tensor_parallel_size 2", parallel={"tensor_parallel_size": 2})
    (d / "five.json").write_text(json.dumps({"format": "vllm-tfm-draft-vocab/1", "vocab_size": vocab,
                                             "token_ids": [4, 3, 2, 1, 0]}))  # a file may rank a part of the vocabulary
    raises(env, tfm(d, draft_vocab="five.json", top_k=8), r"draft_vocab: .*five.json holds 5 token ids, fewer than top_k 8")


def test_engine_and_parallel_refusals(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    d = drafter(env, "engine")
    raises(env, tfm(d), r"does not support pipeline parallelism \(pipeline_parallel_size=2\)", parallel={"pipeline_parallel_size": 2})
    assert build(env, tfm(d), async_scheduling=True).method == "tfm"  # no switch needed (test_async_scheduling.py)
    raises(env, tfm(d), r"does not support prefix caching on a hybrid", enable_prefix_caching=True)
    raises(env, tfm(d), r"needs mamba_cache_mode='none'", mamba_cache_mode="align")
    raises(env, tfm(d, draft_sample_method="probabilistic"), r"draft_sample_method='probabilistic' is not supported")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    raises(env, tfm(d), r"runs on vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER")


def test_target_architectures(env: Any) -> None:
    from vllm.engine.arg_utils import EngineArgs

    d = drafter(env, "arch")
    llama = write_plain_target(env["root"] / "llama", "LlamaForCausalLM", "llama")
    llama_mc = EngineArgs(model=str(llama), skip_tokenizer_init=True).create_model_config()
    msg = raises(env, tfm(d), r"does not support the target architecture 'LlamaForCausalLM'", model_config=llama_mc)
    assert "Qwen3_5ForCausalLM" in msg
    # pure-attention Qwen3 is supported (tree attention alone, no GDN layers)
    qwen3 = write_plain_target(env["root"] / "qwen3", "Qwen3ForCausalLM", "qwen3")
    qwen3_mc = EngineArgs(model=str(qwen3), skip_tokenizer_init=True).create_model_config()
    assert not qwen3_mc.is_hybrid
    assert build(env, tfm(d), model_config=qwen3_mc).method == "tfm"


def test_vision_language_qwen35_with_mrope_is_accepted(env: Any) -> None:
    """Qwen/Qwen3.6-27B's architecture: the VL class (hybrid, multimodal, M-RoPE) takes tfm at
    config time like the text-only class (the runtime's M-RoPE depth positions are GPU-tested)."""
    import json

    from transformers import Qwen3_5Config
    from vllm.engine.arg_utils import EngineArgs

    text = json.loads((env["target"] / "config.json").read_text())
    text.pop("architectures", None)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                               "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": text["hidden_size"]}
    cfg = Qwen3_5Config(text_config=text, vision_config=vision)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    vl = env["root"] / "vl-target"
    cfg.save_pretrained(vl)
    mc = EngineArgs(model=str(vl), skip_tokenizer_init=True).create_model_config()
    assert (mc.architecture, mc.is_hybrid, mc.is_multimodal_model, mc.uses_mrope) == (
        "Qwen3_5ForConditionalGeneration", True, True, True,
    )
    spec = build(env, tfm(drafter(env, "vl-drafter")), model_config=mc)
    assert (spec.method, spec.num_speculative_tokens) == ("tfm", 7)


def test_other_methods_are_untouched(env: Any) -> None:
    """Unknown keys and values stay vLLM's business when the method is not tfm."""
    import pydantic

    d = drafter(env, "other")
    with pytest.raises(pydantic.ValidationError):
        build(env, {"method": "dflash", "model": str(d), "num_speculative_tokens": 3, "proposal": "ddtree"})
    cfg = build(env, {"method": "dflash", "model": str(d), "num_speculative_tokens": 300})
    assert cfg.method == "dflash" and cfg.num_speculative_tokens == 300


# --------------------------------------------------------------------------- requests


def test_request_guard(env: Any) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    d = drafter(env, "requests")
    tfm_cfg = build(env, tfm(d))
    dflash_cfg = build(env, {"method": "dflash", "model": str(d), "num_speculative_tokens": 7})
    mc = env["model_config"]
    cases = {
        "structured output": SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"})),
        "prompt_logprobs": SamplingParams(prompt_logprobs=1),
        "presence_penalty": SamplingParams(presence_penalty=0.5),
        "frequency_penalty": SamplingParams(frequency_penalty=0.5),
        "repetition_penalty": SamplingParams(repetition_penalty=1.2),
        "bad_words": SamplingParams(bad_words=["x"]),
    }
    for feature, params in cases.items():
        with pytest.raises(ValueError, match=f"^{feature} is not supported with speculative method 'tfm'$"):
            params.verify(mc, tfm_cfg, None, None)
        params.verify(mc, dflash_cfg, None, None)  # vLLM's own rules for dflash: accepted
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20, logprobs=2).verify(mc, tfm_cfg, None, None)
    with pytest.raises(ValueError, match="min_p and logit_bias"):  # vLLM's own spec-decode refusal still runs
        SamplingParams(min_p=0.1).verify(mc, tfm_cfg, None, None)


def test_every_vllm_tfm_variable_of_the_project_is_known() -> None:
    """A switch read by the package but missing from NON_OPTION_ENV_VARS would make every tfm
    engine refuse to start while that variable is set."""
    import re

    from vllm_tfm.vllm_plugin.options import ENV_PREFIX, NON_OPTION_ENV_VARS, OPTION_KEYS

    root = Path(__file__).resolve().parents[2]
    used: set[str] = set()
    for folder in ("vllm_tfm", "bench", "examples"):
        for path in (root / folder).rglob("*.py"):
            used |= set(re.findall(r"\bVLLM_TFM_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    options = {ENV_PREFIX + k.upper() for k in OPTION_KEYS}
    assert "VLLM_TFM_FORCE_TREE_PATH" in used and "VLLM_TFM_SKIP_VERSION_CHECK" in used
    assert used - options - NON_OPTION_ENV_VARS == set()


def test_option_resolution_without_vllm_build(tmp_path: Path) -> None:
    """Precedence and defaults of the tree options, straight from the resolver."""
    from vllm_tfm.vllm_plugin.options import resolve_tfm_options

    (tmp_path / "tfm_config.json").write_text(json.dumps({"proposal": "chain", "width": 2, "budget": 40}))
    opts = resolve_tfm_options(tmp_path, {"width": 5}, None, environ={"VLLM_TFM_WIDTH": "3", "VLLM_TFM_TOP_K": "24"})
    assert (opts.proposal, opts.width, opts.top_k, opts.budget) == ("chain", 5, 24, 40)
    with pytest.raises(ValueError, match="environment VLLM_TFM_TOP_K='none': top_k: Input should be a valid integer"):
        resolve_tfm_options(tmp_path, {}, 8, environ={"VLLM_TFM_TOP_K": "none"})
    opts = resolve_tfm_options(tmp_path, {}, 8, environ={"VLLM_TFM_WIDTH": "null", "VLLM_TFM_SKIP_VERSION_CHECK": "1"})
    assert (opts.width, opts.budget) == (None, 8)
    default = resolve_tfm_options(tmp_path / "missing", {}, 3, environ={})
    assert (default.proposal, default.budget, default.width, default.top_k) == ("ddtree", 3, None, 512)
