"""DPO: Direct Preference Optimization (Rafailov et al. 2023, arXiv 2305.18290, eq. 7), IPO, cDPO.

RLHF with a KL-regularised reward has a closed-form optimal policy, so the reward can be written
through the policy itself: r(x, y) = β log π_θ(y|x) / π_ref(y|x) (+ a term of x alone, which cancels
in a pair). Putting that into the Bradley-Terry likelihood of preference pairs (x, chosen y_c,
rejected y_r) gives a classification loss on the policy, with no reward model and no sampling:
    Δ_c = log π_θ(y_c|x) - log π_ref(y_c|x),  Δ_r = the same for y_r,  h = Δ_c - Δ_r
                                                      (log π(y|x): sums over response tokens)
    DPO:   L = -log σ(β h)
    cDPO:  L = -(1 - ε) log σ(β h) - ε log σ(-β h)    labels flipped with probability ε
    IPO:   L = (h - 1/(2β))²                          (Azar et al. 2023, arXiv 2310.12036, eq. 17)
averaged over the pairs of a batch. π_ref is the frozen starting model; each trainer rank holds an
FSDP2 shard of both, and computes the reference logprobs of every batch in a no-grad forward.

Run it:
    python dpo.py                                     # built-in model and arithmetic pairs, CPU/GPU
    python dpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/ultrafeedback_binarized \\
        --eval-dataset trl-lib/ultrafeedback_binarized --accuracy-dataset "" --max-length 1024 \\
        --max-tokens-per-micro-batch 8192 --batch-size 64 --num-steps 500 \\
        --learning-rate 5e-7                           # 1 GPU
    python dpo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset my_pairs.jsonl --num-trainers 8 \\
        --ipo --batch-size 128 --max-tokens-per-micro-batch 16384 \\
        --gradient-checkpointing                       # 8 GPUs, IPO loss
"""

import os
import re
import time
from dataclasses import dataclass
from typing import Annotated

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

# Setup-only plumbing is called through its module (placement.Layout, checkpoint.save, ...): each
# call says where it lives. The names below are what the math, the update and the loop use.
from common import checkpoint, data, greedy, lora, memory, models, placement, vision
from common.data import batch_rows
from common.errors import InputError
from common.flags import Experiment, LoRA, Optimization, Resources, check_flags, parse_args
from common.lm_head import token_logprobs
from common.optim import ema_weights
from common.placement import call
from common.precision import choose_dtype
from common.prompts import read_prompts
from common.ring_attn import sequence_sums, shard_micro_batch
from common.tracking import Run
from common.trainer import Trainer, load_policy


@dataclass
class Args(Optimization, LoRA, Resources, Experiment):  # common/'s flags come first
    # Model and data
    model: str = models.BUILTIN_MODEL
    """HF hub id, local HF folder, or the built-in offline model (also π_ref, the frozen start)"""
    dataset: str = "data/arithmetic/prefs_train.jsonl"
    """preference pairs: local .jsonl/.json/.parquet file or folder, or hub id[:config];
    `prompt`+`chosen`+`rejected`"""
    dataset_split: str = "train"
    """split to read when --dataset is a hub id"""
    eval_dataset: str = "data/arithmetic/prefs_test.jsonl"
    """held-out pairs for the eval loss and preference accuracy ("" to skip)"""
    eval_split: str = "test"
    """split to read when --eval-dataset is a hub id"""
    accuracy_dataset: str = "data/arithmetic/prompts_test.jsonl"
    """held-out `prompt`+`answer` rows for greedy accuracy ("" to skip)"""
    max_length: Annotated[int, ">= 1"] = 512
    """longest sequence (prompt + one response) in tokens"""
    drop_long: bool = False
    """drop pairs longer than --max-length instead of stopping with an error"""
    max_new_tokens: Annotated[int, ">= 1"] = 32
    """generation budget of the greedy accuracy eval"""

    # Algorithm
    beta: Annotated[float, "> 0"] = 0.1
    """β: strength of the implicit KL to π_ref (DPO: scale of the implicit reward; IPO: target
    margin 1/(2β))"""
    label_smoothing: Annotated[float, ">= 0, < 0.5"] = 0.0
    """ε: cDPO, the chance that a pair's label is wrong (0: plain DPO; sigmoid loss only)"""
    ipo: bool = False
    """use the IPO loss (h - 1/(2β))² instead of DPO's -log σ(β h)"""

    # Optimization
    num_steps: Annotated[int, ">= 1"] = 16
    """optimizer steps"""
    batch_size: Annotated[int, ">= 1"] = 8
    """preference pairs per optimizer step, over all ranks"""
    max_tokens_per_micro_batch: Annotated[int | None, ">= 1"] = None
    """token budget of one packed micro-batch on one rank (default: 1024, or one pair if more;
    raise it on GPU); gradients accumulate over micro-batches"""
    learning_rate: Annotated[float, "> 0"] = 2e-5
    """peak learning rate (both halves of Muon too)"""


