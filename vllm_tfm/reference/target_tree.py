"""Tree-verify forward of a `transformers` target with its own weights, and the commit.

Supported targets (transformers 5.x): text-only ``Qwen3_5ForCausalLM`` (hybrid: Gated DeltaNet
"linear_attention" layers and gated "full_attention" layers with q/k RMSNorm and partial RoPE) and
pure-attention ``Qwen3ForCausalLM``. The forward reuses the target's own submodules (norms,
projections, MLP, rotary embedding, ``apply_rotary_pos_emb``); only the token mixing follows the tree:

* full attention: node i attends to the whole committed prefix plus its ancestors-or-self, with
  RoPE position ``prefix_len + depth[i]`` (section 2 of docs DESIGN);
* Gated DeltaNet: the short conv runs over the tree (:func:`vllm_tfm.verify.conv.tree_causal_conv1d`:
  window = self, parent, ... then the committed conv inputs) and the delta rule over the tree from
  the committed state S0 (:func:`vllm_tfm.verify.gdn.gdn_tree_verify`); no state is written.

:meth:`TreeTarget.commit` then appends the accepted path's keys/values and advances the GDN
conv window and recurrent state along root..accepted (``tree_conv_commit``/``gdn_tree_commit``).
One request at a time (batch 1): this is the CPU reference and oracle, not the serving path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vllm_tfm.tree.types import Tree
from vllm_tfm.verify.conv import tree_causal_conv1d, tree_conv_commit
from vllm_tfm.verify.gdn import gdn_gates, gdn_tree_commit, gdn_tree_verify

from .cache import AttentionKV, CommittedState, GDNState, from_hf_cache
from .hf_compat import (
    apply_rotary_fn,
    capture_final_hidden,
    capture_layer_outputs,
    check_supported,
    layer_types,
    output_cache,
    rotary_cos_sin,
)

__all__ = ["PrefillOutput", "TreeVerifyOutput", "TreeTarget"]


@dataclass
class PrefillOutput:
    """``logits [V]`` and ``final_hidden [H]`` (after the final norm) at the last prompt token;
    ``taps [L, n_tap * H]`` at every prompt token (None without tapped layers)."""

    logits: Tensor
    final_hidden: Tensor
    taps: Tensor | None


@dataclass
class _AttnScratch:
    k: Tensor  # [Hkv, n, D] post-RoPE
    v: Tensor  # [Hkv, n, D]


@dataclass
class _GDNScratch:
    x: Tensor  # [n, D_conv] pre-conv inputs
    k: Tensor  # [n, H, K] post-conv keys (before the L2 norm)
    g: Tensor  # [n, HV] log-decay
    delta: Tensor  # [n, HV, V]


@dataclass
class TreeVerifyOutput:
    """Result of one tree-verify forward.

    ``logits [n, V]`` (model dtype) at every node; ``final_hidden [n, H]`` the hidden states after
    the final norm (the lm_head input); ``taps [n, n_tap * H]`` the outputs of the tapped decoder
    layers at every node, concatenated in ``tap_layers`` order (None without taps); ``scratch``
    per-layer tensors the commit needs.
    """

    logits: Tensor
    final_hidden: Tensor
    taps: Tensor | None
    scratch: list


def _silu_name(act: str) -> str:
    if act in ("silu", "swish"):
        return "silu"
    raise ValueError(f"unsupported GDN conv activation {act!r} (only silu)")


class TreeTarget:
    """A `transformers` Qwen3.5/Qwen3 causal LM driven as a tree verifier.

    ``tap_layers``: decoder layer ids whose outputs (before the final norm) are returned for every
    prompt token and tree node; DFlash's ``target_layer_ids`` (= vLLM aux layers ``id + 1``).
    """

    def __init__(self, model: nn.Module, tap_layers: Sequence[int] = ()):
        check_supported(model)
        self.model = model
        self.config = model.config
        self.layer_types = layer_types(model)
        self.tap_layers = tuple(int(i) for i in tap_layers)
        n = len(self.layer_types)
        for lid in self.tap_layers:
            if not 0 <= lid < n:
                raise ValueError(f"tapped layer id {lid} out of range for a {n}-layer target")
        self.conv_width = getattr(self.config, "linear_conv_kernel_dim", None)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, input_ids: Tensor) -> tuple[CommittedState, PrefillOutput]:
        """Run the HF model itself over the prompt ``input_ids [L]`` and convert its cache."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).view(-1)
        if ids.numel() == 0:
            raise ValueError("the prompt must hold at least one token")
        self._check_tokens(ids)
        with capture_layer_outputs(self.model, self.tap_layers) as cap, capture_final_hidden(self.model) as fin:
            out = self.model(input_ids=ids[None], use_cache=True)
        state = from_hf_cache(output_cache(out), self.layer_types, ids.numel(), self.conv_width, self.dtype)
        taps = torch.cat([cap[lid][0] for lid in self.tap_layers], dim=-1) if self.tap_layers else None
        return state, PrefillOutput(out.logits[0, -1], fin["final"][0, -1], taps)

    def _check_tokens(self, ids: Tensor) -> None:
        v = self.config.vocab_size
        if bool(((ids < 0) | (ids >= v)).any()):
            raise ValueError(f"token ids must lie in [0, {v}), got min {int(ids.min())} max {int(ids.max())}")

    # ------------------------------------------------------------------ verify
    @torch.no_grad()
    def verify(self, state: CommittedState, tree: Tree) -> TreeVerifyOutput:
        """Logits (and tapped hidden states) at every node of ``tree``, given ``state``. Writes nothing."""
        n = tree.num_nodes
        tokens = tree.tokens.to(self.device)
        self._check_tokens(tokens)
        parents = tree.parents.to(self.device)
        cu = torch.tensor([0, n], dtype=torch.long, device=self.device)
        slot = torch.zeros(1, dtype=torch.long, device=self.device)
        positions = state.prefix_len + tree.depth.to(self.device)
        allowed = torch.cat(
            [torch.ones(n, state.prefix_len, dtype=torch.bool, device=self.device), tree.ancestor_mask().to(self.device)],
            dim=1,
        )  # [n, P + n]

        self._check_state(state)
        m = self.model.model
        x = m.embed_tokens(tokens)[None]  # [1, n, H]
        cos, sin = rotary_cos_sin(self.model, x, positions)
        scratch: list = []
        taps: dict[int, Tensor] = {}
        for i, layer in enumerate(m.layers):
            residual = x
            h = layer.input_layernorm(x)
            if self.layer_types[i] == "linear_attention":
                h, sc = self._gdn_tree(layer.linear_attn, h, state.layers[i], parents, cu, slot)
            else:
                h, sc = self._attention_tree(layer.self_attn, h, cos, sin, state.layers[i], allowed)
            scratch.append(sc)
            x = residual + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in self.tap_layers:
                taps[i] = x[0]
        final = m.norm(x)
        logits = self.model.lm_head(final)[0]
        tap_t = torch.cat([taps[lid] for lid in self.tap_layers], dim=-1) if self.tap_layers else None
        return TreeVerifyOutput(logits, final[0], tap_t, scratch)

    def _check_state(self, state: CommittedState) -> None:
        if len(state.layers) != len(self.layer_types):
            raise ValueError(f"the committed state has {len(state.layers)} layers, the target {len(self.layer_types)}")
        for i, (kind, st) in enumerate(zip(self.layer_types, state.layers)):
            want = GDNState if kind == "linear_attention" else AttentionKV
            if not isinstance(st, want):
                raise ValueError(f"committed state layer {i} is a {type(st).__name__}, the target's layer {i} is {kind}")
            if isinstance(st, AttentionKV) and st.length != state.prefix_len:
                raise ValueError(f"attention layer {i} holds {st.length} positions, prefix_len is {state.prefix_len}")

    def _attention_tree(
        self, attn: nn.Module, h: Tensor, cos: Tensor, sin: Tensor, kv: AttentionKV, allowed: Tensor
    ) -> tuple[Tensor, _AttnScratch]:
        """Ancestor-masked attention over [committed prefix | tree]; h [1, n, H] -> [1, n, H]."""
        n = h.shape[1]
        d = attn.head_dim
        hq = self.config.num_attention_heads
        gated = attn.q_proj.out_features == 2 * hq * d  # Qwen3.5: q_proj emits [q_h | gate_h] per head
        if gated:
            q, gate = torch.chunk(attn.q_proj(h).view(1, n, hq, 2 * d), 2, dim=-1)
            gate = gate.reshape(1, n, hq * d)
        else:
            q, gate = attn.q_proj(h).view(1, n, hq, d), None
        q = attn.q_norm(q).transpose(1, 2)  # [1, Hq, n, D]
        k = attn.k_norm(attn.k_proj(h).view(1, n, -1, d)).transpose(1, 2)  # [1, Hkv, n, D]
        v = attn.v_proj(h).view(1, n, -1, d).transpose(1, 2)
        q, k = apply_rotary_fn(attn)(q, k, cos, sin)
        keys = torch.cat([kv.k, k[0]], dim=1)  # [Hkv, P + n, D]
        vals = torch.cat([kv.v, v[0]], dim=1)
        groups = hq // keys.shape[0]
        keys = keys.repeat_interleave(groups, dim=0)  # query head h reads kv head h // groups
        vals = vals.repeat_interleave(groups, dim=0)
        scores = torch.matmul(q[0], keys.transpose(1, 2)) * attn.scaling  # [Hq, n, P + n]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, vals).transpose(0, 1).reshape(1, n, hq * d)  # [1, n, Hq * D]
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return attn.o_proj(o), _AttnScratch(k[0], v[0])

    def _gdn_tree(
        self, la: nn.Module, h: Tensor, st: GDNState, parents: Tensor, cu: Tensor, slot: Tensor
    ) -> tuple[Tensor, _GDNScratch]:
        """Gated DeltaNet over the tree from the committed state; h [1, n, H] -> [1, n, H]."""
        n = h.shape[1]
        hk, hv = la.num_k_heads, la.num_v_heads
        dk, dv = la.head_k_dim, la.head_v_dim
        x = la.in_proj_qkv(h)[0]  # [n, 2 * H * K + HV * V] pre-conv (q | k | v channels)
        z = la.in_proj_z(h)[0].reshape(n, hv, dv)
        b = la.in_proj_b(h)[0]  # [n, HV]
        a = la.in_proj_a(h)[0]
        y = tree_causal_conv1d(
            x, parents, cu, st.conv_state, slot, la.conv1d.weight[:, 0, :], la.conv1d.bias,
            activation=_silu_name(la.activation),
        )
        q, k, v = torch.split(y, [la.key_dim, la.key_dim, la.value_dim], dim=-1)
        q = q.reshape(n, hk, dk)
        k = k.reshape(n, hk, dk)
        v = v.reshape(n, hv, dv)
        g, beta = gdn_gates(a, b, la.A_log, la.dt_bias)
        o, delta = gdn_tree_verify(
            q, k, v, g, beta, parents, cu, st.ssm_state, slot, scale=None, use_qk_l2norm=True, return_delta=True
        )
        o = la.norm(o.to(h.dtype).reshape(-1, dv), z.reshape(-1, dv)).reshape(1, n, hv * dv)
        return la.out_proj(o), _GDNScratch(x, k, g, delta)

    # ------------------------------------------------------------------ commit
    @torch.no_grad()
    def commit(self, state: CommittedState, tree: Tree, out: TreeVerifyOutput, accepted: int) -> list[int]:
        """Commit the root..``accepted`` path of ``tree`` into ``state`` (in place).

        Appends the path's keys/values to every attention layer, advances every GDN layer's conv
        window and recurrent state along the path, and adds the path length to ``prefix_len``.
        Returns the committed node indices (root first).
        """
        n = tree.num_nodes
        if not 0 <= accepted < n:
            raise ValueError(f"accepted node {accepted} out of range for a tree of {n} nodes")
        if len(out.scratch) != len(state.layers) or out.logits.shape[0] != n:
            raise ValueError("the verify output does not belong to this tree and state")
        path = tree.path(accepted)
        idx = torch.tensor(path, dtype=torch.long, device=self.device)
        parents = tree.parents.to(self.device)
        cu = torch.tensor([0, n], dtype=torch.long, device=self.device)
        slot = torch.zeros(1, dtype=torch.long, device=self.device)
        acc = torch.tensor([accepted], dtype=torch.long, device=self.device)
        for layer_state, sc in zip(state.layers, out.scratch):
            if isinstance(sc, _AttnScratch):
                layer_state.append(sc.k[:, idx], sc.v[:, idx])
            else:
                gdn_tree_commit(sc.k, sc.g, sc.delta, parents, cu, acc, layer_state.ssm_state, slot, slot, use_qk_l2norm=True)
                tree_conv_commit(sc.x, parents, cu, acc, layer_state.conv_state, slot, slot, self.conv_width)
        state.prefix_len += len(path)
        return path
