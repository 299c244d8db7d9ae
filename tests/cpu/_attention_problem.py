"""Test helper: random inputs of one Weaver layer's node attention (``vllm_tfm.kernels.weaver_attention``),
the float64 function of their stored values, and the checks of a kernel's results against both it
and the torch reference; shared by the CPU emulation tests and the GPU tests."""

from __future__ import annotations

import random

import torch

from vllm_tfm.kernels import weaver_attention as ka

ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # relative spacing


def problem(seed: int, r: int, w: int, heads: int, hd: int, depth: int, n: int, dtype, *, roots: bool = False,
            chain: bool = False, invalid: float = 0.3, device: str = "cpu"):
    """One scorer call's inputs: per request a random forest (or a chain) of earlier nodes in slots
    0..m-1 with their key-mask rows, then w new nodes in the next free slots (roots: parent -1)."""
    g = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    p0 = 1 + depth
    s_len = p0 + n + 1
    cols = -(-s_len // 16) * 16
    kv = torch.randn(2, r, heads, s_len, hd, generator=gen).to(dtype)
    key_bias = torch.full((r, n + 2, cols), float("-inf"), dtype=dtype)
    key_bias[:, :, :p0] = 0.0
    node_ids = torch.zeros(r, w, dtype=torch.long)
    parent_ids = torch.full((r, w), -1, dtype=torch.long)
    valid = torch.zeros(r, w, dtype=torch.bool)
    for b in range(r):
        m = 0 if roots else g.randint(1, n - w)
        for k in range(m):  # earlier nodes: row = the parent's row (or the prompt's) plus the node's column
            par = (k - 1 if chain else g.randrange(k)) if k else -1
            key_bias[b, k] = key_bias[b, par if par >= 0 else n + 1]
            key_bias[b, k, p0 + k] = 0.0
        for i in range(w):
            valid[b, i] = i == 0 or g.random() >= invalid
            if valid[b, i]:
                node_ids[b, i] = m + i
                parent_ids[b, i] = -1 if roots else (m - 1 if chain else g.randrange(m))
            else:  # garbage the kernel must not use
                node_ids[b, i] = g.choice([n, n + 5, -3, 10**6])
                parent_ids[b, i] = g.choice([-1, 0, n + 1, 10**6])
    depths = torch.randint(-1, depth + 2, (r, w), generator=gen)  # clamped to [0, D - 1]
    proj = torch.randn(r * w, 6 * heads * hd, generator=gen).to(dtype)
    rope = torch.randn(depth, 2, 3, 1, hd, generator=gen).to(dtype)
    tensors = [t.to(device) for t in (proj, rope, node_ids, parent_ids, depths, valid, kv, key_bias)]
    return (*tensors, p0, hd**-0.5)


def rounded(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.to(dtype).double()


def float64_attention(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [R w, heads hd], rotated k, v [R, w, heads, hd]) from the stored values in float64, the
    rotation rounded to the dtype after the product and after the multiply-add."""
    proj, rope, node_ids, parent_ids, depths, valid, kv, key_bias, p0, scale = args
    dt = proj.dtype
    r, w = node_ids.shape
    heads, hd, n = kv.shape[2], kv.shape[4], key_bias.shape[1] - 2
    span = p0 + n
    x = proj.double().view(r, w, 2, 3, heads, hd)
    tab = rope.double()[depths.clamp(0, rope.shape[0] - 1)]  # [R, w, 2, 3, 1, hd]
    rot = rounded(rounded(x[:, :, 0] * tab[:, :, 0], dt) + x[:, :, 1] * tab[:, :, 1], dt)  # [R, w, 3, heads, hd]
    out = torch.zeros(r, w, heads, hd, dtype=torch.float64)
    keys, vals = kv[0].double().clone(), kv[1].double().clone()  # [R, heads, S, hd]
    for b in range(r):
        for i in range(w):
            if valid[b, i]:
                keys[b, :, p0 + node_ids[b, i]] = rot[b, i, 1]
                vals[b, :, p0 + node_ids[b, i]] = rot[b, i, 2]
    for b in range(r):
        for i in range(w):
            if not valid[b, i]:
                continue
            key = p0 + int(node_ids[b, i])
            bias = key_bias[b, int(parent_ids[b, i]) % (n + 2), :span].double().clone()
            bias[key] = 0.0
            sc = torch.einsum("hd,hjd->hj", rot[b, i, 0], keys[b, :, :span]) * scale + bias
            out[b, i] = torch.einsum("hj,hjd->hd", torch.softmax(sc, dim=-1), vals[b, :, :span])
    return out.view(r * w, heads * hd), rot[:, :, 1], rot[:, :, 2]


def run_on_copies(fn, args, write_mask: bool):
    """(out, kv, key_bias) of ``fn`` (the kernel or the reference) on copies of the cache and mask."""
    proj, rope, node_ids, parent_ids, depths, valid, kv, key_bias, p0, scale = args
    kv, key_bias = kv.clone(), key_bias.clone()
    out = fn(proj, rope, node_ids, parent_ids, depths, valid, kv, key_bias, p0, scale, write_mask)
    return out, kv, key_bias


def run_reference(args, write_mask: bool):
    """The reference on copies (it, too, reads no node id of an invalid row)."""
    return run_on_copies(ka.node_attention_reference, args, write_mask)


def check_results(args, write_mask: bool, got, ref) -> None:
    """The kernel's (out, kv, key_bias) ``got`` after one call on ``args`` against the float64
    function and the reference's ``ref`` (``run_reference``; None: the float64 function and the
    untouched entries only)."""
    proj, _, node_ids, _, _, valid, kv0, kb0, p0, _ = args
    dt = proj.dtype
    r, w = node_ids.shape
    heads, n = kv0.shape[2], kb0.shape[1] - 2
    out, kv, kb = got
    exact, k_rot, v_rot = (t.to(out.device) for t in float64_attention([a.cpu() if isinstance(a, torch.Tensor) else a
                                                                       for a in args]))
    rows = valid.view(-1)
    err = (out.double() - exact).abs()[rows]
    vmax = float(kv0[1].double().abs().max().clamp(min=v_rot.abs().max()))
    bound = 1e-5 * vmax + 2 * ULP[dt] * exact.abs()[rows]
    assert bool((err <= bound).all()), float((err / bound).max())
    if ref is not None:
        ref_out, ref_kv, ref_kb = ref
        assert bool(((out.double() - ref_out.double()).abs()[rows] <= 2 * bound + 4 * ULP[dt] * vmax).all())
    # K/V: the valid nodes' columns hold their rotated k / v (one rounding), every other column of
    # the span is untouched (the trash column, written by the reference, is outside the span)
    written = torch.zeros(r, kv0.shape[3], dtype=torch.bool, device=out.device)
    for b in range(r):
        for i in range(w):
            if valid[b, i]:
                col = p0 + int(node_ids[b, i])
                written[b, col] = True
                for part, rot in ((0, k_rot), (1, v_rot)):
                    got, want = kv[part, b, :, col].double(), rot[b, i]
                    assert bool(((got - want).abs() <= ULP[dt] * want.abs()).all())
                    if ref is not None:
                        assert bool(((got - ref_kv[part, b, :, col].double()).abs() <= ULP[dt] * want.abs()).all())
    span = p0 + n
    keep = ~written[:, :span]
    assert torch.equal(kv[:, :, :, :span][:, keep[:, None].expand(r, heads, span)],
                       kv0[:, :, :, :span][:, keep[:, None].expand(r, heads, span)])
    # key-mask rows: the valid nodes' rows as the reference writes them, all other rows untouched
    # (row n, the trash slot's, is the reference's to write for invalid rows)
    slots = torch.zeros(r, n + 2, dtype=torch.bool, device=out.device)
    for b in range(r):
        for i in range(w):
            if valid[b, i] and write_mask:
                slots[b, int(node_ids[b, i])] = True
    if ref is not None:
        assert torch.equal(kb[slots], ref_kb[slots])
    untouched = ~slots
    untouched[:, n] = False
    assert torch.equal(kb[untouched], kb0[untouched])
