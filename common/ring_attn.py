"""Ring attention: causal self-attention over a packed row split across a sequence-parallel group.

Rank i of an SP group of k holds chunks i and 2k-1-i of the row's 2k (zigzag: equal causal work).
K/V blocks go once around the ring; each rank attends its queries to each as it passes, merging by
log-sum-exp; the backward sends them around again with a dK/dV accumulator. Memory per rank: T/k
tokens' activations, one (heads, T/2k, T/2k) score block at a time. A token's sequence starts at
(global index - position id). See docs/ring_attention.md."""

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from transformers import AttentionInterface

from common import attn_blocks

RING = "ring_attention"


class SPGroup(NamedTuple):
    group: object  # this rank's SP process group (None when sp_size is 1)
    rank: int  # rank inside the SP group
    size: int  # k


def sp_groups(world_size: int, sp_size: int) -> SPGroup:
    """Split into DP x SP (SP: sp_size consecutive ranks); a collective: every rank must call it."""
    rank, mine = dist.get_rank(), None
    for start in range(0, world_size, sp_size):
        group = dist.new_group(list(range(start, start + sp_size))) if sp_size > 1 else None
        mine = group if start <= rank < start + sp_size else mine
    return SPGroup(mine, rank % sp_size, sp_size)


def zigzag_indices(total: int, sp_rank: int, sp_size: int, device=None) -> torch.Tensor:
    """Global token indices of `sp_rank`: chunks sp_rank and 2k-1-sp_rank of a row of `total`."""
    c = total // (2 * sp_size)
    first, second = sp_rank * c, (2 * sp_size - 1 - sp_rank) * c
    return torch.cat([torch.arange(s, s + c, device=device) for s in (first, second)])


def shard_micro_batch(mb: dict, sp_rank: int, sp_size: int) -> dict:
    """This rank's zigzag share of each (1, T) tensor of a packed micro-batch (the rest as is)."""
    if sp_size == 1:
        return mb
    T = mb["input_ids"].shape[1]
    pad = -T % (2 * sp_size)  # a sequence of its own (loss_mask 0): unseen, adds no loss
    idx = zigzag_indices(T + pad, sp_rank, sp_size, mb["input_ids"].device)
    out = dict(mb)
    for key, v in mb.items():
        if v.dim() == 2 and v.shape[1] == T:
            fill = torch.arange(pad) if key in ("position_ids", "positions") else torch.zeros(pad)
            out[key] = torch.cat([v, fill.to(v).expand(v.shape[0], pad)], dim=1)[:, idx]
    return out


def sequence_sums(values: torch.Tensor, seq_index: torch.Tensor, num_seqs: int, group=None):
    """Per-sequence sums (S,) of per-token `values` (N,) split over the group, all-reduced. Every
    rank computes the same loss from them, so the backward is the identity."""
    sums = values.new_zeros(num_seqs).index_add(0, seq_index, values)
    if group is None:
        return sums
    total = sums.detach().clone()
    dist.all_reduce(total, group=group)
    return total + (sums - sums.detach())  # the value: total; the gradient: each rank's own


class Responses(NamedTuple):
    """Which response each of this rank's response tokens is: `index` (N,) among the `count` of its
    packed micro-batch; their other tokens are on the --sp-size `group`'s other ranks (None: none).
    In compute_loss as values["responses"], for sequence-level terms (GSPO's s_i)."""

    index: torch.Tensor
    count: int
    group: object = None

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """(count,) Σ_t x_it over each whole response. Each rank's loss holds its own tokens' terms,
        so the gradient is summed over the group too (torch's autograd all_reduce)."""
        sums = x.new_zeros(self.count).index_add(0, self.index, x)
        return sums if self.group is None else dist_nn.all_reduce(sums, group=self.group)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """(N,) 1/|o_i| Σ_t x_it of each token's response o_i, at each token: a sequence mean."""
        return (self.sum(x) / self.sum(torch.ones_like(x)).clamp(min=1))[self.index]


def enable_ring_attention(model, group) -> None:
    """Ring attention over `group` for an HF causal LM, on shard_micro_batch rows (None: off)."""
    if group is None:  # for generate() and other unsharded forwards (unrelated prompts' K/V)
        if model.config._attn_implementation == RING:
            model.set_attn_implementation(model._attn_before_ring)
        return
    AttentionInterface.register(RING, ring_attention_forward)
    if model.config._attn_implementation != RING:
        model._attn_before_ring = model.config._attn_implementation
    for m in model.modules():
        if getattr(m, "is_causal", False):  # HF attention modules: the function's `module`
            m.sp_group = group
    model.set_attn_implementation(RING)