# ALGO LOGIC: the log-probabilities and the reward (the same in every script; the model is
# common/trainer.py's load_policy).
def compute_logprobs(
    model, input_ids, positions, labels, mask, temperature=1.0, top_p=1.0, entropy=False, **images
):
    """log π(label_t | tokens ≤ t) at temperature T, for every position t where mask is 1:
        log π(y_t) = z_t[y_t] - logsumexp(z_t),   z_t = logits_t / T
    With top_p < 1 the logsumexp runs over the nucleus only, the distribution vLLM samples from.

    input_ids, positions, labels, mask: (1, T) packed rows; labels[t] is the token after t. Only
    the masked positions go through the LM head, a chunk of them at a time (common/lm_head.py): the
    (N, vocab) logits never exist at once, in the forward or the backward. Returns (N,) fp32; with
    `entropy`, also each position's H_t = -Σ_v π(v) log π(v), from the same chunks: ((N,), (N,)).
    `images`: a VLM's pixel tensors for the row's image tokens (common/vision.py's `inputs`).
    """
    keep = mask[0].nonzero().squeeze(-1)  # (N,)
    with token_logprobs(model, labels[0, keep], temperature, top_p, entropy):  # the head swapped
        kw = dict(position_ids=positions, logits_to_keep=keep, use_cache=False, **images)
        out = model(input_ids, **kw)
    logprobs = out.logits  # log π(y_t) (, H_t): what the swapped head gives where logits would be
    return logprobs.unbind(-1) if entropy else logprobs  # (N,) (, (N,))


def reward_fn(response: str, answer: str) -> float:
    """Rule verifier: 1.0 if the response's final answer equals `answer`, else 0.0.

    Integer answers (the arithmetic task, GSM8K's "#### 72") are compared with the last number in
    the response, one-word answers (the shapes task's "red") with its last word, any case; other
    answers (LaTeX, fractions) go through math-verify.
    """
    answer = answer.split("####")[-1].strip().replace(",", "")
    if re.fullmatch(r"-?\d+", answer):
        numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", response)
        return float(bool(numbers) and float(numbers[-1].replace(",", "")) == int(answer))
    if re.fullmatch(r"[A-Za-z]+", answer):
        words = re.findall(r"[A-Za-z]+", response)
        return float(bool(words) and words[-1].lower() == answer.lower())
    from math_verify import parse, verify

    return float(verify(parse(answer), parse(response)))


# ALGO LOGIC: a response's log-probability and the pair loss.
def sequence_logprobs(model, mb: dict, sp_group=None) -> torch.Tensor:
    """log π(y|x) of every response in a packed micro-batch of pairs: the sum over its tokens.
    Returns (P, 2), column 0 chosen, column 1 rejected (make_pair puts them in that order). With
    --sp-size k this rank holds part of each row; sequence_sums adds the k partial sums."""
    inputs = (mb["input_ids"], mb["positions"], mb["labels"], mb["loss_mask"])
    logprobs = compute_logprobs(model, *inputs)  # (N,)
    keep = mb["loss_mask"][0].bool()
    num_seqs = int(mb["num_seqs"])
    return sequence_sums(logprobs, mb["seq_index"][0, keep], num_seqs, sp_group).view(-1, 2)


def compute_dpo_loss(
    chosen_logratios, rejected_logratios, beta: float, label_smoothing=0.0, ipo=False
):
    """Per-pair loss from Δ = log π_θ(y|x) - log π_ref(y|x) of the chosen and rejected, all (P,).
    One loss, three documented variants of the same algorithm: DPO (ε = 0), cDPO (ε > 0), IPO
    (ipo=True; a squared loss that stops pushing once the log-ratio gap reaches 1/(2β) instead of
    driving it to infinity)."""
    h = chosen_logratios - rejected_logratios
    if ipo:
        return (h - 1 / (2 * beta)) ** 2
    eps = label_smoothing
    return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


