"""The few-row kernels (hpc_rlhf/generation/lean/few_rows.cpp): the products (with the norm or the gating on the way in)
and the decode attention they compute, where the decoder uses them, and what happens where they cannot be built."""
import logging

import pytest
import torch

from hpc_rlhf.generation.lean import few_rows


def _kernel():
    mod = few_rows.kernel()
    # this machine (and CI's) is an x86 CPU with AVX2 and a compiler: the kernel must build here
    assert few_rows.cpu_supported() is None and mod is not None
    return mod


@pytest.mark.parametrize("K", [8, 13, 64, 257])  # whole lanes of 8, and K % 8 left over
def test_products_match_float64(K):
    """Every row count from 1 to 9 (blocks of 4 rows and 1-3 left over), weights of odd and even output counts
    side by side (pairs of weight rows and one left over), against the product in float64."""
    mod = _kernel()
    g = torch.Generator().manual_seed(K)
    weights = [torch.randn(n, K, generator=g) for n in (1, 3, 16, 17)]
    for rows in range(1, 10):
        x = torch.randn(rows, K, generator=g)
        got = mod.linear_rows(x, weights)
        want = (x.double() @ torch.cat(weights).double().t()).float()
        assert got.shape == (rows, 37) and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=1e-5 * K ** 0.5, rtol=1e-5)


def test_the_norm_before_the_product():
    """With a norm weight the rows are RMS-normalised first (Llama's norm: x * rsqrt(mean(x^2) + eps) * g): the
    same as ``F.rms_norm`` then the product, in float64; an input of one value per row normalises to +-1."""
    mod = _kernel()
    g = torch.Generator().manual_seed(5)
    for K in (8, 61):
        x, w, gain = torch.randn(6, K, generator=g) * 3, [torch.randn(9, K, generator=g)], torch.rand(K, generator=g)
        got = mod.linear_rows(x, w, gain, 1e-5)
        normed = torch.nn.functional.rms_norm(x.double(), (K,), gain.double(), 1e-5)
        torch.testing.assert_close(got, (normed @ w[0].double().t()).float(), atol=1e-5 * K ** 0.5, rtol=1e-5)
    # rows [c, c, ..., c]: mean of squares c^2, so each normalised value is sign(c) (eps 0), times the gain
    x = torch.tensor([[2.0] * 8, [-0.5] * 8])
    ones = torch.ones(8)
    got = mod.linear_rows(x, [torch.eye(8)], ones, 0.0)
    torch.testing.assert_close(got, torch.tensor([[1.0] * 8, [-1.0] * 8]))
    with pytest.raises(RuntimeError, match="norm weight must be a contiguous float32 CPU tensor"):
        mod.linear_rows(x, [torch.eye(8)], torch.ones(7), 0.0)


def test_the_gated_input():
    """``gated``: x = [gate | up] and the product's input is silu(gate) * up (Llama's MLP), against float64; an odd
    width and a norm together with gating are refused."""
    mod = _kernel()
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(5, 2 * 21, generator=g) * 4, [torch.randn(7, 21, generator=g)]
    gate, up = x.double().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up) @ w[0].double().t()
    torch.testing.assert_close(mod.linear_rows(x, w, gated=True), want.float(), atol=1e-5, rtol=1e-5)
    # silu(0) = 0 and silu(a) -> a for large a: [0, 30 | 5, 2] -> [0 * 5, 30 * 2] (exp(-30) is below float's step)
    got = mod.linear_rows(torch.tensor([[0.0, 30.0, 5.0, 2.0]]), [torch.eye(2)], gated=True)
    torch.testing.assert_close(got, torch.tensor([[0.0, 60.0]]))
    with pytest.raises(RuntimeError, match="even width"):
        mod.linear_rows(torch.randn(2, 5), [torch.randn(3, 2)], gated=True)
    with pytest.raises(RuntimeError, match="exclude each other"):
        mod.linear_rows(torch.randn(2, 4), [torch.randn(3, 2)], torch.ones(4), 1e-6, True)


def test_leading_dimensions_and_strided_input():
    """``linear_rows`` keeps the input's leading dimensions, and a strided input (a transposed view) gives the
    same product as its contiguous copy."""
    mod = _kernel()
    x = torch.randn(2, 3, 40)
    w = [torch.randn(5, 40)]
    got = few_rows.linear_rows(mod, x, w)
    assert got.shape == (2, 3, 5)
    torch.testing.assert_close(got, x @ w[0].t())
    xt = torch.randn(40, 6).t()  # [6, 40], not contiguous
    torch.testing.assert_close(mod.linear_rows(xt, w), xt.contiguous() @ w[0].t())


