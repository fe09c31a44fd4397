"""Peak memory per rank of one training step (forward + backward) against sequence length, for sp 1,
2, 4.

A model with SmolLM2-135M's shapes (hidden 576, 9 query / 3 K/V heads, vocab 49152) but 4 decoder
layers and random weights, so that long rows fit a CPU's time. One packed row of T tokens (4
sequences of T/4) goes through sft.py's load_policy + compute_logprobs with the loss on every token;
with sp > 1 the row is split with shard_micro_batch and attention runs as common/ring_attn.py's ring
over gloo (one process per rank).

What is measured: on CUDA, torch.cuda.max_memory_allocated during the step minus the memory before
it; on CPU, the rise of the process's peak resident set (VmHWM, reset via /proc/self/clear_refs just
before the step) over its resident set before the step. Both are per rank; the table shows the
largest rank.

    .venv/bin/python benchmark/ring_attn_memory.py --lengths 1024 2048 4096 8192 --sp 1 2 4
"""

import argparse
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def worker(rank, world, port, model_path, T, results):
    from common.ring_attn import enable_ring_attention, shard_micro_batch, sp_groups
    from sft import compute_logprobs, load_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    model = load_policy(model_path, device, gradient_checkpointing=False)
    sp = sp_groups(world, world)
    enable_ring_attention(model, sp.group)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (1, T), generator=gen)
    mb = {
        "input_ids": ids,
        "position_ids": torch.arange(T).remainder(T // 4)[None],  # 4 packed sequences of T/4 tokens
        "labels": torch.roll(ids, -1, 1),
        "loss_mask": torch.ones(1, T, dtype=torch.long),
    }
    mb = shard_micro_batch({k: v.to(device) for k, v in mb.items()}, sp.rank, sp.size)
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (the peak resident set) to the current resident set
        before = rss_kb("VmRSS") * 1024
    t0 = time.time()
    logprobs = compute_logprobs(
        model, mb["input_ids"], mb["position_ids"], mb["labels"], mb["loss_mask"]
    )
    (-logprobs.mean()).backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = rss_kb("VmHWM") * 1024 - before
    results[rank] = (peak, time.time() - t0)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=16384, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as model_path:
        LlamaForCausalLM(config).save_pretrained(model_path)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        print(f"device {device}, {args.layers} layers of SmolLM2-135M shape, fp32 master weights")
        print(
            "| T (tokens per row) | sp | tokens per rank | peak memory per rank (MiB) | step time (s) |"
        )
        print("| --- | --- | --- | --- | --- |")
        for T in args.lengths:
            for k in args.sp:
                results = mp.Manager().dict()
                mp.spawn(worker, args=(k, free_port(), model_path, T, results), nprocs=k, join=True)
                peak = max(p for p, _ in results.values()) / 2**20
                secs = max(s for _, s in results.values())
                print(f"| {T} | {k} | {T // k} | {peak:.0f} | {secs:.1f} |", flush=True)


if __name__ == "__main__":
    main()
