"""Ring attention (common/ring_attn.py, common/attn_blocks.py) against full causal attention.

The ring tests spawn real processes joined by gloo (torch.multiprocessing, no Ray); each rank
computes the reference itself on the whole row and checks its own shard of the ring's result against
it. ring_plan is checked directly; the flash-attn kernels only on CUDA (GPU tier).
"""

import os
import socket
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import REPO

from common import attn_blocks
from common.ring_attn import (
    enable_ring_attention,
    ring_attention_forward,
    ring_plan,
    shard_micro_batch,
    sp_groups,
    zigzag_indices,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args):
    sys.path.insert(0, REPO)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world, *args):
    mp.spawn(_worker, args=(world, _free_port(), fn, args), nprocs=world, join=True)


def reference_attention(q, k, v, position_ids):
    """Plain masked softmax in float64: causal, and no attention across packed sequences."""
    T, rep = q.shape[1], q.shape[0] // k.shape[0]
    seq = (position_ids == 0).cumsum(0)  # which packed sequence each token is in
    allowed = torch.ones(T, T, dtype=torch.bool).tril() & (seq[:, None] == seq[None, :])
    k, v = k.repeat_interleave(rep, 0).double(), v.repeat_interleave(rep, 0).double()
    s = (q.double() @ k.transpose(1, 2)) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v  # (H, T, D)


def _check_ring_attention(rank, world, lengths_cases, kernel="torch"):
    if (
        kernel == "flash-contract"
    ):  # FlashBlocks' plumbing, with a CPU stand-in for flash-attn's kernels
        attn_blocks._flash_interface = lambda: FlashContract
        attn_blocks.kernels_for = lambda q: attn_blocks.FlashBlocks
    sp = sp_groups(world, world)
    assert (sp.rank, sp.size) == (rank, world)
    module = SimpleNamespace(sp_group=sp.group)
    for lengths in lengths_cases:
        gen = torch.Generator().manual_seed(sum(lengths))
        T, H, Hkv, D = sum(lengths), 4, 2, 8  # GQA: 2 query heads per K/V head
        position_ids = torch.cat([torch.arange(n) for n in lengths])
        q, k, v = (torch.randn(h, T, D, generator=gen) for h in (H, Hkv, Hkv))
        w = torch.randn(H, T, D, generator=gen)  # loss = sum(w * out): a dense upstream gradient
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        ref = reference_attention(q, k, v, position_ids)
        (ref * w.double()).sum().backward()
        ref_grads = [x.grad for x in (q, k, v)]

        # Shard the row the way a trainer does: per-token tensors in, this rank's zigzag share out.
        local = shard_micro_batch(
            {"input_ids": torch.arange(T)[None], "position_ids": position_ids[None]}, rank, world
        )
        pad = -T % (2 * world)
        idx = zigzag_indices(T + pad, rank, world)
        assert torch.equal(local["input_ids"][0], torch.where(idx < T, idx, 0))
        real = idx < T  # the padding is a sequence of its own at the end of the row
        padded = [
            torch.cat([x.detach(), torch.randn(x.shape[0], pad, D, generator=gen)], 1)
            for x in (q, k, v)
        ]
        lq, lk, lv = (x[:, idx].clone().requires_grad_() for x in padded)
        out, _ = ring_attention_forward(
            module, lq[None], lk[None], lv[None], None, position_ids=local["position_ids"]
        )
        out = out[0].transpose(0, 1)  # (H, T_local, D)
        lw = torch.cat([w, torch.zeros(H, pad, D)], 1)[:, idx]
        (out * lw).sum().backward()
        where = f"rank {rank}/{world}, lengths {lengths}"
        torch.testing.assert_close(
            out[:, real], ref[:, idx[real]].float(), atol=1e-5, rtol=0, msg=where
        )
        for name, g, ref_g in zip("qkv", (lq.grad, lk.grad, lv.grad), ref_grads):
            torch.testing.assert_close(
                g[:, real], ref_g[:, idx[real]], atol=1e-5, rtol=0, msg=f"d{name}: {where}"
            )


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_full_attention(world):
    # one uneven sequence (padded to a multiple of 2k), then several packed into one row, one of
    # length 1, one spanning several zigzag chunks
    spawn(_check_ring_attention, world, [[29], [5, 11, 1, 20], [3, 3, 2]])


