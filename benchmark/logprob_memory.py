"""Peak memory of the sampled tokens' log-probabilities, forward and backward: plain logits against
the chunked LM head (common/lm_head.py), on the CPU.

    .venv/bin/python benchmark/logprob_memory.py [--tokens 1024 4096] [--vocab 151936] [--hidden 896]

plain: logits = h W^T in fp32, log_softmax, gather, backward (what compute_logprobs did before).
chunked: TokenLogprobs, 256 MiB of logits at a time, recomputed in the backward. top-p: the same
with --top-p 0.9 (each chunk sorted to find the nucleus, in the forward and again in the backward). Each measurement
runs in a fresh process; reported: the peak resident set (VmHWM) minus the resident set after the
inputs (hidden states, head weight, labels) were made, i.e. what the computation itself added, and
seconds.
"""

import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def vm_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure(kind: str, tokens: int, vocab: int, hidden: int) -> None:
    import torch

    sys.path.insert(0, REPO)
    from common.lm_head import TokenLogprobs

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) / hidden**0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    base, t0 = vm_kb("VmRSS"), time.time()
    if kind == "plain":
        logp = torch.log_softmax((h @ w.T).float(), dim=-1).gather(1, labels[:, None]).squeeze(1)
    else:
        logp, _ = TokenLogprobs.apply(h, w, labels, 1.0, 0.9 if kind == "top-p" else 1.0, False)
    logp.sum().backward()
    print(f"{(vm_kb('VmHWM') - base) / 2**20:.2f} {time.time() - t0:.1f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--vocab", type=int, default=151936)  # Qwen2.5's
    parser.add_argument("--hidden", type=int, default=896)  # Qwen2.5-0.5B's
    parser.add_argument("--measure", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        kind, tokens, vocab, hidden = args.measure
        return measure(kind, int(tokens), int(vocab), int(hidden))
    print(
        f"vocab {args.vocab}, hidden {args.hidden}, fp32 on CPU; peak memory added (GiB) and seconds, fwd + bwd"
    )
    kinds = ("plain", "chunked", "top-p")
    print(
        "| tokens | "
        + " | ".join(f"{k} GiB" for k in kinds)
        + " | "
        + " | ".join(f"{k} s" for k in kinds)
        + " |"
    )
    print("|" + " --- |" * 7)
    for tokens in args.tokens:
        out = {}
        for kind in kinds:
            cmd = [
                sys.executable,
                __file__,
                "--measure",
                kind,
                str(tokens),
                str(args.vocab),
                str(args.hidden),
            ]
            out[kind] = subprocess.run(
                cmd, capture_output=True, text=True, check=True
            ).stdout.split()
        print(
            f"| {tokens} | "
            + " | ".join(out[k][0] for k in kinds)
            + " | "
            + " | ".join(out[k][1] for k in kinds)
            + " |"
        )


if __name__ == "__main__":
    main()
