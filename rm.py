"""Reward modelling: a Bradley-Terry scalar reward from preference pairs (Ouyang et al. 2022,
arXiv 2203.02155 §3.5).

A reward model r_θ(x, y) is the language model with its LM head swapped for a scalar head, read at
the last token of prompt x + response y. Under the Bradley-Terry model P(y_c ≻ y_r | x) =
σ(r_θ(x, y_c) - r_θ(x, y_r)), so we minimise, over pairs (x, chosen y_c, rejected y_r),
    L(θ) = -(1 / P) Σ_pairs log σ(r_θ(x, y_c) - r_θ(x, y_r) - m)      P = pairs in the whole batch
with an optional margin m ≥ 0 (Llama 2, Touvron et al. 2023 §3.2.2): a `margin` column per pair, or
--margin. Both responses of a pair are packed side by side into one padding-free micro-batch; each
trainer rank is a Ray actor holding an FSDP2 shard. The result is an HF
`AutoModelForSequenceClassification` folder (one label), which ppo.py's --reward-model and plain
transformers load as it is.

Run it:
    python rm.py                                      # built-in model and arithmetic pairs, CPU/GPU
    python rm.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/ultrafeedback_binarized \\
        --eval-dataset trl-lib/ultrafeedback_binarized --max-length 1024 \\
        --max-tokens-per-micro-batch 8192 --batch-size 64 --num-steps 500 \\
        --learning-rate 1e-5                          # 1 GPU
    python rm.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset my_pairs.jsonl --num-trainers 8 \\
        --batch-size 256 --max-tokens-per-micro-batch 16384 --gradient-checkpointing   # 8 GPUs
"""

import math
import os
import time
from dataclasses import dataclass
from typing import Annotated

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer

# Setup-only plumbing is called through its module (placement.Layout, checkpoint.save, ...): each
# call says where it lives. The names below are what the math, the update and the loop use.
from common import checkpoint, data, lora, memory, models, placement, vision
from common.data import batch_rows
from common.errors import InputError
from common.flags import Experiment, LoRA, Optimization, Resources, check_flags, parse_args
from common.optim import ema_weights
from common.placement import call
from common.precision import choose_dtype
from common.ring_attn import sequence_sums, shard_micro_batch
from common.tracking import Run
from common.trainer import Trainer, load_model


@dataclass
class Args(Optimization, LoRA, Resources, Experiment):  # common/'s flags come first
    # Model and data
    model: str = models.BUILTIN_MODEL
    """HF hub id, local HF folder, or the built-in offline model (its LM head is replaced by a
    scalar head)"""
    dataset: str = "data/arithmetic/prefs_train.jsonl"
    """preference pairs: local .jsonl/.json/.parquet file or folder, or hub id[:config];
    `prompt`+`chosen`+`rejected`"""
    dataset_split: str = "train"
    """split to read when --dataset is a hub id"""
    eval_dataset: str = "data/arithmetic/prefs_test.jsonl"
    """held-out pairs for eval accuracy and margin ("" to skip)"""
    eval_split: str = "test"
    """split to read when --eval-dataset is a hub id"""
    max_length: Annotated[int, ">= 1"] = 512
    """longest sequence (prompt + one response) in tokens"""
    drop_long: bool = False
    """drop pairs longer than --max-length instead of stopping with an error"""

    # Algorithm
    margin: Annotated[float, ">= 0"] = 0.0
    """m: required reward gap r_c - r_r, for pairs without a `margin` column (0: plain
    Bradley-Terry)"""

    # Optimization
    num_steps: Annotated[int, ">= 1"] = 30
    """optimizer steps"""
    batch_size: Annotated[int, ">= 1"] = 8
    """preference pairs per optimizer step, over all ranks"""
    max_tokens_per_micro_batch: Annotated[int | None, ">= 1"] = None
    """token budget of one packed micro-batch on one rank (default: 1024, or one pair if more;
    raise it on GPU); gradients accumulate over micro-batches"""
    learning_rate: Annotated[float, "> 0"] = 5e-5
    """peak learning rate (both halves of Muon too)"""
    warmup_steps: Annotated[int, ">= 0"] = 4
    """linear warm-up steps, then cosine decay"""


