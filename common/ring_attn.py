"""Ring attention: causal self-attention over one packed row split across a sequence-parallel (SP) group.

Each of the k ranks of an SP group holds 2 of the row's 2k chunks (zigzag: rank i has chunks i and 2k-1-i, so
every rank does the same causal work). Its K/V block travels once around the ring; each rank attends its
queries to every block as it passes and merges the partial results with their log-sum-exp. The backward
sends K/V around again together with a dK/dV accumulator that arrives back home after k hops. Memory per
rank: activations of T/k tokens, one (heads, T/k, T/k) score block at a time. See docs/ring_attention.md.

Packed rows need no side channel: position_ids restart at 0 for every sequence, so a token's sequence start
is (global index - position id), and token q may see token k iff k's global index <= q's and their starts
are equal. The rank computes the global indices from the zigzag layout.
"""

from typing import NamedTuple

import torch
import torch.distributed as dist

RING = "ring_attention"


class SPGroup(NamedTuple):
    group: object  # this rank's SP process group (None when sp_size is 1)
    rank: int  # rank inside the SP group
    size: int  # k
    dp_rank: int  # which data-parallel shard this SP group trains on
    dp_size: int  # world_size / k


def sp_groups(world_size: int, sp_size: int) -> SPGroup:
    """Split the world into DP x SP: SP groups are runs of sp_size consecutive ranks. Every rank must call it."""
    if world_size % sp_size:
        raise ValueError(f"world size {world_size} is not divisible by sp size {sp_size}")
    rank, mine = dist.get_rank(), None
    for start in range(0, world_size, sp_size):  # new_group is a collective: all ranks create every group
        group = dist.new_group(list(range(start, start + sp_size))) if sp_size > 1 else None
        mine = group if start <= rank < start + sp_size else mine
    return SPGroup(mine, rank % sp_size, sp_size, rank // sp_size, world_size // sp_size)


def zigzag_indices(total: int, sp_rank: int, sp_size: int, device=None) -> torch.Tensor:
    """Global token indices held by `sp_rank`: chunks sp_rank and 2k-1-sp_rank of a row of `total` tokens."""
    c = total // (2 * sp_size)
    first, second = sp_rank * c, (2 * sp_size - 1 - sp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def shard_micro_batch(mb: dict, sp_rank: int, sp_size: int) -> dict:
    """This rank's zigzag share of a packed micro-batch: every (1, T) tensor is padded to a multiple of 2k and cut.

    Padding is a sequence of its own (position ids 0, 1, ..., zeros elsewhere, so loss_mask 0): nothing real
    attends to it and it adds no loss. Other entries (e.g. the scalar "loss_scale") are passed through.
    """
    if sp_size == 1:
        return mb
    T = mb["input_ids"].shape[1]
    pad = -T % (2 * sp_size)
    idx = zigzag_indices(T + pad, sp_rank, sp_size, mb["input_ids"].device)
    out = {}
    for key, v in mb.items():
        if v.dim() != 2 or v.shape[1] != T:
            out[key] = v
            continue
        if pad:
            fill = torch.arange(pad) if key in ("position_ids", "positions") else torch.zeros(pad)
            v = torch.cat([v, fill.to(v).expand(v.shape[0], pad)], dim=1)
        out[key] = v[:, idx]
    return out


def shares_per_rank(shares: list, sp_size: int) -> list:
    """Driver side of DP x SP: one data share per SP group -> one per rank (its sp_size ranks get the same share)."""
    return [share for share in shares for _ in range(sp_size)]


def sequence_sums(values: torch.Tensor, seq_index: torch.Tensor, num_seqs: int, group=None) -> torch.Tensor:
    """Per-sequence sums (S,) of per-token `values` (N,) whose sequences are split over the SP group.

    Each rank adds up its own tokens, then the partial sums are all-reduced. The backward is the identity: every
    rank of the group computes the same loss from the same sums, and each must get the gradient of its own
    tokens once (a plain all-reduce backward would count it k times).
    """
    sums = values.new_zeros(num_seqs).index_add(0, seq_index, values)
    return sums if group is None else _SumOverGroup.apply(sums, group)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def enable_ring_attention(model, group) -> None:
    """Make an HF causal LM attend with ring attention over `group`; group=None restores its own attention.

    Registers the function with transformers' AttentionInterface and switches config._attn_implementation.
    Inputs must then be rows sharded by shard_micro_batch. Switch it off around generate() and other unsharded
    forwards (each rank of a group would otherwise exchange K/V of unrelated prompts).
    """
    from transformers import AttentionInterface

    if group is None:
        if model.config._attn_implementation == RING:
            model.set_attn_implementation(model._attn_before_ring)
        return
    AttentionInterface.register(RING, ring_attention_forward)
    if model.config._attn_implementation != RING:
        model._attn_before_ring = model.config._attn_implementation
    for m in model.modules():
        if getattr(m, "is_causal", False):  # HF attention modules; the function gets them as `module`
            m.sp_group = group
    model.set_attn_implementation(RING)


def ring_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The AttentionInterface function. query (1, H, T, D), key/value (1, Hkv, T, D) -> ((1, T, H, D), None)."""
    if query.shape[0] != 1 or kwargs.get("position_ids") is None:
        raise ValueError("ring attention takes one packed row (batch 1) with position_ids")
    if dropout or getattr(module, "sliding_window", None) or kwargs.get("softcap"):
        raise NotImplementedError("ring attention supports neither attention dropout, sliding windows nor softcap")
    group = module.sp_group
    T, n = query.shape[2], dist.get_world_size(group)
    gidx = zigzag_indices(T * n, dist.get_rank(group), n, query.device)  # (T,)
    starts = gidx - kwargs["position_ids"][0].to(gidx)  # (T,) global index of each token's sequence start
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = RingAttention.apply(query[0], key[0], value[0], torch.stack([gidx, starts]), scale, group)
    return out.transpose(0, 1).unsqueeze(0), None


def _ring_pass(tensors: list[torch.Tensor], group) -> tuple[list, list[torch.Tensor]]:
    """Start sending `tensors` to the next rank of the ring and receiving the previous rank's. Returns (work, recv)."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prev, group) for t in recv]
    return dist.batch_isend_irecv(ops), recv


def _wait(work: list) -> None:
    for w in work:
        w.wait()


def _scores(q, k, meta_q, meta_k, scale):
    """Masked fp32 scores (H, Tq, Tk): causal by global index, and only within the same packed sequence."""
    allowed = (meta_k[0][None, :] <= meta_q[0][:, None]) & (meta_k[1][None, :] == meta_q[1][:, None])  # (Tq, Tk)
    s = torch.einsum("hqd,hkd->hqk", q.float(), k.float()) * scale
    return s.masked_fill(~allowed, float("-inf"))


class RingAttention(torch.autograd.Function):
    """Exact causal attention of the local queries against the K/V of every rank of the ring.

    Pure torch (fp32 scores, any device): each step computes one (H, T, T) score block of the local queries
    against the visiting K/V block. q (H, T, D), k/v (Hkv, T, D); meta (2, T) = global index, sequence start.
    """

    @staticmethod
    def forward(ctx, q, k, v, meta, scale, group):
        n, rep = dist.get_world_size(group), q.shape[0] // k.shape[0]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (H, T, D)
        lse = torch.full(q.shape[:2], float("-inf"), device=q.device)  # (H, T)
        kv, meta_kv = torch.stack([k, v]), meta
        for step in range(n):
            if step < n - 1:  # overlap: the next block is in flight while this one is computed
                work, (kv_next, meta_next) = _ring_pass([kv, meta_kv], group)
            kb, vb = (x.repeat_interleave(rep, dim=0) for x in kv)  # GQA: expand K/V heads like HF repeat_kv
            s = _scores(q, kb, meta, meta_kv, scale)
            lse_b = torch.logsumexp(s, dim=-1)  # (H, T); -inf for rows that see nothing of this block
            p = torch.exp(s - lse_b.nan_to_num(neginf=0.0)[..., None])
            out_b = torch.einsum("hqk,hkd->hqd", p, vb.float())
            lse_new = torch.logaddexp(lse, lse_b)  # step 0 is the own block: every row sees itself, so finite
            out = out * torch.exp(lse - lse_new)[..., None] + out_b * torch.exp(lse_b - lse_new)[..., None]
            lse = lse_new
            if step < n - 1:
                _wait(work)
                kv, meta_kv = kv_next, meta_next
        ctx.save_for_backward(q, k, v, meta, out, lse)
        ctx.scale, ctx.group = scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, meta, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        n, rep = dist.get_world_size(group), q.shape[0] // k.shape[0]
        dout = dout.float()
        delta = (dout * out).sum(-1)  # (H, T): rowsum(dO * O), the softmax-backward correction
        dq = torch.zeros_like(dout)
        kv, meta_kv = torch.stack([k, v]), meta
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its K/V block
        for step in range(n):
            kb, vb = (x.repeat_interleave(rep, dim=0).float() for x in kv)
            p = torch.exp(_scores(q, kb, meta, meta_kv, scale) - lse[..., None])  # (H, Tq, Tk) final probs
            dv = torch.einsum("hqk,hqd->hkd", p, dout)
            ds = p * (torch.einsum("hqd,hkd->hqk", dout, vb) - delta[..., None])
            dq += torch.einsum("hqk,hkd->hqd", ds, kb) * scale
            dk = torch.einsum("hqk,hqd->hkd", ds, q.float()) * scale
            dkv += torch.stack([dk, dv]).unflatten(1, (k.shape[0], rep)).sum(2)  # fold GQA heads back
            # Pass the block and its gradient on; after the last step only the gradient goes, back to its owner.
            work, received = _ring_pass([kv, meta_kv, dkv] if step < n - 1 else [dkv], group)
            _wait(work)
            if step < n - 1:
                kv, meta_kv, dkv = received
            else:
                (dkv,) = received
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None
