"""Supervised fine-tuning (SFT): next-token cross-entropy on the assistant's tokens only.

Given demonstrations (prompt -> response), SFT maximises log π(response | prompt), token by token:
    L(θ) = -(1 / N) Σ_{t ∈ assistant tokens} log π_θ(x_t | x_<t),   N: assistant tokens in the batch
Prompt and system tokens are context, not targets. Sequences are packed padding-free into
micro-batches of a fixed token budget; each trainer rank is a Ray actor holding an FSDP2 shard of
the model.

Run it:
    python sft.py                                     # built-in model and arithmetic data, CPU/GPU
    python sft.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/Capybara --eval-dataset "" \\
        --accuracy-dataset "" --num-trainers 1        # 1 GPU
    python sft.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset my_data.jsonl --num-trainers 8 \\
        --batch-size 128 --max-tokens-per-micro-batch 16384 --gradient-checkpointing   # 8 GPUs
"""

import os
import re
import time
from dataclasses import dataclass
from typing import Annotated

import torch
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
from common.tracking import Run
from common.trainer import Trainer, load_policy


@dataclass
class Args(Optimization, LoRA, Resources, Experiment):  # common/'s flags come first
    # Model and data
    model: str = models.BUILTIN_MODEL
    """HF hub id, local HF folder, or the built-in offline model"""
    dataset: str = "data/arithmetic/sft_train.jsonl"
    """training data: local .jsonl/.json/.parquet file or folder, or hub id[:config]; `messages` or
    `prompt`+`completion` (a VLM's: and `images`, docs/vision.md)"""
    dataset_split: str = "train"
    """split to read when --dataset is a hub id"""
    eval_dataset: str = "data/arithmetic/sft_test.jsonl"
    """held-out demonstrations for the eval loss ("" to skip)"""
    eval_split: str = "test"
    """split to read when --eval-dataset is a hub id"""
    accuracy_dataset: str = "data/arithmetic/prompts_test.jsonl"
    """held-out `prompt`+`answer` rows for greedy accuracy ("" to skip)"""
    max_length: Annotated[int, ">= 1"] = 512
    """longest sequence (prompt + response) in tokens"""
    drop_long: bool = False
    """drop rows longer than --max-length instead of stopping with an error"""
    max_new_tokens: Annotated[int, ">= 1"] = 32
    """generation budget of the greedy accuracy eval"""

    # Optimization
    num_steps: Annotated[int, ">= 1"] = 30
    """optimizer steps"""
    batch_size: Annotated[int, ">= 1"] = 16
    """sequences per optimizer step, over all ranks"""
    max_tokens_per_micro_batch: Annotated[int | None, ">= 1"] = None
    """token budget of one packed micro-batch on one rank (default: 512, or one sequence of
    --max-length if more; raise it on GPU); gradients accumulate over micro-batches"""
    learning_rate: Annotated[float, "> 0"] = 2e-5
    """peak learning rate (both halves of Muon too)"""
    warmup_steps: Annotated[int, ">= 0"] = 4
    """linear warm-up steps, then cosine decay"""


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


# ALGO LOGIC: the loss.
def compute_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """SFT's loss on one micro-batch: the negative log-likelihood of its assistant tokens, summed,
    (N,) -> (). train_step divides by the assistant tokens of the whole global batch, so every token
    weighs the same however the batch is split over ranks and micro-batches."""
    return -logprobs.sum()


# ALGO LOGIC: what each step logs (docs/sft.md lists every key).
def train_metrics(results: list[dict], num_tokens: int) -> dict:
    """From the ranks' sums (each rank holds a share of the tokens; grad norm and lr are global):
    every per-token sum train_step returns (the loss, ...) as its mean per assistant token."""
    sums = [key for key in results[0] if key not in ("grad_norm", "lr")]
    return {
        **{f"train/{key}": sum(r[key] for r in results) / num_tokens for key in sums},
        "train/grad_norm": results[0]["grad_norm"],
        "train/lr": results[0]["lr"],
        "train/tokens": num_tokens,
    }


# TRY NOT TO MODIFY: the data plumbing.
def make_sequence(ids: list[int], mask: list[int]) -> dict[str, list]:
    """Shift once, here: position t predicts labels[t] = ids[t+1], trained iff token t+1 is an
    assistant token."""
    return {"input_ids": ids, "labels": ids[1:] + [0], "loss_mask": mask[1:] + [0]}


