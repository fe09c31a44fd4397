"""The LM head as log-probabilities of given tokens, a chunk at a time: no (tokens, vocab) logits.
Only the sampled tokens' log π(y_t) = z_t[y_t] - logsumexp(z_t), z_t = W h_t / T, are needed. Done
plainly, N tokens make (N, vocab) fp32 logits and as many gradients: ~10 GB each for 16k tokens of
Qwen's 152k vocabulary. `TokenLogprobs` takes HEAD_CHUNK_BYTES of logits at a time, keeps each
token's log-sum-exp, recomputes the chunk in the backward (∂ log π(y_t) / ∂ z_t = onehot(y_t) -
softmax(z_t)); values are the plain computation's (same matmul in the model's dtype, then fp32).
`token_logprobs` makes the head a `LogprobHead` inside the forward: FSDP2 gathers and frees it."""

from contextlib import contextmanager

import torch

HEAD_CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk of tokens (the memory plan counts it)


class TokenLogprobs(torch.autograd.Function):
    """hidden (N, H), weight (V, H), labels (N,) -> (N,) fp32 log π at temperature T (and top-p),
    and with `entropy` the (N,) entropy H = -Σ_v π(v) log π(v) of that distribution, else None."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float, top_p: float, entropy: bool):
        chunk = max(1, HEAD_CHUNK_BYTES // (4 * weight.shape[0]))
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse, logp, ent = torch.empty_like(out), None, torch.empty_like(out) if entropy else None
        for s in range(0, hidden.shape[0], chunk):
            z = (hidden[s : s + chunk] @ weight.T).float() / temperature  # (c, V)
            z = nucleus(z, labels[s : s + chunk], top_p)
            z_y = z.gather(1, labels[s : s + chunk, None]).squeeze(1)
            logp = torch.log_softmax(z, dim=-1)
            out[s : s + chunk] = logp.gather(1, labels[s : s + chunk, None]).squeeze(1)
            lse[s : s + chunk] = z_y - out[s : s + chunk]  # logsumexp(z), for the backward
            if entropy:  # entr(p) = -p log p, 0 where p = 0 (outside the nucleus)
                ent[s : s + chunk] = torch.special.entr(logp.exp()).sum(dim=-1)
        logp = logp if hidden.shape[0] <= chunk else None  # one chunk: kept, not recomputed
        ctx.save_for_backward(hidden, weight, labels, lse, logp, ent)
        ctx.temperature, ctx.top_p, ctx.chunk = temperature, top_p, chunk
        return out, ent

    @staticmethod
    def backward(ctx, grad, grad_ent):
        hidden, weight, labels, lse, logp, ent = ctx.saved_tensors
        # ∂H/∂z = -π (log π + H): only where the loss uses H (logged alone, its gradient is 0)
        grad_ent = grad_ent if grad_ent is not None and grad_ent.any() else None
        T, chunk = ctx.temperature, ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None  # accumulated in fp32 over the chunks
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s : s + chunk], grad[s : s + chunk, None]
            if logp is None:  # recomputed: (c, V)
                z = nucleus((h @ weight.T).float() / T, labels[s : s + chunk], ctx.top_p)
                logp = z.sub_(lse[s : s + chunk, None])
            coef = g  # + g_H (log π + H) where the loss uses H; 0 outside the nucleus (π = 0)
            if grad_ent is not None:
                coef = logp.add(ent[s : s + chunk, None]).nan_to_num_(0, 0, 0)
                coef = coef.mul_(grad_ent[s : s + chunk, None]).add_(g)
            dz, logp = logp.exp_().mul_(-coef), None  # -coef softmax(z) ...
            dz.scatter_add_(1, labels[s : s + chunk, None], g).div_(T)  # + g onehot(y); z = W h / T
            if grad_hidden is not None:
                grad_hidden[s : s + chunk] = dz.to(weight.dtype) @ weight
            if ctx.needs_input_grad[1]:  # a trained head (not a frozen one, under LoRA)
                grad_weight = mm32(dz.to(weight.dtype).T, h, grad_weight)  # fp32 sums
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def mm32(a: torch.Tensor, b: torch.Tensor, acc=None) -> torch.Tensor:
    """a @ b in fp32 (added to fp32 `acc`): for 16-bit a, b on a GPU the 16-bit tensor-core product
    with fp32 accumulation (an fp32 matmul for the head's weight gradient: ~0.45 s a step at vocab
    49k, ~1.4 s at 152k); elsewhere the same arithmetic by upcasting (the CPU computes in fp32)."""
    if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16):
        out = torch.mm(a, b, out_dtype=torch.float32)
        return out if acc is None else acc.add_(out)
    a, b = a.float(), b.float()
    return a @ b if acc is None else acc.addmm_(a, b)


def nucleus(z: torch.Tensor, labels: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits z (c, V), -inf outside vLLM's top-p nucleus, renormalised: π_θold/π_vllm = 1."""
    if top_p >= 1:
        return z
    ascending, order = z.sort(dim=-1)
    outside = ascending.softmax(dim=-1).cumsum_(dim=-1) <= 1 - top_p
    outside[:, -1] = False  # the most probable token, always
    outside = torch.empty_like(outside).scatter_(1, order, outside)
    outside.scatter_(1, labels[:, None], False)  # a label outside (rounding at the edge) stays in
    return z.masked_fill_(outside, float("-inf"))


class LogprobHead(torch.nn.Linear):
    """The LM head (same weight): logits, or in `token_logprobs` the labels' log-probabilities."""

    targets = None  # (labels (N,), temperature, top_p, entropy) while token_logprobs is active

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return super().forward(hidden)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        logprobs, ent = TokenLogprobs.apply(hidden, self.weight, *self.targets)
        return logprobs if ent is None else torch.stack((logprobs, ent), dim=-1)  # (N,) or (N, 2)


@contextmanager
def token_logprobs(model, labels, temperature: float = 1.0, top_p: float = 1.0, entropy=False):
    """In this block `logits` are the (N,) log π of `labels` (with `entropy`: (N, 2), and H)."""
    if not isinstance(head := model.get_output_embeddings(), LogprobHead):  # made one, in place
        if type(head) is not torch.nn.Linear or head.bias is not None:
            raise TypeError(f"expected an nn.Linear LM head without bias: {type(head).__name__}")
        head.__class__ = LogprobHead  # a class change: the parameters stay
    head.targets = (labels, temperature, top_p, entropy)
    try:
        yield
    finally:
        head.targets = None
