"""Block kernels for ring attention: a block of queries attending to a block of keys, with its LSE.

    forward(q, k, v, cu, scale)                  -> out (Tq, H, D) fp32, lse (H, Tq) fp32
    backward(dout, q, k, v, out, lse, cu, scale) -> dq, dk, dv (fp32); out, lse: the rows' *final*

q (Tq, H, D), k/v (Tk, Hkv, D), Hkv dividing H (GQA). cu None: every query sees every key; else
boundaries [0, ..., Tq] (Tq == Tk; flash-attn's cu_seqlens): causal inside each packed sequence.
TorchBlocks: fp32, any device (CPU tests). FlashBlocks: flash-attn 2.7+'s private varlen forward and
backward (the public function cannot take the *global* log-sum-exp a ring's backward needs)."""

import functools

import torch


class TorchBlocks:
    @staticmethod
    def _scores(q, k, cu, scale):
        """Masked fp32 scores (H, Tq, Tk), K/V heads expanded for GQA like HF's repeat_kv."""
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
        if cu is None:
            return s
        idx = torch.arange(q.shape[0], device=q.device)
        seg = torch.bucketize(idx, torch.tensor(cu[1:-1], device=q.device), right=True)
        allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
        return s.masked_fill(~allowed, float("-inf"))

    @staticmethod
    def forward(q, k, v, cu, scale):
        s = TorchBlocks._scores(q, k, cu, scale)
        lse = torch.logsumexp(s, dim=-1)  # (H, Tq)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1).float()
        return torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v), lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu, scale):
        rep = q.shape[1] // k.shape[1]
        p = torch.exp(TorchBlocks._scores(q, k, cu, scale) - lse[..., None])  # this block's share
        kr, vr = (x.repeat_interleave(rep, dim=1).float() for x in (k, v))
        dout = dout.float()
        delta = (dout * out).sum(-1).T  # (H, Tq): rowsum(dO * O) of the final output
        dv = torch.einsum("hqk,qhd->khd", p, dout)
        ds = p * (torch.einsum("qhd,khd->hqk", dout, vr) - delta[..., None])
        dq = torch.einsum("hqk,khd->qhd", ds, kr) * scale
        dk = torch.einsum("hqk,qhd->khd", ds, q.float()) * scale
        dk, dv = (x.unflatten(1, (k.shape[1], rep)).sum(2) for x in (dk, dv))  # GQA: heads summed
        return dq, dk, dv


@functools.cache
def _flash_interface():
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except ImportError:
        return None
    version = tuple(map(int, flash_attn.__version__.split(".")[:2]))
    return flash_attn_interface if version >= (2, 7) else None


class FlashBlocks:
    @staticmethod
    def _args(q, k, cu, scale) -> dict:
        cu_q, cu_k = (cu, cu) if cu is not None else ([0, q.shape[0]], [0, k.shape[0]])
        return dict(
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=q.device),
            cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=q.device),
            max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])),
            max_seqlen_k=max(b - a for a, b in zip(cu_k, cu_k[1:])),
            dropout_p=0.0,
            softmax_scale=scale,
            causal=cu is not None,
        )

    @staticmethod
    def forward(q, k, v, cu, scale):
        fa, (q, k, v) = _flash_interface(), (x.contiguous() for x in (q, k, v))
        args = FlashBlocks._args(q, k, cu, scale)
        out, lse, _, _ = fa._flash_attn_varlen_forward(q, k, v, **args)
        return out.float(), lse  # lse: (H, Tq) fp32

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu, scale):
        fa, (q, k, v) = _flash_interface(), (x.contiguous() for x in (q, k, v))
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))  # written by the kernel
        dout, out = (x.to(q.dtype).contiguous() for x in (dout, out))
        fa._flash_attn_varlen_backward(
            dout,
            q,
            k,
            v,
            out,
            lse.contiguous(),
            dq,
            dk,
            dv,
            **FlashBlocks._args(q, k, cu, scale),
            window_size_left=-1,
            window_size_right=-1,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            rng_state=None,
        )
        return dq.float(), dk.float(), dv.float()


def kernels_for(q: torch.Tensor):
    """TorchBlocks unless flash-attn runs (Ampere or newer, fp16/bf16, head dim 8, 16, ..., 256)."""
    d, half = q.shape[-1], q.dtype in (torch.float16, torch.bfloat16)
    usable = q.is_cuda and half and d % 8 == 0 and d <= 256
    usable = usable and torch.cuda.get_device_capability(q.device)[0] >= 8
    return FlashBlocks if usable and _flash_interface() is not None else TorchBlocks
