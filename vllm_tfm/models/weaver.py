"""Weaver: a small autoregressive transformer that re-scores DFlash candidates along a tree path.

From the description of the Trees-from-Marginals authors' implementation (DESIGN.md section 10);
no Weaver code is public, this is our own. Shapes: H = d_model (the target's hidden size),
d = d_rank, D = the deepest draft depth (DFlash block size - 1), K = candidates per depth.

* Prompt (1 + D tokens, positions 0..D, causal among themselves, K/V kept):
  token 0 = ``proposal_in(output_norm(h_verifier))`` where h_verifier is the target's final hidden
  state (after its final norm, as vLLM returns it) at the last committed position, i.e. the state
  whose logits gave the bonus token; token j = ``proposal_in(output_norm(h_dflash[j]))`` where
  h_dflash[j] is the DFlash block output (after the DFlash final norm) at block slot j, the state
  whose lm_head logits are the depth-j marginal. One ``output_norm`` is shared by all prompt tokens.
* Tree token: ``token_in(embed_norm(E_target[token]))`` for a realised tree node; the root (the
  bonus token) is depth 0; a node at depth p sits at position p + 1 and attends to the whole prompt
  plus the K/V of its ancestors and itself.
* Blocks: pre-norm; fused ``qkv`` (q, k, v rows in that order); rotate-half RoPE; ``o_proj``;
  SwiGLU with a fused ``gate_up`` (gate rows first, then up) and ``down``. All norms are RMSNorm
  with weight and bias, math in float32. No biases in linear layers.
* Scores of a node at depth p over the K DFlash candidates c of depth p + 1:
  ``log_softmax_c(dflash_logit[p+1, c] + W_lm[c] . lm_head_query_in(out_norm(x)))``, W_lm the
  target lm_head; no temperature.

Parameter names (``tfm/weaver.safetensors``)::

    output_norm.{weight,bias} [H]      proposal_in.weight [d, H]
    embed_norm.{weight,bias}  [H]      token_in.weight    [d, H]
    layers.{i}.attn_norm.{weight,bias} [d]   layers.{i}.qkv.weight [3d, d]   layers.{i}.o_proj.weight [d, d]
    layers.{i}.mlp_norm.{weight,bias}  [d]   layers.{i}.gate_up.weight [2 d_mlp, d]   layers.{i}.down.weight [d, d_mlp]
    out_norm.{weight,bias}    [d]      lm_head_query_in.weight [H, d]

Size at Qwen3.6-27B width (H 5120, d 1024, 3 layers, 8 heads, d_mlp 3072):
``weaver_param_count`` = 56,657,920 parameters (the paper reports 56.7M).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import RMSNormWithBias, apply_rope, as_weight, compute_dtype, masked_attention, rope_cos_sin
from .weaver_step import Fp8Rows, folded_weaver, norm_linear, prompt_pass, rope_table
from .vocab_table import ShardedVocabTable, VocabTable, candidate_scores_reference, table_num_rows, table_rows
from .io import read_state, target_text_config, write_state
from .tfm_config import TFM_CONFIG_NAME, WEAVER_WEIGHTS_NAME, TfmConfig, WeaverConfig
import vllm_tfm.kernels.candidate_scores as candidate_kernel  # module imports: the kernels import this package too
import vllm_tfm.kernels.weaver_attention as attention_kernel
import vllm_tfm.kernels.weaver_linear as linear_kernel

__all__ = ["Weaver", "WeaverTreeScorer", "BatchedWeaverTreeScorer", "weaver_param_count", "candidate_logprobs"]


def weaver_param_count(config: WeaverConfig) -> int:
    """Number of Weaver parameters, from the shapes listed in the module docstring."""
    h, d, m, n = config.d_model, config.d_rank, config.d_mlp, config.n_layers
    io_proj = 3 * h * d  # proposal_in, token_in, lm_head_query_in
    io_norms = 2 * (2 * h) + 2 * d  # output_norm, embed_norm (weight + bias of width H); out_norm
    per_layer = 3 * d * d + d * d + 2 * m * d + m * d + 2 * (2 * d)
    return io_proj + io_norms + n * per_layer


def candidate_logprobs(queries: Tensor, cand_rows: Tensor, cand_logits: Tensor) -> Tensor:
    """log_softmax over K of ``cand_logits + cand_rows . query``.

    queries [..., H]; cand_rows [..., K, H] (target lm_head rows of the candidates); cand_logits
    [..., K] (raw DFlash logits). Returns [..., K] in float32 (float64 for float64 inputs).
    """
    cd = compute_dtype(queries.dtype)
    residual = torch.einsum("...h,...kh->...k", queries.to(cd), cand_rows.to(cd))
    return torch.log_softmax(cand_logits.to(cd) + residual, dim=-1)


def _lookup(embed: VocabTable, ids: Tensor) -> Tensor:
    return table_rows(embed, ids)


class WeaverBlock(nn.Module):
    def __init__(self, cfg: WeaverConfig) -> None:
        super().__init__()
        d = cfg.d_rank
        self.n_heads, self.head_dim, self.d_mlp = cfg.n_heads, cfg.head_dim, cfg.d_mlp
        self.attn_norm = RMSNormWithBias(d, cfg.norm_eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNormWithBias(d, cfg.norm_eps)
        self.gate_up = nn.Linear(d, 2 * cfg.d_mlp, bias=False)
        self.down = nn.Linear(cfg.d_mlp, d, bias=False)

    def qkv_rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [..., T, d] -> q, k, v [..., T, n_heads, head_dim], q and k rotated."""
        q, k, v = self.qkv(self.attn_norm(x)).unflatten(-1, (3, self.n_heads, self.head_dim)).unbind(-3)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, x: Tensor, attn: Tensor) -> Tensor:
        """Residual adds after attention: attn [..., T, n_heads, head_dim]."""
        x = x + self.o_proj(attn.flatten(-2))
        gate, up = self.gate_up(self.mlp_norm(x)).split(self.d_mlp, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Weaver(nn.Module):
    """The Weaver network (see the module docstring for the function and parameter names)."""

    def __init__(self, config: WeaverConfig) -> None:
        super().__init__()
        self.config = config
        h, d = config.d_model, config.d_rank
        self.output_norm = RMSNormWithBias(h, config.norm_eps)
        self.proposal_in = nn.Linear(h, d, bias=False)
        self.embed_norm = RMSNormWithBias(h, config.norm_eps)
        self.token_in = nn.Linear(h, d, bias=False)
        self.layers = nn.ModuleList(WeaverBlock(config) for _ in range(config.n_layers))
        self.out_norm = RMSNormWithBias(d, config.norm_eps)
        self.lm_head_query_in = nn.Linear(d, h, bias=False)
        # BatchedWeaverTreeScorer's folded projections rounded to e4m3 rows (weight-only FP8,
        # weaver_step.py; the tfm option weaver_weights "fp8"); the modules' own forward and
        # WeaverTreeScorer keep the stored weights
        self.fp8_weights = False

    # ------------------------------------------------------------------ pieces
    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def _check_prompt(self, verifier_hidden: Tensor, dflash_hidden: Tensor) -> int:
        h = self.config.d_model
        if verifier_hidden.shape[-1] != h or dflash_hidden.shape[-1] != h:
            raise ValueError(
                f"verifier_hidden and dflash_hidden must end in d_model {h}, got shapes "
                f"{tuple(verifier_hidden.shape)} and {tuple(dflash_hidden.shape)}"
            )
        if dflash_hidden.shape[:-2] != verifier_hidden.shape[:-1]:
            raise ValueError(
                f"dflash_hidden [..., D, H] and verifier_hidden [..., H] batch dims differ: "
                f"{tuple(dflash_hidden.shape)} vs {tuple(verifier_hidden.shape)}"
            )
        depth = dflash_hidden.shape[-2]
        if not 1 <= depth <= self.config.max_depth:
            raise ValueError(f"dflash_hidden has {depth} depths; this Weaver takes 1..{self.config.max_depth}")
        return depth

    def prompt_inputs(self, verifier_hidden: Tensor, dflash_hidden: Tensor) -> Tensor:
        """verifier_hidden [..., H], dflash_hidden [..., D, H] -> prompt [..., 1 + D, d]."""
        self._check_prompt(verifier_hidden, dflash_hidden)
        seq = torch.cat([verifier_hidden.unsqueeze(-2), dflash_hidden], dim=-2)
        return self.proposal_in(self.output_norm(seq))

    def token_inputs(self, tokens: Tensor, embed: VocabTable) -> Tensor:
        """tokens [...] -> token_in(embed_norm(E_target[tokens])) [..., d]. Precomputable per vocab row."""
        return self.token_in(self.embed_norm(_lookup(embed, tokens)))

    def query(self, x: Tensor) -> Tensor:
        """Final states [..., d] -> lm_head queries [..., H]."""
        return self.lm_head_query_in(self.out_norm(x))

    # ------------------------------------------------------------------ full recomputation
    def path_queries(
        self, verifier_hidden: Tensor, dflash_hidden: Tensor, path_tokens: Tensor, embed: nn.Module | Tensor
    ) -> Tensor:
        """From-scratch forward over prompt + one root..node path per batch row (training / oracle).

        Args:
            verifier_hidden: [B, H]; dflash_hidden: [B, D, H] (depths 1..D).
            path_tokens: [B, n] int64, column j = the token at depth j (column 0 = the bonus/root),
                n <= D.
            embed: the target's input embedding (module or [V, H] weight).
        Returns:
            [B, n, H] queries; row j scores the candidates of depth j + 1.
        """
        depth = self._check_prompt(verifier_hidden, dflash_hidden)
        b, n = path_tokens.shape
        if not 1 <= n <= depth:
            raise ValueError(f"path_tokens has {n} tokens; paths of 1..{depth} tokens have candidates (D = {depth})")
        x = torch.cat(
            [self.prompt_inputs(verifier_hidden, dflash_hidden), self.token_inputs(path_tokens, embed)], dim=1
        )
        dev = x.device
        p0 = 1 + depth
        positions = torch.cat([torch.arange(p0, device=dev), torch.arange(1, n + 1, device=dev)])
        idx = torch.arange(p0 + n, device=dev)
        # prompt: causal among the prompt; path: the whole prompt plus earlier-or-same path tokens
        mask = (idx[None, :] <= idx[:, None]) & ((idx[:, None] >= p0) | (idx[None, :] < p0))
        cos, sin = self._rope(positions, x.dtype)
        for layer in self.layers:
            q, k, v = layer.qkv_rope(x, cos, sin)
            x = layer.finish(x, masked_attention(q, k, v, mask, layer.head_dim**-0.5))
        return self.query(x[:, p0:])

    def score_paths(
        self,
        verifier_hidden: Tensor,
        dflash_hidden: Tensor,
        path_tokens: Tensor,
        embed: nn.Module | Tensor,
        lm_head: nn.Module | Tensor,
        cand_ids: Tensor,
        cand_logits: Tensor,
    ) -> Tensor:
        """Log-probs over the candidates for every node of the paths: [B, n, K].

        cand_ids, cand_logits: [B, D, K]; row d - 1 = the candidates of depth d and their raw
        DFlash logits. Node j of a path (depth j) is scored over row j (depth j + 1).
        """
        qry = self.path_queries(verifier_hidden, dflash_hidden, path_tokens, embed)
        n = path_tokens.shape[1]
        rows = as_weight(lm_head, "lm_head")[cand_ids[:, :n]]
        return candidate_logprobs(qry, rows, cand_logits[:, :n])

    # ------------------------------------------------------------------ tree
    def tree_scorer(
        self,
        verifier_hidden: Tensor,
        dflash_hidden: Tensor,
        cand_ids: Tensor,
        cand_logits: Tensor,
        embed: nn.Module | Tensor,
        lm_head: nn.Module | Tensor,
    ) -> WeaverTreeScorer:
        return WeaverTreeScorer(self, verifier_hidden, dflash_hidden, cand_ids, cand_logits, embed, lm_head)

    # ------------------------------------------------------------------ files
    def save_pretrained(self, directory: str | Path) -> None:
        """Write tfm/weaver.safetensors and set the ``weaver`` section of tfm_config.json."""
        path = Path(directory)
        if (path / TFM_CONFIG_NAME).is_file():
            cfg = TfmConfig.load(path)
            cfg = TfmConfig.from_dict({**cfg.model_dump(mode="json"), "weaver": self.config.model_dump(mode="json")})
        else:
            cfg = TfmConfig(weaver=self.config)
        cfg.save(path)
        write_state(self, path, WEAVER_WEIGHTS_NAME)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        target_config: object | None = None,
    ) -> Weaver:
        cfg = TfmConfig.load(directory)
        if cfg.weaver is None:
            raise ValueError(f"{Path(directory) / TFM_CONFIG_NAME}: no 'weaver' section")
        if target_config is not None:
            _check_width("Weaver d_model", cfg.weaver.d_model, target_config)
        with torch.device("meta"):
            model = cls(cfg.weaver)
        model.load_state_dict(read_state(directory, WEAVER_WEIGHTS_NAME, model), strict=True, assign=True)
        if dtype is not None or device is not None:
            model.to(device=device, dtype=dtype)
        return model

    def validate_against_target(self, target_config: object) -> None:
        _check_width("Weaver d_model", self.config.d_model, target_config)


