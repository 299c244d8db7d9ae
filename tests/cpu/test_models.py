"""vllm_tfm.models: DFlash (z-lab layout, vLLM 0.26 weight names), Weaver, TreeFlash, save/load."""

from __future__ import annotations

import json
import math
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from _models import randomize

from vllm_tfm.models import (
    DFlashConfig,
    DFlashDrafter,
    TfmConfig,
    TreeFlashApproximator,
    TreeFlashConfig,
    TreeFlashTransitionScorer,
    Weaver,
    WeaverConfig,
    load_drafter_dir,
    marginal_logits,
    weaver_param_count,
)

F64 = torch.float64
V, H = 64, 32  # tiny target: vocab, hidden


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_dflash_config(causal: bool | None = None, attention_bias: bool = False) -> DFlashConfig:
    return DFlashConfig.create(
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=V,
        target_layer_ids=[0, 2],
        mask_token_id=V - 1,
        block_size=5,
        num_target_layers=4,
        attention_bias=attention_bias,
        causal=causal,
        rope_theta=10000.0,
        max_position_embeddings=256,
    )


def tiny_target(seed: int = 1) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(V, H).double()
    head = torch.nn.Linear(H, V, bias=False).double()
    with torch.no_grad():
        embed.weight.copy_(torch.randn(V, H, generator=g, dtype=F64))
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=F64) * 0.5)
    return embed, head


def dflash_inputs(d: DFlashDrafter, n_ctx: int = 6, bonus: int = 5, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    th = torch.randn(n_ctx, d.config.fc_in_features, generator=g, dtype=F64)
    ctx_pos = torch.arange(n_ctx)
    blk = d.block_tokens(torch.tensor([bonus]))[0]
    blk_pos = torch.arange(n_ctx, n_ctx + d.config.block_size)
    return th, ctx_pos, blk, blk_pos


# --------------------------------------------------------------------------- configs

# Written by hand after the public z-lab Qwen3 DFlash configs (Qwen3-8B target, block 16).
ZLAB_QWEN3_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.3",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# The Qwen3.5 generation style: rope_parameters, block size inside dflash_config, a sliding
# window declared but inactive (6 layers < max_window_layers 28 in Qwen3Config semantics).
ZLAB_QWEN35_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "dtype": "bfloat16",
    "hidden_size": 3072,
    "num_hidden_layers": 6,
    "vocab_size": 248320,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9216,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000},
    "max_position_embeddings": 262144,
    "use_sliding_window": True,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "dflash_config": {"block_size": 16, "mask_token_id": 248077, "target_layer_ids": [1, 7, 14, 20, 26, 32, 39, 45]},
}


