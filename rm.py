"""Reward modelling: a Bradley-Terry scalar reward from preference pairs (Ouyang et al. 2022, arXiv 2203.02155 §3.5).

A reward model r_θ(x, y) is the language model with its LM head swapped for a scalar head, read at the last token
of prompt x + response y. Under the Bradley-Terry model P(y_c ≻ y_r | x) = σ(r_θ(x, y_c) - r_θ(x, y_r)), so we
minimise, over pairs (x, chosen y_c, rejected y_r),
    L(θ) = -(1 / P) Σ_pairs log σ(r_θ(x, y_c) - r_θ(x, y_r) - m)          P = pairs in the whole batch
with an optional margin m ≥ 0 (Llama 2, Touvron et al. 2023 §3.2.2): a `margin` column per pair, or --margin.
Both responses of a pair are packed side by side into one padding-free micro-batch; each trainer rank is a Ray
actor holding an FSDP2 shard. The result is an HF `AutoModelForSequenceClassification` folder (one label), which
ppo.py's --reward-model and plain transformers load as it is.

Run it:
    python rm.py                                               # built-in model and arithmetic pairs, CPU or GPU
    python rm.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/ultrafeedback_binarized \\
        --eval-dataset trl-lib/ultrafeedback_binarized --max-length 1024 --max-tokens-per-micro-batch 8192 \\
        --batch-size 64 --num-steps 500 --learning-rate 1e-5    # 1 GPU
    python rm.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset my_pairs.jsonl --num-trainers 8 \\
        --batch-size 256 --max-tokens-per-micro-batch 16384 --gradient-checkpointing   # 8 GPUs
"""

import math
import os
import time
from dataclasses import dataclass

import ray
import torch
import torch.nn.functional as F
import tyro
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from common import memory
from common.checks import check_output_dir, check_ranges, check_tracking, check_weights
from common.data import InputError, check_pairs, encode_example, load_rows, split_for_ranks, validate_rows
from common.model import (
    BUILTIN_MODEL,
    attn_implementation,
    empty_model,
    load_optimizer,
    load_weights,
    resolve_model,
    save_checkpoint,
)
from common.placement import (
    Layout,
    call,
    choose_layout,
    init_distributed,
    init_ray,
    make_placement_group,
    spawn_trainers,
)
from common.ring_attn import enable_ring_attention, sequence_sums, shard_micro_batch, shares_per_rank, sp_groups
from common.tracking import Run, check_resume


