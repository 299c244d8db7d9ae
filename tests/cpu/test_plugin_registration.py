"""The vllm-tfm entry point: cheap import, version check, idempotent patches that keep vLLM's
originals and change nothing for other methods, the runtime hook-up, model registration."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from _vllm_plugin_env import vllm_cpu_session, write_qwen35_target

ROOT = Path(__file__).resolve().parents[2]

CONFIG_PATCHES = {
    "vllm.engine.arg_utils.EngineArgs.create_speculative_config",
    "vllm.config.speculative.SpeculativeConfig.use_eagle",
    "vllm.config.speculative.SpeculativeConfig.use_dflash",
    "vllm.config.speculative.SpeculativeConfig.compute_hash",
    "vllm.config.speculative.SpeculativeConfig.max_num_new_slots_for_drafting",
    "vllm.config.speculative.SpeculativeConfig.__post_init__",
    "vllm.config.speculative.SpeculativeConfig.method[Literal]",
    "vllm.sampling_params.SamplingParams._validate_spec_decode",
    "vllm.config.vllm.EagleModelTypes",
    "vllm.config.vllm.VllmConfig.__post_init__",
    "vllm ModelRegistry[Qwen3_5ForCausalLM]",
    "vllm ModelRegistry[Qwen3_5MoeForCausalLM]",
}
"""What register() patches besides the runtime package (which registers its own patches)."""


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with vllm_cpu_session(tmp_path_factory.mktemp("vllm-cache")) as module:
        yield module


def test_import_is_cheap() -> None:
    code = "import sys, vllm_tfm; print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_entry_point_names_register() -> None:
    import importlib
    from importlib.metadata import entry_points

    import vllm_tfm

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert declared == {"tfm": "vllm_tfm:register"}
    module, _, attr = declared["tfm"].partition(":")
    assert getattr(importlib.import_module(module), attr) is vllm_tfm.register
    installed = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "tfm"]
    for ep in installed:  # present when the package is installed (CI: pip install -e .)
        assert ep.load() is vllm_tfm.register


def test_version_check(vllm: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from vllm_tfm.vllm_plugin import plugin
    from vllm_tfm.vllm_plugin.version import check_vllm_version

    real = vllm.__version__
    assert check_vllm_version() == real
    monkeypatch.delenv("VLLM_TFM_SKIP_VERSION_CHECK", raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.27.1")
    with pytest.raises(RuntimeError) as info:
        check_vllm_version()
    assert str(info.value) == (
        "vllm-tfm supports vLLM 0.26.x only, but vLLM 0.27.1 is installed "
        "(install vllm==0.26.*, or set VLLM_TFM_SKIP_VERSION_CHECK=1 to try anyway)"
    )
    # register() refuses before it patches anything
    plugin._forget_registration()
    try:
        with pytest.raises(RuntimeError, match="vLLM 0.27.1 is installed"):
            plugin.register()
        assert not plugin.is_registered()
        monkeypatch.setenv("VLLM_TFM_SKIP_VERSION_CHECK", "1")
        with caplog.at_level("WARNING", logger="vllm_tfm"):
            assert check_vllm_version() == "0.27.1"
        assert "vLLM 0.27.1 is installed; continuing because VLLM_TFM_SKIP_VERSION_CHECK is set" in caplog.text
    finally:
        monkeypatch.setattr(vllm, "__version__", real)
        plugin.register()
    assert plugin.is_registered()


def test_register_is_idempotent_and_keeps_originals(vllm: Any) -> None:
    import vllm_tfm
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm_tfm.vllm_plugin import patching

    before = patching.installed_patches()
    assert CONFIG_PATCHES <= set(before)
    vllm_tfm.register()
    vllm_tfm.register()
    after = patching.installed_patches()
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    for owner, name in (
        (SpeculativeConfig, "use_eagle"),
        (SpeculativeConfig, "use_dflash"),
        (SpeculativeConfig, "compute_hash"),
        (SpeculativeConfig, "__post_init__"),
        (EngineArgs, "create_speculative_config"),
        (SamplingParams, "_validate_spec_decode"),
    ):
        patched = getattr(owner, name)
        assert patched.__wrapped__ is patching.original(owner, name)
        assert patched is not patching.original(owner, name)


def test_predicates_fall_through_for_every_other_method(vllm: Any) -> None:
    from vllm.config import SpeculativeConfig
    from vllm_tfm.vllm_plugin import patching
    from vllm_tfm.vllm_plugin.config_patch import _literal_values

    methods = _literal_values(SpeculativeConfig.__dataclass_fields__["method"].type)
    assert "tfm" in methods and "dflash" in methods and len(methods) > 20
    for name in ("use_eagle", "use_dflash"):
        patched, orig = getattr(SpeculativeConfig, name), patching.original(SpeculativeConfig, name)
        for method in methods:
            cfg = SimpleNamespace(method=method)
            assert patched(cfg) is (True if method == "tfm" else orig(cfg)), (name, method)
        assert orig(SimpleNamespace(method="tfm")) is False  # vLLM alone does not know tfm
    tfm = SimpleNamespace(method="tfm")
    for name in ("use_dspark", "uses_draft_model", "uses_extract_hidden_states", "use_ngram_gpu"):
        assert getattr(SpeculativeConfig, name)(tfm) is False, name
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert ngram.compute_hash() == patching.original(SpeculativeConfig, "compute_hash")(ngram)


def test_without_the_plugin_vllm_refuses_tfm(vllm: Any) -> None:
    import pydantic
    from vllm import ModelRegistry
    from vllm.config import SpeculativeConfig
    from vllm_tfm.vllm_plugin import patching, plugin

    originals = {n: patching.original(SpeculativeConfig, n) for n in ("use_eagle", "use_dflash", "compute_hash")}
    try:
        # undo the config-side patches (the runtime's stay: this test is about config acceptance)
        restored = patching.restore(CONFIG_PATCHES)
        plugin._forget_registration()
        assert set(restored) == CONFIG_PATCHES
        assert not CONFIG_PATCHES & set(patching.installed_patches())
        for name, fn in originals.items():
            assert getattr(SpeculativeConfig, name) is fn
        assert "Qwen3_5ForCausalLM" not in ModelRegistry.models
        with pytest.raises(pydantic.ValidationError, match="method"):
            SpeculativeConfig(method="tfm", num_speculative_tokens=3)
    finally:
        plugin.register()
    assert SpeculativeConfig.use_eagle is not originals["use_eagle"]
    with pytest.raises(ValueError, match="method 'tfm' needs 'model', the drafter directory"):
        SpeculativeConfig(method="tfm", num_speculative_tokens=3)


def test_runtime_install(vllm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_tfm.vllm_plugin.plugin import install_runtime

    (tmp_path / "tfm_rt_ok").mkdir()
    (tmp_path / "tfm_rt_ok" / "__init__.py").write_text("calls = []\ndef install():\n    calls.append(1)\n")
    (tmp_path / "tfm_rt_broken").mkdir()
    (tmp_path / "tfm_rt_broken" / "__init__.py").write_text("import tfm_no_such_dependency\n")
    (tmp_path / "tfm_rt_no_install").mkdir()
    (tmp_path / "tfm_rt_no_install" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))

    assert install_runtime("tfm_rt_missing") is False
    assert install_runtime("tfm_rt_ok") is True
    assert sys.modules["tfm_rt_ok"].calls == [1]
    with pytest.raises(ModuleNotFoundError, match="tfm_no_such_dependency"):
        install_runtime("tfm_rt_broken")
    with pytest.raises(RuntimeError, match="tfm_rt_no_install exists but has no install"):
        install_runtime("tfm_rt_no_install")


def test_text_only_qwen35_is_registered_hybrid(vllm: Any, tmp_path: Path) -> None:
    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.interfaces import is_hybrid
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    entry = ModelRegistry.models["Qwen3_5ForCausalLM"]
    assert (entry.module_name, entry.class_name) == ("vllm_tfm.vllm_plugin.qwen3_5_text", "Qwen3_5TextForCausalLM")
    moe = ModelRegistry.models["Qwen3_5MoeForCausalLM"]
    assert (moe.module_name, moe.class_name) == ("vllm_tfm.vllm_plugin.qwen3_5_text", "Qwen3_5MoeTextForCausalLM")
    vl = ModelRegistry.models["Qwen3_5ForConditionalGeneration"]
    assert (vl.module_name, vl.class_name) == ("vllm.model_executor.models.qwen3_5", "Qwen3_5ForConditionalGeneration")

    mc = EngineArgs(model=str(write_qwen35_target(tmp_path / "t")), skip_tokenizer_init=True).create_model_config()
    assert mc.architecture == "Qwen3_5ForCausalLM"
    assert mc.is_hybrid
    info, arch = ModelRegistry.inspect_model_cls(["Qwen3_5ForCausalLM"], mc)
    assert (info.architecture, arch, info.is_hybrid, info.supports_multimodal) == (
        "Qwen3_5TextForCausalLM",
        "Qwen3_5ForCausalLM",
        True,
        False,
    )
    cls, _ = ModelRegistry.resolve_model_cls(["Qwen3_5ForCausalLM"], mc)
    assert cls.__name__ == "Qwen3_5TextForCausalLM" and issubclass(cls, Qwen3_5ForCausalLM) and is_hybrid(cls)
    for hook in ("get_mamba_state_dtype_from_config", "get_mamba_state_shape_from_config", "get_mamba_state_copy_func"):
        assert getattr(cls, hook).__func__ is getattr(Qwen3_5ForConditionalGeneration, hook).__func__
        assert getattr(cls, hook).__self__ is cls


def test_text_only_qwen35_takes_the_checkpoint_ssm_dtype(vllm: Any, tmp_path: Path) -> None:
    """vLLM applies a Qwen3.5 checkpoint's ``mamba_ssm_dtype`` through a config hook keyed by
    architecture name; the plugin gives the text-only names the VL classes' hook, so a text-only
    checkpoint asking for a float32 GDN state gets one (as the same weights under the VL class)."""
    import json
    from types import SimpleNamespace

    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from vllm_tfm.vllm_plugin.models_registry import register_config_hooks

    target = write_qwen35_target(tmp_path / "t")
    cfg = json.loads((target / "config.json").read_text())
    cfg["mamba_ssm_dtype"] = "float32"
    (target / "config.json").write_text(json.dumps(cfg))
    mc = EngineArgs(model=str(target), skip_tokenizer_init=True).create_model_config()
    assert mc.architecture == "Qwen3_5ForCausalLM"
    hook = MODELS_CONFIG_MAP.get(mc.architecture)  # the lookup VllmConfig does
    assert hook is MODELS_CONFIG_MAP["Qwen3_5ForConditionalGeneration"]
    assert MODELS_CONFIG_MAP["Qwen3_5MoeForCausalLM"] is MODELS_CONFIG_MAP["Qwen3_5MoeForConditionalGeneration"]
    fake = SimpleNamespace(cache_config=CacheConfig(), model_config=mc)
    assert fake.cache_config.mamba_ssm_cache_dtype == "auto"
    hook.verify_and_update_config(fake)
    assert fake.cache_config.mamba_ssm_cache_dtype == "float32"
    assert register_config_hooks() == []  # idempotent
