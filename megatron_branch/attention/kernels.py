"""Per-part attention kernels that return (out, lse), with an explicit backward that takes out and lse as inputs.

SHAPE LEGEND (INTERNAL SDPA layout, NOT Megatron's sequence-first one):
    q      [b, n, sq, h]   b batch, n query heads, sq query rows, h head dim
    k, v   [b, g, sk, h]   g kv heads (GQA groups, g divides n; query head j uses kv head j // (n // g)), COMPACT:
                           every kernel here groups the query heads itself, nothing is ever expanded
    mask   [sq, sk] bool   True = visible; None = all visible
    out    [b, n, sq, h]
    lse    [b, n, sq]      log-sum-exp of the scaled scores over the visible keys (FlashAttention-2's L),
                           float32 (float64 for float64 inputs)

Why an explicit backward: a part's backward must be able to run with the MERGED out and lse of several parts
(ring-flash-attention by zhuzilin). With P = exp(S - lse_merged) and D = rowsum(dout * out_merged), the per-part
dS = P * (dP - D) is exactly the slice of the full attention's dS over that part's keys, so summing dq over parts
and scattering dk/dv gives the exact gradient of the merged attention.

Which fused kernel `fused_attention_forward/backward` run (one dispatcher, chosen by device and dtype):
    CPU                    aten._scaled_dot_product_flash_attention_for_cpu (+ _backward), any float dtype; takes
                           g < n kv heads natively (measured in torch 2.13: dk/dv come back with g heads)
    CUDA, fp16/bf16        flash_attn's kernel when that package is installed, else torch's own
                           aten._scaled_dot_product_flash_attention (+ _backward): both return and consume the lse
                           and take g < n natively (FlashAttention-2's MQA/GQA; UNTESTED here, tests/gpu checks it)
    anything else          the math kernels below (exact, slow; CUDA fp32/fp64 land here): the query heads are
                           viewed as [g, r] and K/V broadcast over r (no copy)
Inputs may be strided views (e.g. [s, b, g, h] storage read as [b, g, s, h]): every kernel reads strides, so cached
K/V are never copied to call one (only the last dim must be contiguous).

TRAP: the lse returned by `aten._scaled_dot_product_flash_attention_for_cpu` carries no gradient; autograd through it
is silently wrong (dq off by ~25%). These functions are called under no_grad by the autograd.Function that owns them.
"""

from __future__ import annotations

import inspect

import torch

from megatron_branch.precision import accumulation_dtype

try:  # CUDA only; never required on CPU
    from flash_attn import flash_attn_func  # type: ignore[import-not-found]
    from flash_attn.flash_attn_interface import _flash_attn_backward  # type: ignore[import-not-found]

    # the private backward's arguments changed across flash_attn releases (window_size tuple -> left/right, softcap)
    _FA_BWD_PARAMS = set(inspect.signature(_flash_attn_backward).parameters)
    _HAVE_FLASH_ATTN = True
