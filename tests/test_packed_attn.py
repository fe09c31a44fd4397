"""Attention over packed rows (common/packed_attn.py): a packed row's log-probabilities and their
gradients equal those of its sequences run one by one, without a T x T mask; padding masks and KV
caches still get SDPA's mask; models with sliding windows or softcaps keep SDPA; on a GPU, the
flash varlen kernel equals the per-sequence path."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

from common import packed_attn
from common.packed_attn import PACKED


def load(path, attn):
    if attn == PACKED:
        assert packed_attn.enable(LlamaConfig()) == PACKED
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)


def sequences():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 1000, (n,), generator=gen) for n in (37, 1, 12, 64, 5)]


def logprobs_and_grads(model, rows):
    """Σ over rows of each token's log π(next token); the per-token values and the gradient."""
    model.zero_grad()
    values = []
    for ids, pos in rows:
        logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
        values.append(F.log_softmax(logits.float(), -1)[:-1].gather(1, ids[1:, None])[:, 0])
    # the last token of each sequence predicts the next sequence's first in a packed row: drop it
    values = torch.cat(values)
    return values, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_row(seqs):
    return torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs])


def test_a_packed_row_equals_its_sequences_run_one_by_one(tiny_model, monkeypatch):
    seqs = sequences()
    alone = load(tiny_model, "sdpa")
    one_by_one = [(s, torch.arange(len(s))) for s in seqs]
    want, _ = logprobs_and_grads(alone, one_by_one)
    want.sum().backward()
    want_grads = {n: p.grad.clone() for n, p in alone.named_parameters()}

    def no_mask(*args, **kwargs):
        raise AssertionError("a packed row got a T x T mask")

    model = load(tiny_model, PACKED)
    monkeypatch.setattr(packed_attn, "sdpa_mask", no_mask)
    ids, pos = packed_row(seqs)
    logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
    logp = F.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None])[:, 0]
    ends = torch.tensor([len(s) for s in seqs]).cumsum(0)[:-1] - 1  # predicts the next sequence
    keep = torch.ones(len(ids) - 1, dtype=torch.bool)
    keep[ends] = False
    got = logp[keep]
    got.sum().backward()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want.detach(), atol=2e-5, rtol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want_grads[name], atol=2e-5, rtol=1e-4)
    assert max(g.abs().max().item() for g in want_grads.values()) > 1e-3  # not zeros


def test_the_dense_mask_path_is_what_it_replaces(tiny_model):
    """The same row through transformers' SDPA (its T x T mask from the restarts): equal values,
    so the comparison above is with what the scripts computed before."""
    ids, pos = packed_row(sequences())
    row = dict(input_ids=ids[None], position_ids=pos[None], use_cache=False)
    with torch.no_grad():
        dense, packed = (load(tiny_model, attn)(**row).logits for attn in ("sdpa", PACKED))
    torch.testing.assert_close(packed, dense, atol=2e-5, rtol=0)


def test_padding_masks_and_kv_caches_still_get_sdpa(tiny_model):
    sdpa, packed = load(tiny_model, "sdpa"), load(tiny_model, PACKED)
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        want, got = (m(input_ids=ids, attention_mask=mask).logits for m in (sdpa, packed))
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=0)
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    for batch, batch_mask in ((ids[:1], None), (ids, mask)):  # one row, and a padded batch
        want = sdpa.generate(input_ids=batch, attention_mask=batch_mask, **greedy)
        assert packed.generate(input_ids=batch, attention_mask=batch_mask, **greedy).equal(want)


def test_cuts_are_where_positions_restart():
    packed_attn._last[:] = None, None
    bounds, cu, longest = packed_attn.cuts(torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]]))
    assert bounds == [0, 3, 5, 6, 10] and cu.tolist() == bounds and longest == 4
    assert cu.dtype == torch.int32
    # a row that starts inside a sequence (a ring's shard, a truncated row): a restart is any jump
    assert packed_attn.cuts(torch.tensor([[5, 6, 7, 0, 1]]))[0] == [0, 3, 5]


@pytest.mark.parametrize(
    "config,want",
    [
        (LlamaConfig(), PACKED),
        (Qwen2Config(use_sliding_window=False, sliding_window=4096), PACKED),
        (Qwen2Config(use_sliding_window=True, sliding_window=4096, max_window_layers=0), "sdpa"),
        (MistralConfig(sliding_window=4096), "sdpa"),
        (Gemma2Config(), "sdpa"),  # sliding layers and logit softcapping
    ],
)
def test_only_plainly_causal_models_skip_the_mask(config, want, monkeypatch):
    assert packed_attn.enable(config) == want
    monkeypatch.setenv("POSTTRAIN_PACKED_ATTENTION", "0")  # the switch back to SDPA's mask
    assert packed_attn.enable(config) == "sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_varlen_equals_the_per_sequence_path_on_a_gpu(dtype):
    """Both branches of packed_attention_forward on one packed row (GQA, 4 sequences), values and
    gradients, within the 16-bit kernel's rounding."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths, H, Hkv, D = [300, 1, 700, 47], 14, 2, 64  # Qwen2.5-0.5B's heads
    T, module = sum(lengths), torch.nn.Module()
    pos = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    qkv = [torch.randn(1, h, T, D, device="cuda", generator=gen) for h in (H, Hkv, Hkv)]
    results = []
    for half in (True, False):  # the flash kernel, then the per-sequence path (fp32)
        leaves = [x.to(dtype if half else torch.float32).requires_grad_() for x in qkv]
        packed_attn._last[:] = None, None
        out, _ = packed_attn.packed_attention_forward(
            module, *leaves, None, scaling=D**-0.5, position_ids=pos
        )
        out.float().square().sum().backward()
        results.append([out.float(), *(x.grad.float() for x in leaves)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