def compute_loss(logprobs, ref_logprobs, args: Args) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's loss on one micro-batch of pairs. logprobs, ref_logprobs: (P, 2) summed response
    log-probabilities of (chosen, rejected) under π_θ and π_ref. Returns the per-pair losses (P,)
    and the implicit rewards β Δ (P, 2); train_step sums the losses and divides by the pairs of the
    whole global batch."""
    logratios = logprobs - ref_logprobs  # (P, 2) Δ
    chosen, rejected = logratios[:, 0], logratios[:, 1]
    losses = compute_dpo_loss(chosen, rejected, args.beta, args.label_smoothing, args.ipo)
    return losses, args.beta * logratios.detach()


def compute_pair_losses(model, ref, mb: dict, args: Args, sp_group=None):
    """(P,) losses and (P, 2) implicit rewards of this rank's part of a micro-batch of pairs: log
    π(y|x) under π_θ and π_ref (no gradient), then compute_loss. Another per-response sum (a length,
    ...) goes here, through sequence_sums as in sequence_logprobs."""
    with torch.no_grad():
        ref_logprobs = sequence_logprobs(ref, mb, sp_group)  # (P, 2)
    return compute_loss(sequence_logprobs(model, mb, sp_group), ref_logprobs, args)


# ALGO LOGIC: what each step logs (docs/dpo.md lists every key).
def pair_stats(losses: torch.Tensor, rewards: torch.Tensor) -> dict:
    """Sums over a micro-batch of pairs: the loss, the implicit rewards β Δ (P, 2) of chosen and
    rejected, and the pairs ranked right (margin > 0; a tie, h = 0 as at step 0, counts half)."""
    margins = rewards[:, 0] - rewards[:, 1]
    return {
        "loss": losses.sum(),
        "accuracy": (margins > 0).sum() + 0.5 * (margins == 0).sum(),
        "margin": margins.sum(),
        "chosen_reward": rewards[:, 0].sum(),
        "rejected_reward": rewards[:, 1].sum(),
        "pairs": len(losses),
    }


def pair_metrics(prefix: str, sums: list[dict], args: Args) -> dict:
    """Means per pair from the ranks' sums of every stat pair_stats returns, as <prefix>/<name>: the
    loss, the share of pairs whose chosen response has the higher implicit reward, the mean margin,
    the two rewards (the chosen one should rise, the rejected one fall)."""
    sums = sums[:: args.sp_size]  # the ranks of an SP group report the same pairs: count them once
    n = sum(s["pairs"] for s in sums)
    keys = [k for k in sums[0] if k not in ("pairs", "grad_norm", "lr")]
    return {f"{prefix}/{k}": sum(s[k] for s in sums) / n for k in keys}


# TRY NOT TO MODIFY: the data plumbing.
def make_pair(chosen: tuple[list[int], list[int]], rejected: tuple[list[int], list[int]]) -> dict:
    """One packing unit from (ids, response mask) of prompt + chosen and of prompt + rejected, in
    that order, so a pair never straddles micro-batches or ranks. Each half is shifted once, as in
    sft.py: position t predicts labels[t] = ids[t+1], counted iff that is a response token.
    `positions` restart at the rejected half, so the halves attend only to themselves."""
    seq = {"input_ids": [], "labels": [], "loss_mask": [], "positions": []}
    for ids, mask in (chosen, rejected):
        seq["input_ids"] += ids
        seq["labels"] += ids[1:] + [0]
        seq["loss_mask"] += mask[1:] + [0]
        seq["positions"] += list(range(len(ids)))
    return seq


# ALGO LOGIC: the update and the evaluation, run on every trainer rank (common/trainer.py's shell
# holds the model, the frozen π_ref and the optimizer).
def pair_losses(trainer, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """compute_pair_losses on this rank's device and part of a micro-batch (plumbing)."""
    mb = {k: v.to(trainer.device) for k, v in mb.items()}
    mb["seq_index"] = (mb["positions"] == 0).cumsum(1) - 1  # (1, T) each token's sequence
    mb["num_seqs"] = mb["seq_index"][0, -1] + 1
    mb = shard_micro_batch(mb, trainer.sp.rank, trainer.sp.size)  # this rank's part of every row
    ref = trainer.frozen["ref_logprobs"]  # π_ref
    return compute_pair_losses(trainer.model, ref, mb, trainer.args, trainer.sp.group)


