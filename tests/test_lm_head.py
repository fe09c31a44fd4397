"""The LM head's chunked log-probabilities (common/lm_head.py) equal the plain computation, values
and gradients, for any chunking, and the scripts' compute_logprobs through a real FSDP2 model equals
the formula it replaced."""

import os

import pytest
import torch
import torch.nn.functional as F

from common import lm_head


def plain(hidden, weight, labels, temperature, top_p=1.0):
    """log_softmax(z / T)[label]; with top_p < 1 over the nucleus only: the tokens whose more
    probable tokens hold less than p of the mass (and the label)."""
    z = (hidden @ weight.T).float() / temperature
    if top_p < 1:
        probs, order = z.softmax(dim=-1).sort(dim=-1, descending=True)
        above = probs.cumsum(dim=-1) - probs  # the mass of the more probable tokens
        inside = torch.zeros_like(z, dtype=torch.bool).scatter(1, order, above < top_p)
        inside[torch.arange(len(labels)), labels] = True
        z = z.masked_fill(~inside, float("-inf"))
    return -F.cross_entropy(z, labels, reduction="none")


def plain_entropy(hidden, weight, labels, temperature, top_p=1.0):
    """H = -Σ_v π(v) log π(v) of the same distribution, through autograd (0 log 0 = 0)."""
    z = (hidden @ weight.T).float() / temperature
    logp = plain(hidden, weight, labels, temperature, top_p)  # to find the nucleus: its lse
    if top_p < 1:
        lse = z.gather(1, labels[:, None]).squeeze(1) - logp
        probs, order = z.softmax(dim=-1).sort(dim=-1, descending=True)
        inside = torch.zeros_like(z, dtype=torch.bool).scatter(
            1, order, probs.cumsum(-1) - probs < top_p
        )
        inside[torch.arange(len(labels)), labels] = True
        logq = torch.where(inside, z - lse[:, None], torch.zeros_like(z))
        return -(torch.where(inside, logq.exp(), torch.zeros_like(z)) * logq).sum(dim=-1)
    logq = torch.log_softmax(z, dim=-1)
    return -(logq.exp() * logq).sum(dim=-1)


@pytest.mark.parametrize("tokens_per_chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.7, 0.5)])
def test_chunked_logprobs_equal_the_plain_ones(monkeypatch, tokens_per_chunk, temperature, top_p):
    torch.manual_seed(0)
    N, H, V = 37, 16, 500
    monkeypatch.setattr(lm_head, "HEAD_CHUNK_BYTES", 4 * V * tokens_per_chunk)
    # logits of a trained model's size (std ~1): log-probabilities around -6, as in the scripts
    hidden, weight = (
        torch.randn(N, H, requires_grad=True),
        (torch.randn(V, H) / H**0.5).requires_grad_(),
    )
    labels, upstream = torch.randint(0, V, (N,)), torch.randn(N)

    ref = plain(hidden, weight, labels, temperature, top_p)
    (ref * upstream).sum().backward()
    ref_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    out, _ = lm_head.TokenLogprobs.apply(hidden, weight, labels, temperature, top_p, False)
    (out * upstream).sum().backward()

    assert (out - ref).abs().max() <= 1e-6
    for got, want in zip((hidden.grad, weight.grad), ref_grads):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_heads_weight_gradient_stays_near_the_fp32_one(monkeypatch, dtype):
    """A 16-bit head's weight gradient takes 16-bit products with fp32 sums (mm32; cuBLAS's on a
    GPU): within 1 % of the fp32 gradient of the same 16-bit weights over 8 chunks of 512 tokens,
    as near as the hidden states' gradient (16-bit since before) is; not the fp32 matmul's cost."""
    torch.manual_seed(0)
    N, H, V = 4096, 64, 2000
    monkeypatch.setattr(lm_head, "HEAD_CHUNK_BYTES", 4 * V * 512)
    hidden, weight = torch.randn(N, H).to(dtype), (torch.randn(V, H) / H**0.5).to(dtype)
    labels, upstream = torch.randint(0, V, (N,)), torch.randn(N)
    fp32 = [x.float().requires_grad_() for x in (hidden, weight)]
    (plain(*fp32, labels, 1.0) * upstream).sum().backward()
    half = [x.clone().requires_grad_() for x in (hidden, weight)]
    out, _ = lm_head.TokenLogprobs.apply(*half, labels, 1.0, 1.0, False)
    (out * upstream).sum().backward()
    for got, want in zip((half[0].grad, half[1].grad), (fp32[0].grad, fp32[1].grad)):
        assert got.dtype == dtype
        assert (got.float() - want).norm() <= 1e-2 * want.norm()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mm32_on_a_gpu_is_the_upcast_product():
    a, b = (torch.randn(*shape, device="cuda").bfloat16() for shape in ((300, 4096), (4096, 96)))
    acc = torch.ones(300, 96, device="cuda")
    got = lm_head.mm32(a, b, acc.clone())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, acc + a.float() @ b.float(), atol=1e-2, rtol=1e-4)