except Exception:  # any import failure (missing wheel, ABI mismatch) means "not available"
    _HAVE_FLASH_ATTN = False


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 statistics for half/bf16/fp32 inputs, fp64 for fp64 inputs (precision.accumulation_dtype)."""
    return accumulation_dtype(dtype)


def _causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    assert sq == sk, f"causal parts are a segment's own keys: need sq == sk, got {sq} != {sk}"
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()  # [sq, sk]


# ---------------------------------------------------------------------------------------------------------------
# math kernels: any mask, any dtype, any device
# ---------------------------------------------------------------------------------------------------------------


def _grouped(x: torch.Tensor, g: int) -> torch.Tensor:
    """[b, n, s, t] -> [b, g, r, s, t]: query head j = (group j // r, member j % r)."""
    b, n, s, t = x.shape
    return x.reshape(b, g, n // g, s, t)


def math_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention; rows with no visible key get out = 0 and lse = -inf (no NaN)."""
    acc = lse_dtype(q.dtype)
    b, n, sq, h = q.shape
    g = k.shape[1]
    qg = _grouped(q.to(acc), g)  # [b, g, r, sq, h]
    s = torch.matmul(qg, k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale  # [b, g, r, sq, sk]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [b, g, r, sq]; -inf on empty rows
    # empty rows: exp(-inf - (-inf)) would be NaN, so subtract 0 there instead; exp(-inf) = 0 gives out = 0
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe_lse.unsqueeze(-1))  # [b, g, r, sq, sk]
    out = torch.matmul(p, v.to(acc).unsqueeze(2))  # [b, g, r, sq, hv] (hv: v's width, h's unless MLA)
    return out.reshape(b, n, sq, v.shape[-1]).to(q.dtype), lse.reshape(b, n, sq)


def math_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2 backward using the GIVEN out and lse (possibly merged over several parts)."""
    acc = lse_dtype(q.dtype)
    b, n, sq, h = q.shape
    g = k.shape[1]
    qa, doa, oa = (_grouped(t.to(acc), g) for t in (q, dout, out))  # [b, g, r, sq, h]
    ka, va = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)  # [b, g, 1, sk, h]
    s = torch.matmul(qa, ka.transpose(-1, -2)) * scale  # [b, g, r, sq, sk]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse_g = lse.to(acc).reshape(b, g, n // g, sq)
    safe_lse = torch.where(torch.isinf(lse_g), torch.zeros_like(lse_g), lse_g)  # [b, g, r, sq]
    p = torch.exp(s - safe_lse.unsqueeze(-1))  # rows of the merged softmax, this part's columns
    dv = torch.matmul(p.transpose(-1, -2), doa).sum(2)  # [b, g, sk, h]: the r query heads of a group summed
    dp = torch.matmul(doa, va.transpose(-1, -2))  # [b, g, r, sq, sk]
    d = (doa * oa).sum(dim=-1, keepdim=True)  # [b, g, r, sq, 1]; D = rowsum(dO * O) over the MERGED out
    ds = p * (dp - d)  # [b, g, r, sq, sk]
    dq = torch.matmul(ds, ka) * scale  # [b, g, r, sq, h]
    dk = (torch.matmul(ds.transpose(-1, -2), qa) * scale).sum(2)  # [b, g, sk, h]
    return dq.reshape(b, n, sq, h).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------------------------------------------
# fused kernels: no mask, only "all visible" or causal with sq == sk
# ---------------------------------------------------------------------------------------------------------------

_HALF = (torch.float16, torch.bfloat16)


def fused_kernel_name(q: torch.Tensor) -> str:
    """Which kernel `fused_attention_forward` runs for inputs like `q`: "cpu-flash", "flash-attn",
    "cuda-flash" or "math"."""
    if q.device.type == "cpu":
        return "cpu-flash"
    if q.is_cuda and q.dtype in _HALF:
        return "flash-attn" if _HAVE_FLASH_ATTN else "cuda-flash"
    return "math"


def _kernel(q: torch.Tensor, v: torch.Tensor) -> str:
    """`fused_kernel_name`, or "math" where the values' head width differs from the queries' (multi-latent
    attention: v_head_dim vs qk_nope + qk_rope, models/mla.py), which the flash kernels refuse."""
    return fused_kernel_name(q) if q.shape[-1] == v.shape[-1] else "math"


def fused_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention returning (out, lse), the kernel chosen by `fused_kernel_name`.

    Never differentiate through the returned lse (see TRAP above): call it under no_grad.
    """
    if causal:
        assert q.shape[-2] == k.shape[-2], "causal fused parts need sq == sk"
    kind = _kernel(q, v)
    if kind == "cpu-flash":
        # the CPU flash op supports fp64/fp32/bf16/fp16 in torch 2.13; lse comes back fp32 (fp64 for fp64)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale
        )
        return out, lse
    if kind == "flash-attn":
        # flash_attn wants [b, s, n, h]; the public API returns softmax_lse [b, n, sq] fp32 with return_attn_probs
        t = [x.transpose(1, 2) for x in (q, k, v)]  # [b, s, n, h]
        out, lse, _ = flash_attn_func(*t, 0.0, softmax_scale=scale, causal=causal, return_attn_probs=True)
        return out.transpose(1, 2), lse
    if kind == "cuda-flash":
        # torch's own FlashAttention-2: (out, logsumexp [b, n, sq] fp32, cum_seq_q, cum_seq_k, max_q, max_k,
        # philox_seed, philox_offset, debug_mask). UNTESTED on GPU (none was lent): tests/gpu checks it.
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    mask = _causal_mask(q.shape[-2], k.shape[-2], q.device) if causal else None
    return math_attention_forward(q, k, v, mask, scale)


def fused_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward with the GIVEN out and lse (merged ones make the per-part backward exact)."""
    kind = _kernel(q, v)
    if kind == "cpu-flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(),
            q,
            k,
            v,
            out.contiguous(),
            lse.contiguous(),
            0.0,
            causal,
            attn_mask=None,
            scale=scale,
        )
        return dq, dk, dv
    if kind == "flash-attn":
        t = [x.transpose(1, 2).contiguous() for x in (dout, q, k, v, out)]  # [b, s, n, h]
        dq, dk, dv = (torch.empty_like(x) for x in t[1:4])
        kw: dict = dict(
            dropout_p=0.0, softmax_scale=scale, causal=causal, alibi_slopes=None, deterministic=False
        )
        if "window_size_left" in _FA_BWD_PARAMS:
            kw.update(window_size_left=-1, window_size_right=-1)
        else:
            kw.update(window_size=(-1, -1))
        if "softcap" in _FA_BWD_PARAMS:
            kw.update(softcap=0.0)
        _flash_attn_backward(*t, lse.contiguous(), dq, dk, dv, **kw)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if kind == "cuda-flash":
        # the backward op takes the forward's sequence bookkeeping; for dense (non-varlen) calls the cumulative
        # lengths are unused (None) and the philox state is irrelevant at dropout 0.
        sq, sk = q.shape[-2], k.shape[-2]
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.to(q.dtype).contiguous(),
            q,
            k,
            v,
            out.to(q.dtype).contiguous(),
            lse.to(torch.float32).contiguous(),
            None,
            None,
            sq,
            sk,
            0.0,
            causal,
            seed,
            seed,
            scale=scale,
        )
        return dq, dk, dv
    mask = _causal_mask(q.shape[-2], k.shape[-2], q.device) if causal else None
    return math_attention_backward(dout, q, k, v, out, lse, mask, scale)
