"""Supervised fine-tuning (SFT): next-token cross-entropy on the assistant's tokens only.

Given demonstrations (prompt -> response), SFT maximises log π(response | prompt), token by token:
    L(θ) = -(1 / N) Σ_{t ∈ assistant tokens} log π_θ(x_t | x_<t),    N = assistant tokens in the whole batch
Prompt and system tokens are context, not targets. Sequences are packed padding-free into micro-batches of a
fixed token budget; each trainer rank is a Ray actor holding an FSDP2 shard of the model.

Run it:
    python sft.py                                              # built-in model and arithmetic data, CPU or GPU
    python sft.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/Capybara --eval-dataset "" \\
        --accuracy-dataset "" --num-trainers 1                 # 1 GPU
    python sft.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset my_data.jsonl --num-trainers 8 \\
        --batch-size 128 --max-tokens-per-micro-batch 16384 --gradient-checkpointing   # 8 GPUs
"""

import math
import os
import re
import time
from dataclasses import dataclass

import ray
import torch
import tyro
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

from common import memory
from common.checks import check_output_dir, check_ranges, check_tracking, check_weights
from common.data import InputError, encode_example, encode_prompt, load_rows, split_for_ranks, validate_rows
from common.lm_head import token_logprobs
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
from common.ring_attn import enable_ring_attention, shard_micro_batch, shares_per_rank, sp_groups
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
    """HF hub id, local HF folder, or the built-in offline model"""
    dataset: str = "data/arithmetic/sft_train.jsonl"
    """training data: local .jsonl/.json/.parquet file or folder, or hub id[:config]; `messages` or `prompt`+`completion`"""
    dataset_split: str = "train"
    """split to read when --dataset is a hub id"""
    eval_dataset: str = "data/arithmetic/sft_test.jsonl"
    """held-out demonstrations for the eval loss ("" to skip)"""
    eval_split: str = "test"
    """split to read when --eval-dataset is a hub id"""
    accuracy_dataset: str = "data/arithmetic/prompts_test.jsonl"
    """held-out `prompt`+`answer` rows for greedy accuracy ("" to skip)"""
    max_length: int = 512
    """longest sequence (prompt + response) in tokens"""
    drop_long: bool = False
    """drop rows longer than --max-length instead of stopping with an error"""
    max_new_tokens: int = 32
    """generation budget of the greedy accuracy eval"""

    # Resources
    num_trainers: int = 1
    """FSDP2 trainer ranks (one GPU each on GPU; share the cores on CPU)"""
    sp_size: int = 1
    """ring attention: split every packed row over this many ranks (--num-trainers = data-parallel x sp-size)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, ~30% more compute"""

    # Optimization
    num_steps: int = 30
    """optimizer steps"""
    batch_size: int = 16
    """sequences per optimizer step, over all ranks"""
    max_tokens_per_micro_batch: int | None = None
    """token budget of one packed micro-batch on one rank (default: 512, or one sequence of --max-length if more; raise it
    on GPU); gradients accumulate over micro-batches"""
    learning_rate: float = 2e-5
    """peak learning rate of AdamW"""
    warmup_steps: int = 4
    """linear warm-up steps, then cosine decay"""
    min_lr_ratio: float = 0.1
    """the cosine decays to learning_rate * min_lr_ratio"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""


# ALGO LOGIC: the model, its shards and the loss. The first two functions are identical in every script.
def load_policy(path: str, device: torch.device, gradient_checkpointing: bool) -> torch.nn.Module:
    """Load a causal LM sharded with FSDP2: each decoder layer, then the root (embeddings, norm, LM head).

    The model is built on the meta device and sharded before any weight exists; then rank 0 reads the checkpoint
    and broadcasts it, each rank keeping only its shard (common/model.py). Master weights stay fp32; on GPU the
    forward/backward run in bf16 and gradients are reduced in fp32.
    """
    model = empty_model(AutoModelForCausalLM, path, attn_implementation(device))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
    for layer in model.base_model.layers:
        fully_shard(layer, mp_policy=mp or MixedPrecisionPolicy())
    fully_shard(model, mp_policy=mp or MixedPrecisionPolicy())
    load_weights(model, AutoModelForCausalLM, path, device)
    return model


def compute_logprobs(model, input_ids, position_ids, labels, mask, temperature: float = 1.0) -> torch.Tensor:
    """log π(label_t | tokens ≤ t) at temperature T, for every position t where mask is 1:
        log π(y_t) = z_t[y_t] - logsumexp(z_t),   z_t = logits_t / T

    input_ids, position_ids, labels, mask: (1, T) packed rows; labels[t] is the token after t. Only the masked
    positions go through the LM head, a chunk of them at a time (common/lm_head.py): the (N, vocab) logits never
    exist at once, in the forward or the backward. Returns (N,) fp32.
    """
    keep = mask[0].nonzero().squeeze(-1)  # (N,)
    with token_logprobs(model, labels[0, keep], temperature):  # the head returns log π(y_t), not logits
        out = model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=keep, use_cache=False)
    return out.logits  # (N,)


def reward_fn(response: str, answer: str) -> float:
    """Rule verifier: 1.0 if the response's final answer equals `answer`, else 0.0.

    Integer answers (the arithmetic task, GSM8K's "#### 72") are compared with the last number in the response;
    other answers (LaTeX, fractions) go through math-verify.
    """
    answer = answer.split("####")[-1].strip().replace(",", "")
    if re.fullmatch(r"-?\d+", answer):
        numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", response)
        return float(bool(numbers) and float(numbers[-1].replace(",", "")) == int(answer))
    from math_verify import parse, verify

    return float(verify(parse(answer), parse(response)))


def compute_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """SFT's loss on one micro-batch: the negative log-likelihood of its assistant tokens, summed. (N,) -> ().

    train_step divides by the assistant tokens of the whole global batch, so every token weighs the same
    however the batch is split over ranks and micro-batches.
    """
    return -logprobs.sum()


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


def make_sequence(ids: list[int], mask: list[int]) -> dict[str, list]:
    """Shift once, here: position t predicts labels[t] = ids[t+1], trained iff token t+1 is an assistant token."""
    return {"input_ids": ids, "labels": ids[1:] + [0], "loss_mask": mask[1:] + [0]}


# TRY NOT TO MODIFY: the trainer actor (one per rank).
@ray.remote
class Trainer:
    def __init__(self, args: Args, model_path: str, rank: int, world_size: int, addr: str, port: int):
        self.args, self.rank, self.world_size = args, rank, world_size
        self.device = init_distributed(rank, world_size, addr, port)
        torch.manual_seed(args.seed)
        self.model = load_policy(model_path, self.device, args.gradient_checkpointing)
        self.sp = sp_groups(world_size, args.sp_size)  # DP x SP: ranks [k*sp, (k+1)*sp) share data shard k
        enable_ring_attention(self.model, self.sp.group)  # a no-op when --sp-size is 1
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=args.weight_decay
        )

    def train_step(self, micro_batches: list[dict], num_tokens: int, step: int) -> dict:
        """One optimizer step over this rank's micro-batches. Returns sums; the driver divides by counts."""
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.args)
        loss_sum = 0.0
        for i, mb in enumerate(micro_batches):
            # With --sp-size k this rank holds 2 of the row's 2k zigzag chunks; each token's loss is on one rank.
            mb = shard_micro_batch({k: v.to(self.device) for k, v in mb.items()}, self.sp.rank, self.sp.size)
            # Reduce-scatter gradients only after the last micro-batch; before it they accumulate locally.
            self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            logprobs = compute_logprobs(self.model, mb["input_ids"], mb["position_ids"], mb["labels"], mb["loss_mask"])
            loss = compute_loss(logprobs) * mb["loss_scale"]  # loss_scale: 0 for a filler micro-batch (split_for_ranks)
            # Normalise by the tokens of the whole global batch; FSDP averages over ranks, so undo its 1/world.
            (loss * self.world_size / num_tokens).backward()
            loss_sum += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if not torch.isfinite(grad_norm):  # the same global norm on every rank: all stop before the update
            raise FloatingPointError(f"non-finite loss or gradient norm ({grad_norm.item()}) at step {step + 1}")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss_sum": loss_sum, "grad_norm": grad_norm.item(), "lr": self.optimizer.param_groups[0]["lr"]}

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[dict]) -> dict:
        self.model.eval()
        loss_sum = tokens = 0.0
        for mb in micro_batches:
            mb = shard_micro_batch({k: v.to(self.device) for k, v in mb.items()}, self.sp.rank, self.sp.size)
            logprobs = compute_logprobs(self.model, mb["input_ids"], mb["position_ids"], mb["labels"], mb["loss_mask"])
            loss_sum += compute_loss(logprobs).item() * mb["loss_scale"].item()
            tokens += mb["loss_mask"].sum().item() * mb["loss_scale"].item()
        return {"loss_sum": loss_sum, "tokens": tokens}

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy completions of this rank's prompts. synced_gpus keeps the ranks' FSDP collectives in step."""
        self.model.eval()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)  # left-pad
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        enable_ring_attention(self.model, None)  # each rank generates its own prompts whole
        greedy = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, synced_gpus=self.world_size > 1)
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **greedy)
        enable_ring_attention(self.model, self.sp.group)
        stop = {self.tokenizer.eos_token_id, pad}
        return [[t for t in row[width:].tolist() if t not in stop] for row in out]

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
            ">= 0": "seed save_every warmup_steps weight_decay",
            ">= 1": "eval_every max_length max_new_tokens num_trainers sp_size num_steps batch_size "
            "max_tokens_per_micro_batch",
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
        args.max_tokens_per_micro_batch = max(512, args.max_length)
    if args.max_tokens_per_micro_batch < args.max_length:
        raise InputError(f"--max-tokens-per-micro-batch must fit one sequence of --max-length {args.max_length}")


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
        validate_rows(rows, ["messages"] if "messages" in rows[0] else ["prompt", "completion"], source)
    accuracy_rows = []
    if args.accuracy_dataset:
        accuracy_rows, source = load_rows(args.accuracy_dataset, args.eval_split)
        validate_rows(accuracy_rows, ["prompt", "answer"], source, numeric=("answer",))
    model_path = resolve_model(args.model)
    check_weights(model_path, "model")
    memory.check_run(args, use_gpu, model_path)  # a run that cannot fit stops here
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    # ---- tokenize: ids + assistant mask per row; count rows that are too long ----
    sequences = {}
    for split, (rows, source) in datasets.items():
        encoded = [encode_example(tokenizer, r.get("messages", r.get("prompt")), r.get("completion")) for r in rows]
        too_long = [i + 1 for i, (ids, _) in enumerate(encoded) if len(ids) > args.max_length]
        if too_long and not args.drop_long:
            raise InputError(
                f"{source}: {len(too_long)} of {len(rows)} rows are longer than --max-length {args.max_length} "
                f"tokens (first: row {too_long[0]}); raise --max-length or pass --drop-long"
            )
        silent = sum(1 for _, m in encoded if not sum(m))  # nothing to learn from: no assistant turn
        if silent:
            print(f"warning: {source}: {silent} of {len(rows)} rows have no assistant turn; they are skipped")
        sequences[split] = [make_sequence(ids, m) for ids, m in encoded if len(ids) <= args.max_length and sum(m)]
        if not sequences[split]:
            raise InputError(f"{source}: no rows left with assistant tokens within --max-length")
    accuracy_prompts = [encode_prompt(tokenizer, r["prompt"]) for r in accuracy_rows]

    # ---- start Ray, place the trainers, open the run directory ----
    layout = Layout(use_gpu, args.num_trainers)
    init_ray(len(layout.bundles))
    pg = make_placement_group(layout.bundles, use_gpu)
    start_from = resume_ckpt if args.resume else model_path
    trainers = spawn_trainers(Trainer, pg, layout.trainers, args, start_from)
    if args.resume:
        call(trainers, "load_optimizer", resume_ckpt)
    run = Run(args, run_dir, resume_step)
    run.print(f"run dir: {run.dir}  model: {args.model}  train rows: {len(sequences['train'])}")

    def evaluate(step: int) -> dict:
        metrics = {}
        if "eval" in sequences:
            shares = split_for_ranks(sequences["eval"], dp_size, args.max_tokens_per_micro_batch)
            sums = call(trainers, "eval_loss", per_rank=shares_per_rank(shares, args.sp_size))
            metrics["eval/loss"] = sum(s["loss_sum"] for s in sums) / sum(s["tokens"] for s in sums)
        if accuracy_prompts:
            n = args.num_trainers
            shares = [accuracy_prompts[r::n] for r in range(n)]
            outs = call(trainers, "generate", args.max_new_tokens, per_rank=shares)
            responses = [None] * len(accuracy_prompts)
            for r, out in enumerate(outs):
                responses[r::n] = [tokenizer.decode(o) for o in out]
            rewards = [reward_fn(resp, str(row["answer"])) for resp, row in zip(responses, accuracy_rows)]
            metrics["eval/accuracy"] = sum(rewards) / len(rewards)
            samples = zip(accuracy_rows, responses, rewards)
            run.log_samples(
                step,
                [{"prompt": r["prompt"], "response": t, "answer": r["answer"], "reward": x} for r, t, x in samples],
            )
        return metrics

    # ---- training loop ----
    console = ("train/loss", "train/grad_norm", "train/lr", "eval/loss", "eval/accuracy", "perf/tokens_per_s")
    first = evaluate(resume_step) if resume_step == 0 else {}
    if first:
        run.log(0, first, console)
    run.start_progress(args.num_steps, resume_step)
    train = sequences["train"]
    for step in range(resume_step, args.num_steps):
        t0 = time.time()
        batch = [train[i] for i in batch_rows(step, len(train), args.batch_size, args.seed)]
        num_tokens = sum(sum(s["loss_mask"]) for s in batch)
        shares = split_for_ranks(batch, dp_size, args.max_tokens_per_micro_batch)
        results = call(trainers, "train_step", num_tokens, step, per_rank=shares_per_rank(shares, args.sp_size))
        elapsed = time.time() - t0
        metrics = {
            "train/loss": sum(r["loss_sum"] for r in results) / num_tokens,
            "train/grad_norm": results[0]["grad_norm"],
            "train/lr": results[0]["lr"],
            "train/tokens": num_tokens,
            "time/step": elapsed,
            "perf/tokens_per_s": sum(len(s["input_ids"]) for s in batch) / elapsed,
        }
        done = step + 1
        if done % args.eval_every == 0 or done == args.num_steps:
            metrics.update(evaluate(done))
        run.log(done, metrics, console)
        if args.save_every and done % args.save_every == 0 and done < args.num_steps:
            call(trainers, "save", run.checkpoint_dir(done), done, True)

    # ---- teardown: final model in HF format ----
    call(trainers, "save", run.checkpoint_dir("final"), args.num_steps, False)
    if first and "eval/accuracy" in first:
        run.print(
            f"greedy accuracy on the held-out split: {first['eval/accuracy']:.3f} -> {metrics['eval/accuracy']:.3f}"
        )
    run.print(f"final model: {run.checkpoint_dir('final')}")
    run.close()
    ray.shutdown()


if __name__ == "__main__":
    main(tyro.cli(Args))