# ALGO LOGIC: the update and the evaluation, run on every trainer rank (common/trainer.py's shell
# holds the model and the optimizer).
def train_step(trainer, micro_batches: list[dict], num_tokens: int, step: int) -> dict:
    """One optimizer step over this rank's micro-batches. Returns sums; the driver divides."""
    model = trainer.model
    model.train()
    loss_sum = 0.0
    for i, mb in enumerate([trainer.local_part(mb) for mb in micro_batches]):
        # reduce-scatter gradients after the last micro-batch only
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        inputs = (mb["input_ids"], mb["position_ids"], mb["labels"], mb["loss_mask"])
        loss = compute_loss(compute_logprobs(model, *inputs, **vision.inputs(mb)))
        loss = loss * mb["real"]  # real: 0 for a filler micro-batch
        # the token mean of the whole global batch; FSDP averages over ranks: undo it
        trainer.scaler.backward(loss * trainer.world_size / num_tokens)
        loss_sum += loss.item()
    grad_norm = trainer.optimizer_step(step)
    return {"loss": loss_sum, "grad_norm": grad_norm, "lr": trainer.lr}


@torch.no_grad()
def eval_loss(trainer, micro_batches: list[dict]) -> dict:
    """Sums of the loss and of the assistant tokens over this rank's micro-batches."""
    trainer.model.eval()
    loss_sum = tokens = 0.0
    for mb in [trainer.local_part(mb) for mb in micro_batches]:
        inputs = (mb["input_ids"], mb["position_ids"], mb["labels"], mb["loss_mask"])
        real, images = mb["real"].item(), vision.inputs(mb)
        loss_sum += compute_loss(compute_logprobs(trainer.model, *inputs, **images)).item() * real
        tokens += mb["loss_mask"].sum().item() * real
    return {"loss": loss_sum, "tokens": tokens}


def main(args: Args):
    # ---- check everything cheap, then start Ray and the trainers (SETUP AND CHECKS, below) ----
    validate_args(args)
    use_gpu, resume = check_machine(args, os.path.basename(__file__))
    run_dir, resume_ckpt, resume_step = resume or (None, None, 0)
    model_path, tokenizer, sequences, accuracy = prepare_inputs(args, use_gpu)
    shell = load_policy, resume_ckpt or model_path, model_path, args  # + the base: LoRA's
    trainers = placement.start_trainers(Trainer, use_gpu, args.num_trainers, *shell)
    if args.resume:
        call(trainers, "load_optimizer", resume_ckpt)
    run = Run(args, run_dir, resume_step, args.num_steps)
    run.print(f"run dir: {run.dir}  model: {args.model}  train rows: {len(sequences['train'])}")

    # a batch: dealt to the DP groups (balanced by tokens), packed into micro-batches, SP-split
    split = (args.num_trainers, args.max_tokens_per_micro_batch, args.sp_size)

    @ema_weights(trainers, None, args.eval_ema)  # --eval-ema: θ_ema's
    def evaluate(step: int) -> dict:
        metrics = {}
        if "eval" in sequences:
            sums = call(
                trainers, eval_loss, per_rank=data.split_for_ranks(sequences["eval"], *split)
            )
            metrics["eval/loss"] = sum(s["loss"] for s in sums) / sum(s["tokens"] for s in sums)
        if accuracy:  # greedy generation on the trainers, scored by the rule verifier
            metrics["eval/accuracy"], samples = greedy.accuracy(
                trainers, *accuracy, tokenizer, args.max_new_tokens, reward_fn
            )
            run.log_samples(step, samples)
        return metrics

    # ---- training loop ----
    console = ("eval/loss", "eval/accuracy", "perf/tokens_per_s")  # after every train/* but tokens
    first = evaluate(0) if resume_step == 0 else {}
    if first:
        run.log(0, first, console)
    train = sequences["train"]
    for step in range(resume_step, args.num_steps):
        t0 = time.time()
        batch = [train[i] for i in batch_rows(step, len(train), args.batch_size, args.seed)]
        num_tokens = sum(sum(s["loss_mask"]) for s in batch)  # assistant tokens: the loss's 1/N
        shares = data.split_for_ranks(batch, *split)
        results = call(trainers, train_step, num_tokens, step, per_rank=shares)
        elapsed = time.time() - t0  # throughput: every token trained on, prompts included
        metrics = train_metrics(results, num_tokens)
        metrics |= {
            "time/step": elapsed,
            "perf/tokens_per_s": sum(len(s["input_ids"]) for s in batch) / elapsed,
        }

        done = step + 1
        if done % args.eval_every == 0 or done == args.num_steps:
            metrics.update(evaluate(done))
        update = [k for k in metrics if k.startswith("train/") and k != "train/tokens"]
        run.log(done, metrics, (*update, *console))
        checkpoint.keep_best(args, run, metrics, done, trainers)  # --best-metric
        if args.save_every and done % args.save_every == 0 and done < args.num_steps:
            with checkpoint.staged(run.checkpoint_dir(done), done) as folder:  # whole or absent
                call(trainers, "save", folder, done)

    # ---- teardown: the final model in HF format, the accuracy line (checkpoint.finish) ----
    accuracy = {"eval/accuracy": "greedy accuracy on the held-out split"}
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
        args.max_tokens_per_micro_batch = max(512, args.max_length)
    if args.max_tokens_per_micro_batch < args.max_length:
        raise InputError(
            f"--max-tokens-per-micro-batch must fit one sequence of --max-length {args.max_length}"
        )


