"""tegula.ops.rope against a plain torch reference (float32 products and one sum per output, rounded once),
bit for bit, in place; NeoX and GPT-J pairing, conjugate, positions or offsets, strided q/k."""
import pytest
import torch
from _quant_ref import assert_equal

from tegula.ops import rope

torch.manual_seed(0)


@pytest.fixture(params=["c", "interp"])
def target(request, monkeypatch):
    monkeypatch.setenv("TEGULA_TARGET", request.param)
    return request.param


def rope_ref(x, cs, pos, interleaved, conjugate):
    r = cs.shape[1]
    c, s = cs[pos.long(), :r // 2].float(), cs[pos.long(), r // 2:].float()
    if conjugate:
        s = -s
    c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    y = x.float().clone()
    sl1, sl2 = (slice(0, r, 2), slice(1, r, 2)) if interleaved else (slice(0, r // 2), slice(r // 2, r))
    x1, x2 = y[..., sl1].clone(), y[..., sl2].clone()
    y[..., sl1], y[..., sl2] = x1 * c - x2 * s, x2 * c + x1 * s
    return y.to(x.dtype)


CASES = [  # (dtype, interleaved, conjugate, head_dim, rot_dim, layout, positions)
    (torch.bfloat16, False, False, 128, 64, "tokens", True),
    (torch.float32, True, True, 64, 64, "tokens", True),
    (torch.bfloat16, False, True, 128, 128, "fused_qkv", True),
    (torch.float16, True, False, 64, 32, "batch", False),
    (torch.bfloat16, False, False, 128, 64, "batch_strided", False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_apply_rotary(target, case):
    dtype, inter, conj, d, r, kind, with_pos = case
    n = 4001 if target == "c" else 6
    nh, nkv, off = 8, 2, 3
    cs = torch.randn(n + 8, r)
    if kind == "fused_qkv":
        qkv = torch.randn(n, (nh + 2 * nkv) * d).to(dtype)
        q, k = qkv[:, :nh * d].view(n, nh, d), qkv[:, nh * d:(nh + nkv) * d].view(n, nkv, d)
    elif kind.startswith("batch"):
        b, s = 3, n // 3
        q, k = torch.randn(b, s, nh, d).to(dtype), torch.randn(b, s, nkv, d).to(dtype)
        if kind == "batch_strided":  # a batch stride that is not seqlen * token stride
            q = torch.randn(b, s + 2, nh, d).to(dtype)[:, 1:s + 1]
    else:
        q, k = torch.randn(n, nh, d).to(dtype), torch.randn(n, nkv, d).to(dtype)
    shape = q.shape[:-2]
    pos = torch.randint(0, cs.shape[0], shape) if with_pos else (torch.arange(shape[-1]) + off).expand(shape)
    rq, rk = rope_ref(q, cs, pos, inter, conj), rope_ref(k, cs, pos, inter, conj)
    q_strides = q.stride()
    out_q, out_k = rope.apply_rotary(q, cs, k, pos if with_pos else None, inter, conj, 0 if with_pos else off)
    assert out_q is q and out_k is k and q.stride() == q_strides
    assert torch.equal(q.view(torch.uint8) if q.is_contiguous() else q.float(), rq.view(torch.uint8)
                       if q.is_contiguous() else rq.float())
    assert_equal(k.contiguous(), rk.contiguous())


@pytest.mark.parametrize("streams", [True, False])
@pytest.mark.parametrize("dtype,inter", [(torch.bfloat16, False), (torch.float32, True)])
def test_streamed_write_back(dtype, inter, streams, monkeypatch):
    """Calls rotating >= rope.STREAM_MIN values write each head's rotated dims back by streaming copies (bfloat16:
    the prelude's converting copy) where rope.streams_in_place(), else by plain stores: heads not a multiple of the
    4-head tiles, a slice of a fused qkv row (head dims beyond rot_dim untouched), cache entries that make
    subnormal and tie results."""
    from tegula.runtime import cpu
    monkeypatch.setattr(cpu, "host_vendor", lambda: "AuthenticAMD" if streams else "GenuineIntel")
    assert rope.streams_in_place() is streams
    nh, d, r = 18, 128, 64
    n = -(-rope.STREAM_MIN // (nh * r)) + 3
    qkv = torch.randn(n, (nh + 2) * d).to(dtype)
    q = qkv[:, :nh * d].view(n, nh, d)
    cs = torch.randn(4096, r)
    cs[::7, :r // 2] = 3e-39  # cos subnormal, sin 0: x * c stays subnormal
    cs[::7, r // 2:] = 0.0
    pos = torch.randint(0, cs.shape[0], (n,))
    rest, want = qkv[:, nh * d:].clone(), rope_ref(q, cs, pos, inter, False)
    rope.apply_rotary(q, cs, None, pos, inter)
    assert torch.equal(q.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    assert torch.equal(qkv[:, nh * d:], rest)


def test_query_only_and_round_trip(target):
    n = 300 if target == "c" else 5
    q = torch.randn(n, 4, 64)
    cs = torch.cat([torch.cos(torch.arange(n)[:, None] * 0.1 * torch.arange(32)),
                    torch.sin(torch.arange(n)[:, None] * 0.1 * torch.arange(32))], 1)
    q0 = q.clone()
    rope.apply_rotary(q, cs)
    assert not torch.equal(q, q0)
    rope.apply_rotary(q, cs, conjugate=True)  # the inverse rotation, up to rounding
    torch.testing.assert_close(q, q0, rtol=1e-5, atol=1e-5)


def test_bad_input_names_the_argument():
    q, cs = torch.randn(4, 2, 64), torch.randn(16, 64)
    for fn, exc, name in [
        (lambda: rope.apply_rotary(q, torch.randn(16, 63)), ValueError, "cos_sin_cache"),
        (lambda: rope.apply_rotary(q, torch.randn(16, 128)), ValueError, "cos_sin_cache"),
        (lambda: rope.apply_rotary(q.int(), cs), TypeError, "query"),
        (lambda: rope.apply_rotary(q, cs, key=torch.randn(4, 2, 32)), ValueError, "key"),
        (lambda: rope.apply_rotary(q, cs, positions=torch.tensor([0, 1, 2, 99])), ValueError, "positions"),
        (lambda: rope.apply_rotary(q, cs, positions=torch.zeros(3, dtype=torch.int64)), ValueError, "positions"),
        (lambda: rope.apply_rotary(q, cs, seqlen_offset=20), ValueError, "seqlen_offset"),
        (lambda: rope.apply_rotary(q, cs, interleaved=1), TypeError, "interleaved"),
        (lambda: rope.apply_rotary(q.transpose(1, 2), cs), ValueError, "query"),
    ]:
        with pytest.raises(exc, match=name):
            fn()