def train_step(trainer, micro_batches: list[dict], num_pairs: int, step: int) -> dict:
    """One optimizer step over this rank's micro-batches. Returns sums; the driver divides."""
    trainer.model.train()
    stats = {}
    for i, mb in enumerate(micro_batches):
        # reduce-scatter gradients after the last micro-batch only
        trainer.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        losses, rewards = pair_losses(trainer, mb)
        loss = losses.sum() * mb["real"]  # real: 0 for a filler micro-batch
        # the mean over the global batch's pairs; FSDP averages over ranks: undo it. SP: each
        # rank gets the gradient of its own tokens
        trainer.scaler.backward(loss * trainer.world_size / num_pairs)
        for key, value in pair_stats(losses.detach(), rewards).items():
            stats[key] = stats.get(key, 0.0) + float(value) * mb["real"].item()
    grad_norm = trainer.optimizer_step(step)
    return {**stats, "grad_norm": grad_norm, "lr": trainer.lr}


@torch.no_grad()
def eval_pairs(trainer, micro_batches: list[dict]) -> dict:
    """pair_stats summed over this rank's micro-batches."""
    trainer.model.eval()
    stats = {}
    for mb in micro_batches:
        for key, value in pair_stats(*pair_losses(trainer, mb)).items():
            stats[key] = stats.get(key, 0.0) + float(value) * mb["real"].item()
    return stats


def main(args: Args):
    # ---- check everything cheap, then start Ray and the trainers (SETUP AND CHECKS, below) ----
    validate_args(args)
    use_gpu, resume = check_machine(args, os.path.basename(__file__))
    run_dir, resume_ckpt, resume_step = resume or (None, None, 0)
    model_path, tokenizer, pairs, accuracy = prepare_inputs(args, use_gpu)
    shell = load_policy, resume_ckpt or model_path, model_path, args  # + π_ref
    frozen = ["ref_logprobs"]
    trainers = placement.start_trainers(Trainer, use_gpu, args.num_trainers, *shell, frozen=frozen)
    if args.resume:
        call(trainers, "load_optimizer", resume_ckpt)
    run = Run(args, run_dir, resume_step, args.num_steps)
    run.print(f"run dir: {run.dir}  model: {args.model}  train pairs: {len(pairs['train'])}")

    # a batch: dealt to the DP groups (balanced by tokens), packed into micro-batches, SP-split
    split = (args.num_trainers, args.max_tokens_per_micro_batch, args.sp_size)

    @ema_weights(trainers, None, args.eval_ema)  # --eval-ema: θ_ema's
    def evaluate(step: int) -> dict:
        metrics = {}
        if "eval" in pairs:
            sums = call(trainers, eval_pairs, per_rank=data.split_for_ranks(pairs["eval"], *split))
            metrics.update(pair_metrics("eval", sums, args))
        if accuracy:  # greedy generation on the trainers, scored by the rule verifier
            metrics["eval/greedy_accuracy"], samples = greedy.accuracy(
                trainers, *accuracy, tokenizer, args.max_new_tokens, reward_fn
            )
            run.log_samples(step, samples)
        return metrics

    # ---- training loop ----
    console = ("eval/loss", "eval/accuracy", "eval/greedy_accuracy")  # after every train/* but lr
    first = evaluate(0) if resume_step == 0 else {}
    if first:
        run.log(0, first, console)
    train = pairs["train"]
    for step in range(resume_step, args.num_steps):
        t0 = time.time()
        batch = [train[i] for i in batch_rows(step, len(train), args.batch_size, args.seed)]
        shares = data.split_for_ranks(batch, *split)
        results = call(trainers, train_step, len(batch), step, per_rank=shares)
        elapsed = time.time() - t0  # throughput: every token trained on, prompts included
        metrics = {
            **pair_metrics("train", results, args),
            "train/grad_norm": results[0]["grad_norm"],
            "train/lr": results[0]["lr"],
            "time/step": elapsed,
            "perf/tokens_per_s": sum(len(s["input_ids"]) for s in batch) / elapsed,
        }

        done = step + 1
        if done % args.eval_every == 0 or done == args.num_steps:
            metrics.update(evaluate(done))
        update = [k for k in metrics if k.startswith("train/") and k != "train/lr"]
        run.log(done, metrics, (*update, *console))
        checkpoint.keep_best(args, run, metrics, done, trainers)  # --best-metric
        if args.save_every and done % args.save_every == 0 and done < args.num_steps:
            with checkpoint.staged(run.checkpoint_dir(done), done) as folder:  # whole or absent
                call(trainers, "save", folder, done)

    # ---- teardown: the final model in HF format, the accuracy lines (checkpoint.finish) ----
    accuracy = {"eval/accuracy": "held-out preference accuracy"}
    accuracy["eval/greedy_accuracy"] = "held-out greedy accuracy"
    checkpoint.finish(args, run, trainers, first, metrics, accuracy)