# ALGO LOGIC: the reward model, where it reads the reward, and the Bradley-Terry loss.
def load_reward_model(
    path: str, device, gradient_checkpointing: bool, adapters=None, dtype="auto", pad_token_id=None
):
    """A causal LM (or an earlier reward model) as a sequence classifier with one label, sharded as
    every model is (common/trainer.py's load_model: each decoder layer, then the root with the
    head). The scalar head `score` (hidden -> 1) is new when `path` is a causal LM: a seeded init on
    rank 0, which the loader broadcasts with the rest. With `adapters` (--lora-rank): LoRA adapters
    on the frozen base, trained with the whole head (common/lora.py), read from `path` on --resume.
    """
    auto = AutoModelForSequenceClassification
    model, _ = load_model(auto, path, device, gradient_checkpointing, adapters, dtype, num_labels=1)
    if model.config.pad_token_id is None:  # HF's own scoring needs it to find a row's last token
        if pad_token_id is None:  # the tokenizer's pad token, else EOS
            tokenizer = AutoTokenizer.from_pretrained(path)
            pad_token_id = tokenizer.pad_token_id
            pad_token_id = tokenizer.eos_token_id if pad_token_id is None else pad_token_id
        model.config.pad_token_id = pad_token_id
    return model


def sequence_ends(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool, True at the last real token of every sequence.

    Works for padded batches (attention_mask 0 on padding, left or right) and packed rows (mask all
    1, position ids restarting at 0 where a new sequence starts): a token ends a sequence if it is
    real and the next token is padding, starts a new sequence, or does not exist.
    """
    real = attention_mask.bool()
    next_real = torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)
    next_starts = torch.cat([position_ids[:, 1:] == 0, torch.ones_like(real[:, :1])], dim=1)
    return real & (~next_real | next_starts)


def compute_rewards(model, input_ids, position_ids, attention_mask=None, ends=None):
    """r_θ(x, y) of every sequence in a batch, in reading order: (B, T) ids -> (S,) rewards.

    HF's classifier scores every position and then keeps one per row (the rightmost non-pad token),
    which cannot see the sequences inside a packed row, and goes wrong when pad = EOS ends every
    response. So we catch the head's per-position scores with a hook and read them at sequence_ends
    ourselves (or at `ends`, (B, T) bool).
    """
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    scores = []
    hook = model.score.register_forward_hook(lambda module, inputs, out: scores.append(out))
    try:
        model(input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    finally:
        hook.remove()
    ends = sequence_ends(mask, position_ids) if ends is None else ends
    return scores[0][..., 0].float()[ends]  # (S,)


def compute_rm_loss(chosen_rewards, rejected_rewards, margins) -> torch.Tensor:
    """Bradley-Terry negative log-likelihood per pair, all (P,): -log σ(r_c - r_r - m)."""
    return -F.logsigmoid(chosen_rewards - rejected_rewards - margins)


def compute_loss(chosen_rewards, rejected_rewards, margins) -> tuple[torch.Tensor, dict]:
    """rm.py's loss on one micro-batch of pairs, summed over its pairs, and its stats to sum: pairs
    ranked right and the reward gap. train_step divides the sum by the pairs of the whole global
    batch."""
    loss = compute_rm_loss(chosen_rewards, rejected_rewards, margins).sum()
    gap = (chosen_rewards - rejected_rewards).detach()
    return loss, {"accuracy": (gap > 0).sum(), "margin": gap.sum()}


# ALGO LOGIC: what each step logs (docs/rm.md lists every key).
def pair_metrics(prefix: str, sums: list[dict], num_pairs: float) -> dict:
    """Means per pair from the ranks' sums of the loss and every stat compute_loss returns, as
    <prefix>/<name>: the share of pairs ranked right (r_c > r_r), the mean reward gap r_c - r_r."""
    keys = [key for key in sums[0] if key not in ("pairs", "grad_norm", "lr")]
    return {f"{prefix}/{key}": sum(s[key] for s in sums) / num_pairs for key in keys}


# TRY NOT TO MODIFY: the data plumbing.
def make_pair(chosen: list[int], rejected: list[int], margin: float) -> dict[str, list]:
    """One packing unit: chosen then rejected, so a pair never straddles micro-batches or ranks.

    `positions` restart at the rejected sequence, so the two attend only to themselves (as packed
    rows do); sequence_ends then finds the chosen end, then the rejected end.
    """
    ids = chosen + rejected
    positions = list(range(len(chosen))) + list(range(len(rejected)))
    return {"input_ids": ids, "positions": positions, "margin": [margin] * len(ids)}


# ALGO LOGIC: the update and the evaluation, run on every trainer rank (common/trainer.py's shell
# holds the model and the optimizer).
def pair_rewards(trainer, mb: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(P,) chosen rewards, rejected rewards and margins of one packed micro-batch of pairs."""
    mb = {k: v.to(trainer.device) for k, v in mb.items()}
    ends = sequence_ends(torch.ones_like(mb["input_ids"]), mb["positions"])  # before SP split
    margins = mb["margin"][ends].view(-1, 2)[:, 0]
    mb["ends"], mb["seq_index"] = ends, ends.cumsum(1) - 1  # sequence i's score: at its end
    sp = trainer.sp
    mb = shard_micro_batch(mb, sp.rank, sp.size)  # this rank's part of every row
    ends = mb["ends"].bool()  # the ends this rank holds; sequence_sums puts each in its place
    rewards = compute_rewards(trainer.model, mb["input_ids"], mb["positions"], ends=ends)
    place = mb["seq_index"][ends]
    rewards = sequence_sums(rewards, place, 2 * len(margins), sp.group).view(-1, 2)
    return rewards[:, 0], rewards[:, 1], margins


def train_step(trainer, micro_batches: list[dict], num_pairs: int, step: int) -> dict:
    """One optimizer step over this rank's micro-batches. Returns sums; the driver divides."""
    trainer.model.train()
    stats = {"loss": 0.0}  # + compute_loss's stats
    for i, mb in enumerate(micro_batches):
        # reduce-scatter gradients after the last micro-batch only
        trainer.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        loss, pair_stats = compute_loss(*pair_rewards(trainer, mb))
        loss = loss * mb["real"]  # real: 0 for a filler micro-batch
        # the mean over the global batch's pairs; FSDP averages over ranks: undo it
        trainer.scaler.backward(loss * trainer.world_size / num_pairs)
        stats["loss"] += loss.item()
        for key, value in pair_stats.items():
            stats[key] = stats.get(key, 0.0) + value.item() * mb["real"].item()
    grad_norm = trainer.optimizer_step(step)
    return {**stats, "grad_norm": grad_norm, "lr": trainer.lr}


@torch.no_grad()
def eval_pairs(trainer, micro_batches: list[dict]) -> dict:
    """The loss and pair stats summed over this rank's micro-batches, and their pairs."""
    trainer.model.eval()
    stats = {"loss": 0.0, "pairs": 0.0}  # + compute_loss's stats
    for mb in micro_batches:
        chosen, rejected, margins = pair_rewards(trainer, mb)
        loss, pair_stats = compute_loss(chosen, rejected, margins)
        real = mb["real"].item()  # 0 for a filler micro-batch
        stats["loss"] += loss.item() * real
        for key, value in pair_stats.items():
            stats[key] = stats.get(key, 0.0) + value.item() * real
        stats["pairs"] += len(chosen) * real
    return stats


def main(args: Args):
    # ---- check everything cheap, then start Ray and the trainers (SETUP AND CHECKS, below) ----
    validate_args(args)
    use_gpu, resume = check_machine(args, os.path.basename(__file__))
    run_dir, resume_ckpt, resume_step = resume or (None, None, 0)
    model_path, pairs = prepare_inputs(args, use_gpu)
    shell = load_reward_model, resume_ckpt or model_path, model_path, args  # + the base: LoRA's
    whole = ["score"]  # LoRA: the score head trained whole
    trainers = placement.start_trainers(Trainer, use_gpu, args.num_trainers, *shell, whole=whole)
    if args.resume:
        call(trainers, "load_optimizer", resume_ckpt)
    run = Run(args, run_dir, resume_step, args.num_steps)
    run.print(f"run dir: {run.dir}  model: {args.model}  train pairs: {len(pairs['train'])}")

    # a batch: dealt to the DP groups (balanced by tokens), packed into micro-batches, SP-split
    split = (args.num_trainers, args.max_tokens_per_micro_batch, args.sp_size)

    @ema_weights(trainers, None, args.eval_ema)  # --eval-ema: θ_ema's
    def evaluate() -> dict:
        if "eval" not in pairs:
            return {}
        sums = call(trainers, eval_pairs, per_rank=data.split_for_ranks(pairs["eval"], *split))
        sums = sums[:: args.sp_size]  # the ranks of an SP group report the same pairs: once each
        return pair_metrics("eval", sums, sum(s["pairs"] for s in sums))

    # ---- training loop ----
    console = ("eval/loss", "eval/accuracy", "eval/margin")  # after every train/* stat but lr
    first = evaluate() if resume_step == 0 else {}
    if first:
        run.log(0, first, console)
    train = pairs["train"]
    for step in range(resume_step, args.num_steps):
        t0 = time.time()
        batch = [train[i] for i in batch_rows(step, len(train), args.batch_size, args.seed)]
        shares = data.split_for_ranks(batch, *split)
        results = call(trainers, train_step, len(batch), step, per_rank=shares)
        results = results[:: args.sp_size]  # one rank per SP group
        elapsed = time.time() - t0  # throughput: every token trained on, prompts included
        metrics = {
            **pair_metrics("train", results, len(batch)),
            "train/grad_norm": results[0]["grad_norm"],
            "train/lr": results[0]["lr"],
            "time/step": elapsed,
            "perf/tokens_per_s": sum(len(s["input_ids"]) for s in batch) / elapsed,
        }

        done = step + 1
        if done % args.eval_every == 0 or done == args.num_steps:
            metrics.update(evaluate())
        update = [k for k in metrics if k.startswith("train/") and k != "train/lr"]
        run.log(done, metrics, (*update, *console))
        checkpoint.keep_best(args, run, metrics, done, trainers)  # --best-metric
        if args.save_every and done % args.save_every == 0 and done < args.num_steps:
            with checkpoint.staged(run.checkpoint_dir(done), done) as folder:  # whole or absent
                call(trainers, "save", folder, done)

    # ---- teardown: the final model (AutoModelForSequenceClassification, one label), the line ----
    accuracy = {"eval/accuracy": "held-out pair accuracy"}
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


def check_machine(args: Args, script: str) -> tuple[bool, tuple | None]:
    """The checks that need the file system or the machine: the output dir or the run to resume
    (same script and model, a whole checkpoint), the wandb login, the GPUs. Returns whether to use
    GPUs, and (run dir, checkpoint, step) to resume or None."""
    resume = checkpoint.check_start(args, script, args.model, args.num_steps)  # or a new run
    use_gpu = placement.choose_layout(args.num_trainers, None, False)[0]  # GPUs if there are enough
    args.dtype = choose_dtype(args.dtype, use_gpu)  # bf16; fp16 below compute capability 8
    return use_gpu, resume


def prepare_inputs(args: Args, use_gpu: bool) -> tuple[str, dict[str, list[dict]]]:
    """Read and check the pairs (and their margins) and the model; plan the GPUs' memory; tokenize.
    Returns (model folder, {split: [pair]})."""
    datasets = {"train": data.load_rows(args.dataset, args.dataset_split)}
    if args.eval_dataset:
        datasets["eval"] = data.load_rows(args.eval_dataset, args.eval_split)
    for rows, source in datasets.values():
        data.validate_rows(rows, ["prompt", "chosen", "rejected"], source)
        data.check_pairs(rows, source)
        for i, row in enumerate(rows, 1):  # a `margin` column overrides --margin per pair
            m = row.get("margin", args.margin)
            number = isinstance(m, (int, float)) and not isinstance(m, bool)
            if not (number and math.isfinite(m) and m >= 0):
                what = f"row {i} column 'margin' must be a number >= 0 (got {m!r})"
                raise InputError(f"{source}: {what}")
    model_path = models.resolve_model(args.model)
    models.check_weights(model_path, "model")
    vision.check_model(args, model_path, "rm.py")  # a language model: no pictures here
    lora.check_model(args, model_path, args.model)
    memory.check_run(args, use_gpu, model_path, head="score")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pairs = {split: encode_pairs(*rows, tokenizer, args) for split, rows in datasets.items()}
    train, source = len(pairs["train"]), datasets["train"][1]
    data.check_batch(args.batch_size, train, "--batch-size", source, "pairs")
    return model_path, pairs


def encode_pairs(rows: list[dict], source: str, tokenizer, args: Args) -> list[dict]:
    """Tokenize prompt + chosen and prompt + rejected of every row with the chat template. Pairs
    over --max-length stop the run, naming the first, or with --drop-long are left out."""
    sides = ("chosen", "rejected")
    encoded = [[data.encode_example(tokenizer, r["prompt"], r[s])[0] for s in sides] for r in rows]
    lengths = [max(len(c), len(r)) for c, r in encoded]
    pairs = [
        make_pair(c, r, float(row.get("margin", args.margin))) for (c, r), row in zip(encoded, rows)
    ]
    return data.within(pairs, lengths, args.max_length, args.drop_long, source, "pairs")


if __name__ == "__main__":
    main(parse_args(Args))