@dataclass
class Args:
    # Experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of the experiment; runs go to <output-dir>/<exp-name>__<seed>__<unix time>"""
    seed: int = 1
    """seed of model init, data order and sampling"""
    track: bool = False
    """log metrics to Weights & Biases"""
    wandb_project: str = "posttrain"
    """the wandb project"""
    output_dir: str = "runs"
    """folder for run directories"""
    resume: str | None = None
    """continue a run: its run dir (latest checkpoint) or one of its checkpoints/step_N"""
    save_every: int = 0
    """save a resumable checkpoint every N steps (0: only the final model)"""
    eval_every: int = 10
    """evaluate every N steps, and before the first and after the last"""

    # Model and data
    model: str = BUILTIN_MODEL
    """HF hub id, local HF folder, or the built-in offline model (its LM head is replaced by a scalar head)"""
    dataset: str = "data/arithmetic/prefs_train.jsonl"
    """preference pairs: local .jsonl/.json/.parquet file or folder, or hub id[:config]; `prompt`+`chosen`+`rejected`"""
    dataset_split: str = "train"
    """split to read when --dataset is a hub id"""
    eval_dataset: str = "data/arithmetic/prefs_test.jsonl"
    """held-out pairs for eval accuracy and margin ("" to skip)"""
    eval_split: str = "test"
    """split to read when --eval-dataset is a hub id"""
    max_length: int = 512
    """longest sequence (prompt + one response) in tokens"""
    drop_long: bool = False
    """drop pairs longer than --max-length instead of stopping with an error"""

    # Resources
    num_trainers: int = 1
    """FSDP2 trainer ranks (one GPU each on GPU; share the cores on CPU)"""
    sp_size: int = 1
    """ring attention: split every packed row over this many ranks (--num-trainers = data-parallel x sp-size)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, ~30% more compute"""

    # Algorithm
    margin: float = 0.0
    """m: required reward gap r_c - r_r, for pairs without a `margin` column (0: plain Bradley-Terry)"""

    # Optimization
    num_steps: int = 30
    """optimizer steps"""
    batch_size: int = 8
    """preference pairs per optimizer step, over all ranks"""
    max_tokens_per_micro_batch: int | None = None
    """token budget of one packed micro-batch on one rank (default: 1024, or one pair if more; raise it
    on GPU); gradients accumulate over micro-batches"""
    learning_rate: float = 5e-5
    """peak learning rate of AdamW"""
    warmup_steps: int = 4
    """linear warm-up steps, then cosine decay"""
    min_lr_ratio: float = 0.1
    """the cosine decays to learning_rate * min_lr_ratio"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""


# ALGO LOGIC: the reward model, where it reads the reward, and the Bradley-Terry loss.
def load_reward_model(path: str, device: torch.device, gradient_checkpointing: bool, pad_token_id: int):
    """A causal LM (or an earlier reward model) as a sequence classifier with one label, sharded like load_policy.

    The scalar head `score` (hidden -> 1) is new when `path` is a causal LM: a seeded init on rank 0, which
    load_weights broadcasts with the rest. FSDP2: each decoder layer, then the root (embeddings, norm, score head).
    """
    model = empty_model(AutoModelForSequenceClassification, path, attn_implementation(device), num_labels=1)
    if model.config.pad_token_id is None:  # HF's own scoring needs it to find the last token of padded rows
        model.config.pad_token_id = pad_token_id
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
    for layer in model.base_model.layers:
        fully_shard(layer, mp_policy=mp or MixedPrecisionPolicy())
    fully_shard(model, mp_policy=mp or MixedPrecisionPolicy())
    load_weights(model, AutoModelForSequenceClassification, path, device)
    return model


def sequence_ends(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool, True at the last real token of every sequence.

    Works for padded batches (attention_mask 0 on padding, left or right) and packed rows (mask all 1, position
    ids restarting at 0 where a new sequence starts): a token ends a sequence if it is real and the next token
    is padding, starts a new sequence, or does not exist.
    """
    real = attention_mask.bool()
    next_real = torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)
    next_starts = torch.cat([position_ids[:, 1:] == 0, torch.ones_like(real[:, :1])], dim=1)
    return real & (~next_real | next_starts)


def compute_rewards(model, input_ids, position_ids, attention_mask=None, ends=None) -> torch.Tensor:
    """r_θ(x, y) of every sequence in a batch, in reading order: (B, T) ids -> (S,) scalar rewards.

    HF's classifier scores every position and then keeps one per row (the rightmost non-pad token), which cannot
    see the sequences inside a packed row, and goes wrong when pad = EOS ends every response. So we catch the
    head's per-position scores with a hook and read them at sequence_ends ourselves (or at `ends`, (B, T) bool).
    """
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    scores = []
    hook = model.score.register_forward_hook(lambda module, inputs, out: scores.append(out))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    finally:
        hook.remove()
    return scores[0][..., 0].float()[sequence_ends(mask, position_ids) if ends is None else ends]  # (S,)


def compute_rm_loss(chosen_rewards, rejected_rewards, margins) -> torch.Tensor:
    """Bradley-Terry negative log-likelihood per pair, all (P,): -log σ(r_c - r_r - m)."""
    return -F.logsigmoid(chosen_rewards - rejected_rewards - margins)


def compute_loss(chosen_rewards, rejected_rewards, margins) -> tuple[torch.Tensor, dict]:
    """rm.py's loss on one micro-batch of pairs, summed over its pairs, and its stats to sum: pairs ranked right
    and the reward gap. train_step divides the sum by the pairs of the whole global batch."""
    loss = compute_rm_loss(chosen_rewards, rejected_rewards, margins).sum()
    gap = (chosen_rewards - rejected_rewards).detach()
    return loss, {"correct": (gap > 0).sum(), "margin_sum": gap.sum()}