class FlashContract:
    """A CPU stand-in for flash_attn.flash_attn_interface (2.7/2.8): the same argument names, int32
    cu_seqlens, lse (H, total_q), the backward writing into dq/dk/dv from the given out and lse.
    Each segment is plain float64 attention. It checks how FlashBlocks calls flash-attn, not
    flash-attn itself (that is the GPU test below)."""

    @staticmethod
    def _segments(
        q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal
    ):
        assert (
            cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
            and q.is_contiguous()
            and k.is_contiguous()
        )
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0]
        assert max_seqlen_q == max(torch.tensor(cu_q).diff()) and max_seqlen_k == max(
            torch.tensor(cu_k).diff()
        )
        rep = q.shape[1] // k.shape[1]
        for i in range(len(cu_q) - 1):
            qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            kr = k[ks].double().repeat_interleave(rep, 1)
            s = torch.einsum("qhd,khd->hqk", q[qs].double(), kr) * softmax_scale
            if causal:
                assert qs.stop - qs.start == ks.stop - ks.start
                s = s.masked_fill(~torch.ones(s.shape[1:], dtype=torch.bool).tril(), float("-inf"))
            yield qs, ks, s, rep

    @staticmethod
    def _flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
    ):  # fmt: skip
        assert dropout_p == 0.0 and (window_size_left, window_size_right, softcap) == (-1, -1, 0.0)
        out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0])
        segs = (q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
        for qs, ks, s, rep in FlashContract._segments(*segs):
            lse[:, qs] = torch.logsumexp(s, -1).float()
            out[qs] = torch.einsum(
                "hqk,khd->qhd", torch.softmax(s, -1), v[ks].double().repeat_interleave(rep, 1)
            )
        return out, lse, None, None

    @staticmethod
    def _flash_attn_varlen_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
        deterministic, rng_state=None,
    ):  # fmt: skip
        assert (
            dout.dtype == out.dtype == q.dtype
            and softmax_lse.is_contiguous()
            and dq.shape == q.shape
        )
        dq.zero_(), dk.zero_(), dv.zero_()
        segs = (q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
        for qs, ks, s, rep in FlashContract._segments(*segs):
            p = torch.exp(s - softmax_lse[:, qs, None].double())
            do, vr = dout[qs].double(), v[ks].double().repeat_interleave(rep, 1)
            ds = p * (torch.einsum("qhd,khd->hqk", do, vr) - (do * out[qs]).sum(-1).T[..., None])
            dq[qs] = (
                torch.einsum("hqk,khd->qhd", ds, k[ks].double().repeat_interleave(rep, 1))
                * softmax_scale
            )
            dk[ks] = (
                (torch.einsum("hqk,qhd->khd", ds, q[qs].double()) * softmax_scale)
                .unflatten(1, (-1, rep))
                .sum(2)
            )
            dv[ks] = torch.einsum("hqk,qhd->khd", p, do).unflatten(1, (-1, rep)).sum(2)


def test_flash_blocks_call_flash_attn_as_documented():
    # the ring on 2 ranks with FlashBlocks, flash-attn's kernels replaced by FlashContract: the
    # rectangle and causal-segment pieces must reach the kernels with the right cu_seqlens, causal
    # flag, lse and out
    spawn(_check_ring_attention, 2, [[29], [5, 11, 1, 20]], "flash-contract")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_plan_covers_the_causal_mask_exactly_once(n):
    gen = torch.Generator().manual_seed(n)
    for _ in range(30):
        T = 2 * n * int(torch.randint(1, 7, (), generator=gen))
        cuts = sorted(
            set(
                torch.randint(
                    1, T, (int(torch.randint(0, 5, (), generator=gen)),), generator=gen
                ).tolist()
            )
        )
        lengths = torch.tensor([0, *cuts, T]).diff()  # packed sequences of random lengths
        starts = torch.repeat_interleave(
            torch.tensor([0, *cuts]), lengths
        )  # (T,) global index of each seq start
        g = torch.arange(T)
        allowed = (g[None, :] <= g[:, None]) & (starts[None, :] == starts[:, None])
        covered = torch.zeros(T, T, dtype=torch.long)
        for rank in range(n):
            mine = zigzag_indices(T, rank, n)
            for step, pieces in enumerate(ring_plan(starts, rank, n)):
                visiting = zigzag_indices(T, (rank - step) % n, n)
                for rows, cols, cu in pieces:
                    r, c = mine[rows], visiting[cols]
                    if cu is None:
                        mask = torch.ones(len(r), len(c), dtype=torch.long)
                    else:  # causal inside each segment [cu[i], cu[i+1])
                        seg = torch.repeat_interleave(
                            torch.arange(len(cu) - 1), torch.tensor(cu).diff()
                        )
                        mask = (
                            (seg[:, None] == seg[None, :])
                            & torch.ones(len(r), len(c)).tril().bool()
                        ).long()
                    covered[r[:, None], c[None, :]] += mask
        assert torch.equal(covered, allowed.long()), f"sp {n}, lengths {lengths.tolist()}"


@pytest.mark.gpu
def test_flash_blocks_match_torch_blocks():
    if attn_blocks._flash_interface() is None:
        pytest.skip("flash-attn >= 2.7 is not installed")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for Tq, Tk, cu in [
        (24, 31, None),
        (40, 40, [0, 5, 17, 18, 40]),
    ]:  # a rectangle; causal packed segments
        q = torch.randn(Tq, 8, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
        k, v = (
            torch.randn(Tk, 2, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in "kv"
        )
        dout = torch.randn(Tq, 8, 64, generator=gen, device="cuda")
        assert attn_blocks.kernels_for(q) is attn_blocks.FlashBlocks
        out_t, lse_t = attn_blocks.TorchBlocks.forward(q, k, v, cu, 0.125)
        out_f, lse_f = attn_blocks.FlashBlocks.forward(q, k, v, cu, 0.125)
        torch.testing.assert_close(lse_f, lse_t, atol=2e-2, rtol=0)
        torch.testing.assert_close(out_f, out_t, atol=2e-2, rtol=2e-2)
        grads_t = attn_blocks.TorchBlocks.backward(dout, q, k, v, out_t, lse_t, cu, 0.125)
        grads_f = attn_blocks.FlashBlocks.backward(dout, q, k, v, out_t, lse_t, cu, 0.125)
        for name, f, t in zip("qkv", grads_f, grads_t):
            assert (f - t).norm() / t.norm() < 2e-2, f"d{name}, cu {cu}"


def test_shard_micro_batch_zigzag_layout():
    mb = {
        "input_ids": torch.arange(10)[None],
        "position_ids": torch.arange(10)[None],
        "real": torch.tensor(1.0),
    }
    shards = [shard_micro_batch(mb, r, 2) for r in range(2)]  # 10 tokens -> 12 = 4 chunks of 3
    assert shards[0]["input_ids"].tolist() == [[0, 1, 2, 9, 0, 0]]
    assert shards[1]["input_ids"].tolist() == [[3, 4, 5, 6, 7, 8]]
    assert shards[0]["position_ids"].tolist() == [
        [0, 1, 2, 9, 0, 1]
    ]  # the padding starts a new sequence
    assert shards[0]["real"] is mb["real"]
    assert shard_micro_batch(mb, 0, 1) is mb


def _train_step(model, micro_batches, num_tokens, world, sp):
    """sft.py's train_step loss, with the SP sharding the scripts add; returns this rank's loss
    sum."""
    from sft import compute_logprobs

    loss_sum = 0.0
    for i, mb in enumerate(micro_batches):
        mb = shard_micro_batch(mb, sp.rank, sp.size)
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        logprobs = compute_logprobs(
            model, mb["input_ids"], mb["position_ids"], mb["labels"], mb["loss_mask"]
        )
        loss = -logprobs.sum() * mb["real"]
        (loss * world / num_tokens).backward()
        loss_sum += loss.item()
    return loss_sum


def _check_training_step(rank, world, model_path, sp_size):
    from common.data import split_for_ranks
    from sft import load_policy

    gen = torch.Generator().manual_seed(0)
    batch = []
    for n in (40, 23, 9, 17, 31, 6):
        ids = torch.randint(0, 1000, (n,), generator=gen).tolist()
        mask = [0] * (n // 3) + [1] * (n - n // 3)
        batch.append({"input_ids": ids, "labels": ids[1:] + [0], "loss_mask": mask[1:] + [0]})
    batch.append(
        {"input_ids": [5, 6, 7, 8, 9], "labels": [6, 7, 8, 9, 0], "loss_mask": [1, 1, 0, 0, 0]}
    )
    num_tokens = sum(sum(s["loss_mask"]) for s in batch)
    results = {}
    for size in (1, sp_size):
        torch.manual_seed(0)
        model = load_policy(model_path, torch.device("cpu"), gradient_checkpointing=size > 1)
        sp = sp_groups(world, size)
        if size > 1:
            enable_ring_attention(model, sp.group)
            assert model.config._attn_implementation == "ring_attention"
        shares = split_for_ranks(batch, world // size, 64)  # the driver splits over DP groups only
        loss = torch.tensor(_train_step(model, shares[rank // size], num_tokens, world, sp))
        dist.all_reduce(loss)  # the driver sums every rank's loss_sum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grads = [p.grad.full_tensor() for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.step()
        results[size] = (
            loss / num_tokens,
            grads,
            [p.full_tensor().detach() for p in model.parameters()],
        )
    (loss1, grads1, weights1), (loss_sp, grads_sp, weights_sp) = results[1], results[sp_size]
    grad_diff = max((a - b).abs().max().item() for a, b in zip(grads_sp, grads1))
    weight_diff = max((a - b).abs().max().item() for a, b in zip(weights_sp, weights1))
    print(
        f"rank {rank}: loss {loss1:.6f} vs {loss_sp:.6f}, max |dgrad| {grad_diff:.1e}, max |dw| {weight_diff:.1e}"
    )
    torch.testing.assert_close(loss_sp, loss1, atol=1e-4, rtol=0)
    assert grad_diff < 1e-4 and weight_diff < 1e-4
    assert max(g.abs().max().item() for g in grads1) > 1e-3  # the comparison is not between zeros


@pytest.mark.parametrize("world,sp_size", [(2, 2), (4, 2)])
def test_training_step_with_sp_equals_without(tiny_model, world, sp_size):
    # (4, 2): a 2 x 2 DP x SP mesh, compared with 4-way DP; gradient checkpointing re-runs the ring
    # in backward
    spawn(_check_training_step, world, tiny_model, sp_size)


def _response_means(rank, world, sp_size):
    """A sequence-level loss through Trainer.local_part's Responses, on `world` ranks in SP groups
    of sp_size: each rank's local loss summed, and each token's gradient, against one rank's."""
    from common.data import response_values
    from common.trainer import Trainer

    lengths, gen = [5, 11, 1, 9], torch.Generator().manual_seed(0)
    T = sum(lengths)  # 26 tokens in one packed row: four sequences, 2k-padded by the shard
    mb = {"input_ids": torch.randint(0, 50, (1, T), generator=gen),
          "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
          "labels": torch.zeros(1, T, dtype=torch.long), "at": torch.arange(T)[None].double(),
          "loss_mask": (torch.rand(1, T, generator=gen) < 0.7).long(),  # prompts and glue: 0
          "x": torch.randn(1, T, generator=gen, dtype=torch.float64)}  # fmt: skip
    advantages = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)

    def loss_and_grads(sp):
        shell = SimpleNamespace(device=torch.device("cpu"), sp=sp)
        values = response_values(Trainer.__ray_actor_class__.local_part(shell, mb))
        x = values["x"].clone().requires_grad_(True)
        responses = values["responses"]
        s = torch.exp(responses.mean(x))  # GSPO's s_i: the mean over the whole response
        loss = (s * advantages[responses.index] + 0.1 * x**2).sum()  # + a per-token term
        loss.backward()
        return loss, dict(zip(values["at"].long().tolist(), x.grad.tolist()))

    sp = sp_groups(world, sp_size)
    loss, grads = loss_and_grads(sp)
    single_loss, single_grads = loss_and_grads(SimpleNamespace(group=None, rank=0, size=1))
    total = loss.detach().clone()
    dist.all_reduce(total)
    every = [None] * world
    dist.all_gather_object(every, grads)
    merged = {t: g for rank_grads in every for t, g in rank_grads.items()}
    # the data-parallel groups hold the same row: their tokens' losses add up world / sp times
    torch.testing.assert_close(total, single_loss.detach() * (world // sp_size))
    assert merged.keys() == single_grads.keys()  # every loss token on exactly one rank of a group
    for t, g in single_grads.items():
        assert merged[t] == pytest.approx(g, rel=1e-9, abs=1e-12), t


@pytest.mark.parametrize("world,sp_size", [(2, 2), (4, 2)])
def test_response_means_under_sp_equal_the_whole_row(world, sp_size):
    """values["responses"].mean (GSPO's sequence ratio) on a row split by ring attention's zigzag:
    the same loss and, summed over the group as FSDP sums them, the same gradient at every token."""
    spawn(_response_means, world, sp_size)
