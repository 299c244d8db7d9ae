"""The runtime's GDN tree step and commit against vLLM's chain state layout, and the KV compaction.

vLLM 0.26 (VLLM_HOOKS.md section 5) keeps, per spec request n with num_accepted = a: the SSM state
in slot ``state_indices[n, a - 1]`` and the conv window (last W - 1 pre-conv inputs, oldest first)
in columns ``a - 1 .. a + W - 3`` of conv slot ``state_indices[n, 0]``, whose storage is "SD"
([slots, L, D]) and is used through a transposed [slots, D, L] view. The oracle below is the plain
chain: causal conv over [history | path] and the per-token recurrence ``gdn_chain_recurrence``;
the native conv write pattern is written out from ``_causal_conv1d_update_kernel``
(model_executor/layers/mamba/ops/causal_conv1d.py:749-933).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _trees import path_of, random_tree_parents
from vllm_tfm.verify.gdn import gdn_chain_recurrence, gdn_gates
from vllm_tfm.vllm_plugin.runtime.commit import commit_gdn_layer, compact_kv, compaction_rows
from vllm_tfm.vllm_plugin.runtime.gdn import spec_tree_gdn

F64 = torch.float64
H, K, HV, V, W, S = 2, 4, 4, 3, 4, 5  # heads, dims, conv width, num_speculative_tokens
CONV_DIM = 2 * H * K + HV * V
L = W - 1 + S


class Layer:
    def __init__(self, num_req: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.num_slots = num_req * (1 + S) + 3
        self.conv_sd = torch.randn(self.num_slots, L, CONV_DIM, generator=g, dtype=F64)  # garbage everywhere
        self.conv = self.conv_sd.transpose(-1, -2)  # the [slots, D, L] view vLLM's kernels use
        self.ssm = torch.randn(self.num_slots, HV, V, K, generator=g, dtype=F64)
        self.slots = torch.randperm(self.num_slots, generator=g)[: num_req * (1 + S)].view(num_req, 1 + S).to(torch.int32)
        self.weight = 0.5 * torch.randn(CONV_DIM, W, generator=g, dtype=F64)
        self.bias = 0.1 * torch.randn(CONV_DIM, generator=g, dtype=F64)
        self.A_log = torch.rand(HV, generator=g, dtype=F64).log()
        self.dt_bias = 0.5 * torch.randn(HV, generator=g, dtype=F64)

    def conv_chain(self, window: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        """Causal conv of xs [n, D] after the committed window [W-1, D]: [n, D], silu."""
        seq = torch.cat([window, xs]).T[None]  # [1, D, W - 1 + n]
        return F.silu(F.conv1d(seq, self.weight[:, None, :], self.bias, groups=CONV_DIM)[0].T)

    def chain_truth(self, window, state, xs, a, b):
        """Outputs [n, HV, V], final state and final window of the chain over xs."""
        y = self.conv_chain(window, xs)
        q, k, v = torch.split(y, [H * K, H * K, HV * V], dim=-1)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        o, st = gdn_chain_recurrence(q.reshape(-1, H, K), k.reshape(-1, H, K), v.reshape(-1, HV, V), g, beta, state)
        return o, st, torch.cat([window, xs])[-(W - 1) :]

    def run(self, parents_list, xs, a, b, prev_accepted):
        cu = torch.zeros(len(parents_list) + 1, dtype=torch.long)
        cu[1:] = torch.tensor([p.numel() for p in parents_list]).cumsum(0)
        return spec_tree_gdn(
            xs, a, b, torch.cat(parents_list), cu, self.conv, self.ssm, self.slots, prev_accepted,
            self.weight, self.bias, "silu", self.A_log, self.dt_bias, H, K, HV, V,
        ), cu


def test_tree_verify_and_commit_match_the_chain_in_vllm_slots():
    num_req = 2
    lay = Layer(num_req, seed=0)
    g = lay.g
    prev = torch.tensor([1, 4])  # num_accepted_tokens of each request before the step
    windows, states = [], []
    for n in range(num_req):  # committed state where vLLM reads it
        w = torch.randn(W - 1, CONV_DIM, generator=g, dtype=F64)
        s0 = torch.randn(HV, V, K, generator=g, dtype=F64)
        o = int(prev[n]) - 1
        lay.conv[lay.slots[n, 0], :, o : o + W - 1] = w.T
        lay.ssm[lay.slots[n, o]] = s0
        windows.append(w)
        states.append(s0)
    ssm_before = lay.ssm.clone()

    for step in range(2):  # two consecutive tree steps, the second from what the first committed
        parents_list = [random_tree_parents(1 + S, g, kind) for kind in ("random", "deep")]
        n_tok = sum(p.numel() for p in parents_list)
        xs = torch.randn(n_tok, CONV_DIM, generator=g, dtype=F64)
        a = torch.randn(n_tok, HV, generator=g, dtype=F64)
        b = torch.randn(n_tok, HV, generator=g, dtype=F64)
        conv_before = lay.conv_sd.clone()
        (out, stash), cu = lay.run(parents_list, xs, a, b, prev)
        assert torch.equal(lay.conv_sd, conv_before) and torch.equal(lay.ssm, ssm_before)  # verify writes nothing
        last, num_acc, truths = [], [], []
        for n, parents in enumerate(parents_list):
            s = int(cu[n])
            for i in range(parents.numel()):  # every node's output = the chain over its root..i path
                rows = [s + j for j in path_of(parents, i)]
                o_ref, _, _ = lay.chain_truth(windows[n], states[n], xs[rows], a[rows], b[rows])
                torch.testing.assert_close(out[s + i], o_ref[-1], rtol=1e-10, atol=1e-10)
            node = int(torch.randint(0, parents.numel(), (1,), generator=g))
            rows = [s + j for j in path_of(parents, node)]
            last.append(node)
            num_acc.append(len(rows) - 1)
            truths.append(lay.chain_truth(windows[n], states[n], xs[rows], a[rows], b[rows]))
        commit_gdn_layer(stash, torch.cat(parents_list), cu, torch.tensor(last), torch.tensor(num_acc))
        for n in range(num_req):
            p = num_acc[n]
            _, st, win = truths[n]
            torch.testing.assert_close(lay.ssm[lay.slots[n, p]], st, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(lay.conv[lay.slots[n, 0], :, p : p + W - 1], win.T, rtol=0, atol=0)
            windows[n], states[n] = win, st
        written = {int(lay.slots[n, num_acc[n]]) for n in range(num_req)}
        for slot in set(range(lay.num_slots)) - written:  # no other SSM slot changed
            assert torch.equal(lay.ssm[slot], ssm_before[slot])
        ssm_before = lay.ssm.clone()
        prev = torch.tensor(num_acc) + 1  # what vLLM records: accepted drafts + 1


def native_conv_spec_write(cols: torch.Tensor, offset: int, xs: torch.Tensor) -> torch.Tensor:
    """vLLM's spec-decoding conv state update for one request, written from the Triton kernel:
    reads the window at column ``offset``, stores [old columns offset+1 .. offset+W-2, x_0 .. x_{q-1}]
    from column 0 (state_len = W - 2 + q). cols: [D, L]; xs: [q, D]."""
    new = cols.clone()
    kept = cols[:, offset + 1 : offset + W - 1]
    new[:, : W - 2] = kept
    new[:, W - 2 : W - 2 + xs.shape[0]] = xs.T
    return new


def test_commit_writes_the_window_a_native_chain_step_leaves():
    """For a chain, the columns vLLM's next step reads (a - 1 .. a + W - 3) are the same whether the
    native kernel or our commit wrote them."""
    lay = Layer(1, seed=1)
    g = lay.g
    for prev_acc in (1, 3):
        for accepted in range(S + 1):
            o = prev_acc - 1
            window = torch.randn(W - 1, CONV_DIM, generator=g, dtype=F64)
            lay.conv[lay.slots[0, 0], :, o : o + W - 1] = window.T
            chain = torch.arange(-1, S, dtype=torch.long)
            xs = torch.randn(S + 1, CONV_DIM, generator=g, dtype=F64)
            ab = torch.randn(S + 1, HV, generator=g, dtype=F64)
            native = native_conv_spec_write(lay.conv[lay.slots[0, 0]], o, xs)
            (_, stash), cu = lay.run([chain], xs, ab, ab, torch.tensor([prev_acc]))
            commit_gdn_layer(stash, chain, cu, torch.tensor([accepted]), torch.tensor([accepted]))
            a_next = accepted + 1
            ours = lay.conv[lay.slots[0, 0], :, a_next - 1 : a_next + W - 2]
            torch.testing.assert_close(ours, native[:, a_next - 1 : a_next + W - 2], rtol=0, atol=0)


def test_kv_compaction_moves_the_path_to_chain_rows():
    gen = torch.Generator().manual_seed(4)
    num_blocks, heads, bs, hs = 7, 2, 4, 3
    storage = torch.randn(num_blocks, bs, heads, 2 * hs, generator=gen, dtype=F64)  # NHD physical layout
    kv = storage.permute(0, 2, 1, 3)  # logical [blocks, H, block_size, 2*hs] like TRITON_ATTN
    rows_per_req = [5, 1, 7]  # tree, prefill-like (no path), tree
    t = sum(rows_per_req)
    slot_mapping = torch.randperm(num_blocks * bs, generator=gen)[:t]
    row_base = torch.tensor([0, 5, 6])
    accepted = torch.tensor([[3, 4, -1], [-1, -1, -1], [2, 5, 6]])
    before = kv.clone()
    src, dst = compaction_rows(row_base, accepted)
    compact_kv([kv], slot_mapping, src, dst)

    def at(tensor, row):
        s = int(slot_mapping[row])
        return tensor[s // bs, :, s % bs]

    expect_moves = {1: 3, 2: 4, 7: 8, 8: 11, 9: 12}  # destination row -> source row
    for row in range(t):
        src_row = expect_moves.get(row, row)
        assert torch.equal(at(kv, row), at(before, src_row)), row
    untouched = set(range(num_blocks * bs)) - {int(slot_mapping[r]) for r in expect_moves}
    for s in untouched:
        assert torch.equal(kv[s // bs, :, s % bs], before[s // bs, :, s % bs])