def lr_at(step: int, args: Args) -> float:
    """Linear warm-up to the peak, then cosine decay to min_lr_ratio * peak at the last step."""
    if step < args.warmup_steps:
        return args.learning_rate * (step + 1) / args.warmup_steps
    progress = (step + 1 - args.warmup_steps) / max(1, args.num_steps - args.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.learning_rate * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def batch_rows(step: int, num_rows: int, batch_size: int, seed: int) -> list[int]:
    """Row indices of global step `step`: the data in a fresh seeded permutation every epoch.

    A pure function of the step, so --resume replays exactly the order an uninterrupted run would have seen.
    """
    rows = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(pos, num_rows)
        perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        rows.append(int(perm[i]))
    return rows


def make_pair(chosen: list[int], rejected: list[int], margin: float) -> dict[str, list]:
    """One packing unit: chosen then rejected, so a pair never straddles micro-batches or ranks.

    `positions` restart at the rejected sequence, so the two attend only to themselves (as packed rows do);
    sequence_ends then finds the chosen end, then the rejected end.
    """
    ids = chosen + rejected
    positions = list(range(len(chosen))) + list(range(len(rejected)))
    return {"input_ids": ids, "positions": positions, "margin": [margin] * len(ids)}


# TRY NOT TO MODIFY: the trainer actor (one per rank).
@ray.remote
class Trainer:
    def __init__(self, args: Args, model_path: str, rank: int, world_size: int, addr: str, port: int):
        self.args, self.rank, self.world_size = args, rank, world_size
        self.device = init_distributed(rank, world_size, addr, port)
        torch.manual_seed(args.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.model = load_reward_model(model_path, self.device, args.gradient_checkpointing, pad)
        self.sp = sp_groups(world_size, args.sp_size)  # DP x SP: ranks [k*sp, (k+1)*sp) share data shard k
        enable_ring_attention(self.model, self.sp.group)  # a no-op when --sp-size is 1
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=args.weight_decay
        )

    def pair_rewards(self, mb: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(P,) chosen rewards, rejected rewards and margins of one packed micro-batch of pairs."""
        mb = {k: v.to(self.device) for k, v in mb.items()}
        ends = sequence_ends(torch.ones_like(mb["input_ids"]), mb["positions"])  # (1, T), before any SP split
        margins = mb["margin"][ends].view(-1, 2)[:, 0]
        mb["ends"], mb["seq_index"] = ends, ends.cumsum(1) - 1  # the score of sequence i is read at its end
        mb = shard_micro_batch(mb, self.sp.rank, self.sp.size)  # this rank's part of every row (SP)
        ends = mb["ends"].bool()  # the ends this rank holds; sequence_sums puts each in its place (all-reduce)
        rewards = compute_rewards(self.model, mb["input_ids"], mb["positions"], ends=ends)
        rewards = sequence_sums(rewards, mb["seq_index"][ends], 2 * len(margins), self.sp.group).view(-1, 2)
        return rewards[:, 0], rewards[:, 1], margins

    def train_step(self, micro_batches: list[dict], num_pairs: int, step: int) -> dict:
        """One optimizer step over this rank's micro-batches. Returns sums; the driver divides by counts."""
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.args)
        stats = {"loss_sum": 0.0, "correct": 0.0, "margin_sum": 0.0}
        for i, mb in enumerate(micro_batches):
            # Reduce-scatter gradients only after the last micro-batch; before it they accumulate locally.
            self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            loss, pair_stats = compute_loss(*self.pair_rewards(mb))
            loss = loss * mb["loss_scale"]  # loss_scale: 0 for a filler micro-batch (split_for_ranks), else 1
            # Mean over the pairs of the whole global batch; FSDP averages over ranks, so undo its 1/world.
            (loss * self.world_size / num_pairs).backward()
            stats["loss_sum"] += loss.item()
            for key, value in pair_stats.items():
                stats[key] += value.item() * mb["loss_scale"].item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if not torch.isfinite(grad_norm):  # the same global norm on every rank: all stop before the update
            raise FloatingPointError(f"non-finite loss or gradient norm ({grad_norm.item()}) at step {step + 1}")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**stats, "grad_norm": grad_norm.item(), "lr": self.optimizer.param_groups[0]["lr"]}

    @torch.no_grad()
    def eval_pairs(self, micro_batches: list[dict]) -> dict:
        self.model.eval()
        stats = {"loss_sum": 0.0, "correct": 0.0, "margin_sum": 0.0, "pairs": 0.0}
        for mb in micro_batches:
            chosen, rejected, margins = self.pair_rewards(mb)
            loss, pair_stats = compute_loss(chosen, rejected, margins)
            real = mb["loss_scale"].item()  # 0 for a filler micro-batch
            stats["loss_sum"] += loss.item() * real
            for key, value in pair_stats.items():
                stats[key] += value.item() * real
            stats["pairs"] += len(chosen) * real
        return stats

    def save(self, path: str, step: int, with_optimizer: bool):
        save_checkpoint(self.model, self.optimizer, self.tokenizer, path, step, with_optimizer)  # rank 0 writes

    def load_optimizer(self, path: str):
        load_optimizer(self.model, self.optimizer, path)