# SETUP AND CHECKS: once, before the loop; bad input stops here with one `error:` line.
def validate_args(args: Args) -> None:
    """Stop with one `error:` line on flags out of their range (declared in Args) or that cannot
    work together; fill the defaults that depend on others. Pure: no files, devices or Ray, so the
    docstring's commands are checked by a test on any machine."""
    check_flags(args)
    lora.check_args(args)
    dp_size = args.dp_size()  # data-parallel groups (each splits rows over SP)
    if args.batch_size % dp_size:
        raise InputError(
            f"--batch-size {args.batch_size} is not divisible by {dp_size} data-parallel groups"
        )
    if args.max_tokens_per_micro_batch is None:
        args.max_tokens_per_micro_batch = max(1024, 2 * args.max_length)
    if args.max_tokens_per_micro_batch < 2 * args.max_length:
        raise InputError(
            "--max-tokens-per-micro-batch must fit one pair: 2 x --max-length = "
            f"{2 * args.max_length}"
        )
    if args.ipo and args.label_smoothing:
        raise InputError("--label-smoothing (cDPO) applies to the sigmoid loss only, not to --ipo")


def check_machine(args: Args, script: str) -> tuple[bool, tuple | None]:
    """The checks that need the file system or the machine: the output dir or the run to resume
    (same script and model, a whole checkpoint), the wandb login, the GPUs. Returns whether to use
    GPUs, and (run dir, checkpoint, step) to resume or None."""
    resume = checkpoint.check_start(args, script, args.model, args.num_steps)  # or a new run
    use_gpu = placement.choose_layout(args.num_trainers, None, False)[0]  # GPUs if there are enough
    args.dtype = choose_dtype(args.dtype, use_gpu)  # bf16; fp16 below compute capability 8
    return use_gpu, resume


def prepare_inputs(args: Args, use_gpu: bool) -> tuple:
    """Read and check the data and the model; plan the GPUs' memory (the policy and π_ref);
    tokenize. Returns (model folder, tokenizer, {split: [pair]}, (rows, prompts) for greedy
    accuracy or None)."""
    datasets = {"train": data.load_rows(args.dataset, args.dataset_split)}
    if args.eval_dataset:
        datasets["eval"] = data.load_rows(args.eval_dataset, args.eval_split)
    for rows, source in datasets.values():
        data.validate_rows(rows, ["prompt", "chosen", "rejected"], source)
        data.check_pairs(rows, source)
    accuracy_rows = read_prompts(args.accuracy_dataset, args.eval_split)[0]
    model_path = models.resolve_model(args.model)
    models.check_weights(model_path, "model")
    vision.check_model(args, model_path, "dpo.py")  # a language model: no pictures here
    lora.check_model(args, model_path, args.model)
    memory.check_run(args, use_gpu, model_path, True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pairs = {split: encode_pairs(*rows, tokenizer, args) for split, rows in datasets.items()}
    train, source = len(pairs["train"]), datasets["train"][1]
    data.check_batch(args.batch_size, train, "--batch-size", source, "pairs")
    prompts = [data.encode_prompt(tokenizer, r["prompt"]) for r in accuracy_rows]
    return model_path, tokenizer, pairs, (accuracy_rows, prompts) if prompts else None


def encode_pairs(rows: list[dict], source: str, tokenizer, args: Args) -> list[dict]:
    """Tokenize prompt + chosen and prompt + rejected of every row with the chat template. Pairs
    over --max-length stop the run, naming the first, or with --drop-long are left out."""
    sides = ("chosen", "rejected")  # (ids, response mask) of prompt + each
    encoded = [[data.encode_example(tokenizer, r["prompt"], r[s]) for s in sides] for r in rows]
    lengths = [max(len(c[0]), len(r[0])) for c, r in encoded]
    pairs = [make_pair(c, r) for c, r in encoded]
    return data.within(pairs, lengths, args.max_length, args.drop_long, source, "pairs")


if __name__ == "__main__":
    main(parse_args(Args))