def _check_width(what: str, width: int, target_config: object) -> None:
    t = target_text_config(target_config)
    if width != t.hidden_size:
        raise ValueError(f"{what} {width} does not match the target's hidden_size {t.hidden_size}")


class WeaverTreeScorer:
    """Stateful Weaver scoring for one tree, in the tree builder's callback protocol.

    ``scorer(node_ids [w], parent_ids [w], tokens [w], depths [w]) -> [w, K]`` log-probabilities
    over the K candidates of depth ``depths + 1`` (``cand_ids[depths]``). The root comes first
    (parent -1, depth 0, token = the bonus token); a node comes after its parent (in an earlier
    call or earlier in the same call). Every node's per-layer K/V is kept, so a call costs one
    Weaver step for its w nodes. Inference only (runs under ``torch.no_grad``).

    Args:
        verifier_hidden: [H]; dflash_hidden: [D, H] (DFlash block slots 1..D, after the final norm).
        cand_ids: [D, K] int64, row d - 1 = the DFlash top-K tokens of depth d.
        cand_logits: [D, K], their raw DFlash logits.
        embed, lm_head: the target's input embedding and lm_head (modules, [V, H] weights, or
            ``ShardedVocabTable`` for vocabulary-split weights under tensor parallelism).
    """

    def __init__(
        self,
        weaver: Weaver,
        verifier_hidden: Tensor,
        dflash_hidden: Tensor,
        cand_ids: Tensor,
        cand_logits: Tensor,
        embed: nn.Module | Tensor,
        lm_head: nn.Module | Tensor,
    ) -> None:
        self.weaver = weaver
        depth = weaver._check_prompt(verifier_hidden, dflash_hidden)
        if verifier_hidden.dim() != 1:
            raise ValueError(f"verifier_hidden must be [H] (one tree), got shape {tuple(verifier_hidden.shape)}")
        if cand_ids.dim() != 2 or cand_ids.shape[0] != depth or cand_logits.shape != cand_ids.shape:
            raise ValueError(
                f"cand_ids and cand_logits must both be [D={depth}, K], "
                f"got shapes {tuple(cand_ids.shape)} and {tuple(cand_logits.shape)}"
            )
        self.depth = depth
        self.embed = embed
        self.cand_logits = cand_logits
        self.cand_rows = as_weight(lm_head, "lm_head")[cand_ids]  # [D, K, H]
        self.n_embed_rows = as_weight(embed, "embed").shape[0]
        self.slot_of: dict[int, int] = {}
        self.paths: list[list[int]] = []  # slot -> slots of root..node
        self.depths: list[int] = []
        self.k_cache: list[Tensor] = []
        self.v_cache: list[Tensor] = []
        with torch.no_grad():
            x = weaver.prompt_inputs(verifier_hidden, dflash_hidden)  # [1 + D, d]
            dev = x.device
            cos, sin = weaver._rope(torch.arange(1 + depth, device=dev), x.dtype)
            causal = torch.ones(1 + depth, 1 + depth, dtype=torch.bool, device=dev).tril()
            self.prompt_kv: list[tuple[Tensor, Tensor]] = []
            for layer in weaver.layers:
                q, k, v = layer.qkv_rope(x, cos, sin)
                self.prompt_kv.append((k, v))
                x = layer.finish(x, masked_attention(q, k, v, causal, layer.head_dim**-0.5))
            cfg = weaver.config
            for _ in weaver.layers:
                self.k_cache.append(x.new_empty(0, cfg.n_heads, cfg.head_dim))
                self.v_cache.append(x.new_empty(0, cfg.n_heads, cfg.head_dim))

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    def _register(self, node_ids: Tensor, parent_ids: Tensor, tokens: Tensor, depths: Tensor) -> list[int]:
        if node_ids.dim() != 1 or node_ids.shape[0] == 0:
            raise ValueError(f"node_ids must be a non-empty 1-D tensor, got shape {tuple(node_ids.shape)}")
        w = node_ids.shape[0]
        for name, t in (("parent_ids", parent_ids), ("tokens", tokens), ("depths", depths)):
            if t.shape != (w,):
                raise ValueError(f"{name} must be [{w}] like node_ids, got shape {tuple(t.shape)}")
        toks = tokens.tolist()
        if min(toks) < 0 or max(toks) >= self.n_embed_rows:
            raise ValueError(f"tokens must lie in [0, {self.n_embed_rows}), got {toks}")
        # validate the whole call before touching any state
        pending: dict[int, int] = {}
        new_paths: list[list[int]] = []
        new_depths: list[int] = []
        n0 = len(self.paths)
        for nid, pid, dep in zip(node_ids.tolist(), parent_ids.tolist(), depths.tolist(), strict=True):
            if nid in self.slot_of or nid in pending:
                raise ValueError(f"node {nid} was already scored")
            if pid == -1:
                if n0 + len(new_paths) > 0:
                    raise ValueError(f"node {nid} has parent -1 but the root was already given")
                if dep != 0:
                    raise ValueError(f"root node {nid} must have depth 0, got {dep}")
                path: list[int] = []
            else:
                if n0 + len(new_paths) == 0:
                    raise ValueError(
                        f"the root (parent -1, depth 0) must be scored first, got node {nid} with parent {pid}"
                    )
                ps = self.slot_of.get(pid, pending.get(pid))
                if ps is None:
                    raise ValueError(f"node {nid} has parent {pid}, which has not been scored")
                pdep = self.depths[ps] if ps < n0 else new_depths[ps - n0]
                if dep != pdep + 1:
                    raise ValueError(f"node {nid} has depth {dep}, its parent {pid} has depth {pdep}")
                path = self.paths[ps] if ps < n0 else new_paths[ps - n0]
            if dep >= self.depth:
                raise ValueError(
                    f"node {nid} at depth {dep} has no candidates: the deepest scored depth is {self.depth}"
                )
            slot = n0 + len(new_paths)
            pending[nid] = slot
            new_paths.append(path + [slot])
            new_depths.append(dep)
        self.slot_of.update(pending)
        self.paths.extend(new_paths)
        self.depths.extend(new_depths)
        return list(range(n0, n0 + len(new_paths)))

    def __call__(self, node_ids: Tensor, parent_ids: Tensor, tokens: Tensor, depths: Tensor) -> Tensor:
        slots = self._register(node_ids, parent_ids, tokens, depths)
        wv = self.weaver
        with torch.no_grad():
            x = wv.token_inputs(tokens.to(self.cand_rows.device), self.embed)  # [w, d]
            dev = x.device
            dep = torch.tensor([self.depths[s] for s in slots], device=dev)
            cos, sin = wv._rope(dep + 1, x.dtype)
            longest = max(len(self.paths[s]) for s in slots)
            path_idx = torch.zeros(len(slots), longest, dtype=torch.long, device=dev)
            path_ok = torch.zeros(len(slots), longest, dtype=torch.bool, device=dev)
            for i, s in enumerate(slots):
                p = self.paths[s]
                path_idx[i, : len(p)] = torch.tensor(p, device=dev)
                path_ok[i, : len(p)] = True
            p0 = 1 + self.depth
            mask = torch.cat([torch.ones(len(slots), p0, dtype=torch.bool, device=dev), path_ok], dim=1)[:, None, :]
            for li, layer in enumerate(wv.layers):
                q, k, v = layer.qkv_rope(x, cos, sin)  # [w, heads, hd]
                # store this layer's K/V of the new nodes first: a node sees itself and any
                # ancestor passed earlier in the same call
                self.k_cache[li] = torch.cat([self.k_cache[li], k])
                self.v_cache[li] = torch.cat([self.v_cache[li], v])
                pk, pv = self.prompt_kv[li]
                keys = torch.cat([pk.expand(len(slots), *pk.shape), self.k_cache[li][path_idx]], dim=1)
                vals = torch.cat([pv.expand(len(slots), *pv.shape), self.v_cache[li][path_idx]], dim=1)
                attn = masked_attention(q[:, None], keys, vals, mask, layer.head_dim**-0.5)[:, 0]
                x = layer.finish(x, attn)
            qry = wv.query(x)  # [w, H]
            return candidate_logprobs(qry, self.cand_rows[dep], self.cand_logits[dep])


