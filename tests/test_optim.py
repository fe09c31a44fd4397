"""common/optim.py's --optimizer: Muon's step against torch.optim.Muon's, the AdamW groups against
torch.optim.AdamW, which parameter goes where, and Muon under FSDP2 on 2 gloo ranks (rows split
unevenly) against one unsharded copy, resumed exactly from get/set_optimizer_state_dict."""

import io

import pytest
import torch
from test_ring_attn import spawn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from common.errors import InputError
from common.optim import NS_COEFFICIENTS, NS_STEPS, Muon, make_optimizer, newton_schulz

HIDDEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(cls=LlamaForCausalLM, hidden=16, intermediate=37, vocab=33, seed=0):
    """2 layers; 37 and 33 rows split 19/18 and 17/16 over 2 ranks; untied: lm_head is its own."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=hidden // 2, tie_word_embeddings=False, num_labels=1,
                         pad_token_id=0)  # fmt: skip
    return cls(config)


def set_grads(model, seed: int):
    """The same gradients, whole or as each parameter's shard (FSDP2's split)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        g = torch.randn(p.shape, generator=gen)
        if isinstance(p, DTensor):
            g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = g


def test_newton_schulz_is_torchs_and_orthogonalises():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(48, 80, generator=gen)
    theirs = torch.optim._muon._zeropower_via_newtonschulz(g, NS_COEFFICIENTS, NS_STEPS, 1e-7)
    assert torch.equal(newton_schulz(g, torch.bfloat16), theirs)  # bf16: torch's (and the GPU's)
    for shape in [(48, 80), (80, 48), (16, 37)]:  # fp32 (CPU): every singular value near 1
        s = torch.linalg.svdvals(newton_schulz(torch.randn(*shape, generator=gen), torch.float32))
        assert 0.65 < s.min() and s.max() < 1.2, (shape, s.min(), s.max())
        assert (
            s.max() - s.min() > 0.1
        )  # not an SVD: NS's known band (a square one: its tiniest lag)


def test_muon_step_is_torchs_match_rms_adamw(monkeypatch):
    # torch's NS runs in bf16; with ours (fp32) in its place the rest must agree: momentum,
    # Nesterov, decoupled decay, 0.2 √max(A, B); then the update's RMS is AdamW's ~0.2 lr (Moonshot)
    ns = torch.optim._muon._zeropower_via_newtonschulz
    fp32 = lambda g, coefficients, steps, eps: newton_schulz(g, torch.float32)  # noqa: E731
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", fp32)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=gen)
    ours, theirs = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    opt = Muon([{"params": [ours], "muon": True}], lr=0.02, weight_decay=0.1)
    ref = torch.optim.Muon([theirs], 0.02, 0.1, 0.95, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        g = torch.randn(48, 80, generator=gen)
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step(), ref.step()
    torch.testing.assert_close(ours.data, theirs.data, atol=1e-6, rtol=0)
    buffers = opt.state[ours]["momentum_buffer"], ref.state[theirs]["momentum_buffer"]
    torch.testing.assert_close(*buffers, atol=0, rtol=0)
    assert (ours - w).abs().max() > 1e-3  # it moved
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", ns)
    fresh = torch.nn.Parameter(w.clone())
    fresh.grad = torch.randn(48, 80, generator=gen)
    Muon([{"params": [fresh], "muon": True}], lr=0.02, weight_decay=0.0).step()
    rms = ((fresh - w) / 0.02).pow(2).mean().sqrt().item()
    assert 0.15 < rms < 0.22, rms


def test_adamw_groups_equal_torch_adamw():
    ours, theirs = tiny_llama(), tiny_llama()
    opt = make_optimizer(ours, "muon", 1e-3, 0.1)
    ref = torch.optim.AdamW(theirs.parameters(), 1e-3, (0.9, 0.95), weight_decay=0.1)
    for step in range(3):
        set_grads(ours, step), set_grads(theirs, step)
        opt.step(), ref.step()
    adamw = [
        n for n, _ in ours.named_parameters() if not n.startswith("model.layers.") or "norm" in n
    ]
    assert adamw and dict(ours.named_parameters()).keys() == dict(theirs.named_parameters()).keys()
    for name in adamw:
        a, b = ours.get_parameter(name), theirs.get_parameter(name)
        assert torch.equal(a, b), name
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[a][key], ref.state[b][key]), (name, key)