def test_bad_inputs_are_refused_with_the_reason():
    mod = _kernel()
    with pytest.raises(RuntimeError, match="contiguous float32 CPU tensor"):
        mod.linear_rows(torch.randn(2, 8), [torch.randn(8, 4).t()])  # [4, 8] but strided
    with pytest.raises(RuntimeError, match="contiguous float32 CPU tensor"):
        mod.linear_rows(torch.randn(2, 8), [torch.randn(4, 9)])  # K differs
    with pytest.raises(RuntimeError, match="2-d float32"):
        mod.linear_rows(torch.randn(2, 8, dtype=torch.float64), [torch.randn(4, 8)])


def test_a_failed_build_warns_and_leaves_onednn(tmp_path, monkeypatch, caplog):
    """A source that does not compile: ``build`` returns None and logs why, naming the file."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++;\n")  # fails at once, before any header is parsed
    with caplog.at_level(logging.WARNING, logger=few_rows.__name__):
        assert few_rows.build(bad, "hpc_rlhf_few_rows_broken") is None
    assert "few-row kernel unavailable" in caplog.text and str(bad) in caplog.text


def test_other_cpus_are_named(monkeypatch):
    monkeypatch.setattr(few_rows.platform, "machine", lambda: "aarch64")
    assert few_rows.cpu_supported() == "the CPU is aarch64, not x86-64"
    monkeypatch.setattr(few_rows.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(few_rows.torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert few_rows.cpu_supported() == "the CPU has no AVX2 (PyTorch reports DEFAULT)"


@pytest.mark.parametrize("M,N,K", [(64, 960, 576), (67, 49, 300), (130, 24, 8), (5, 1, 3), (1, 30, 600)])
def test_panel_products_match_float64(M, N, K):
    """``pack_panels`` + ``linear_panels``: several weights stacked, against float64, with and without a residual
    added; rows in tiles of 4 and chunks of 64 with 1 to 3 left over, outputs in panels of 24 with a partial last
    one, K in steps of 256 with a rest.  The panels hold each weight at [output // 24, k, output % 24] and zeros
    past the outputs."""
    mod = _kernel()
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    weights = [torch.randn(N, K, generator=g), torch.randn(7, K, generator=g)]
    stacked = torch.cat(weights)
    panels = mod.pack_panels(weights)
    P = (N + 7 + 23) // 24
    assert panels.shape == (P, K, 24)
    padded = torch.cat([stacked, stacked.new_zeros(P * 24 - N - 7, K)])
    assert torch.equal(panels, padded.view(P, 24, K).transpose(1, 2))
    x = torch.randn(M, K, generator=g)
    got = mod.linear_panels(x, panels, N + 7)
    assert got.shape == (M, N + 7)
    want = x.double() @ stacked.double().t()
    torch.testing.assert_close(got.double(), want, atol=2e-6 * K ** 0.5, rtol=1e-5)
    residual = torch.randn(M, N + 7, generator=g)  # the sums start from it, in the first steps of k only
    got = mod.linear_panels(x, panels, N + 7, residual=residual)
    torch.testing.assert_close(got.double(), want + residual.double(), atol=2e-6 * K ** 0.5, rtol=1e-5)


def test_panel_products_take_the_norm_and_the_gating():
    """The RMS norm and ``silu(gate) * up`` on the way into ``linear_panels`` match PyTorch's in float64, gates
    from -100 to 100 included (sigmoid of a large gate is 1, of a large negative one 0, never NaN), and a strided
    input gives the same as its contiguous copy."""
    mod = _kernel()
    g = torch.Generator().manual_seed(11)
    K, N, M = 40, 30, 19
    w = torch.randn(N, K, generator=g)
    panels = mod.pack_panels([w])
    gain = torch.rand(K, generator=g) + 0.5
    x = torch.randn(M, K, generator=g) * 3
    want = torch.nn.functional.rms_norm(x.double(), (K,), gain.double(), 1e-5) @ w.double().t()
    torch.testing.assert_close(mod.linear_panels(x, panels, N, gain, 1e-5).double(), want, atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(M, 2 * K, generator=g) * 6
    gate_up[0, :8] = torch.tensor([-100.0, -88.0, -30.0, -0.0, 0.0, 30.0, 88.0, 100.0])
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up) @ w.double().t()
    got = mod.linear_panels(gate_up, panels, N, gated=True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    strided = torch.randn(2 * K, M, generator=g).t()
    torch.testing.assert_close(few_rows.linear_panels(mod, strided[None], panels, N, gated=True)[0],
                               mod.linear_panels(strided.contiguous(), panels, N, gated=True))
    with pytest.raises(RuntimeError, match=r"the residual must be a float32 CPU tensor \[19, 30\]"):
        mod.linear_panels(x, panels, N, residual=torch.zeros(19, 31))
    with pytest.raises(RuntimeError, match="panels hold 1 to 24 outputs, not 25"):
        mod.linear_panels(x, mod.pack_panels([torch.randn(5, K)]), 25)
    with pytest.raises(RuntimeError, match=r"panels must be a contiguous float32 CPU tensor \[P, 41, 24\]"):
        mod.linear_panels(torch.randn(2, 41), panels, N)
    with pytest.raises(RuntimeError, match=r"pack_panels: each weight must be a contiguous float32 CPU tensor "
                                           r"\[out, 8\]"):
        mod.pack_panels([torch.randn(3, 8), torch.randn(3, 9)])


@pytest.mark.parametrize("nq,nkv,D", [(9, 3, 64), (4, 4, 6)])
def test_rope_store_rotates_and_writes_the_slot(nq, nkv, D):
    """``rope_store``: the queries and keys rotated as ``x * cos + rotate_half(x) * sin`` (the transformers
    formula, in float64), the rotated keys and the values written at the one cache slot given of a strided cache (a
    view of a longer one), every other slot left as it was; a slot outside the cache is refused."""
    mod = _kernel()
    g = torch.Generator().manual_seed(nq + D)
    B, S = 5, 7
    qkv = torch.randn(B, (nq + 2 * nkv) * D, generator=g)
    cos, sin = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
    signed_sin = torch.cat([-sin[:, :D // 2], sin[:, D // 2:]], dim=-1)
    keys = torch.randn(B, nkv, S + 3, D, generator=g)[:, :, :S]
    values = torch.randn(B, nkv, S + 3, D, generator=g)[:, :, :S]
    before_k, before_v = keys.clone(), values.clone()
    q = mod.rope_store(qkv, cos, signed_sin, keys, values, 4, nq)

    def rotated(x):  # [B, H, D]
        x = x.double()
        half = torch.cat([-x[..., D // 2:], x[..., :D // 2]], dim=-1)
        return x * cos.double()[:, None] + half * sin.double()[:, None]
    heads = qkv.view(B, nq + 2 * nkv, D)
    torch.testing.assert_close(q.double(), rotated(heads[:, :nq]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(keys[:, :, 4].double(), rotated(heads[:, nq:nq + nkv]), atol=1e-6, rtol=1e-6)
    assert torch.equal(values[:, :, 4], heads[:, nq + nkv:])
    others = [s for s in range(S) if s != 4]
    assert torch.equal(keys[:, :, others], before_k[:, :, others])
    assert torch.equal(values[:, :, others], before_v[:, :, others])
    with pytest.raises(RuntimeError, match="slot 7 is outside the cache's 7 slots"):
        mod.rope_store(qkv, cos, signed_sin, keys, values, 7, nq)


def test_decoder_uses_it_for_few_rows_only(tmp_path, monkeypatch):
    """With the kernel, the lean decoder sends products of at most MAX_ROWS rows to ``linear_rows`` (the module's
    own weights) and larger ones to ``linear_panels``, packing a product's panels only when that needs them and
    making no oneDNN copy; without it (``few_row_kernel=False``) every product goes to oneDNN.  The same logits
    either way."""
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.generation.lean import decoder as lean_decoder
    from hpc_rlhf.models.tiny import build_tiny_model
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(
        tmp_path / "m", arch="qwen2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64, seed=3)).eval()
    rows_seen, panel_rows_seen = [], []
    real, real_panels = few_rows.linear_rows, few_rows.linear_panels

    def counting(mod, x, weights, norm=None, gated=False):
        rows_seen.append(x.numel() // x.shape[-1])
        return real(mod, x, weights, norm, gated)

    def counting_panels(mod, x, panels, n, norm=None, gated=False, residual=None):
        panel_rows_seen.append(x.numel() // x.shape[-1])
        return real_panels(mod, x, panels, n, norm, gated, residual)
    monkeypatch.setattr(lean_decoder.few_rows, "linear_rows", counting)
    monkeypatch.setattr(lean_decoder.few_rows, "linear_panels", counting_panels)
    logits = {}
    for use in (True, False):
        dec = lean_decoder.LeanDecoder(model, few_row_kernel=use)
        B = 3
        dec.start(B, 8, torch.float32, torch.device("cpu"))
        assert (dec.few is not None) == use
        with torch.no_grad():
            first = dec.forward(torch.tensor([[5, 6, 7, 8]] * B), torch.arange(4).expand(B, 4),
                                torch.ones(B, 4, dtype=torch.bool))
            second = dec.forward(torch.tensor([[9]] * B), torch.full((B, 1), 4), torch.ones(B, 1, dtype=torch.bool))
        logits[use] = (first, second)
        if use:
            # the prefill's 12 rows went to the panels, its head (3 rows) and every decode product to linear_rows
            assert rows_seen and max(rows_seen) <= few_rows.MAX_ROWS and len(rows_seen) == 1 + 4 * 2 + 1
            assert panel_rows_seen == [B * 4] * (4 * 2)
            rows_seen.clear()
            panel_rows_seen.clear()
        # panels only for the products that went to them (not the head's); oneDNN's copies only without the kernel
        assert all((p._panels is not None) == use and (p._weight is None) == use for layer in dec.layers for p in layer)
        assert dec.head._panels is None and (dec.head._weight is None) == use
    assert not rows_seen and not panel_rows_seen
    for a, b in zip(logits[True], logits[False]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)



@pytest.mark.parametrize("nq,nkv,D", [(4, 4, 16), (6, 2, 12), (3, 1, 64)])  # equal heads, grouped, one kv head
def test_decode_attention_matches_sdpa(nq, nkv, D):
    """``attend_one``: one query per row and head over the valid slots of strided key/value caches (a view of
    the first S of a longer cache, as the decoder passes them), against ``scaled_dot_product_attention`` with
    ``enable_gqa`` in float64; heads side by side in the output."""
    mod = _kernel()
    g = torch.Generator().manual_seed(nq * 100 + D)
    B, S, capacity = 5, 7, 11
    qk = torch.randn(B, 1, nq + nkv, D, generator=g)  # the decoder's rotated queries and keys, one token
    keys = torch.randn(B, nkv, capacity, D, generator=g)[:, :, :S]
    values = torch.randn(B, nkv, capacity, D, generator=g)[:, :, :S]
    valid = torch.rand(B, S, generator=g) > 0.4
    valid[:, -1] = True  # the slot just written
    got = mod.attend_one(qk[:, 0, :nq], keys, values, valid, D ** -0.5)
    want = torch.nn.functional.scaled_dot_product_attention(
        qk[:, :, :nq].transpose(1, 2).double(), keys.double(), values.double(), attn_mask=valid[:, None, None],
        enable_gqa=True)
    assert got.shape == (B, nq * D)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(B, nq * D).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("nq,nkv,D", [(9, 3, 64), (6, 2, 12), (4, 4, 16)])  # SmolLM2's heads; D % 8 left over
def test_decode_attention_over_a_shared_prefix(nq, nkv, D):
    """With a shared prefix, row b reads prefix ``prefix_row[b]``'s slots (its padding left out) and then its own,
    under one softmax: the same as attention over the prefix and the row's slots concatenated, in float64.  Rows
    map to prefixes in any order, a prefix may have no row, a row's own slots may all be masked but one, and a
    prefix may be all padding for a row whose own slots are valid; more slots than a block of 8, and fewer."""
    mod = _kernel()
    g = torch.Generator().manual_seed(nq * 7 + D)
    B, U, P = 6, 4, 13
    rows = torch.tensor([2, 0, 0, 3, 2, 3])  # prefix 1 has no row
    for S in (3, 21):
        q = torch.randn(B, nq, D, generator=g)
        keys, values = torch.randn(B, nkv, S + 4, D, generator=g)[:, :, :S], torch.randn(B, nkv, S, D, generator=g)
        pk, pv = torch.randn(U, nkv, P, D, generator=g), torch.randn(U, nkv, P, D, generator=g)
        pvalid = torch.rand(U, P, generator=g) > 0.3
        pvalid[3] = False  # rows 3 and 5 read a prefix of padding only
        valid = torch.rand(B, S, generator=g) > 0.3
        valid[:, -1] = True
        valid[1, :-1] = False
        got = mod.attend_one(q, keys, values, valid, D ** -0.5, pk, pv, pvalid, rows)
        # a masked slot's value never reaches the output, whatever it holds
        poisoned = values.masked_fill(~valid[:, None, :, None], float("nan"))
        assert torch.equal(mod.attend_one(q, keys, poisoned, valid, D ** -0.5, pk, pv, pvalid, rows), got)
        allk = torch.cat([pk[rows], keys], dim=2).double()
        allv = torch.cat([pv[rows], values], dim=2).double()
        allowed = torch.cat([pvalid[rows], valid], dim=1)
        want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None].double(), allk, allv,
                                                                attn_mask=allowed[:, None, None], enable_gqa=True)
        assert got.shape == (B, nq * D)
        torch.testing.assert_close(got, want.reshape(B, nq * D).float(), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="prefix_row"):
        mod.attend_one(q, keys, values, valid, 0.5, pk, pv, pvalid, torch.tensor([0, 1, 2, 3, 4, 0]))
    with pytest.raises(RuntimeError, match="together"):
        mod.attend_one(q, keys, values, valid, 0.5, pk, pv)
    with pytest.raises(RuntimeError, match="prefix's keys and values"):
        mod.attend_one(q, keys, values, valid, 0.5, pk[:, :1], pv[:, :1], pvalid, rows)


def test_the_kernels_exp_matches_float64_softmax_over_a_wide_range():
    """The kernel's exponential (``exp_nonpositive``) through its softmax: scores spread over 0 to -100 (weights
    down to below the smallest float, which count as 0) give the softmax of float64 to float32's rounding."""
    mod = _kernel()
    g = torch.Generator().manual_seed(3)
    S = 203
    q = torch.ones(2, 1, 8)
    keys = torch.zeros(2, 1, S, 8)
    keys[..., 0] = -torch.rand(2, 1, S, generator=g) * 100  # score = key[0] * scale with q = 1, scale 1
    keys[0, 0, 0, 0] = 0.0
    values = torch.randn(2, 1, S, 8, generator=g)
    valid = torch.ones(2, S, dtype=torch.bool)
    got = mod.attend_one(q, keys, values, valid, 1.0)
    weights = torch.softmax(keys[..., 0].double(), dim=-1)  # [2, 1, S]
    want = (weights[..., None] * values.double()).sum(2).reshape(2, 8)
    torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=1e-6)


