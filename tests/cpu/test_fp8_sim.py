"""vllm_tfm.reference.fp8_sim: the DFlash drafter's linear layers rounded as vLLM's online FP8 runs them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vllm_tfm.models.dflash import DFlashConfig, DFlashDecoderLayer, DFlashDrafter
from vllm_tfm.reference.fp8_sim import (
    E4M3_MAX,
    Fp8SimLinear,
    fp8_round,
    fp8_round_rows,
    simulate_fp8_linears,
    simulate_fp8_weaver_rows,
)


@pytest.fixture
def tiny_dflash_config() -> DFlashConfig:
    return DFlashConfig.create(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=64, target_layer_ids=[0, 2], mask_token_id=63, block_size=5,
        num_target_layers=4, rope_theta=10000.0, max_position_embeddings=256,
    )


def e4m3_values() -> torch.Tensor:
    """Every finite float8 e4m3fn value, from its 256 bit patterns (NaN dropped), sorted."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(v[torch.isfinite(v)])


def assert_nearest_e4m3(scaled: torch.Tensor, rounded: torch.Tensor) -> None:
    """Each ``rounded`` is an e4m3 value and no e4m3 value is nearer to ``scaled`` (ties either way)."""
    table = e4m3_values().double()
    s, r = scaled.double().flatten(), rounded.double().flatten()
    tol = 1e-5 * r.abs().clamp_min(1.0)  # the float32 scale's own rounding in rounded / scale
    assert torch.all((r[:, None] - table[None, :]).abs().min(dim=1).values <= tol)
    best = (s[:, None] - table[None, :]).abs().min(dim=1).values
    assert torch.all((s - r).abs() <= best + tol)


def test_fp8_round_is_the_nearest_e4m3_multiple_of_the_scale() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * 3.0
    scale = x.abs().amax() / E4M3_MAX
    assert_nearest_e4m3(x / scale, fp8_round(x, scale) / scale)
    big = torch.tensor([1e6, -1e6])
    assert fp8_round(big, torch.tensor(1.0)).tolist() == [E4M3_MAX, -E4M3_MAX]  # saturating


def test_rows_have_their_own_scale() -> None:
    x = torch.tensor([[1.0, 0.001, 300.0], [0.002, 0.001, 0.0005]])
    out = fp8_round_rows(x)
    for row_in, row_out in zip(x, out):
        scale = row_in.abs().amax() / E4M3_MAX
        assert_nearest_e4m3(row_in / scale, row_out / scale)
    assert out[1].ne(0).all()  # a shared per-tensor scale would flush the small row's entries to 0 or subnormals
    assert out[0, 2] == 300.0 or abs(float(out[0, 2]) - 300.0) / 300.0 <= 2.0**-4


def test_linear_layer_rounds_weight_once_and_input_every_call() -> None:
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(32, 24, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 32, generator=g))
        lin.bias.copy_(torch.randn(24, generator=g))
    scale = lin.weight.abs().amax() / E4M3_MAX
    sim = Fp8SimLinear(lin, scale)
    assert_nearest_e4m3(lin.weight / scale, sim.weight / scale)
    x = torch.randn(5, 32, generator=g)
    rows = torch.stack([fp8_round(r, r.abs().amax() / E4M3_MAX) for r in x])
    torch.testing.assert_close(sim(x), F.linear(rows, sim.weight, lin.bias), rtol=0, atol=0)
    exact = lin(x)
    err = (sim(x) - exact).norm() / exact.norm()
    assert 0 < err < 0.1  # rounded, and by about e4m3's 2^-4 relative step, not more