def _kv_specs(weaver: Weaver, r: int, depth: int, max_nodes: int, dtype: torch.dtype,
              device: torch.device) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
    """(shape, dtype, device) of the scorer's K/V buffer of each layer: [prompt (1 + D) | node slots | trash slot]."""
    return [((2, r, layer.n_heads, 1 + depth + max_nodes + 1, layer.head_dim), dtype, device) for layer in weaver.layers]


def _fused_linear(x: Tensor, weight_t: Tensor, fp8: Fp8Rows | None, bias: Tensor | None, residual: Tensor | None,
                  eps: float | None, swiglu: bool, rows: Tensor | None = None) -> Tensor:
    """The fused kernel (``vllm_tfm.kernels.weaver_linear``) on the e4m3 rows where there are some and the kernel
    takes this many rows, else on the weights' values (weight_t [in, out]: the same function to rounding)."""
    m = x.shape[0] if rows is None else rows.shape[0]
    if fp8 is not None and m <= linear_kernel.FP8_KERNEL_ROWS:
        return linear_kernel.weaver_linear(x, fp8.q, bias, residual, eps, swiglu, fp8.scale, rows)
    return linear_kernel.weaver_linear(x, weight_t.t(), bias, residual, eps, swiglu, None, rows)


def _norm_linear(fused: bool, x: Tensor, weight_t: Tensor, bias: Tensor, eps: float, fp8: Fp8Rows | None = None) -> Tensor:
    """``Linear(RMSNormWithBias(x))`` with the norm folded into (weight_t [in, out], bias): the fused
    kernel (``vllm_tfm.kernels.weaver_linear``) or ``norm_linear``."""
    if fused:
        return _fused_linear(x, weight_t, fp8, bias, None, eps, False)
    return norm_linear(x, weight_t, bias, eps)