def ring_attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """For AttentionInterface: query (1, H, T, D), k/v (1, Hkv, T, D) -> ((1, T, H, D), None)."""
    if query.shape[0] != 1 or kwargs.get("position_ids") is None:
        raise ValueError("ring attention takes one packed row (batch 1) with position_ids")
    if dropout or getattr(module, "sliding_window", None) or kwargs.get("softcap"):
        unsupported = "neither attention dropout, sliding windows nor softcap"
        raise NotImplementedError(f"ring attention supports {unsupported}")
    group, T, n = module.sp_group, query.shape[2], dist.get_world_size(module.sp_group)
    # Every rank needs the whole row's sequence starts to plan its blocks: an all-gather a layer.
    pos = [torch.empty_like(kwargs["position_ids"][0]) for _ in range(n)]
    dist.all_gather(pos, kwargs["position_ids"][0].contiguous(), group=group)
    gidx = torch.cat([zigzag_indices(T * n, r, n) for r in range(n)])  # of each gathered token
    starts = torch.empty(T * n, dtype=torch.long)
    starts[gidx] = gidx - torch.cat(pos).cpu()  # global index of each token's sequence start
    plan = ring_plan(starts, dist.get_rank(group), n)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D): varlen layout
    return RingAttention.apply(q.contiguous(), k, v, plan, scale, group).unsqueeze(0), None


def ring_plan(starts: torch.Tensor, rank: int, n: int) -> list[list[tuple]]:
    """Per ring step, the pieces (rows, cols, cu) of local queries x visiting K/V with allowed
    pairs. An earlier K chunk meets only the Q chunk's first sequence: one rectangle (cu None), a Q
    prefix by a K suffix. A chunk against itself is causal per sequence (cu: their boundaries)."""
    c = starts.numel() // (2 * n)
    plan = []
    for step in range(n):
        src, pieces = (rank - step) % n, []  # the visiting block started on rank `src`
        for hq, cq in enumerate((rank, 2 * n - 1 - rank)):
            for hk, ck in enumerate((src, 2 * n - 1 - src)):
                sq, sk = starts[cq * c : (cq + 1) * c], starts[ck * c : (ck + 1) * c]
                q0, k0 = hq * c, hk * c  # where the two chunks start locally
                if ck == cq:
                    bounds = ((sq[1:] != sq[:-1]).nonzero().flatten() + 1).tolist()
                    pieces.append((slice(q0, q0 + c), slice(k0, k0 + c), [0, *bounds, c]))
                elif ck < cq:
                    nq, nk = int((sq == sq[0]).sum()), int((sk == sq[0]).sum())
                    if nk:
                        pieces.append((slice(q0, q0 + nq), slice(k0 + c - nk, k0 + c), None))
        plan.append(pieces)
    return plan


def _ring_pass(t: torch.Tensor, group):
    """Start sending `t` to the next rank, receiving the previous rank's: (wait, received)."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    recv = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, nxt, group), dist.P2POp(dist.irecv, recv, prev, group)]
    work = dist.batch_isend_irecv(ops)
    return lambda: [w.wait() for w in work], recv


class RingAttention(torch.autograd.Function):
    """Exact causal attention of local q (T, H, D) to every ring rank's K/V (T, Hkv, D), by plan."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale, group):
        n, kernel = dist.get_world_size(group), attn_blocks.kernels_for(q)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (T, H, D)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)  # (H, T)
        kv = torch.stack([k, v])  # (2, T, Hkv, D): one tensor to send
        for step in range(n):
            if step < n - 1:  # overlap: the next block is in flight while this one is computed
                wait, kv_next = _ring_pass(kv, group)
            for rows, cols, cu in plan[step]:
                out_b, lse_b = kernel.forward(q[rows], kv[0, cols], kv[1, cols], cu, scale)
                lse_new = torch.logaddexp(lse[:, rows], lse_b)  # each row sees a key: finite
                out[rows] = out[rows] * torch.exp(lse[:, rows] - lse_new).T[..., None]
                out[rows] += out_b * torch.exp(lse_b - lse_new).T[..., None]
                lse[:, rows] = lse_new
            if step < n - 1:
                wait()
                kv = kv_next
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.group = plan, scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        n, kernel = dist.get_world_size(ctx.group), attn_blocks.kernels_for(q)
        dq, kv = torch.zeros(q.shape, dtype=torch.float32, device=q.device), torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with K/V
        for step in range(n):
            if step < n - 1:  # the K/V block travels while in use; its gradient after this step
                wait, kv_next = _ring_pass(kv, ctx.group)
            for rows, cols, cu in ctx.plan[step]:
                # With the rows' final out and lse, P = exp(S - lse) is the piece's exact share.
                block = (dout[rows], q[rows], kv[0, cols], kv[1, cols], out[rows], lse[:, rows])
                dq_b, dk_b, dv_b = kernel.backward(*block, cu, ctx.scale)
                dq[rows] += dq_b
                dkv[0, cols] += dk_b
                dkv[1, cols] += dv_b
            if n > 1:  # one hop a step; after the last, home to the block's owner
                wait_dkv, dkv = _ring_pass(dkv, ctx.group)
                wait_dkv()
            if step < n - 1:
                wait()
                kv = kv_next
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None
