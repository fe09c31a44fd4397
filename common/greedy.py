"""Greedy accuracy without engines (sft.py, dpo.py): HF generate on the trainer ranks, reward_fn."""

import torch

from common.placement import call
from common.ring_attn import enable_ring_attention
from common.vision import batch


def greedy_completions(model, tokenizer, prompts: list, max_new_tokens: int, synced):
    """Greedy completions (ids, no EOS or padding) of prompts batched left-padded: all end where
    generation starts. synced: the FSDP ranks generate together, in step if one finishes first.
    A VLM's prompts are (ids, its images' tensors) pairs."""
    images = batch([p[1] if isinstance(p, tuple) else {} for p in prompts])
    prompts = [p[0] if isinstance(p, tuple) else p for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width, device = max(len(p) for p in prompts), model.device
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    greedy = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    images = {k: v.to(device) for k, v in images.items()}
    out = model.generate(
        input_ids=input_ids, attention_mask=mask, synced_gpus=synced, **greedy, **images
    )
    stop = {tokenizer.eos_token_id, pad}
    return [[t for t in row[width:].tolist() if t not in stop] for row in out]


@torch.no_grad()
def generate(trainer, prompts: list, max_new_tokens: int) -> list[list[int]]:
    """Greedy completions of this rank's prompts, each whole here (ring attention off). The root's
    weights gathered first: a VLM's generate runs its vision tower outside the root's forward."""
    trainer.model.eval()
    trainer.model.unshard()
    enable_ring_attention(trainer.model, None)
    args = (trainer.tokenizer, prompts, max_new_tokens, trainer.world_size > 1)
    out = greedy_completions(trainer.model, *args)
    enable_ring_attention(trainer.model, trainer.sp.group)
    trainer.model.reshard()
    return out


def accuracy(trainers: list, rows: list[dict], prompts: list, tokenizer, max_new_tokens, reward_fn):
    """The prompts dealt round-robin to the trainer ranks, completed there, scored with
    reward_fn(text, answer) against each row's answer. Returns (accuracy, sample rows)."""
    n = len(trainers)
    outs = call(trainers, generate, max_new_tokens, per_rank=[prompts[r::n] for r in range(n)])
    texts = [""] * len(prompts)
    for r, out in enumerate(outs):
        texts[r::n] = [tokenizer.decode(o) for o in out]
    rewards = [reward_fn(text, str(row["answer"])) for text, row in zip(texts, rows)]
    samples = [
        dict(prompt=row["prompt"], response=text, answer=row["answer"], reward=reward)
        for row, text, reward in zip(rows, texts, rewards)
    ]
    return sum(rewards) / len(rewards), samples