def _residual_linear(fused: bool, residual: Tensor, x: Tensor, weight_t: Tensor, fp8: Fp8Rows | None = None) -> Tensor:
    """``residual + x @ weight_t`` (weight_t [in, out])."""
    if fused:
        return _fused_linear(x, weight_t, fp8, None, residual, None, False)
    return torch.addmm(residual, x, weight_t)


def _norm_swiglu(fused: bool, x: Tensor, weight_t: Tensor, bias: Tensor, eps: float, fp8: Fp8Rows | None = None) -> Tensor:
    """``silu(gate) * up`` of the folded ``gate_up(mlp_norm(x))`` (weight_t [in, 2 d_mlp])."""
    if fused:
        return _fused_linear(x, weight_t, fp8, bias, None, eps, True)
    gate, up = norm_linear(x, weight_t, bias, eps).chunk(2, dim=-1)
    return F.silu(gate) * up


class BatchedWeaverTreeScorer:
    """Weaver scoring for R trees at once, in the lockstep builder's protocol
    (``vllm_tfm.tree.build_weaver_padded``); per request the same function as ``WeaverTreeScorer``.

    ``scorer(node_ids, parent_ids, tokens, depths [R, w] int64, valid [R, w] bool) -> [R, w, K]``:
    row [r, i] (when valid) = log-probabilities over ``cand_ids[r, depths[r, i]]`` given node
    i's root..node path in request r; invalid rows are computed on clamped inputs and mean
    nothing. Node ids index a per-request buffer of ``max_nodes`` slots (the tree's 1 + B nodes):
    per layer, K/V ``[2, R, heads, 1 + D + max_nodes, head_dim]`` (the prompt's, then every scored
    node's) and one additive key mask per node slot ``[R, max_nodes, 1 + D + max_nodes]`` (0 for
    the prompt and the ancestors-or-self: the parent's row plus the node itself; -inf elsewhere).
    A node attends to the keys its mask row names: the same keys as
    ``WeaverTreeScorer`` (prompt + root..node path), summed in a different order, so outputs agree
    to rounding (float32: ~1e-6), not bit for bit. One call = one Weaver step of R x w nodes with
    fixed shapes and no host sync, in few kernels: the fused step of ``weaver_step.py`` (norms
    folded into the projections, RoPE from the qkv GEMM, fused attention), with weights folded
    once per parameter version and cached on the Weaver.

    Protocol (not checked unless ``validate``, which syncs with the host): the first call holds
    the roots (node 0, parent -1, depth 0) of every request; a valid node's parent was valid in an
    EARLIER call (never in the same call: the lockstep builder never scores a node with its
    parent) and its depth is the parent's + 1 < D; node ids are < max_nodes and not reused.

    Args:
        verifier_hidden: [R, H]; dflash_hidden: [R, D, H] (DFlash slots 1..D, after the final norm).
        cand_ids: [R, D, K] int64; cand_logits: [R, D, K] raw DFlash logits of those candidates.
        embed, lm_head: the target's input embedding and lm_head (modules, [V, H] weights, or
            ``ShardedVocabTable`` for vocabulary-split weights under tensor parallelism).
        max_nodes: node slots per request (1 + the largest budget).
        score_kernel: the scorer's kernels where they take the tensors (else their torch
            references): the linear layers with their norms, SwiGLU and residual adds through
            ``vllm_tfm.kernels.weaver_linear`` (up to its KERNEL_ROWS = 4 rows R x w), each layer's
            RoPE, K/V write, key-mask rows and attention through ``vllm_tfm.kernels.weaver_attention``
            and the candidate scores (DFlash logit + lm_head row . query) through
            ``vllm_tfm.kernels.candidate_scores``, one launch each: the same function in another
            order with fewer roundings (agreeing with the torch path to the activation dtype's
            rounding).
        prompt_stream: CUDA only. The prompt pass (the K/V of the prompt, which reads only
            ``verifier_hidden``, ``dflash_hidden``, the folded weights and the RoPE table) runs on
            this stream, after ``prompt_after`` (an event recorded on the current stream; None: the
            current stream now), while the current stream goes on with the work the caller queued
            after that event (the DFlash top-K, the growth's set-up: ``proposal_trees.weaver_growth``).
            The first call, or :meth:`join_prompt`, makes the current stream wait for it. The same
            values as without it: the same kernels, in another stream.
        kv_cache: the K/V buffers from :meth:`prompt_buffers` (None: allocated here). With
            ``prompt_after`` they are required, made before that event was recorded: memory the
            caching allocator hands out after it may be memory the current stream's work queued
            after the event still reads (a temporary freed on the host), which the prompt stream,
            ordered only after the event, would overwrite.
    """

    def __init__(
        self,
        weaver: Weaver,
        verifier_hidden: Tensor,
        dflash_hidden: Tensor,
        cand_ids: Tensor,
        cand_logits: Tensor,
        embed: VocabTable,
        lm_head: VocabTable,
        max_nodes: int,
        validate: bool = False,
        score_kernel: bool = False,
        prompt_stream: torch.cuda.Stream | None = None,
        prompt_after: torch.cuda.Event | None = None,
        kv_cache: list[Tensor] | None = None,
    ) -> None:
        self.weaver = weaver
        self.score_kernel = score_kernel
        self._prompt_done: torch.cuda.Event | None = None
        depth = weaver._check_prompt(verifier_hidden, dflash_hidden)
        if verifier_hidden.dim() != 2:
            raise ValueError(f"verifier_hidden must be [R, H], got shape {tuple(verifier_hidden.shape)}")
        r = verifier_hidden.shape[0]
        if cand_ids.dim() != 3 or tuple(cand_ids.shape[:2]) != (r, depth) or cand_logits.shape != cand_ids.shape:
            raise ValueError(
                f"cand_ids and cand_logits must both be [R={r}, D={depth}, K], "
                f"got shapes {tuple(cand_ids.shape)} and {tuple(cand_logits.shape)}"
            )
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"max_nodes must be an integer >= 1, got {max_nodes!r}")
        self.num_requests, self.depth, self.max_nodes, self.validate = r, depth, max_nodes, validate
        self.embed = embed
        self.lm_head = lm_head if isinstance(lm_head, ShardedVocabTable) else as_weight(lm_head, "lm_head")
        self.n_embed_rows = table_num_rows(embed, "embed")
        self.cand_ids = cand_ids
        self.cand_logits = cand_logits
        self.folded = folded_weaver(weaver)
        with torch.no_grad():
            dev, dtype = verifier_hidden.device, self.folded.proposal_in.dtype
            p0 = 1 + depth
            # RoPE of positions 0..D for (q, k, v), cached on the Weaver: the prompt's rows, and rows
            # 1..D for the node positions ([D, 2 (cos, sin), 3, 1, head_dim], indexed by depth)
            rope = rope_table(weaver, depth, dtype, dev)
            self._rope_nodes = rope[1:]
            # per layer, keys and values [2, R, heads, S, head_dim] of [prompt (1 + D) | node slots
            # (max_nodes) | trash slot]: heads before positions, the layout attention reads; the
            # prompt's part written by the fused prompt pass
            side = prompt_stream if prompt_stream is not None and dev.type == "cuda" else None
            if kv_cache is None:
                if side is not None and prompt_after is not None:
                    raise ValueError("a prompt stream that starts after an earlier event needs the K/V buffers "
                                     "made before it (kv_cache=BatchedWeaverTreeScorer.prompt_buffers(...))")
            want = _kv_specs(weaver, r, depth, max_nodes, dtype, dev)
            if kv_cache is None:  # the folded weights and RoPE table are made above: no prompt_buffers call
                kv_cache = [torch.empty(shape, dtype=dt, device=d) for shape, dt, d in want]
            else:
                got = [(tuple(t.shape), t.dtype, t.device) for t in kv_cache]
                if got != want:
                    raise ValueError(f"kv_cache must be {len(want)} buffers of (shape, dtype, device) {want}, got {got}")
            self.kv_cache: list[Tensor] = list(kv_cache)
            if side is not None:
                if prompt_after is None:
                    side.wait_stream(torch.cuda.current_stream(dev))
                else:
                    side.wait_event(prompt_after)
            with nullcontext() if side is None else torch.cuda.stream(side):
                for kv in self.kv_cache:  # unscored node slots are read (with weight 0): no garbage
                    kv.zero_()
                prompt_pass(weaver, self.folded, verifier_hidden, dflash_hidden, rope, self.kv_cache)
                if side is not None:
                    self._prompt_done = torch.cuda.Event()
                    self._prompt_done.record(side)
            # additive key mask (0: visible, -inf: not) of every node slot, the trash slot (row
            # max_nodes) and the root's parent (row max_nodes + 1, the prompt only): the whole
            # prompt, then its ancestors-or-self among the node slots; one more column for the
            # trash slot's own key, columns padded to a multiple of 16 (an aligned mask for CUDA's
            # memory-efficient attention); attention reads the first 1 + D + max_nodes columns
            cols = -(-(p0 + max_nodes + 1) // 16) * 16
            self.key_bias = torch.full((r, max_nodes + 2, cols), float("-inf"), dtype=dtype, device=dev)
            self.key_bias[:, :, :p0] = 0.0
        self._scored = torch.zeros(r, max_nodes, dtype=torch.bool, device=dev) if validate else None
        self._depths = torch.zeros(r, max_nodes, dtype=torch.long, device=dev) if validate else None

    def _check(self, node_ids: Tensor, parent_ids: Tensor, tokens: Tensor, depths: Tensor, valid: Tensor) -> None:
        """The protocol of the class docstring, for the valid rows (host sync)."""
        first = not bool(self._scored.any())
        for r, i in valid.nonzero().tolist():
            nid, pid, tok, dep = (int(t[r, i]) for t in (node_ids, parent_ids, tokens, depths))
            if not 0 <= nid < self.max_nodes:
                raise ValueError(f"request {r}: node id {nid} outside 0..{self.max_nodes - 1}")
            if bool(self._scored[r, nid]):
                raise ValueError(f"request {r}: node {nid} was already scored")
            if not 0 <= tok < self.n_embed_rows:
                raise ValueError(f"request {r}: token {tok} outside [0, {self.n_embed_rows})")
            if first != (pid == -1):
                raise ValueError(f"request {r}: node {nid} with parent {pid}: the first call holds the roots (parent -1) only")
            if pid == -1:
                if dep != 0 or nid != 0:
                    raise ValueError(f"request {r}: the root must be node 0 at depth 0, got node {nid} at depth {dep}")
            else:
                if not (0 <= pid < self.max_nodes and bool(self._scored[r, pid])):
                    raise ValueError(f"request {r}: node {nid} has parent {pid}, which was not scored in an earlier call")
                if dep != int(self._depths[r, pid]) + 1:
                    raise ValueError(f"request {r}: node {nid} has depth {dep}, its parent {pid} has depth {int(self._depths[r, pid])}")
            if dep >= self.depth:
                raise ValueError(f"request {r}: node {nid} at depth {dep} has no candidates (D = {self.depth})")
        rows, cols = valid.nonzero().unbind(1)
        self._scored[rows, node_ids[rows, cols]] = True
        self._depths[rows, node_ids[rows, cols]] = depths[rows, cols]

    @staticmethod
    def prompt_buffers(weaver: Weaver, verifier_hidden: Tensor, dflash_hidden: Tensor, max_nodes: int) -> list[Tensor]:
        """The K/V buffers of a scorer of these inputs ([2, R, heads, 1 + D + max_nodes + 1, head_dim] per layer,
        uninitialised: the prompt pass zeroes them first), after making what the prompt pass reads besides its
        inputs, the folded weights and the RoPE table (both cached on the Weaver). A caller that runs the prompt
        on another stream calls this before recording the event the stream starts after (``kv_cache``)."""
        depth = weaver._check_prompt(verifier_hidden, dflash_hidden)
        dev, dtype = verifier_hidden.device, folded_weaver(weaver).proposal_in.dtype
        rope_table(weaver, depth, dtype, dev)
        specs = _kv_specs(weaver, int(verifier_hidden.shape[0]), depth, max_nodes, dtype, dev)
        return [torch.empty(shape, dtype=dt, device=d) for shape, dt, d in specs]

    def join_prompt(self) -> None:
        """Make the current stream wait for the prompt pass queued on ``prompt_stream`` (once; nothing
        without one). Every call does it first; a caller that may make no call joins with this."""
        done, self._prompt_done = self._prompt_done, None
        if done is not None:
            torch.cuda.current_stream(self.key_bias.device).wait_event(done)

    def __call__(self, node_ids: Tensor, parent_ids: Tensor, tokens: Tensor, depths: Tensor, valid: Tensor) -> Tensor:
        self.join_prompt()
        r = self.num_requests
        if node_ids.dim() != 2 or node_ids.shape[0] != r or node_ids.shape[1] == 0:
            raise ValueError(f"node_ids must be [R={r}, w >= 1], got shape {tuple(node_ids.shape)}")
        for name, t in (("parent_ids", parent_ids), ("tokens", tokens), ("depths", depths), ("valid", valid)):
            if t.shape != node_ids.shape:
                raise ValueError(f"{name} must be {list(node_ids.shape)} like node_ids, got shape {tuple(t.shape)}")
        if self.validate:
            self._check(node_ids, parent_ids, tokens, depths, valid)
        wv, fw = self.weaver, self.folded
        dev = self.key_bias.device
        if node_ids.device != dev:
            node_ids, parent_ids, tokens, depths, valid = (t.to(dev) for t in (node_ids, parent_ids, tokens, depths, valid))
        with torch.no_grad():
            # invalid rows: computed on clamped inputs (token ids, depths: the candidate scores clamp
            # them), written to the trash slot, ignored
            fused = self.score_kernel
            if fused:  # the kernels read [R, w] index tensors as contiguous rows
                node_ids, parent_ids, depths, valid = (t.contiguous() for t in (node_ids, parent_ids, depths, valid))
            attention = attention_kernel.node_attention if fused else attention_kernel.node_attention_reference
            if fused and isinstance(self.embed, Tensor):  # the embedding rows gathered (and clamped) by the kernel
                x = _fused_linear(self.embed, fw.token_in, fw.token_in_fp8, fw.token_in_bias, None, fw.embed_eps, False,
                                  tokens.reshape(-1).contiguous())
            else:
                emb = _lookup(self.embed, tokens.clamp(0, self.n_embed_rows - 1)).flatten(0, 1)  # [R w, H]
                x = _norm_linear(fused, emb, fw.token_in, fw.token_in_bias, fw.embed_eps, fw.token_in_fp8)  # [R w, d]
            for li, (layer, lw, kv) in enumerate(zip(wv.layers, fw.layers, self.kv_cache)):
                # q, k, v and their rotate_half in one GEMM: [R w, 2 * 3 * heads * hd]
                proj = _norm_linear(fused, x, lw.qkv_rot, lw.qkv_rot_bias, lw.attn_eps, lw.qkv_rot_fp8)
                # RoPE, the nodes' K/V into the cache, attention over the prompt and the
                # ancestors-or-self; the first layer also writes the nodes' key-mask rows
                attn = attention(proj, self._rope_nodes, node_ids, parent_ids, depths, valid, kv, self.key_bias,
                                 1 + self.depth, layer.head_dim**-0.5, li == 0)  # [R w, heads hd]
                x = _residual_linear(fused, x, attn, lw.o_proj, lw.o_proj_fp8)
                act = _norm_swiglu(fused, x, lw.gate_up, lw.gate_up_bias, lw.mlp_eps, lw.gate_up_fp8)
                x = _residual_linear(fused, x, act, lw.down, lw.down_fp8)
            qry = _norm_linear(fused, x, fw.query, fw.query_bias, fw.out_eps, fw.query_fp8)  # [R w, H]
            score_fn = candidate_kernel.candidate_scores if fused else candidate_scores_reference
            scores = score_fn(self.lm_head, self.cand_ids, self.cand_logits, depths, qry.view(r, node_ids.shape[1], -1))
            return torch.log_softmax(scores, dim=-1)  # [R, w, K]