def test_adamw_is_todays_torch_adamw():
    model = tiny_llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    opt = make_optimizer(model, "adamw", 3e-4, 0.05)
    assert type(opt) is torch.optim.AdamW and len(opt.param_groups) == 1
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        3e-4, (0.9, 0.95), 1e-8, 0.05)  # fmt: skip
    assert group["params"] == [p for p in model.parameters() if p.requires_grad]
    assert not group["foreach"] and not group["fused"]  # torch's defaults, as before


@pytest.mark.parametrize("cls", [LlamaForCausalLM, LlamaForSequenceClassification])
def test_which_parameters_muon_trains(cls):
    model = tiny_llama(cls, hidden=64, intermediate=128)
    opt = make_optimizer(model, "muon", 1e-3, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    muon, adamw = ({names[id(p)] for p in g["params"]} for g in opt.param_groups)
    assert [g["muon"] for g in opt.param_groups] == [True, False]
    assert muon == {f"model.layers.{i}.{'mlp' if m in HIDDEN[4:] else 'self_attn'}.{m}.weight"
                    for i in range(2) for m in HIDDEN}  # fmt: skip
    head = "lm_head.weight" if cls is LlamaForCausalLM else "score.weight"
    assert {head, "model.embed_tokens.weight", "model.norm.weight"} <= adamw
    assert {n for n in adamw if n.startswith("model.layers.")} == {
        f"model.layers.{i}.{norm}.weight"
        for i in range(2)
        for norm in ("input_layernorm", "post_attention_layernorm")
    }
    assert len(muon | adamw) == len(names)


def test_muon_refuses_lora():
    from peft import LoraConfig, inject_adapter_in_model

    model = tiny_llama()
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), model)
    with pytest.raises(InputError, match="LoRA"):
        make_optimizer(model, "muon", 1e-3, 0.1)


def _check_fsdp2(rank, world):
    import torch.distributed.checkpoint.state_dict as sd
    from torch.distributed.fsdp import fully_shard

    whole, model = tiny_llama(), tiny_llama()
    for module in [*model.model.layers, model]:  # as common/trainer.py shards
        fully_shard(module)
    rows = model.model.layers[0].mlp.gate_proj.weight.to_local().shape[0]
    assert rows == (19 if rank == 0 else 18)  # 37 rows: the shards are uneven
    start = {n: p.detach().clone() for n, p in whole.named_parameters()}
    optimizers = [make_optimizer(m, "muon", 0.02, 0.1) for m in (whole, model)]
    for step in range(3):
        for m, opt in zip((whole, model), optimizers):
            set_grads(m, step)
            opt.step()
            opt.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), whole.get_parameter(name).data, atol=1e-6,
                                   rtol=0, msg=name)  # fmt: skip
    assert max((whole.get_parameter(n) - w).abs().max() for n, w in start.items()) > 1e-2

    # exact resume: the full state (as checkpoint.save writes it), loaded as trainer.load_optimizer
    opt = optimizers[1]
    full = sd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    buffer = io.BytesIO()
    torch.save(sd.get_optimizer_state_dict(model, opt, options=full), buffer)
    saved = [p.detach().clone() for p in model.parameters()]
    set_grads(model, 3)
    opt.step()
    continued = [p.full_tensor() for p in model.parameters()]
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
    opt.zero_grad(set_to_none=True)
    fresh = make_optimizer(model, "muon", 0.02, 0.1)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False) if rank == 0 else {}
    if rank == 0:
        kinds = {k for s in state["state"].values() for k in s}
        assert {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"} <= kinds
    options = sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    sd.set_optimizer_state_dict(model, fresh, state, options=options)
    set_grads(model, 3)
    fresh.step()
    for (name, p), c in zip(model.named_parameters(), continued):
        assert torch.equal(p.full_tensor(), c), name


def test_muon_under_fsdp2_equals_unsharded_and_resumes_exactly():
    spawn(_check_fsdp2, 2)