def test_decode_attention_edge_cases():
    """One valid slot: its value exactly; equal scores: the mean of the values; no valid slot: zeros (the
    decoder never asks for one: the slot it just wrote is valid)."""
    mod = _kernel()
    q = torch.zeros(3, 1, 8)
    keys = torch.randn(3, 1, 4, 8)  # q = 0: every score is 0
    values = torch.arange(3 * 4 * 8, dtype=torch.float32).view(3, 1, 4, 8)
    valid = torch.tensor([[False, False, True, False], [True] * 4, [False] * 4])
    got = mod.attend_one(q, keys, values, valid, 0.5)
    torch.testing.assert_close(got[0], values[0, 0, 2])
    torch.testing.assert_close(got[1], values[1, 0].mean(0))
    assert torch.equal(got[2], torch.zeros(8))
    with pytest.raises(RuntimeError, match="valid must be boolean"):
        mod.attend_one(q, keys, values, valid.float(), 0.5)


def test_work_large_enough_is_split_among_threads():
    """At the toy model's sizes the kernel splits its outputs among 2 threads (tiny products run on one): the
    same results as in float64, for the products (8 rows of 256 by 768 outputs, in chunks of 16) and for the
    attention (8 rows x 4 heads over 300 slots)."""
    mod = _kernel()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(9)
        x, w = torch.randn(8, 256, generator=g), [torch.randn(700, 256, generator=g), torch.randn(68, 256, generator=g)]
        want = (x.double() @ torch.cat(w).double().t()).float()
        torch.testing.assert_close(mod.linear_rows(x, w), want, atol=2e-4, rtol=1e-5)
        q = torch.randn(8, 4, 64, generator=g)
        k, v = torch.randn(8, 4, 300, 64, generator=g), torch.randn(8, 4, 300, 64, generator=g)
        valid = torch.rand(8, 300, generator=g) > 0.3
        want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None].double(), k.double(), v.double(),
                                                                attn_mask=valid[:, None, None], scale=0.125)
        torch.testing.assert_close(mod.attend_one(q, k, v, valid, 0.125), want.reshape(8, 4 * 64).float(),
                                   atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)
