"""The memory-efficient loader (meta device, FSDP2 wrap, rank 0 reads and broadcasts) gives exactly
what the plain loader gave: every rank reading the whole checkpoint with from_pretrained, then
sharding. Two gloo ranks, tiny models; the weights, the buffers, one training step's loss and the
weights after it must be bit-identical."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import REPO
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification


def plain_loader(kind: str, path: str):
    """The loader every script had before: the whole checkpoint on every rank, then the FSDP2
    wrap."""
    if kind == "policy":
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        )
    else:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path,
            num_labels=1,
            dtype=torch.float32,
            attn_implementation="sdpa",
            output_loading_info=True,
        )
        if kind == "critic" and any(k.startswith("score.") for k in info["missing_keys"]):
            torch.nn.init.zeros_(model.score.weight)
        model.config.pad_token_id = (
            model.config.pad_token_id if model.config.pad_token_id is not None else 0
        )
    for layer in model.base_model.layers:
        fully_shard(layer, mp_policy=MixedPrecisionPolicy())
    fully_shard(model, mp_policy=MixedPrecisionPolicy())
    return model


def new_loader(kind: str, path: str):
    import ppo
    import rm
    import sft

    cpu = torch.device("cpu")
    if kind == "policy":
        return sft.load_policy(path, cpu, gradient_checkpointing=False)
    if kind == "reward_model":
        return rm.load_reward_model(path, cpu, gradient_checkpointing=False, pad_token_id=0)
    return ppo.load_critic(path, cpu, gradient_checkpointing=False, pad_token_id=0)


def one_step(model, kind: str) -> float:
    """One AdamW step on a fixed batch; returns the loss."""
    ids = torch.arange(3, 3 + 2 * 16).view(2, 16) * 7 % 1000
    out = model(input_ids=ids, use_cache=False).logits
    loss = (
        (out.float() - 1).pow(2).mean()
        if kind != "policy"
        else torch.nn.functional.cross_entropy(out[0, :-1], ids[0, 1:])
    )
    loss.backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    return loss.item()


def compare(rank: int, port: int, kind: str, path: str):
    import sys

    sys.path.insert(0, REPO)
    # A CPU test on any machine: with a GPU visible, FSDP2's default device mesh would be CUDA's
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(7)  # the scripts seed before loading: a new scalar head is a seeded draw
        plain = plain_loader(kind, path)
        torch.manual_seed(7)
        new = new_loader(kind, path)
        full = StateDictOptions(full_state_dict=True)
        before_plain, before_new = (
            get_model_state_dict(plain, options=full),
            get_model_state_dict(new, options=full),
        )
        assert before_plain.keys() == before_new.keys()
        for name in before_plain:
            assert torch.equal(before_plain[name], before_new[name]), (
                f"{kind}: {name} differs after loading"
            )
        for (name, a), (_, b) in zip(plain.named_buffers(), new.named_buffers()):
            assert torch.equal(a, b), f"{kind}: buffer {name} differs (not broadcast from rank 0?)"
        assert one_step(plain, kind) == one_step(new, kind)
        after_plain, after_new = (
            get_model_state_dict(plain, options=full),
            get_model_state_dict(new, options=full),
        )
        for name in after_plain:
            assert torch.equal(after_plain[name], after_new[name]), (
                f"{kind}: {name} differs after one step"
            )
        moved = max((after_new[n] - before_new[n]).abs().max().item() for n in after_new)
        assert (
            moved > 1e-4
        )  # the step changed the weights: the comparison is not between two idle models
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "kind,tied", [("policy", True), ("policy", False), ("reward_model", True), ("critic", False)]
)  # fmt: skip
def test_rank0_broadcast_loader_matches_the_plain_loader(kind, tied, tiny_model, tiny_model_untied):
    path = tiny_model if tied else tiny_model_untied
    mp.spawn(compare, args=(free_port(), kind, path), nprocs=2, join=True)
