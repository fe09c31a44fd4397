"""Attention over packed rows without a T x T mask: each packed sequence attends only to itself.

Given a (1, T) row of common/data.py (position_ids restart at each sequence), transformers' SDPA
path builds a (1, 1, T, T) mask and computes all T^2 score pairs (~97 % masked at 16k tokens of
~500-token sequences), keeping the mask for the backward. Here the row is cut at its restarts and
each sequence attends causally to itself: on CUDA in 16 bits by torch's flash varlen kernel (GQA
without repeating K/V), else by one SDPA call per sequence (exact). Padding masks, KV caches and
batches get SDPA's mask as before. docs/benchmarks.md has the figures."""

import os

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED = "packed_sdpa"
_last = [None, None]  # the position_ids last cut and their cuts: once per forward, not per layer


def needs_mask(config) -> bool:
    """Sliding windows and logit softcaps need SDPA's mask (and so its T x T bytes)."""
    text = config.get_text_config()
    windowed = "sliding_attention" in (getattr(text, "layer_types", None) or ())
    windowed |= bool(getattr(text, "sliding_window", 0) and getattr(text, "use_sliding_window", 1))
    return windowed or bool(getattr(text, "attn_logit_softcapping", None))


def enable(config) -> str:
    """PACKED for a model whose every layer is plainly causal, else "sdpa" (also with the switch
    POSTTRAIN_PACKED_ATTENTION=0: SDPA's mask as before). Registers the two functions."""
    if needs_mask(config) or os.environ.get("POSTTRAIN_PACKED_ATTENTION") == "0":
        return "sdpa"
    AttentionInterface.register(PACKED, packed_attention_forward)
    AttentionMaskInterface.register(PACKED, packed_mask)
    return PACKED


def packed_mask(
    batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kw
):
    """None for one row without padding or cache (cut by packed_attention_forward), else SDPA's."""
    plain = batch_size == 1 and attention_mask is None and q_offset == kv_offset == 0
    if plain and q_length == kv_length:
        return None
    return sdpa_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask, **kw
    )


def cuts(position_ids: torch.Tensor) -> tuple[list[int], torch.Tensor, int]:
    """Sequence boundaries [0, ..., T] of a (1, T) row, where a position does not follow the one
    before (transformers' rule for packed rows), as a list and an int32 tensor on the row's device
    (cu_seqlens); and the longest sequence's length."""
    if _last[0] is not position_ids:
        pos = position_ids[0]
        bounds = [0, *((pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1).tolist(), pos.numel()]
        cu = torch.tensor(bounds, dtype=torch.int32, device=pos.device)
        _last[:] = position_ids, (bounds, cu, max(b - a for a, b in zip(bounds, bounds[1:])))
    return _last[1]


def packed_attention_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """For AttentionInterface: query (B, H, T, D), k/v (B, Hkv, S, D) -> ((B, T, H, D), None)."""
    position_ids = kwargs.get("position_ids")
    one_row = query.shape[0] == 1 and query.shape[2] == key.shape[2] and position_ids is not None
    one_row &= kwargs.get("is_causal") is not False and getattr(module, "is_causal", True)
    if attention_mask is not None or not one_row or kwargs.get("dropout"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )
    bounds, cu, longest = cuts(position_ids)
    half = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
    if half and torch.cuda.get_device_capability(query.device)[0] >= 8:  # flash: Ampere and newer
        from torch.nn.attention.varlen import varlen_attn

        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # (T, H, D)
        out = varlen_attn(
            q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0), enable_gqa=True
        )
        return out.unsqueeze(0), None
    causal = dict(is_causal=True, scale=scaling, enable_gqa=True)
    parts = [
        F.scaled_dot_product_attention(*(x[:, :, a:b] for x in (query, key, value)), **causal)
        for a, b in zip(bounds, bounds[1:])
    ]
    out = torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None