def validate_args(args: Args) -> None:
    """Stop with one `error:` line on flags that cannot work together; fill the defaults that depend on others.

    Pure: no files, devices or Ray, so the docstring's commands are checked by a test on any machine.
    """
    check_ranges(
        args,
        {
            ">= 0": "seed save_every margin warmup_steps weight_decay",
            ">= 1": "eval_every max_length num_trainers sp_size num_steps batch_size max_tokens_per_micro_batch",
            "> 0": "learning_rate max_grad_norm",
            ">= 0, <= 1": "min_lr_ratio",
        },
    )
    if args.num_trainers % args.sp_size:
        raise InputError(f"--num-trainers {args.num_trainers} is not a multiple of --sp-size {args.sp_size}")
    dp_size = args.num_trainers // args.sp_size  # data-parallel groups; each splits its rows over sp_size ranks
    if args.batch_size % dp_size:
        raise InputError(f"--batch-size {args.batch_size} is not divisible by {dp_size} data-parallel groups")
    if args.max_tokens_per_micro_batch is None:
        args.max_tokens_per_micro_batch = max(1024, 2 * args.max_length)
    if args.max_tokens_per_micro_batch < 2 * args.max_length:
        raise InputError(f"--max-tokens-per-micro-batch must fit one pair: 2 x --max-length = {2 * args.max_length}")


