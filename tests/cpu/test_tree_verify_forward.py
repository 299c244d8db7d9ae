"""Tree-verify forward of a transformers target (vllm_tfm.reference.target_tree) against the HF model.

Oracles: the unmodified HF model run per root-to-leaf branch from a copy of its cache
(BranchVerifier), the HF model run from scratch over prompt + path, and our own GDN chain
recurrence for the converted prefill state.

Tolerances: relative max error (max |a - b| / max |b|) 1e-5, for float32 AND float64 models
(measured: <= 3e-6 on logits, taps and final hidden states). float64 is not much tighter because
transformers computes Qwen3/Qwen3.5 RMSNorms (``x.float()``) and the Qwen3.5 gated-delta-rule
torch kernels in float32 whatever the weights' dtype; the forward reuses those modules.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _trees import random_tree_parents

from vllm_tfm.reference.branch_verifier import BranchVerifier, leaves
from vllm_tfm.reference.cache import AttentionKV, GDNState, from_hf_cache
from vllm_tfm.reference.hf_compat import capture_layer_outputs, output_cache
from vllm_tfm.reference.target_tree import TreeTarget
from vllm_tfm.reference.toy_targets import tiny_qwen3, tiny_qwen3_5
from vllm_tfm.tree.types import Tree
from vllm_tfm.verify.gdn import gdn_chain_recurrence, gdn_gates

REL_TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def random_tree(n: int, vocab: int, seed: int, kind: str = "random") -> Tree:
    g = torch.Generator().manual_seed(seed)
    parents = random_tree_parents(n, g, kind)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    return Tree.from_parents(tokens, parents)


_MODELS: dict = {}


def model(kind: str, dtype: torch.dtype):
    key = (kind, dtype)
    if key not in _MODELS:
        _MODELS[key] = tiny_qwen3_5(seed=11, dtype=dtype) if kind == "qwen3_5" else tiny_qwen3(seed=12, dtype=dtype)
    return _MODELS[key]


TAPS = {"qwen3_5": [0, 2, 3], "qwen3": [0, 1]}


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("prompt", [[5], [5, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11]])
def test_tree_verify_equals_per_branch_hf(kind, dtype, prompt):
    """Logits, tapped layers and final hidden states at every node, over two verify+commit rounds."""
    m = model(kind, dtype)
    tt, bv = TreeTarget(m, TAPS[kind]), BranchVerifier(m, TAPS[kind])
    ours, pre = tt.prefill(torch.tensor(prompt))
    ref, pre_ref = bv.prefill(torch.tensor(prompt))
    assert rel_err(pre.logits, pre_ref.logits) == 0.0  # both are the HF model's own prefill
    assert rel_err(pre.taps, pre_ref.taps) == 0.0
    vocab = m.config.vocab_size
    for step, (n, tkind) in enumerate([(9, "random"), (7, "deep"), (5, "star")]):
        tree = random_tree(n, vocab, seed=100 * step + len(prompt), kind=tkind)
        o, r = tt.verify(ours, tree), bv.verify(ref, tree)
        assert rel_err(o.logits, r.logits) < REL_TOL
        assert rel_err(o.taps, r.taps) < REL_TOL
        assert rel_err(o.final_hidden, r.final_hidden) < REL_TOL
        accepted = leaves(tree)[-1]  # commit the deepest-numbered leaf's path
        assert tt.commit(ours, tree, o, accepted) == bv.commit(ref, tree, r, accepted) == tree.path(accepted)
        assert ours.prefix_len == ref.prefix_len


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3"])
def test_tree_nodes_equal_hf_from_scratch(kind):
    """Each node's logits equal the HF model run without cache over prompt + root..node."""
    m = model(kind, torch.float32)
    prompt = [1, 2, 3]
    tt = TreeTarget(m)
    st, _ = tt.prefill(torch.tensor(prompt))
    tree = random_tree(8, m.config.vocab_size, seed=3)
    out = tt.verify(st, tree)
    for node in range(tree.num_nodes):
        ids = prompt + tree.tokens[tree.path(node)].tolist()
        full = m(input_ids=torch.tensor([ids])).logits[0, -1]
        assert rel_err(out.logits[node], full) < REL_TOL


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3"])
def test_commit_equals_prefill_of_the_longer_sequence(kind):
    """After verify + commit of a path, the state equals the converted HF prefill of prompt + path."""
    m = model(kind, torch.float32)
    prompt = [6, 2]
    tt = TreeTarget(m)
    st, _ = tt.prefill(torch.tensor(prompt))
    tree = random_tree(9, m.config.vocab_size, seed=5, kind="deep")
    acc = tree.num_nodes - 1
    path = tt.commit(st, tree, tt.verify(st, tree), acc)
    full, _ = tt.prefill(torch.tensor(prompt + tree.tokens[path].tolist()))
    assert st.prefix_len == full.prefix_len == len(prompt) + len(path)
    for a, b in zip(st.layers, full.layers):
        if isinstance(a, AttentionKV):
            assert rel_err(a.k, b.k) < REL_TOL and rel_err(a.v, b.v) < REL_TOL
        else:
            assert a.conv_state.shape == b.conv_state.shape
            assert rel_err(a.conv_state, b.conv_state) < REL_TOL
            assert rel_err(a.ssm_state, b.ssm_state) < REL_TOL