@pytest.mark.parametrize("tokens_per_chunk", [1, 7, 1000])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.5)])
def test_entropy_from_the_chunk_loop_equals_the_plain_one(
    monkeypatch, tokens_per_chunk, temperature, top_p
):
    """The head's entropy H_t (the entropy hook's values["entropy"]): values and the gradient of a
    loss using both log π and H equal autograd through the plain computation; logged alone (its
    gradient 0), the gradient of log π is bitwise the one without the entropy."""
    torch.manual_seed(0)
    N, H, V = 37, 16, 500
    monkeypatch.setattr(lm_head, "HEAD_CHUNK_BYTES", 4 * V * tokens_per_chunk)
    hidden = torch.randn(N, H, requires_grad=True)
    weight = (torch.randn(V, H) / H**0.5).requires_grad_()
    labels, up, up_h = torch.randint(0, V, (N,)), torch.randn(N), torch.randn(N)

    ref = plain(hidden, weight, labels, temperature, top_p)
    ref_h = plain_entropy(hidden, weight, labels, temperature, top_p)
    ((ref * up).sum() + (ref_h * up_h).sum()).backward()
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    out, ent = lm_head.TokenLogprobs.apply(hidden, weight, labels, temperature, top_p, True)
    ((out * up).sum() + (ent * up_h).sum()).backward()
    assert (ent - ref_h).abs().max() <= 1e-5 and (ent > 0).all()
    for got, w in zip((hidden.grad, weight.grad), want):
        assert (got - w).abs().max() <= 1e-5 * w.abs().max()

    grads = []
    for entropy in (False, True):  # the entropy logged only: log π's gradient unchanged
        hidden.grad = weight.grad = None
        out, ent = lm_head.TokenLogprobs.apply(hidden, weight, labels, temperature, top_p, entropy)
        both = out if ent is None else torch.stack((out, ent), dim=-1)[:, 0]  # 0 into H
        (both * up).sum().backward()
        grads.append((hidden.grad.clone(), weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_compute_logprobs_through_an_fsdp2_model_equals_the_formula_it_replaced(
    one_rank_group, tiny_model
):
    """One gloo rank, the scripts' loader (FSDP2, the LogprobHead installed): the log-probabilities
    and every parameter's gradient equal log_softmax(logits / T)[label] from the model's plain
    logits."""
    import torch.distributed as dist

    import grpo

    addr, port = one_rank_group
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = grpo.load_policy(tiny_model, torch.device("cpu"), gradient_checkpointing=False)
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (1, 40))
    positions, labels = torch.arange(40)[None], torch.roll(ids, -1, 1)
    mask = (torch.arange(40) >= 12).long()[None]

    logprobs = grpo.compute_logprobs(model, ids, positions, labels, mask, 0.8)
    assert isinstance(
        model.lm_head, lm_head.LogprobHead
    )  # installed on first use, the same parameter
    logprobs.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    keep = mask[0].nonzero().squeeze(-1)
    logits = model(
        input_ids=ids, position_ids=positions, logits_to_keep=keep, use_cache=False
    ).logits[0]
    assert logits.shape == (
        len(keep),
        model.config.vocab_size,
    )  # outside token_logprobs: logits, as before
    reference = (
        torch.log_softmax(logits.float() / 0.8, dim=-1).gather(1, labels[0, keep, None]).squeeze(1)
    )
    reference.sum().backward()

    assert logprobs.shape == (len(keep),) and (logprobs - reference).abs().max() <= 1e-6
    for name, p in model.named_parameters():
        assert (grads[name] - p.grad).abs().max() <= 1e-5 * max(1.0, p.grad.abs().max().item()), (
            name
        )


def test_no_tokens_at_all():
    """A rank's share of a row under ring attention can hold no response token: (0,) out, zero
    gradients."""
    hidden, weight = torch.randn(0, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    none = torch.zeros(0, dtype=torch.long)
    out, ent = lm_head.TokenLogprobs.apply(hidden, weight, none, 1.0, 1.0, True)
    (out.sum() + ent.sum()).backward()
    assert out.shape == (0,) and hidden.grad.shape == (0, 16)
    assert weight.grad is None or not weight.grad.any()


def test_install_refuses_a_head_it_cannot_compute():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(4, 8, bias=True)

        def get_output_embeddings(self):
            return self.head

    with pytest.raises(TypeError, match="nn.Linear LM head without bias"):
        with lm_head.token_logprobs(Model(), torch.zeros(1, dtype=torch.long)):
            pass
