"""Attention over a packed row, three ways, forward + backward of the decoder (no LM head):
  dense   transformers' SDPA with the T x T mask it builds from the restarts (the scripts before
          common/packed_attn.py);
  packed  common/packed_attn.py: flash varlen on a GPU in 16 bits, one SDPA call per sequence
          elsewhere;
  rows    every sequence in a row of its own (no mask: SDPA's causal kernel), the work's floor.
A random model of Qwen2.5-0.5B's shape (hidden 896, 14 query heads, 2 K/V heads, head dim 64;
--layers of it), or --model's config. A row of T tokens: sequences of --seq-len tokens, or of 128-640
(a prompt and a response of GRPO's reference). Prints a markdown row per T and way: the median
seconds over --repeats after a warm-up, on CUDA the step's peak memory, and the largest difference
of the hidden states from the first way's (0 for the first).

    python benchmark/packed_attention.py                                   # CPU: 512 2048 4096
    python benchmark/packed_attention.py --device cuda --dtype bfloat16 --gradient-checkpointing \\
        --model /tmp/qwen2.5-0.5b-random --seq-len 557 --tokens 2048 4096 16384
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import packed_attn  # noqa: E402


def lengths(total: int, seq_len: int | None) -> list[int]:
    gen, out = torch.Generator().manual_seed(total), []
    while sum(out) < total:
        n = seq_len or int(torch.randint(128, 641, (1,), generator=gen))
        out.append(min(n, total - sum(out)))
    return out


def step(model, ids, pos, way: str, seqs: list[int]) -> torch.Tensor:
    """One forward + backward of the decoder; returns the hidden states (for the cross-check)."""
    if way == "rows":
        rows = torch.split(ids, seqs, dim=1)
        hidden = [model.model(input_ids=r, use_cache=False).last_hidden_state for r in rows]
        for h in hidden:
            h.float().square().mean().backward()
        return torch.cat([h.detach() for h in hidden], dim=1)
    hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    hidden.float().square().mean().backward()
    return hidden.detach()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--model", help="a folder whose config to build (random weights)")
    p.add_argument("--layers", type=int, default=2, help="without --model")
    p.add_argument("--seq-len", type=int, help="every sequence this long (else 128-640)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ways", nargs="+", default=["dense", "packed", "rows"])
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.model:
        config = AutoConfig.from_pretrained(args.model)
    else:
        shape = dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, head_dim=64)
        config = Qwen2Config(
            vocab_size=1024,
            intermediate_size=4864,
            use_sliding_window=False,
            num_hidden_layers=args.layers,
            max_position_embeddings=32768,
            **shape,
        )
    layers = config.get_text_config().num_hidden_layers
    ckpt = " ckpt" if args.gradient_checkpointing else ""
    print("| device | dtype | layers | T | sequences | way | s (fwd+bwd) | peak GiB | max diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for total in args.tokens:
        seqs = lengths(total, args.seq_len)
        ids = torch.randint(0, config.vocab_size, (1, total), generator=torch.Generator())
        pos = torch.cat([torch.arange(n) for n in seqs])[None]
        ids, pos, reference = ids.to(device), pos.to(device), None
        for way in args.ways:
            attn = packed_attn.enable(config) if way == "packed" else "sdpa"
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
            model = model.to(device=device, dtype=dtype).train()
            if args.gradient_checkpointing:
                model.gradient_checkpointing_enable({"use_reentrant": False})
            times, peak = [], ""
            try:
                for i in range(args.repeats + 1):  # the first is a warm-up
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                    hidden = step(model, ids, pos, way, seqs)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f}"
                    times += [time.perf_counter() - start] if i else []
                    model.zero_grad(set_to_none=True)
                reference = hidden if reference is None else reference
                diff = f"{(hidden.float() - reference.float()).abs().max().item():.1e}"
                seconds = f"{statistics.median(times):.3f}"
            except torch.OutOfMemoryError:
                seconds, peak, diff, hidden = "out of memory", "", "", None
            row = [device.type, args.dtype, f"{layers}{ckpt}", total, len(seqs), way, seconds]
            print("| " + " | ".join(map(str, [*row, peak, diff])) + " |", flush=True)
            del model, hidden
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
