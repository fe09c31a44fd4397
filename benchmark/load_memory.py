"""Peak host memory per trainer rank while loading a ≥1B-parameter model: the plain loader against
the scripts'.

    .venv/bin/python benchmark/load_memory.py --ranks 2

plain: what every script did before: each rank calls from_pretrained (the whole fp32 model), then
the FSDP2 wrap. scripts: sft.py's load_policy (the loader of every script): the model built on the
meta device and sharded,
         rank 0 alone reads the checkpoint and broadcasts it; each rank keeps its shard.
The model has random weights and a Llama shape of 1.0B parameters (benchmark/random_model.py's
llama-1b: hidden 2048, 20 layers, MLP 5632, vocab 49152, tied embeddings), saved once in bf16 like
hub checkpoints (2.0 GB of safetensors) under --cache; both loaders make fp32 master weights of it.
Each loader runs in fresh processes (gloo, CPU). Reported per rank: the peak resident set (VmHWM,
which also counts the pages of the memory-mapped checkpoint that the rank read) and the seconds the
load took.
"""

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmark.random_model import make_random_model  # noqa: E402


def vm_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def worker(rank, world, port, loader, path, results):
    from torch.distributed.fsdp import fully_shard

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES=""
    )  # a CPU benchmark
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers import AutoModelForCausalLM

    from sft import load_policy

    before = vm_kb("VmRSS")
    t0 = time.time()
    if loader == "plain":
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        )
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = load_policy(path, torch.device("cpu"), gradient_checkpointing=False)
    dist.barrier()
    seconds = time.time() - t0
    local = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()
    )
    results[rank] = (before / 2**20, vm_kb("VmHWM") / 2**20, vm_kb("VmRSS") / 2**20, seconds, local)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cache", default="/tmp/posttrain-bench/llama-1b-random-bf16")
    args = parser.parse_args()
    make_random_model("llama-1b", args.cache)
    print(
        "| loader | rank | RSS before (GiB) | peak RSS (GiB) | RSS after (GiB) | load (s) | params held |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for loader in ("plain", "scripts"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        results = mp.Manager().dict()
        mp.spawn(
            worker,
            args=(args.ranks, port, loader, args.cache, results),
            nprocs=args.ranks,
            join=True,
        )
        for rank in range(args.ranks):
            before, peak, after, seconds, local = results[rank]
            print(
                f"| {loader} | {rank} | {before:.2f} | {peak:.2f} | {after:.2f} | {seconds:.1f} | {local / 1e6:.0f}M |"
            )


if __name__ == "__main__":
    main()
