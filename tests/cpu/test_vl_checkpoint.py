"""bench/vl_checkpoint.py: the zoo target as a Qwen3_5ForConditionalGeneration checkpoint (Qwen3.6-27B's
architecture) and the mamba_ssm_dtype option, checked against transformers and vLLM 0.26."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from _vllm_plugin_env import vllm_cpu_session

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from vl_checkpoint import convert_to_vl, mrope_section, prepare_target

ZOO_TARGET = ROOT / "zoo" / "target"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vl")
    convert_to_vl(ZOO_TARGET, root / "vl")
    convert_to_vl(ZOO_TARGET, root / "vl-ssm", ssm_dtype="float32")
    prepare_target(ZOO_TARGET, root / "text-ssm", vl=False, ssm_dtype="float32")
    return {"root": root, "vl": root / "vl", "vl-ssm": root / "vl-ssm", "text-ssm": root / "text-ssm"}


@pytest.fixture(scope="module")
def vllm(dirs: dict[str, Path]) -> Any:
    with vllm_cpu_session(dirs["root"] / "vllm-cache") as module:
        yield module


def test_mrope_section_splits_the_rotary_half_dimension() -> None:
    assert mrope_section(256, 0.25) == [11, 11, 10]  # Qwen3.5 / Qwen3.6 hub configs
    assert mrope_section(128, 1.0) == [22, 21, 21]
    assert mrope_section(64, 0.25) == [3, 3, 2]  # the zoo: head_dim 64, rotary dim 16
    with pytest.raises(ValueError, match="rotary dimension 4 is too small"):
        mrope_section(16, 0.25)


def test_config_loads_as_qwen35_vl(dirs: dict[str, Path]) -> None:
    from transformers import AutoConfig

    zoo = json.loads((ZOO_TARGET / "config.json").read_text())
    cfg = AutoConfig.from_pretrained(dirs["vl"])
    assert type(cfg).__name__ == "Qwen3_5Config" and cfg.model_type == "qwen3_5"
    assert cfg.architectures == ["Qwen3_5ForConditionalGeneration"]
    text = cfg.text_config
    assert type(text).__name__ == "Qwen3_5TextConfig"
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "head_dim", "linear_num_value_heads",
                "intermediate_size", "tie_word_embeddings"):
        assert getattr(text, key) == zoo[key], key
    rope = text.rope_parameters
    assert rope["mrope_section"] == [3, 3, 2] and rope["mrope_interleaved"] is True
    assert sum(rope["mrope_section"]) == int(zoo["head_dim"] * zoo["partial_rotary_factor"]) // 2
    assert rope["rope_theta"] == zoo["rope_parameters"]["rope_theta"]
    assert cfg.vision_config.model_type == "qwen3_5_vision" and cfg.vision_config.out_hidden_size == zoo["hidden_size"]
    assert cfg.tie_word_embeddings is True
    assert getattr(text, "mamba_ssm_dtype", None) is None
    assert AutoConfig.from_pretrained(dirs["vl-ssm"]).text_config.mamba_ssm_dtype == "float32"
    assert json.loads((dirs["text-ssm"] / "config.json").read_text())["mamba_ssm_dtype"] == "float32"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (dirs["vl"] / name).read_bytes() == (ZOO_TARGET / name).read_bytes(), name


def test_text_weights_are_byte_identical_under_the_hub_names(dirs: dict[str, Path]) -> None:
    import torch
    from safetensors import safe_open

    with safe_open(str(ZOO_TARGET / "model.safetensors"), "pt") as z, safe_open(str(dirs["vl"] / "model.safetensors"), "pt") as v:
        zoo_names, vl_names = set(z.keys()), set(v.keys())
        assert len(zoo_names) == 108
        expected = {"model.language_model." + n.removeprefix("model.") for n in zoo_names}
        assert expected <= vl_names
        assert all(n.startswith("model.visual.") for n in vl_names - expected)
        assert len(vl_names - expected) == 21  # one vision block (12) + patch/pos embeddings (3) + merger (6)
        for n in zoo_names:
            a, b = z.get_tensor(n), v.get_tensor("model.language_model." + n.removeprefix("model."))
            assert a.dtype == b.dtype and a.shape == b.shape, n
            assert a.contiguous().view(-1).view(dtype=torch.uint8).equal(b.contiguous().view(-1).view(dtype=torch.uint8)), n


def test_transformers_loads_every_tensor_and_text_logits_match_the_text_model(dirs: dict[str, Path]) -> None:
    """The VL checkpoint has exactly transformers' tensors, and with M-RoPE on a text prompt (three equal
    position components) its logits are the text-only zoo target's."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    vl, info = Qwen3_5ForConditionalGeneration.from_pretrained(dirs["vl"], dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    text = Qwen3_5ForCausalLM.from_pretrained(ZOO_TARGET, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 300, 42, 1000, 7, 7, 123, 4000, 17, 2]])
    with torch.no_grad():
        a = vl.eval()(input_ids=ids).logits
        b = text(input_ids=ids).logits
    assert a.shape == b.shape == (1, 10, 8192)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), float((a - b).abs().max())
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_vllm_resolves_a_hybrid_multimodal_mrope_target_with_the_checkpoint_ssm_dtype(vllm: Any, dirs: dict[str, Path]) -> None:
    from types import SimpleNamespace

    from safetensors import safe_open
    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    for name, ssm in (("vl", "auto"), ("vl-ssm", "float32"), ("text-ssm", "float32")):
        mc = EngineArgs(model=str(dirs[name]), skip_tokenizer_init=True,
                        limit_mm_per_prompt={"image": 0, "video": 0}).create_model_config()
        if name.startswith("vl"):
            assert (mc.architecture, mc.is_hybrid, mc.is_multimodal_model, mc.uses_mrope) == (
                "Qwen3_5ForConditionalGeneration", True, True, True), name
        else:
            assert (mc.architecture, mc.is_hybrid, mc.uses_mrope) == ("Qwen3_5ForCausalLM", True, False)
        fake = SimpleNamespace(cache_config=CacheConfig(), model_config=mc)
        MODELS_CONFIG_MAP[mc.architecture].verify_and_update_config(fake)  # the hook VllmConfig runs
        assert fake.cache_config.mamba_ssm_cache_dtype == ssm, name

    mapper = Qwen3_5ForConditionalGeneration.hf_to_vllm_mapper  # vLLM's checkpoint -> module names
    with safe_open(str(dirs["vl"] / "model.safetensors"), "pt") as v:
        names = list(v.keys())
    mapped = {n: mapper._map_name(n) for n in names}
    for n, m in mapped.items():
        assert m is not None and m.startswith(("language_model.model.", "language_model.lm_head.", "visual.")), (n, m)
    assert mapped["model.language_model.embed_tokens.weight"] == "language_model.model.embed_tokens.weight"
    assert mapped["model.visual.merger.linear_fc2.weight"] == "visual.merger.linear_fc2.weight"