def test_zlab_qwen3_config_parses_and_builds_the_checkpoint_shapes():
    cfg = DFlashConfig.from_dict(ZLAB_QWEN3_CONFIG)
    assert (cfg.block_size, cfg.max_depth, cfg.mask_token_id) == (16, 15, 151669)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert (cfg.rope_theta, cfg.causal, cfg.head_dim, cfg.num_key_value_heads) == (1e6, False, 128, 8)
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["fc.weight"] == (4096, 5 * 4096)
    assert shapes["layers.4.self_attn.k_proj.weight"] == (8 * 128, 4096)
    assert shapes["layers.4.self_attn.q_norm.weight"] == (128,)
    assert shapes["layers.0.mlp.gate_proj.weight"] == (12288, 4096)
    assert not any("embed" in k or "lm_head" in k for k in shapes)
    assert len(shapes) == 3 + 5 * 11
    cfg.validate_against_target({"vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 36})


def test_zlab_qwen35_config_parses_and_fits_a_multimodal_target_config():
    cfg = DFlashConfig.from_dict(ZLAB_QWEN35_CONFIG)
    assert (cfg.block_size, cfg.rope_theta, cfg.fc_in_features) == (16, 1e7, 8 * 3072)
    target = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": {"vocab_size": 248320, "hidden_size": 3072, "num_hidden_layers": 48},
    }
    cfg.validate_against_target(target)
    with pytest.raises(
        ValueError, match=r"^DFlash dflash_config.target_layer_ids taps layer 45 but the target has 40 layers$"
    ):
        cfg.validate_against_target({"vocab_size": 248320, "hidden_size": 3072, "num_hidden_layers": 40})


@pytest.mark.parametrize(
    "patch, message",
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}},
            "only default RoPE is supported, got rope_type 'yarn'",
        ),
        ({"dflash_config": {"target_layer_ids": [1]}}, "missing dflash_config.mask_token_id"),
        (
            {"layer_types": ["full_attention"] * 5 + ["sliding_attention"]},
            "layer 5 is 'sliding_attention'; only full-attention DFlash layers are supported",
        ),
        ({"block_size": 8}, "block_size 8 disagrees with dflash_config.block_size 16"),
        (
            {"architectures": ["Qwen3ForCausalLM"]},
            "architectures must contain 'DFlashDraftModel', got ['Qwen3ForCausalLM']",
        ),
        ({"hidden_act": "gelu"}, "hidden_act must be 'silu', got 'gelu'"),
    ],
)
def test_bad_dflash_configs_are_refused_in_one_line(patch, message):
    raw = {**ZLAB_QWEN35_CONFIG, **patch}
    with pytest.raises(ValueError) as e:
        DFlashConfig.from_dict(raw, "cfg.json")
    assert str(e.value) == f"cfg.json: {message}"


def test_tfm_config_defaults_roundtrip_and_refusals(tmp_path):
    cfg = TfmConfig(weaver=WeaverConfig(d_model=5120))
    assert (cfg.proposal, cfg.top_k, cfg.budget, cfg.children_per_node, cfg.sampling) == (
        "tfm",
        512,
        64,
        8,
        "target_only",
    )
    assert (cfg.weaver.d_rank, cfg.weaver.n_layers, cfg.weaver.d_mlp, cfg.weaver.head_dim) == (1024, 3, 3072, 128)
    cfg.save(tmp_path)
    assert TfmConfig.load(tmp_path) == cfg
    with pytest.raises(ValueError, match=r"^tfm_config.json: top_kk: Extra inputs are not permitted$"):
        TfmConfig.from_dict({"proposal": "chain", "top_kk": 3})
    with pytest.raises(ValueError, match=r"^tfm_config.json: <root>: proposal 'tfm' needs a 'weaver' section$"):
        TfmConfig.from_dict({"proposal": "tfm"})
    with pytest.raises(ValueError, match=r"^tfm_config.json: sampling: "):
        TfmConfig.from_dict({"proposal": "chain", "sampling": "greedy"})


# --------------------------------------------------------------------------- DFlash


def test_dflash_is_non_causal_within_the_block():
    d = randomize(DFlashDrafter(tiny_dflash_config()), seed=3)
    embed, _ = tiny_target()
    th, cp, blk, bp = dflash_inputs(d)
    out = d(th, cp, blk, bp, embed)
    blk2 = blk.clone()
    blk2[3] = 7  # a later block slot
    out2 = d(th, cp, blk2, bp, embed)
    assert (out2[0] - out[0]).abs().max() > 1e-3  # slot 0 sees slot 3
    th2 = th.clone()
    th2[2] += 1.0  # one context token
    assert (d(th2, cp, blk, bp, embed)[0] - out[0]).abs().max() > 1e-3


def test_dflash_causal_flag_hides_later_block_slots():
    d = randomize(DFlashDrafter(tiny_dflash_config(causal=True)), seed=3)
    assert d.config.causal
    embed, _ = tiny_target()
    th, cp, blk, bp = dflash_inputs(d)
    out = d(th, cp, blk, bp, embed)
    blk2 = blk.clone()
    blk2[3] = 7
    out2 = d(th, cp, blk2, bp, embed)
    assert torch.equal(out2[:3], out[:3])
    assert (out2[3] - out[3]).abs().max() > 1e-3