def main(args: Args):
    # ---- validate everything cheap before anything expensive starts ----
    validate_args(args)
    dp_size = args.num_trainers // args.sp_size  # data-parallel groups; each splits its rows over sp_size ranks
    resume_step, run_dir = 0, None
    if args.resume:  # same script and model, a whole checkpoint
        run_dir, resume_ckpt, resume_step = check_resume(args.resume, args, os.path.basename(__file__))
    else:
        check_output_dir(args.output_dir)
    check_tracking(args.track)
    use_gpu = choose_layout(args.num_trainers, None, False)[0]  # GPUs if there are (enough)
    datasets = {"train": load_rows(args.dataset, args.dataset_split)}
    if args.eval_dataset:
        datasets["eval"] = load_rows(args.eval_dataset, args.eval_split)
    for rows, source in datasets.values():
        validate_rows(rows, ["prompt", "chosen", "rejected"], source)
        check_pairs(rows, source)
        for i, row in enumerate(rows, 1):  # a `margin` column overrides --margin per pair
            m = row.get("margin", args.margin)
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m < 0:
                raise InputError(f"{source}: row {i} column 'margin' must be a number >= 0 (got {m!r})")
    model_path = resolve_model(args.model)
    check_weights(model_path, "model")
    memory.check_run(args, use_gpu, model_path, head="score")  # a run that cannot fit stops here
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    # ---- tokenize: prompt + chosen and prompt + rejected per row; count pairs that are too long ----
    pairs = {}
    for split, (rows, source) in datasets.items():
        encoded = [
            tuple(encode_example(tokenizer, r["prompt"], r[side])[0] for side in ("chosen", "rejected")) for r in rows
        ]
        too_long = [i + 1 for i, (c, r) in enumerate(encoded) if max(len(c), len(r)) > args.max_length]
        if too_long and not args.drop_long:
            raise InputError(
                f"{source}: {len(too_long)} of {len(rows)} pairs are longer than --max-length {args.max_length} "
                f"tokens (first: row {too_long[0]}); raise --max-length or pass --drop-long"
            )
        pairs[split] = [
            make_pair(c, r, float(row.get("margin", args.margin)))
            for (c, r), row in zip(encoded, rows)
            if max(len(c), len(r)) <= args.max_length
        ]
        if not pairs[split]:
            raise InputError(f"{source}: no pairs left within --max-length")

    # ---- start Ray, place the trainers, open the run directory ----
    layout = Layout(use_gpu, args.num_trainers)
    init_ray(len(layout.bundles))
    pg = make_placement_group(layout.bundles, use_gpu)
    start_from = resume_ckpt if args.resume else model_path
    trainers = spawn_trainers(Trainer, pg, layout.trainers, args, start_from)
    if args.resume:
        call(trainers, "load_optimizer", resume_ckpt)
    run = Run(args, run_dir, resume_step)
    run.print(f"run dir: {run.dir}  model: {args.model}  train pairs: {len(pairs['train'])}")

    def evaluate() -> dict:
        if "eval" not in pairs:
            return {}
        shares = split_for_ranks(pairs["eval"], dp_size, args.max_tokens_per_micro_batch)
        sums = call(trainers, "eval_pairs", per_rank=shares_per_rank(shares, args.sp_size))
        sums = sums[:: args.sp_size]  # the ranks of an SP group report the same pairs: count them once
        n = sum(s["pairs"] for s in sums)
        return {
            "eval/loss": sum(s["loss_sum"] for s in sums) / n,
            "eval/accuracy": sum(s["correct"] for s in sums) / n,  # share of pairs with r_c > r_r
            "eval/margin": sum(s["margin_sum"] for s in sums) / n,  # mean r_c - r_r
        }

    # ---- training loop ----
    console = ("train/loss", "train/accuracy", "train/grad_norm", "eval/loss", "eval/accuracy", "eval/margin")
    first = evaluate() if resume_step == 0 else {}
    if first:
        run.log(0, first, console)
    run.start_progress(args.num_steps, resume_step)
    train = pairs["train"]
    for step in range(resume_step, args.num_steps):
        t0 = time.time()
        batch = [train[i] for i in batch_rows(step, len(train), args.batch_size, args.seed)]
        shares = split_for_ranks(batch, dp_size, args.max_tokens_per_micro_batch)
        results = call(trainers, "train_step", len(batch), step, per_rank=shares_per_rank(shares, args.sp_size))
        results = results[:: args.sp_size]  # one rank per SP group
        elapsed = time.time() - t0
        metrics = {
            "train/loss": sum(r["loss_sum"] for r in results) / len(batch),
            "train/accuracy": sum(r["correct"] for r in results) / len(batch),
            "train/margin": sum(r["margin_sum"] for r in results) / len(batch),
            "train/grad_norm": results[0]["grad_norm"],
            "train/lr": results[0]["lr"],
            "time/step": elapsed,
            "perf/tokens_per_s": sum(len(p["input_ids"]) for p in batch) / elapsed,
        }
        done = step + 1
        if done % args.eval_every == 0 or done == args.num_steps:
            metrics.update(evaluate())
        run.log(done, metrics, console)
        if args.save_every and done % args.save_every == 0 and done < args.num_steps:
            call(trainers, "save", run.checkpoint_dir(done), done, True)

    # ---- teardown: final model in HF format (AutoModelForSequenceClassification, one label) ----
    call(trainers, "save", run.checkpoint_dir("final"), args.num_steps, False)
    if first and "eval/accuracy" in metrics:
        run.print(f"held-out pair accuracy: {first['eval/accuracy']:.3f} -> {metrics['eval/accuracy']:.3f}")
    run.print(f"final model: {run.checkpoint_dir('final')}")
    run.close()
    ray.shutdown()


if __name__ == "__main__":
    main(tyro.cli(Args))