def check_machine(args: Args, script: str) -> tuple[bool, tuple | None]:
    """The checks that need the file system or the machine: the output dir or the run to resume
    (same script and model, a whole checkpoint), the wandb login, the GPUs. Returns whether to use
    GPUs, and (run dir, checkpoint, step) to resume or None."""
    resume = checkpoint.check_start(args, script, args.model, args.num_steps)  # or a new run
    use_gpu = placement.choose_layout(args.num_trainers, None, False)[0]  # GPUs if there are enough
    args.dtype = choose_dtype(args.dtype, use_gpu)  # bf16; fp16 below compute capability 8
    return use_gpu, resume


def prepare_inputs(args: Args, use_gpu: bool) -> tuple:
    """Read and check the data (images too) and the model; plan the GPUs' memory; tokenize. Returns
    (model folder, tokenizer, {split: [sequence]}, (rows, prompts) for greedy accuracy or None)."""
    datasets = {"train": data.load_rows(args.dataset, args.dataset_split)}
    if args.eval_dataset:
        datasets["eval"] = data.load_rows(args.eval_dataset, args.eval_split)
    for rows, source in datasets.values():
        columns = ["messages"] if "messages" in rows[0] else ["prompt", "completion"]
        data.validate_rows(rows, columns, source)
    accuracy_rows, accuracy_source = read_prompts(args.accuracy_dataset, args.eval_split)
    model_path = models.resolve_model(args.model)
    models.check_weights(model_path, "model")
    vlm = vision.check_model(args, model_path)  # a VLM: images read and checked here
    conversation = ("messages", "prompt", "completion")
    images = {k: vision.row_images(*rows, vlm, *conversation) for k, rows in datasets.items()}
    accuracy_images = vision.row_images(accuracy_rows, accuracy_source, vlm, "prompt")
    lora.check_model(args, model_path, args.model)
    memory.check_run(args, use_gpu, model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    processor = vision.processor(model_path, vlm)
    encode = (tokenizer, processor, args)
    sequences = {k: encode_rows(*rows, images[k], *encode) for k, rows in datasets.items()}
    train, source = len(sequences["train"]), datasets["train"][1]
    data.check_batch(args.batch_size, train, "--batch-size", source, "rows")
    prompts = [data.encode_prompt(tokenizer, r["prompt"]) for r in accuracy_rows]
    if vlm:  # (ids, pixels): each image's tokens in, as the model sees them
        prompts = [vision.prompt(processor, p, i) for p, i in zip(prompts, accuracy_images)]
    return model_path, tokenizer, sequences, (accuracy_rows, prompts) if prompts else None


def encode_rows(rows: list[dict], source: str, images: list, tokenizer, processor, args: Args):
    """Tokenize every row with the chat template into ids + assistant mask (a VLM's: each image's
    tokens in, its pixels beside them). Rows over --max-length stop the run, naming the first, or
    with --drop-long are left out; rows with no assistant turn are skipped with a warning."""
    encoded = [
        data.encode_example(tokenizer, r.get("messages", r.get("prompt")), r.get("completion"))
        for r in rows
    ]
    encoded = [vision.expand(processor, *e, i) for e, i in zip(encoded, images)]
    lengths = [len(ids) for ids, _, _ in encoded]
    kept = data.within(encoded, lengths, args.max_length, args.drop_long, source, "rows")
    silent = sum(1 for _, m, _ in encoded if not sum(m))  # nothing to learn from: no assistant turn
    if silent:
        what = f"{silent} of {len(rows)} rows have no assistant turn"
        print(f"warning: {source}: {what}; they are skipped")
    sequences = [make_sequence(ids, m) | pixels for ids, m, pixels in kept if sum(m)]
    if not sequences:
        raise InputError(f"{source}: no rows left with assistant tokens within --max-length")
    return sequences


if __name__ == "__main__":
    main(parse_args(Args))