def _hf_reference_dflash(d: DFlashDrafter, th, cp, blk, bp, embed) -> torch.Tensor:
    """The z-lab formula written with Hugging Face Qwen3 primitives (RMSNorm, rotary embedding,
    rotate_half): keys/values = [k_proj(ctx) ; k_proj(block)], queries = block, no mask."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

    c = d.config
    hf = Qwen3Config(**{k: v for k, v in c.raw.items() if k not in ("architectures", "dtype")})

    def norm(w, x):
        n = Qwen3RMSNorm(w.shape[0], eps=c.rms_norm_eps).double()
        n.weight.data.copy_(w)
        return n(x)

    rot = Qwen3RotaryEmbedding(hf).double()
    pos = torch.cat([cp, bp])[None]
    cos, sin = rot(torch.zeros(1, dtype=F64), pos)
    cos, sin = cos[0].double()[:, None, :], sin[0].double()[:, None, :]  # [S, 1, D]
    sd = d.state_dict()
    ctx = norm(sd["hidden_norm.weight"], th @ sd["fc.weight"].T)
    x = embed(blk)
    g, nh, nkv, hd = len(blk), c.num_attention_heads, c.num_key_value_heads, c.head_dim
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        h = norm(sd[p + "input_layernorm.weight"], x)
        q = norm(sd[p + "self_attn.q_norm.weight"], (h @ sd[p + "self_attn.q_proj.weight"].T).view(g, nh, hd))
        kin = torch.cat([ctx, h])
        k = norm(sd[p + "self_attn.k_norm.weight"], (kin @ sd[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd))
        v = (kin @ sd[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q = q * cos[-g:] + rotate_half(q) * sin[-g:]
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd), dim=-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(g, nh * hd)
        x = x + o @ sd[p + "self_attn.o_proj.weight"].T
        h = norm(sd[p + "post_attention_layernorm.weight"], x)
        mlp = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ sd[p + "mlp.down_proj.weight"].T
    return norm(sd["norm.weight"], x)


def test_dflash_matches_the_zlab_formula_with_hf_qwen3_primitives():
    d = randomize(DFlashDrafter(tiny_dflash_config()), seed=4)
    embed, _ = tiny_target()
    th, cp, blk, bp = dflash_inputs(d, n_ctx=7)
    ref = _hf_reference_dflash(d, th, cp, blk, bp, embed)
    # HF computes cos/sin in float32 even for float64 models (ours: float64), hence 1e-5; a wrong
    # position, rotation layout, norm or mask changes the output by O(0.1)
    torch.testing.assert_close(d(th, cp, blk, bp, embed), ref, rtol=0, atol=1e-5)


def test_dflash_ragged_batch_and_cached_context_equal_single_requests():
    d = randomize(DFlashDrafter(tiny_dflash_config()), seed=5)
    embed, _ = tiny_target()
    a = dflash_inputs(d, n_ctx=4, bonus=3, seed=10)
    b = dflash_inputs(d, n_ctx=7, bonus=9, seed=11)
    with torch.no_grad():
        batch = d.forward_batch(
            torch.cat([a[0], b[0]]),
            torch.cat([a[1], b[1]]),
            torch.tensor([0, 4, 11]),
            torch.stack([a[2], b[2]]),
            torch.stack([a[3], b[3]]),
            embed,
        )
        torch.testing.assert_close(batch[0], d(*a, embed), rtol=0, atol=1e-12)
        torch.testing.assert_close(batch[1], d(*b, embed), rtol=0, atol=1e-12)
        # context K/V computed in two pieces (as a decoder caches it) equals one piece
        th, cp, blk, bp = b
        kv1, kv2 = d.context_kv(th[:3], cp[:3]), d.context_kv(th[3:], cp[3:])
        kv = [(torch.cat([k1, k2]), torch.cat([v1, v2])) for (k1, v1), (k2, v2) in zip(kv1, kv2, strict=True)]
        pre = d.forward_batch_prenorm(kv, torch.tensor([0, 7]), blk[None], bp[None], embed)[0]
        torch.testing.assert_close(d.norm(pre), batch[1], rtol=0, atol=1e-12)


def test_marginal_logits_are_lm_head_of_slots_1_to_gamma_minus_1():
    d = randomize(DFlashDrafter(tiny_dflash_config()), seed=6)
    embed, head = tiny_target()
    out = d(*dflash_inputs(d), embed)
    logits = marginal_logits(out, head)
    assert logits.shape == (d.config.block_size - 1, V)
    torch.testing.assert_close(logits, out[1:] @ head.weight.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(marginal_logits(out, head.weight), logits, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- vLLM names

STACKED = {
    ".q_proj": ".qkv_proj",
    ".k_proj": ".qkv_proj",
    ".v_proj": ".qkv_proj",
    ".gate_proj": ".gate_up_proj",
    ".up_proj": ".gate_up_proj",
}


def vllm_name(key: str) -> str:
    """Where vLLM's DFlashQwen3ForCausalLM puts a checkpoint tensor: ``model.`` prefix, q/k/v
    stacked into qkv_proj and gate/up into gate_up_proj (its hf_to_vllm_mapper)."""
    for a, b in STACKED.items():
        if a in key:
            return "model." + key.replace(a, b)
    return "model." + key


def test_saved_dflash_weights_load_through_vllm_qwen3_dflash(tmp_path, monkeypatch):
    """Our model.safetensors goes through vLLM 0.26's real DFlashQwen3ForCausalLM.load_weights.

    The vLLM module is built on CPU with its attention layer replaced by a parameter-free stub
    (vLLM cannot pick an attention backend without a GPU platform; that layer holds no weights).
    Every vLLM parameter except the ones shared from the target (embed_tokens, lm_head) and the
    optional mask_embedding must receive our tensors, stacked as vLLM stacks them.
    """
    pytest.importorskip("vllm")
    import vllm.model_executor.models.qwen3_dflash as vq
    from transformers import AutoConfig
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    class NoWeightAttention(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    monkeypatch.setattr(vq, "Attention", NoWeightAttention)
    if torch.distributed.is_initialized():
        pytest.skip("a torch.distributed group already exists in this process")
    vc = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shared = {"model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding"}
    with set_current_vllm_config(vc):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        try:
            initialize_model_parallel(1, 1)
            for bias in (False, True):
                ours = randomize(DFlashDrafter(tiny_dflash_config(attention_bias=bias)), seed=7).float()
                out_dir = tmp_path / f"bias{bias}"
                ours.save_pretrained(out_dir)
                hf = AutoConfig.from_pretrained(out_dir)  # how vLLM reads config.json
                draft = SimpleNamespace(
                    hf_config=hf, model=str(out_dir), revision=None, quantization=None, dtype=torch.float32
                )
                target = SimpleNamespace(
                    dtype=torch.float32,
                    head_dtype=torch.float32,
                    quantization=None,
                    is_moe=False,
                    is_mm_prefix_lm=False,
                    get_num_layers=lambda _p: 4,
                    get_vocab_size=lambda: V,
                )
                object.__setattr__(vc, "speculative_config", SimpleNamespace(draft_model_config=draft))
                object.__setattr__(vc, "model_config", target)
                vm = vq.DFlashQwen3ForCausalLM(vllm_config=vc)
                monkeypatch.setattr(vm, "_read_mask_embedding", lambda: None)
                with torch.no_grad():
                    for p in vm.parameters():
                        p.fill_(float("nan"))
                saved = load_file(str(out_dir / "model.safetensors"))
                vm.load_weights(list(saved.items()))
                got = dict(vm.named_parameters())
                assert set(got) - shared == {vllm_name(k) for k in saved}
                for k, t in saved.items():
                    if any(s in k for s in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                        continue
                    assert torch.equal(got["model." + k], t), k
                for i in range(2):
                    p = f"layers.{i}."
                    for suffix in ("weight", "bias") if bias else ("weight",):
                        qkv = torch.cat([saved[p + f"self_attn.{n}_proj.{suffix}"] for n in "qkv"])
                        assert torch.equal(got[f"model.{p}self_attn.qkv_proj.{suffix}"], qkv)
                    gate_up = torch.cat([saved[p + "mlp.gate_proj.weight"], saved[p + "mlp.up_proj.weight"]])
                    assert torch.equal(got[f"model.{p}mlp.gate_up_proj.weight"], gate_up)
                assert all(not got[n].isnan().any() for n in set(got) - shared)
                # no embed_tokens / lm_head in the file: vLLM shares the target's
                assert vm.has_own_lm_head is False and vm.has_own_embed_tokens is False
                with pytest.raises(
                    ValueError, match="There is no module or parameter named 'layers.0.self_attn.extra'"
                ):
                    vm.load_weights([("layers.0.self_attn.extra.weight", torch.zeros(1))])
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


# --------------------------------------------------------------------------- save / load


def tiny_weaver_config(**kw) -> WeaverConfig:
    return WeaverConfig(**{"d_model": H, "d_rank": 16, "n_layers": 2, "n_heads": 2, "d_mlp": 24, "max_depth": 4, **kw})


def test_drafter_dir_roundtrip_gives_equal_outputs(tmp_path):
    d = randomize(DFlashDrafter(tiny_dflash_config()), seed=8)
    w = randomize(Weaver(tiny_weaver_config()), seed=9)
    t = randomize(TreeFlashApproximator(TreeFlashConfig(hidden_size=H, intermediate_size=20)), seed=10)
    d.save_pretrained(tmp_path)
    w.save_pretrained(tmp_path)
    t.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == [0, 2]
    assert cfg["dtype"] == "float64"
    tfm = json.loads((tmp_path / "tfm_config.json").read_text())
    assert tfm["weaver"]["d_rank"] == 16 and tfm["treeflash"]["intermediate_size"] == 20
    target = {"vocab_size": V, "hidden_size": H, "num_hidden_layers": 4}
    b = load_drafter_dir(tmp_path, target_config=target)
    for a, c in ((d, b.dflash), (w, b.weaver), (t, b.treeflash)):
        sa, sc = a.state_dict(), c.state_dict()
        assert sa.keys() == sc.keys() and all(torch.equal(sa[k], sc[k]) for k in sa)
    embed, head = tiny_target()
    x = dflash_inputs(d)
    torch.testing.assert_close(b.dflash(*x, embed), d(*x, embed), rtol=0, atol=1e-12)
    vh, dh = torch.randn(H, dtype=F64), torch.randn(4, H, dtype=F64)
    path = torch.tensor([[3, 8, 1]])
    cand = torch.randint(0, V, (1, 4, 6))
    cl = torch.randn(1, 4, 6, dtype=F64)
    torch.testing.assert_close(
        b.weaver.score_paths(vh[None], dh[None], path, embed, head, cand, cl),
        w.score_paths(vh[None], dh[None], path, embed, head, cand, cl),
        rtol=0,
        atol=1e-12,
    )
    e, h = torch.randn(3, H, dtype=F64), torch.randn(3, H, dtype=F64)
    torch.testing.assert_close(b.treeflash(e, h, d.norm), t(e, h, d.norm), rtol=0, atol=1e-12)


def _saved_dflash(tmp_path) -> DFlashDrafter:
    d = DFlashDrafter(tiny_dflash_config())
    d.save_pretrained(tmp_path)
    return d


def test_missing_config_json(tmp_path):
    _saved_dflash(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match=rf"^{tmp_path}: missing config.json$"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_missing_weights_file(tmp_path):
    _saved_dflash(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=rf"^{tmp_path}: missing weights file model.safetensors$"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_wrong_tensor_shape_names_the_tensor_and_both_shapes(tmp_path):
    _saved_dflash(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        DFlashDrafter.from_pretrained(tmp_path)
    assert (
        str(e.value) == f"{tmp_path / 'model.safetensors'}: tensor 'layers.0.mlp.down_proj.weight' has shape (32, 48), "
        "expected (32, 40)"
    )


def test_unknown_and_missing_tensors(tmp_path):
    _saved_dflash(tmp_path)
    f = tmp_path / "model.safetensors"
    state = load_file(str(f))
    save_file({**state, "lm_head.weight": torch.zeros(V, H)}, str(f))
    with pytest.raises(ValueError, match=r"unknown tensor 'lm_head.weight'$"):
        DFlashDrafter.from_pretrained(tmp_path)
    del state["norm.weight"]
    save_file(state, str(f))
    with pytest.raises(ValueError, match=r"model.safetensors: missing tensor 'norm.weight'$"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_vocab_and_width_mismatch_with_the_target(tmp_path):
    _saved_dflash(tmp_path)
    Weaver(tiny_weaver_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^DFlash drafter vocab_size 64 does not match the target's vocab_size 72$"):
        DFlashDrafter.from_pretrained(
            tmp_path, target_config={"vocab_size": 72, "hidden_size": H, "num_hidden_layers": 4}
        )
    with pytest.raises(ValueError, match=r"^DFlash drafter vocab_size 64 does not match the target's vocab_size 72$"):
        load_drafter_dir(tmp_path, target_config=SimpleNamespace(vocab_size=72, hidden_size=H, num_hidden_layers=4))
    wide = {"vocab_size": V, "hidden_size": 48, "num_hidden_layers": 4}
    with pytest.raises(ValueError, match=r"^Weaver d_model 32 does not match the target's hidden_size 48$"):
        Weaver.from_pretrained(tmp_path, target_config=wide)


def test_tfm_dir_errors(tmp_path):
    _saved_dflash(tmp_path)
    TfmConfig(proposal="chain").save(tmp_path)
    with pytest.raises(ValueError, match=r"tfm_config.json: no 'weaver' section$"):
        Weaver.from_pretrained(tmp_path)
    Weaver(tiny_weaver_config()).save_pretrained(tmp_path)
    (tmp_path / "tfm" / "weaver.safetensors").unlink()
    with pytest.raises(ValueError, match=rf"^{tmp_path}: missing weights file tfm/weaver.safetensors$"):
        load_drafter_dir(tmp_path)


# --------------------------------------------------------------------------- Weaver


def test_weaver_param_count_formula_and_27b_size():
    cfg = tiny_weaver_config()
    assert weaver_param_count(cfg) == sum(p.numel() for p in Weaver(cfg).parameters())
    # Qwen3.6-27B width, by hand: 3 projections 5120x1024, 2 norms (w+b) of 5120 + out_norm of 1024,
    # per layer qkv 3*1024^2 + o 1024^2 + gate_up 2*3072*1024 + down 3072*1024 + 2 norms (w+b) of 1024
    per_layer = 3 * 1024**2 + 1024**2 + 3 * 3072 * 1024 + 4 * 1024
    assert (
        weaver_param_count(WeaverConfig(d_model=5120))
        == 3 * 5120 * 1024 + 4 * 5120 + 2 * 1024 + 3 * per_layer
        == 56_657_920
    )


def weaver_problem(seed: int = 12, depth: int = 4, k: int = 6):
    g = torch.Generator().manual_seed(seed)
    w = randomize(Weaver(tiny_weaver_config()), seed=seed)
    embed, head = tiny_target(seed + 1)
    vh = torch.randn(H, generator=g, dtype=F64)
    dh = torch.randn(depth, H, generator=g, dtype=F64)
    cand = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(depth)])
    cl = torch.randn(depth, k, generator=g, dtype=F64) * 2
    return w, embed, head, vh, dh, cand, cl


def call(scorer, ids, parents, tokens, depths):
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return scorer(t(ids), t(parents), t(tokens), t(depths))


def test_weaver_scores_are_log_probs_and_match_full_recomputation():
    w, embed, head, vh, dh, cand, cl = weaver_problem()
    s = w.tree_scorer(vh, dh, cand, cl, embed, head)
    # tree: 0 -> {1, 2}; 1 -> {3}; 3 -> {4}; 2 -> {5}; node 4 is passed with its parent 3
    rows = {}
    out = call(s, [0], [-1], [11], [0])
    rows[0] = out[0]
    out = call(s, [1, 2], [0, 0], [20, 21], [1, 1])
    rows.update({1: out[0], 2: out[1]})
    out = call(s, [3, 5, 4], [1, 2, 3], [30, 31, 40], [2, 2, 3])
    rows.update({3: out[0], 5: out[1], 4: out[2]})
    for r in rows.values():
        assert r.shape == (6,) and r.dtype == F64
        torch.testing.assert_close(r.exp().sum(), torch.tensor(1.0, dtype=F64), rtol=0, atol=1e-12)
    paths = {0: [11], 1: [11, 20], 2: [11, 21], 3: [11, 20, 30], 5: [11, 21, 31], 4: [11, 20, 30, 40]}
    for node, toks in paths.items():
        full = w.score_paths(vh[None], dh[None], torch.tensor([toks]), embed, head, cand[None], cl[None])[0, -1]
        torch.testing.assert_close(rows[node], full, rtol=0, atol=1e-10)
    # at zero residual weights the scores are the DFlash candidate log-softmax
    with torch.no_grad():
        w.lm_head_query_in.weight.zero_()
    z = w.tree_scorer(vh, dh, cand, cl, embed, head)
    torch.testing.assert_close(call(z, [0], [-1], [11], [0])[0], torch.log_softmax(cl[0], -1), rtol=0, atol=1e-14)


def test_weaver_node_depends_on_its_ancestors_only():
    w, embed, head, vh, dh, cand, cl = weaver_problem(seed=13)

    def node3(sibling_token: int, parent_token: int) -> torch.Tensor:
        s = w.tree_scorer(vh, dh, cand, cl, embed, head)
        call(s, [0], [-1], [5], [0])
        call(s, [1, 2], [0, 0], [parent_token, sibling_token], [1, 1])
        return call(s, [3, 4], [1, 2], [9, 10], [2, 2])[0]  # node 3 under 1; node 4 under its sibling 2

    base = node3(sibling_token=17, parent_token=23)
    torch.testing.assert_close(node3(sibling_token=44, parent_token=23), base, rtol=0, atol=1e-13)
    assert (node3(sibling_token=17, parent_token=24) - base).abs().max() > 1e-4


def test_weaver_scorer_refuses_bad_calls():
    w, embed, head, vh, dh, cand, cl = weaver_problem()
    s = w.tree_scorer(vh, dh, cand, cl, embed, head)
    with pytest.raises(
        ValueError, match=r"^the root \(parent -1, depth 0\) must be scored first, got node 1 with parent 0$"
    ):
        call(s, [1], [0], [3], [1])
    call(s, [0], [-1], [3], [0])
    with pytest.raises(ValueError, match=r"^node 2 has parent 7, which has not been scored$"):
        call(s, [1, 2], [0, 7], [3, 4], [1, 1])
    assert s.num_nodes == 1  # a refused call leaves the scorer unchanged
    with pytest.raises(ValueError, match=r"^node 1 has depth 2, its parent 0 has depth 0$"):
        call(s, [1], [0], [3], [2])
    call(s, [1], [0], [3], [1])
    call(s, [2], [1], [3], [2])
    call(s, [3], [2], [3], [3])
    with pytest.raises(ValueError, match=r"^node 4 at depth 4 has no candidates: the deepest scored depth is 4$"):
        call(s, [4], [3], [3], [4])


# --------------------------------------------------------------------------- TreeFlash


def test_treeflash_zero_init_is_identity_and_gives_the_marginals():
    d = randomize(DFlashDrafter(tiny_dflash_config()), seed=14)
    embed, head = tiny_target(15)
    t = TreeFlashApproximator(TreeFlashConfig(hidden_size=H, intermediate_size=20)).double()
    assert torch.count_nonzero(t.down.weight) == 0 and torch.count_nonzero(t.up_gate.weight) > 0
    x = dflash_inputs(d)
    with torch.no_grad():
        pre = d.forward_prenorm(*x, embed)
        prev = torch.tensor([1, 5, 9])
        assert torch.equal(t(embed(prev), pre[2].expand(3, H), d.norm), pre[2].expand(3, H))
        scorer = TreeFlashTransitionScorer(t, d.norm, pre, embed, head)
        marg = torch.log_softmax(marginal_logits(d.norm(pre), head), dim=-1)  # [gamma - 1, V]
        for depth in (1, 2, 4):
            out = scorer(depth, prev)
            assert out.shape == (3, V)
            torch.testing.assert_close(out, marg[depth - 1].expand(3, V), rtol=0, atol=1e-12)
        with torch.no_grad():
            t.down.weight.normal_(generator=torch.Generator().manual_seed(0))
        out = scorer(2, prev)
        assert (out[0] - out[1]).abs().max() > 1e-3  # trained: the previous token matters
        torch.testing.assert_close(out.exp().sum(-1), torch.ones(3, dtype=F64), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- with the tree builders


def test_models_drive_the_weaver_and_treeflash_tree_builders():
    """DFlash block -> top-K candidates -> WeaverTreeScorer inside build_weaver: every node's
    draft log-prob equals the full recomputation over its root path; TreeFlashTransitionScorer
    inside build_treeflash: the same for the transitions."""
    from vllm_tfm.tree import build_treeflash, build_weaver

    d = randomize(DFlashDrafter(tiny_dflash_config()), seed=16)
    w = randomize(Weaver(tiny_weaver_config()), seed=17)
    t = randomize(TreeFlashApproximator(TreeFlashConfig(hidden_size=H, intermediate_size=20)), seed=18)
    embed, head = tiny_target(19)
    x = dflash_inputs(d, bonus=12)
    with torch.no_grad():
        pre = d.forward_prenorm(*x, embed)
        out = d.norm(pre)
        logits = marginal_logits(out, head)  # [4, V]
    cl, cand = logits.topk(8, dim=-1)
    vh = torch.randn(H, dtype=F64, generator=torch.Generator().manual_seed(20))
    scorer = w.tree_scorer(vh, out[1:], cand, cl, embed, head)
    tree = build_weaver(12, cand, scorer, budget=12, max_depth=4, width=3, children_per_node=3)
    assert tree.num_nodes == 13 and scorer.num_nodes >= 4
    toks, par, dep = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
    for i in range(1, tree.num_nodes):
        path, j = [], par[i]
        while j >= 0:
            path.insert(0, toks[j])
            j = par[j]
        full = w.score_paths(vh[None], out[None, 1:], torch.tensor([path]), embed, head, cand[None], cl[None])[0, -1]
        col = cand[dep[i] - 1].tolist().index(toks[i])
        torch.testing.assert_close(tree.draft_logprobs[i].double(), full[col], rtol=0, atol=1e-10)

    ts = TreeFlashTransitionScorer(t, d.norm, pre, embed, head)
    tf = build_treeflash(12, torch.log_softmax(logits, -1), ts, budget=10, max_depth=4, top_m=4)
    toks, par = tf.tokens.tolist(), tf.parents.tolist()
    for i in range(1, tf.num_nodes):
        direct = ts(int(tf.depth[i]), torch.tensor([toks[par[i]]]))[0, toks[i]]
        torch.testing.assert_close(tf.draft_logprobs[i].double(), direct, rtol=0, atol=1e-10)


def test_drafter_dir_top_level_safetensors_are_only_dflash_weights(tmp_path) -> None:
    """vLLM loads every top-level *.safetensors of the drafter dir into its DFlash model, so Weaver
    and TreeFlash weights must live elsewhere (the tfm/ subfolder)."""
    from vllm_tfm.models.tfm_config import TREEFLASH_WEIGHTS_NAME, WEAVER_WEIGHTS_NAME

    assert "/" in WEAVER_WEIGHTS_NAME and "/" in TREEFLASH_WEIGHTS_NAME
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"")
    for name in (WEAVER_WEIGHTS_NAME, TREEFLASH_WEIGHTS_NAME):
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(b"")
    assert sorted(p.name for p in d.glob("*.safetensors")) == ["model.safetensors"]