@pytest.mark.parametrize("prompt_len", [1, 2, 6])
def test_prefill_state_layout(prompt_len):
    """The converted HF cache holds what our layouts promise, computed independently:
    conv_state [1, D, W-1] = the last W-1 pre-conv inputs (zeros before the prompt), oldest first;
    ssm_state [1, HV, V, K] = the chain recurrence state (V-first) from zero over the prompt;
    attention k/v [Hkv, L, D]."""
    m = model("qwen3_5", torch.float64)
    ids = torch.arange(3, 3 + prompt_len)
    gdn_layers = [i for i, t in enumerate(m.config.layer_types) if t == "linear_attention"]
    captured: dict = {}
    handles = []
    for i in gdn_layers:
        la = m.model.layers[i].linear_attn
        for name in ("in_proj_qkv", "in_proj_a", "in_proj_b"):
            handles.append(getattr(la, name).register_forward_hook(
                lambda _m, _i, out, i=i, name=name: captured.__setitem__((i, name), out[0])))
    try:
        st, _ = TreeTarget(m).prefill(ids)
    finally:
        for h in handles:
            h.remove()
    w = m.config.linear_conv_kernel_dim
    for i in gdn_layers:
        la = m.model.layers[i].linear_attn
        x = captured[(i, "in_proj_qkv")]  # [L, D] pre-conv
        padded = torch.cat([torch.zeros(w - 1, x.shape[1], dtype=x.dtype), x])  # zeros before the prompt
        layer_state = st.layers[i]
        assert isinstance(layer_state, GDNState)
        assert layer_state.conv_state.shape == (1, x.shape[1], w - 1)
        assert torch.equal(layer_state.conv_state[0], padded[-(w - 1):].T)
        y = F.silu(F.conv1d(padded.T[None], la.conv1d.weight, groups=x.shape[1])[0].T)  # [L, D]
        q, k, v = torch.split(y, [la.key_dim, la.key_dim, la.value_dim], dim=-1)
        g, beta = gdn_gates(captured[(i, "in_proj_a")], captured[(i, "in_proj_b")], la.A_log, la.dt_bias)
        _, s = gdn_chain_recurrence(
            q.reshape(prompt_len, la.num_k_heads, la.head_k_dim), k.reshape(prompt_len, la.num_k_heads, la.head_k_dim),
            v.reshape(prompt_len, la.num_v_heads, la.head_v_dim), g, beta,
            torch.zeros(la.num_v_heads, la.head_v_dim, la.head_k_dim, dtype=torch.float64),
        )
        assert layer_state.ssm_state.shape == (1, la.num_v_heads, la.head_v_dim, la.head_k_dim)
        assert rel_err(layer_state.ssm_state[0], s) < REL_TOL  # HF's kernel runs in float32
    attn = [i for i, t in enumerate(m.config.layer_types) if t == "full_attention"]
    kv = st.layers[attn[0]]
    assert isinstance(kv, AttentionKV)
    assert kv.k.shape == (m.config.num_key_value_heads, prompt_len, m.config.head_dim)


def test_tapped_layers_are_decoder_layer_outputs():
    """Taps of layer i = output of decoder layer i = HF hidden_states[i + 1] (i < last layer)."""
    m = model("qwen3_5", torch.float32)
    ids = torch.tensor([[2, 7, 1, 8]])
    st, pre = TreeTarget(m, [0, 1, 2]).prefill(ids[0])
    hs = m(input_ids=ids, output_hidden_states=True).hidden_states
    h = m.config.hidden_size
    for j, lid in enumerate([0, 1, 2]):
        assert torch.equal(pre.taps[:, j * h:(j + 1) * h], hs[lid + 1][0])


def test_from_hf_cache_refuses_mismatched_length():
    m = model("qwen3", torch.float32)
    out = m(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    with pytest.raises(ValueError, match="holds 3 positions, expected prefix_len 4"):
        from_hf_cache(output_cache(out), ["full_attention"] * 2, 4, None, torch.float32)


def test_errors_name_the_problem():
    m = model("qwen3_5", torch.float32)
    with pytest.raises(ValueError, match="tapped layer id 4 out of range for a 4-layer target"):
        TreeTarget(m, [4])
    tt = TreeTarget(m)
    st, _ = tt.prefill(torch.tensor([1]))
    tree = Tree.chain([1, 2])
    with pytest.raises(ValueError, match="accepted node 2 out of range for a tree of 2 nodes"):
        tt.commit(st, tree, tt.verify(st, tree), 2)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 96\)"):
        tt.verify(st, Tree.chain([1, 96]))
    with pytest.raises(ValueError, match="the prompt must hold at least one token"):
        tt.prefill(torch.tensor([], dtype=torch.long))
    bad = torch.nn.Linear(2, 2)
    bad.config = type("C", (), {"model_type": "llama"})()
    with pytest.raises(ValueError, match="unsupported target model_type 'llama'"):
        TreeTarget(bad)
    before = dict(m.model.layers[0]._forward_hooks)
    with capture_layer_outputs(m, [0]):
        assert len(m.model.layers[0]._forward_hooks) == len(before) + 1
    assert dict(m.model.layers[0]._forward_hooks) == before  # our hook is removed on exit
