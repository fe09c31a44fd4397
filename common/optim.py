"""How the trainer shell steps the weights (the Optimization flags, docs/weights.md): --optimizer,
AdamW or Muon on the hidden matrices; --ema-beta, a running average of them kept where the shards
live (--eval-ema evaluates it). common/trainer.py and the scripts' evaluations call what is here."""

import contextlib
import math
import os

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from common.errors import InputError
from common.placement import call

# ---- --optimizer: Muon (Jordan 2024, kellerjordan.github.io/posts/muon; Liu et al. 2025, arXiv
# 2502.16982) on the hidden 2-D matrices, AdamW on the rest, as both papers and torch.optim.Muon do
NS_COEFFICIENTS, NS_STEPS = (3.4445, -4.7750, 2.0315), 5  # Jordan's quintic, torch.optim.Muon's


def make_optimizer(model, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """adamw: torch's AdamW (β 0.9, 0.95) on the trainable parameters, as before. muon: `Muon`,
    one group of the 2-D matrices in model.get_decoder().layers, one AdamW group of the rest."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # LoRA: the adapters
    if name == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr, (0.9, 0.95), weight_decay=weight_decay)
    # LoRA's A, B are factors of a rank-r ΔW: orthogonalising each orthogonalises no ΔW: refused
    if lora := next((n for n, _ in named if "lora_" in n), None):
        raise InputError(f"--optimizer muon orthogonalises whole matrices, not LoRA's ({lora})")
    hidden = {id(p) for p in model.get_decoder().layers.parameters() if p.ndim == 2}
    muon = [p for _, p in named if id(p) in hidden]
    if any(type(s) not in (Shard, Replicate) for p in muon for s in getattr(p, "placements", ())):
        raise InputError("--optimizer muon: a matrix is split other than by FSDP2's rows (TP?)")
    rest = [p for _, p in named if id(p) not in hidden]
    return Muon([{"params": muon, "muon": True}, {"params": rest, "muon": False}], lr, weight_decay)


class Muon(torch.optim.Optimizer):
    """Muon on the groups with "muon", AdamW on the rest, each at its group's lr: the schedule sets
    one rate, as Moonshot's RMS matching lets Muon reuse AdamW's lr and λ (§2.2). For θ (A x B), G:
        M ← μM + (1-μ)G, U ← (1-μ)G + μM   (Nesterov, μ 0.95; torch's form: (1-μ) times Jordan's
                                           M ← μM + G, U ← G + μM, the same once NS normalises U)
        θ ← θ(1 - lr λ) - lr 0.2 √max(A, B) NS(U)   (NS(U) has RMS ≈ 1/√max(A, B); AdamW's ≈ 0.2)
    FSDP2: each rank gathers U, orthogonalises it whole, keeps its shard (§2.3 divides that work)"""

    def __init__(self, groups, lr: float, weight_decay: float):
        hyper = dict(lr=lr, weight_decay=weight_decay, momentum=0.95, betas=(0.9, 0.95), eps=1e-8)
        super().__init__(groups, hyper)

    @torch.no_grad()
    def step(self, closure=None):  # closure: torch's signature (set_optimizer_state_dict uses it)
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                p.mul_(1 - group["lr"] * group["weight_decay"])  # decoupled weight decay
                (muon_step if group["muon"] else adamw_step)(p, self.state[p], group)


def muon_step(p, state: dict, group: dict):
    if not state:
        state["momentum_buffer"] = torch.zeros_like(p)
    mu, m = group["momentum"], state["momentum_buffer"]
    m.lerp_(p.grad, 1 - mu)  # elementwise: on this rank's shard
    u = p.grad.lerp(m, mu)
    whole = u.full_tensor() if isinstance(u, DTensor) else u  # NS needs the whole matrix
    o = newton_schulz(whole, torch.bfloat16 if p.is_cuda else torch.float32).to(p.dtype)
    if isinstance(p, DTensor):  # this rank's slice of it, as FSDP2 splits the rows (unevenly too)
        o = distribute_tensor(o, p.device_mesh, p.placements, src_data_rank=None)
    p.add_(o, alpha=-group["lr"] * 0.2 * math.sqrt(max(p.shape)))


def adamw_step(p, state: dict, group: dict):
    """torch.optim.AdamW's single-tensor step: m ← β₁m + (1-β₁)g, v ← β₂v + (1-β₂)g²,
    θ ← θ - lr m̂ / (√v̂ + ε), m̂ = m / (1-β₁ᵗ), v̂ = v / (1-β₂ᵗ) (Loshchilov & Hutter 2019)."""
    if not state:
        zeros = torch.zeros_like
        state.update(step=torch.tensor(0.0), exp_avg=zeros(p), exp_avg_sq=zeros(p))
    (beta1, beta2), g, t = group["betas"], p.grad, state["step"].add_(1).item()
    state["exp_avg"].lerp_(g, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])
    p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**t))


def newton_schulz(g: torch.Tensor, dtype, eps: float = 1e-7) -> torch.Tensor:
    """≈ UVᵀ of g = USVᵀ: from X = g/‖g‖_F (every singular value ≤ 1), 5 times X ← aX + (bA + cA²)X,
    A = XXᵀ (the short side's Gram). The quintic takes each singular value (but the tiniest) into
    ~[0.68, 1.13], not to 1: Jordan finds it trains as well, in 5 steps. bf16 on GPU, as the papers
    and torch; fp32 on CPU, where the trainers compute in fp32 and bf16 matmuls are slow."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype).T if g.size(0) > g.size(1) else g.to(dtype)
    x = x / x.norm().clamp(min=eps)
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.size(0) > g.size(1) else x


# ---- --ema-beta: θ_ema, this rank's shards of it, updated in place: never gathered on the way ----
def local(param):  # this rank's shard of an FSDP2 parameter (a DTensor), as a plain tensor
    return param.to_local() if hasattr(param, "to_local") else param


def ema_start(model, load, path: str, device, dtype) -> list[torch.Tensor]:
    """θ_ema = θ_0 (the model as loaded), or on --resume the checkpoint's ema/ as saved."""
    source = (
        load(f"{path}/ema", device, False, None, dtype) if os.path.isdir(f"{path}/ema") else model
    )
    return [local(p).detach().clone() for p in source.parameters()]


@torch.no_grad()
def ema_update(ema: list, model, beta: float):  # θ_ema ← β θ_ema + (1 - β) θ, after each step
    for average, p in zip(ema, model.parameters()):
        average.lerp_(local(p), 1 - beta)


@torch.no_grad()
def ema_swap(trainer):
    """θ and θ_ema trade places on a trainer rank (twice: back as they were, exactly)."""
    trainer.model.reshard()  # an eval's forward leaves the root unsharded: its shards back
    for average, p in zip(trainer.ema, trainer.model.parameters()):
        held = local(p).clone()
        local(p).copy_(average)
        average.copy_(held)


@contextlib.contextmanager
def ema_weights(trainers: list, sync=None, on: bool = True):
    """--eval-ema, around (or as a decorator on) a script's evaluation: inside it the trainers hold
    θ_ema; `sync()` after each swap puts the same weights in the engines."""

    def swap():
        if on:
            call(trainers, ema_swap)
        if on and sync:
            sync()

    swap()
    try:
        yield
    finally:
        swap()