def test_drafter_layers_fused_shards_share_their_largest_scale(tiny_dflash_config) -> None:
    torch.manual_seed(2)
    layer = DFlashDecoderLayer(tiny_dflash_config)
    with torch.no_grad():
        layer.self_attn.k_proj.weight.mul_(4.0)  # k's range the largest of q, k, v
        layer.mlp.up_proj.weight.mul_(3.0)
    amax = {n: m.weight.abs().amax().item() for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    assert simulate_fp8_linears(layer) == 7
    attn, mlp = layer.self_attn, layer.mlp
    for name in ("q_proj", "k_proj", "v_proj"):
        assert getattr(attn, name).weight_scale == pytest.approx(amax["self_attn.k_proj"] / E4M3_MAX)
    assert attn.o_proj.weight_scale == pytest.approx(amax["self_attn.o_proj"] / E4M3_MAX)
    for name in ("gate_proj", "up_proj"):
        assert getattr(mlp, name).weight_scale == pytest.approx(amax["mlp.up_proj"] / E4M3_MAX)
    assert mlp.down_proj.weight_scale == pytest.approx(amax["mlp.down_proj"] / E4M3_MAX)
    assert not any(isinstance(m, nn.Linear) for m in layer.modules())


def test_whole_drafter_every_linear_but_no_other_parameter(tiny_dflash_config) -> None:
    torch.manual_seed(3)
    drafter = DFlashDrafter(tiny_dflash_config)
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    linears = sum(isinstance(m, nn.Linear) for m in drafter.modules())
    assert simulate_fp8_linears(drafter) == linears == 7 * tiny_dflash_config.num_hidden_layers + 1  # + fc
    after = dict(drafter.named_parameters())
    assert after.keys() == before.keys()
    for name, p in after.items():
        if name.endswith("norm.weight"):
            assert torch.equal(p, before[name])
        elif name.endswith("proj.weight") or name == "fc.weight":
            assert not torch.equal(p, before[name])


def test_fp8_head_rounds_each_vocabulary_row_at_its_own_scale_and_is_not_saved(tiny_dflash_config) -> None:
    from vllm_tfm.models.dflash import drafter_logits, marginal_logits
    from vllm_tfm.reference.fp8_sim import Fp8SimHead

    g = torch.Generator().manual_seed(4)
    lm_head = nn.Linear(32, 64, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(64, 32, generator=g))
        lm_head.weight[7] *= 1e-3  # a small row keeps its precision with its own scale
    head = Fp8SimHead(lm_head)
    for row, rounded in zip(lm_head.weight.detach(), head.weight):
        scale = row.abs().amax() / E4M3_MAX
        assert_nearest_e4m3(row / scale, rounded / scale)
    assert head.state_dict() == {} and list(head.parameters()) == []
    x = torch.randn(3, 32, generator=g)
    torch.testing.assert_close(head(x), F.linear(fp8_round_rows(x), head.weight), rtol=0, atol=0)

    drafter = DFlashDrafter(tiny_dflash_config)
    hidden = torch.randn(5, 32, generator=g)
    assert torch.equal(drafter_logits(drafter, hidden, lm_head), marginal_logits(hidden, lm_head))
    drafter.logits_head = head
    assert torch.equal(drafter_logits(drafter, hidden, lm_head), head(hidden[1:]))
    assert not torch.equal(drafter_logits(drafter, hidden, lm_head), marginal_logits(hidden, lm_head))
    assert "logits_head.weight" not in drafter.state_dict()


def test_weaver_rows_simulation_is_the_runtime_rounding() -> None:
    """simulate_fp8_weaver_rows (vllm-tfm eval --weaver-weights fp8): the reference decoder's module path on the rounded
    Weaver gives the log-probabilities of the runtime's batched scorer with Weaver.fp8_weights (folded weights rounded
    to e4m3 rows), to float32 rounding; both differ from the unrounded Weaver's by far more (the rounding took effect)."""
    import copy

    from vllm_tfm.models import Weaver, WeaverConfig
    from vllm_tfm.models.weaver import BatchedWeaverTreeScorer

    torch.manual_seed(3)
    h, depth, k, vocab = 64, 4, 12, 100
    weaver = Weaver(WeaverConfig(d_model=h, d_rank=32, n_layers=2, n_heads=2, d_mlp=48, max_depth=depth)).eval()
    with torch.no_grad():
        for p in weaver.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms with non-trivial gains and biases
    rounded = copy.deepcopy(weaver)
    assert simulate_fp8_weaver_rows(rounded) == 3 + 4 * 2
    assert all(float(layer.attn_norm.weight.detach().sub(1).abs().max()) == 0 for layer in rounded.layers)
    weaver.fp8_weights = True
    embed, head = torch.randn(vocab, h), torch.randn(vocab, h) * 0.1
    vh, dh = torch.randn(1, h), torch.randn(1, depth, h)
    cand, cl = torch.randint(0, vocab, (1, depth, k)), torch.randn(1, depth, k)
    batched = BatchedWeaverTreeScorer(weaver, vh, dh, cand, cl, embed, head, max_nodes=8)
    modules = rounded.tree_scorer(vh[0], dh[0], cand[0], cl[0], embed, head)
    plain = copy.deepcopy(weaver)
    plain.fp8_weights = False
    unrounded = plain.tree_scorer(vh[0], dh[0], cand[0], cl[0], embed, head)
    t = lambda *x: torch.tensor([x], dtype=torch.long)  # noqa: E731
    for ids, parents, tokens, depths in (((0,), (-1,), (7,), (0,)), ((1, 2), (0, 0), (9, 4), (1, 1))):
        got = batched(t(*ids), t(*parents), t(*tokens), t(*depths), torch.ones(1, len(ids), dtype=torch.bool))[0]
        want = modules(torch.tensor(ids), torch.tensor(parents), torch.tensor(tokens), torch.tensor(depths))
        off = unrounded(torch.tensor(ids), torch.tensor(parents), torch.tensor(tokens), torch.tensor(depths))
        assert torch.allclose(got, want.to(got.dtype), rtol=0, atol=2e-5)
        assert float((want - off).abs().max()) > 1e-3
