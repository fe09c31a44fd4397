"""On-policy distillation (Agarwal et al. 2024, GKD, arXiv 2306.13649; Thinking Machines 2025).

The student π_θ samples o ~ π_θ(· | q) as grpo.py does (vLLM, weight sync); a frozen teacher π_T
scores every sampled token, and the per-token reverse KL is a dense advantage (λ adds r_i):
    Â_it = -k(o_it) + λ (r_i - b),     k1 = log π_θold(o_it) - log π_T(o_it)   (k3: --kl-estimator)
    J(θ) = 1/G Σ_i 1/|o_i| Σ_t min(ρ_it Â_it, clip(ρ_it, 1-ε, 1+ε) Â_it),  ρ_it = π_θ / π_θold
With k1, on-policy, ∇J = -∇KL(π_θ || π_T) in expectation: the student learns the teacher's choices
on its own mistakes, a signal per token where RL has one per response. The teacher is --teacher or,
by default, the starting model told the answer in its prompt (self-distillation: OPSD, SDFT).

Run it:
    python distill.py                                 # self-distillation, built-in model and task
    python distill.py --teacher runs/grpo__1__1764000000/checkpoints/final   # a trained teacher
    python distill.py --model Qwen/Qwen2.5-0.5B-Instruct --teacher Qwen/Qwen2.5-7B-Instruct \\
        --dataset openai/gsm8k:main --eval-dataset openai/gsm8k:main --max-response-length 512 \\
        --prompts-per-step 64 --num-generations 1 --gradient-checkpointing   # 1 GPU, colocated
"""

import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from transformers import AutoTokenizer

# Setup-only plumbing is called through its module (placement.Layout, checkpoint.save, ...): each
# call says where it lives. The names below are what the math, the update and the loop use.
from common import checkpoint, data, lora, memory, models, placement, vision, weight_sync
from common.data import batch_rows, make_sequence, response_values
from common.engines import generate, spawn_engines
from common.errors import InputError
from common.flags import Engines, Experiment, LoRA, Optimization, Resources, check_flags, parse_args
from common.lm_head import token_logprobs
from common.optim import ema_weights
from common.placement import call
from common.precision import choose_dtype
from common.prompts import encode_prompts, read_prompts
from common.rewards import composed_reward, reward_terms, score_responses
from common.tracking import Run
from common.trainer import Trainer, load_policy
from common.weight_sync import sync_weights


@dataclass
class Args(Optimization, LoRA, Engines, Resources, Experiment):  # common/'s flags come first
    # Model and data
    model: str = models.BUILTIN_MODEL
    """HF hub id, local HF folder, or the built-in offline model"""
    dataset: str = "data/arithmetic/prompts_train.jsonl"
    """prompts: local .jsonl/.json/.parquet file or folder, or hub id[:config]; `prompt`+`answer` or
    `question`+`answer`"""
    dataset_split: str = "train"
    """split to read when --dataset is a hub id"""
    eval_dataset: str = "data/arithmetic/prompts_test.jsonl"
    """held-out prompts for greedy accuracy ("" to skip)"""
    eval_split: str = "test"
    """split to read when --eval-dataset is a hub id"""
    reward_fn: tuple[str, ...] = ()
    """reward terms added to the verifier's: `path/to/file.py:function[=weight]` each (weight 1),
    called as function(response: str, answer: str) -> float; each logged as rollout/reward/<name>"""
    verifier_weight: Annotated[float, ">= 0"] = 1.0
    """the rule verifier's weight in the reward (0: --reward-fn alone; eval/accuracy stays its)"""
    reward_timeout: Annotated[float, "> 0"] = 30.0
    """seconds one reward call may take; a slower one stops the run, naming the function, the step,
    the row"""
    max_prompt_length: Annotated[int, ">= 1"] = 256
    """longest prompt in tokens"""
    max_response_length: Annotated[int, ">= 1"] = 24
    """longest response in tokens (generation stops there)"""
    drop_long: bool = False
    """drop prompts longer than --max-prompt-length instead of stopping with an error"""

    # Resources (and common/flags.py's: --num-trainers, --num-engines, ...)
    colocate: bool = False
    """GPU: trainer rank i and engine i share GPU i, vLLM sleeping while the trainers train (the
    default when there are too few GPUs to give each its own)"""

    # Algorithm
    teacher: str = ""  # DISTILL (teacher)
    """π_T: hub id, folder or run checkpoint, frozen, with --model's tokenizer ("": self-distill)"""
    teacher_prompt: Literal["auto", "answer", "same"] = "auto"  # DISTILL (teacher)
    """the teacher's prompt: the student's with the reference answer before the question (answer),
    or the student's (same); auto: answer for self-distillation, same with --teacher"""
    live_teacher: bool = False  # DISTILL (teacher)
    """self-distillation: the teacher is the current policy (in its prompt), not the frozen start"""
    kl_estimator: Literal["k1", "k3"] = "k1"  # DISTILL (advantage)
    """the reverse KL's estimate per token in Â: k1 (its gradient is the KL's) or k3 (reverse_kl)"""
    verifier_coef: Annotated[float, ">= 0"] = 0.0  # DISTILL (advantage)
    """λ: the verifier's reward (less its group's mean) in every token's Â at this weight"""
    num_generations: Annotated[int, ">= 1"] = 8  # DISTILL: no group baseline, so G = 1 works
    """G: responses sampled per prompt"""
    temperature: Annotated[float, "> 0"] = 1.0
    """sampling temperature; the trainer scores tokens at the same temperature"""
    top_p: Annotated[float, "> 0, <= 1"] = 1.0
    """nucleus sampling"""
    clip_eps: Annotated[float, "> 0, < 1"] = 0.2
    """ε: PPO clip range of the ratio π_θ / π_θold"""
    # DISTILL (advantage): no β KL to a reference: the teacher is what the student is held to
    tis_cap: Annotated[float, ">= 1"] = 2.0
    """C: cap of the truncated importance weight π_θold / π_vllm (IcePop: its band is [1/C, C])"""
    is_correction: Literal["tis", "icepop", "seq-mask"] = "tis"
    """how tokens sampled by vLLM are reweighted: tis, by min(π_θold / π_vllm, C); icepop, by the
    ratio inside [1/C, C] and masked (weight 0) outside it, both sides; seq-mask, by the response's
    geometric-mean ratio inside [1/c, c] (--seq-mask-cap), else the response masked whole"""
    seq_mask_cap: Annotated[float, "> 1"] = 1.01
    """c: --is-correction seq-mask's band [1/c, c] of a response's geometric-mean ratio"""
    num_minibatches: Annotated[int, ">= 1"] = 1
    """optimizer steps per rollout batch (the batch is split into this many minibatches)"""
    num_epochs: Annotated[int, ">= 1"] = 1
    """μ: passes over each rollout batch"""

    # Optimization
    num_steps: Annotated[int, ">= 1"] = 20
    """rollout + training steps"""
    prompts_per_step: Annotated[int, ">= 1"] = 6
    """prompts per rollout batch (each sampled G times)"""
    max_tokens_per_micro_batch: Annotated[int | None, ">= 1"] = None
    """token budget of one packed micro-batch on one rank (default: 512, or one longest prompt +
    response if more; raise it on GPU); gradients accumulate over micro-batches"""
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


# ALGO LOGIC: the advantages, which groups to train on, the loss and how it is aggregated.
def compute_advantages(rewards: torch.Tensor, group_size: int, coef: float):  # DISTILL (advantage)
    """The verifier's part of Â, the same for every token of o_i: (B*G,) rewards grouped by prompt
    -> λ (r_i - b), b the group's mean (0 for G = 1); the teacher's part joins in compute_loss."""
    r = rewards.view(-1, group_size)  # (B, G)
    baseline = r.mean(dim=1, keepdim=True) if group_size > 1 else 0.0
    return (coef * (r - baseline)).view(-1)


def keep_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups to train on, (B,) bool. GRPO keeps them all (an all-equal group has Â = 0)."""
    return torch.ones(rewards.numel() // group_size, dtype=torch.bool)


def teacher_prompt(prompt, tokenizer, args: Args) -> list[int]:  # DISTILL (teacher)
    """The teacher's prompt ids: the student's, or (--teacher-prompt answer, self-distillation's
    default) with the reference answer before the question, in its text or last message."""
    if args.teacher_prompt == "same" or (args.teacher_prompt == "auto" and args.teacher):
        return prompt.ids
    hint, text = f"Reference answer: {prompt.answer}\n", prompt.text
    last = {**text[-1], "content": hint + text[-1]["content"]} if isinstance(text, list) else None
    return data.encode_prompt(tokenizer, [*text[:-1], last] if last else hint + text)


def frozen_models(args: Args) -> list:  # DISTILL (teacher)
    """The frozen model the trainers hold, (name, folder): the teacher's, or the starting model's
    (None: self-distillation); with --live-teacher none, the policy scores."""
    teacher = models.resolve_model(args.teacher) if args.teacher else None
    return [] if args.live_teacher else [("teacher", teacher)]


def policy_values(args: Args) -> list[str]:
    """The per-token values the policy's own forward gives compute_loss besides log π_θ: "entropy"
    (H_t of π_θ at each response token, from the LM head's chunk loop, logged as train/entropy; a
    loss that uses it, e.g. an entropy bonus -α H_t, gets its gradient too). [] turns it off."""
    return ["entropy"]


def compute_policy_loss(logprobs, old_logprobs, advantages, eps_low: float, eps_high: float):
    """Per-token clipped surrogate (negated: a loss), all (N,); also where the clip was active. The
    ratio is clipped to [1 - ε_low, 1 + ε_high]; GRPO's range is symmetric (ε_low = ε_high = ε)."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20, 20))  # ρ, finite (inf·0 would be NaN)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages
    return -torch.min(unclipped, clipped), clipped < unclipped


def reverse_kl(logprobs, teacher_logprobs, estimator: str = "k1"):  # DISTILL (advantage)
    """KL(π_θ || π_T) estimated at each token o_t ~ π_θ (Schulman 2020), (N,):
        k1 = log π_θ(o_t) - log π_T(o_t)      unbiased, of either sign
        k3 = e^(-k1) + k1 - 1 >= 0            unbiased for the KL's value, lower variance
    As a reward -k, k1's policy gradient is -∇KL; k3's is biased (docs/distill.md)."""
    k1 = logprobs - teacher_logprobs
    return torch.exp(-k1) + k1 - 1 if estimator == "k3" else k1


def importance_weights(old_logprobs, engine_logprobs, args: Args, responses=None) -> torch.Tensor:
    """Each token's weight for the sampler's mismatch (N,): vLLM sampled the tokens, not π_θold.
    With r_t = π_θold / π_vllm, TIS (Yao et al. 2025) weights by min(r_t, C); IcePop (Ring-1T,
    arXiv 2510.18855) by r_t inside [1/C, C] and 0 outside it: a token the two disagree on either
    way is dropped from the gradient, not clipped (where r_t = 1 both give exactly 1). seq-mask
    (TRL's default mode; SkyRL's geometric mask): a response's r̄_i = exp(1/|o_i| Σ_t log r_it)
    weights its every token inside [1/c, c] and masks the response whole outside it (`responses`:
    ring_attn.Responses, which response each token is; exact under --sp-size)."""
    log_ratio = old_logprobs - engine_logprobs
    ratio, cap = torch.exp(log_ratio), args.tis_cap
    if args.is_correction == "seq-mask":  # r̄_i at each token of o_i
        ratio, cap = torch.exp(responses.mean(log_ratio)), args.seq_mask_cap
    if args.is_correction != "tis":
        return torch.where((ratio >= 1 / cap) & (ratio <= cap), ratio, 0.0)
    return ratio.clamp(max=cap)


def loss_weights(response_lengths: list[int], args: Args) -> list[list[float]]:
    """GRPO's aggregation over one minibatch: mean over each response's tokens, then over responses,
    L = 1/N Σ_i 1/|o_i| Σ_t ℓ_it.
    One weight per token, so packed micro-batches on any number of ranks add up to exactly this."""
    n = len(response_lengths)
    return [[1.0 / (n * length)] * length for length in response_lengths]


def compute_loss(logprobs: torch.Tensor, values: dict, args: Args) -> tuple[torch.Tensor, dict]:
    """The loss on one micro-batch's response tokens, and per-token stats to sum (train/<name>):
        L = Σ_t w_t IS_t · clipped surrogate_t,   Â_t = -k_t + λ (r_i - b)  # DISTILL (advantage)
    logprobs (N,) are π_θ's; `values` holds the micro-batch's other per-token values, (N,) each:
    those the loop gave make_sequence (advantages: the verifier's part, engine_logprobs,
    teacher_logprobs), the aggregation's loss_weights w_t, old_logprobs (π_θold). TIS: sampled by
    vLLM, whose numerics differ from the trainer's, not by π_θold itself; each token is reweighted
    by IS_t, its likelihood ratio capped (TIS) or masked (IcePop): importance_weights.
    """
    old = values["old_logprobs"]
    tis = importance_weights(old, values["engine_logprobs"], args, values.get("responses"))
    eps = (args.clip_eps, args.clip_eps)  # [1 - ε, 1 + ε]
    # DISTILL (advantage): the teacher's signal at each token, from π_θold: a constant, like Â_i
    kl = reverse_kl(old, values["teacher_logprobs"], args.kl_estimator)
    advantages = values["advantages"] - kl
    pg_loss, clipped = compute_policy_loss(logprobs, old, advantages, *eps)
    token_loss = tis * pg_loss
    # clipfrac: the clip cut the gradient (ρ left [1-ε, 1+ε] the way Â pushes it); tis_weight: 1
    # when the trainer and vLLM agree on every token
    stats = {"clipfrac": clipped.sum(), "tis_weight": tis.sum()}
    # DISTILL (advantage): the reverse KL's k1 estimate, whichever estimator Â uses
    stats["reverse_kl"] = reverse_kl(old, values["teacher_logprobs"]).sum()
    masked = {"icepop": "icepop_masked", "seq-mask": "seq_masked"}.get(args.is_correction)
    if masked:  # the share of tokens the mask dropped (seq-mask: whole responses')
        stats[masked] = (tis == 0).sum()
    return (token_loss * values["loss_weights"]).sum(), stats


# ALGO LOGIC: what each step logs (docs/grpo.md lists every key).
def rollout_metrics(rewards, parts: dict, responses: list[dict], group_size: int) -> dict:
    """What was sampled. GRPO learns only from groups whose rewards differ, so besides the mean
    reward (and each term's): the spread inside groups and the share of groups every sample solved,
    or none did, by the verifier (with the verifier alone those two carry no signal: Â = 0)."""
    # |o_i|: a response's sampled tokens (each came with its log-probability)
    grouped, lengths = rewards.view(-1, group_size), [len(s["logprobs"]) for s in responses]
    solved = parts["verifier"].view(-1, group_size)
    return {
        "rollout/reward": rewards.mean().item(),
        **{f"rollout/reward/{name}": values.mean().item() for name, values in parts.items()},
        "rollout/reward_std": grouped.std(dim=1).mean().item(),
        "rollout/solved_all": (solved.min(dim=1).values == 1).float().mean().item(),
        "rollout/solved_none": (solved.max(dim=1).values == 0).float().mean().item(),
        "rollout/response_length": sum(lengths) / len(lengths),
        "rollout/truncated": sum(s["finish_reason"] == "length" for s in responses)
        / len(responses),
    }


def train_metrics(results: list[dict], args: Args) -> dict:
    """From the trainer ranks' sums (each rank its share of tokens; grad norm and lr are global).
    Every per-token stat of the update (compute_loss's, train/entropy) is logged as its mean."""
    total, sums = defaultdict(float), defaultdict(float)
    for rank in results:
        for key in ("loss", "tokens", "logprob_diff_sum"):  # no diff: a rank of fillers only
            total[key] += rank.get(key, 0.0)
        for key, value in rank["token_sums"].items():
            sums[key] += value
    updates = args.num_minibatches * args.num_epochs  # each update's loss is a mean: average them
    return {
        "train/loss": total["loss"] / updates,
        **{f"train/{key}": value / total["tokens"] for key, value in sums.items()},
        "train/grad_norm": results[0]["grad_norms"] / updates,
        "train/lr": results[0]["lr"],
        # |log π_θold - log π_vllm| before any update (the first epoch): float noise when the
        # engines hold the trainer's weights, far more when they serve stale ones
        "train/logprob_diff_mean": total["logprob_diff_sum"] / (total["tokens"] / args.num_epochs),
        "train/logprob_diff_max": max(rank.get("logprob_diff_max", 0.0) for rank in results),
    }


def time_metrics(times: tuple, generated_tokens: int, trained_tokens: int) -> dict:
    """Seconds per phase from the step's (start, generated, trained, synced) times; throughput."""
    t0, t_gen, t_train, t_sync = times
    return {
        "time/generate": t_gen - t0,
        "time/train": t_train - t_gen,
        "time/sync": t_sync - t_train,
        "time/step": t_sync - t0,
        "perf/generate_tokens_per_s": generated_tokens / (t_gen - t0),
        "perf/train_tokens_per_s": trained_tokens / (t_train - t_gen),
    }


# ALGO LOGIC: the update, run on every trainer rank (common/trainer.py's shell holds the model, the
# frozen π_ref and the optimizer): π_θold, π_ref, the loss, backward, the stats.
def train_step(trainer, minibatches: list[list[dict]], step: int) -> dict:
    """num_epochs passes, an optimizer step per minibatch of micro-batches. Returns sums to the
    driver."""
    args, model = trainer.args, trainer.model
    stats, sums = defaultdict(float), defaultdict(float)  # sums: per-token stats, train/<name>
    sampled = (args.temperature, args.top_p)  # the distribution vLLM sampled from
    # With --sp-size k this rank holds 2 of each row's 2k zigzag chunks; a token is on one rank
    minibatches = [[trainer.local_part(mb) for mb in mini] for mini in minibatches]
    one_update = args.num_minibatches * args.num_epochs == 1
    with torch.no_grad():
        for mb in [mb for mini in minibatches for mb in mini]:
            # every per-token value the loop gave make_sequence, at the response tokens
            mb["values"] = values = response_values(mb)
            inputs = (mb["input_ids"], mb["position_ids"], mb["labels"], mb["loss_mask"])
            images = vision.inputs(mb)  # a VLM's pixel values, else none
            # DISTILL (teacher): no π_ref; the teacher scored in its own prompt (score_teacher)
            if not one_update:  # π_θold: the policy before this step's first update
                values["old_logprobs"] = compute_logprobs(model, *inputs, *sampled, **images)
    model.train()
    for epoch in range(args.num_epochs):
        for mini in minibatches:
            for i, mb in enumerate(mini):
                # reduce-scatter gradients after the minibatch's last micro-batch only
                model.set_requires_gradient_sync(i == len(mini) - 1)
                inputs = (mb["input_ids"], mb["position_ids"], mb["labels"], mb["loss_mask"])
                values = dict(mb["values"])
                entropy = "entropy" in policy_values(args)  # H_t, from the same forward
                images = vision.inputs(mb)
                logprobs = compute_logprobs(model, *inputs, *sampled, entropy=entropy, **images)
                if entropy:  # a pair: (N,) log π_θ and (N,) H_t
                    logprobs, values["entropy"] = logprobs
                if one_update:  # one update per rollout: this forward *is* π_θold, the ratio 1
                    values["old_logprobs"] = logprobs.detach()
                loss, token_stats = compute_loss(logprobs, values, args)
                # real: 1, or 0 for a filler micro-batch that keeps ranks in lock-step
                real = mb["real"].item()
                loss = loss * mb["real"]
                # FSDP averages over ranks: undo it; float16: × the loss scale S
                trainer.scaler.backward(loss * trainer.world_size)
                stats["loss"] += loss.item()
                stats["tokens"] += len(logprobs) * real
                if "entropy" in values:  # falling fast: entropy collapse
                    token_stats["entropy"] = values["entropy"].sum()
                for key, value in token_stats.items():
                    sums[key] += value.item() * real
                # trainer vs engine, before any update: do they hold the same weights?
                if epoch == 0 and real and len(logprobs) and "engine_logprobs" in values:
                    diff = (values["old_logprobs"] - values["engine_logprobs"]).abs()
                    stats["logprob_diff_sum"] += diff.sum().item()
                    stats["logprob_diff_max"] = max(stats["logprob_diff_max"], diff.max().item())
            stats["grad_norms"] += trainer.optimizer_step(step)
    stats["lr"] = trainer.lr
    return {**stats, "token_sums": dict(sums)}


def score_teacher(trainer, micro_batches: list[dict]) -> torch.Tensor:  # DISTILL (teacher)
    """log π_T(o_t | its prompt, o_<t) at this rank's tokens as vLLM sampled (temperature, top-p):
    (2, N): which of the step's tokens ("token"), log π_T (--live-teacher: π_θ, not yet updated)."""
    args = trainer.args
    teacher = trainer.model if args.live_teacher else trainer.frozen["teacher"]
    out = [torch.zeros(2, 0)]
    with torch.no_grad():
        for mb in micro_batches:
            mb = trainer.local_part(mb)  # with --sp-size: this rank's chunks of each row
            inputs = (mb["input_ids"], mb["position_ids"], mb["labels"], mb["loss_mask"])
            logprobs = compute_logprobs(teacher, *inputs, args.temperature, args.top_p)
            out.append(torch.stack([response_values(mb, "token")["token"], logprobs]).cpu())
    return torch.cat(out, dim=1)


def teacher_scores(trainers, prompts: list, responses, args: Args) -> list:  # DISTILL (teacher)
    """log π_T of every response token in its teacher's prompt, (B*G,) lists: dealt to the ranks as
    an update is, scored there, put back by each token's index ("token": exact in fp32 to 2^24)."""
    starts = torch.tensor([0] + [len(s["token_ids"]) for s in responses]).cumsum(0).tolist()
    spans = zip(prompts, responses, starts, starts[1:])  # response i's tokens: a..b of the step's
    seqs = [make_sequence(p, s["token_ids"], token=range(a, b)) for p, s, a, b in spans]
    n, budget, scores = args.num_trainers, args.max_tokens_per_micro_batch, torch.zeros(starts[-1])
    shares = data.split_for_ranks(seqs, n, budget, args.sp_size)
    for which, logprobs in call(trainers, score_teacher, per_rank=shares):
        scores[which.long()] = logprobs
    return [scores[a:b].tolist() for a, b in zip(starts, starts[1:])]


def main(args: Args):
    # ---- check everything cheap, then start Ray and the actors (SETUP AND CHECKS, below) ----
    validate_args(args)
    G = args.num_generations  # the group size
    use_gpu, resume = check_machine(args, os.path.basename(__file__))
    run_dir, resume_ckpt, resume_step = resume or (None, None, 0)
    model_path, tokenizer, prompts, terms = prepare_inputs(args, use_gpu)
    trainers, engines = start_actors(args, use_gpu, model_path, resume_ckpt)
    if args.resume:
        call(trainers, "load_optimizer", resume_ckpt)
    run = Run(args, run_dir, resume_step, args.num_steps)
    run.print(f"run dir: {run.dir}  model: {args.model}  prompts: {len(prompts['train'])}  G: {G}")
    sampling = dict(top_p=args.top_p, max_tokens=args.max_response_length, seed=args.seed)
    timeout = args.reward_timeout  # seconds one reward call may take

    @ema_weights(trainers, lambda: sync_weights(trainers, engines, colocated=False), args.eval_ema)
    def evaluate(step: int) -> dict:
        if "eval" not in prompts:
            return {}
        ids = [p.request or p.ids for p in prompts["eval"]]  # a VLM's: with its pictures
        outs = generate(engines, ids, n=1, temperature=0.0, **sampling)  # greedy
        where = f"eval at step {step}"
        _, _, parts = score_responses(terms, prompts["eval"], outs, tokenizer, where, timeout)
        metrics = {"eval/accuracy": parts["verifier"].mean().item()}  # the verifier's alone
        # DISTILL (teacher): self-distillation's teacher is the engines' model in its own prompt
        if not args.teacher and (step == 0 or args.live_teacher) and not args.eval_ema:
            ids = [teacher_prompt(p, tokenizer, args) for p in prompts["eval"]]
            outs = generate(engines, ids, n=1, temperature=0.0, **sampling)
            _, _, parts = score_responses(terms, prompts["eval"], outs, tokenizer, where, timeout)
            metrics["eval/teacher_accuracy"] = parts["verifier"].mean().item()
        return metrics

    # the console line: the reward, the loss and every per-token stat of the update, eval, time
    quiet = ("train/grad_norm", "train/lr", "train/logprob_diff_mean", "train/logprob_diff_max")

    def end_step(done: int, metrics: dict, batch: list, texts: list[str], rewards: torch.Tensor):
        """Evaluate (every --eval-every steps and after the last), log the metrics and the first two
        groups as samples, and save a resumable checkpoint every --save-every steps."""
        if done % args.eval_every == 0 or done == args.num_steps:
            metrics.update(evaluate(done))
        update = [k for k in metrics if k.startswith("train/") and k not in quiet]
        run.log(done, metrics, ("rollout/reward", *update, "eval/accuracy", "time/step"))
        group = [p for p in batch for _ in range(G)]  # each response's prompt
        rows = [
            dict(prompt=p.text, response=t, answer=p.answer, reward=r)
            for p, t, r in zip(group[: 2 * G], texts, rewards.tolist())
        ]
        run.log_samples(done, rows)
        checkpoint.keep_best(args, run, metrics, done, trainers)  # --best-metric
        if args.save_every and done % args.save_every == 0 and done < args.num_steps:
            with checkpoint.staged(run.checkpoint_dir(done), done) as folder:  # whole or absent
                call(trainers, "save", folder, done)

    # ---- training loop: generate -> reward -> advantages -> train -> sync ----
    first = evaluate(0) if resume_step == 0 else {}
    if first:
        run.log(0, first, ("eval/accuracy",))
    train = prompts["train"]
    for step in range(resume_step, args.num_steps):
        t0 = time.time()
        batch = [train[i] for i in batch_rows(step, len(train), args.prompts_per_step, args.seed)]
        ids, where = [p.request or p.ids for p in batch], f"step {step + 1}"
        outs = generate(engines, ids, n=G, temperature=args.temperature, draw=step, **sampling)
        if args.colocate:
            call(engines, "sleep")  # free the GPUs for training
        t_gen = time.time()

        # ALGO LOGIC: rewards and advantages, per group; the values each trained token carries
        responses = [s for group in outs for s in group]  # (B*G,) prompt-major
        texts, rewards, parts = score_responses(terms, batch, outs, tokenizer, where, timeout)
        advantages = compute_advantages(rewards, G, args.verifier_coef)  # DISTILL: λ (r_i - b)
        kept = keep_groups(rewards, G).repeat_interleave(G)
        # DISTILL (teacher): the teacher scores every sampled token, in its own prompt
        teacher = [teacher_prompt(p, tokenizer, args) for p in batch for _ in range(G)]
        teacher_logprobs = teacher_scores(trainers, teacher, responses, args)
        sequences = []
        for i in kept.nonzero().squeeze(-1).tolist():
            s = responses[i]
            values = {"advantages": [advantages[i].item()] * len(s["logprobs"])}  # |o_i| of Â
            values["engine_logprobs"] = s["logprobs"]  # what vLLM sampled with, for TIS
            values |= batch[i // G].pixels or {}  # a VLM's: the prompt's pictures
            values["teacher_logprobs"] = teacher_logprobs[i]  # DISTILL (teacher): log π_T
            sequences.append((batch[i // G].ids, s["token_ids"], values))
        shares = plan_minibatches(sequences, step, args)  # with loss_weights: the aggregation
        results = call(trainers, train_step, step, per_rank=shares)
        t_train = time.time()

        # wake (colocated), push, check the engines serve the new weights (common/weight_sync.py)
        synced = sync_weights(trainers, engines, args.colocate)
        t_sync = time.time()

        # ---- log ----
        generated = sum(len(s["logprobs"]) for s in responses)
        trained = sum(len(p) + len(r) for p, r, _ in sequences) * args.num_epochs
        metrics = {
            **rollout_metrics(rewards, parts, responses, G),
            **train_metrics(results, args),
            **time_metrics((t0, t_gen, t_train, t_sync), generated, trained),
            **synced,  # perf/sync_*: bytes, the probe's gap, seconds waking, sending, probing
        }
        end_step(step + 1, metrics, batch, texts, rewards)

    # ---- teardown: the final model in HF format, the accuracy line (checkpoint.finish) ----
    accuracy = {"eval/accuracy": "greedy accuracy on the held-out prompts"}
    checkpoint.finish(args, run, trainers, first, metrics, accuracy)


# TRY NOT TO MODIFY: the loop's plumbing.
def plan_minibatches(sequences: list[tuple], step: int, args: Args) -> list[list[list[dict]]]:
    """The step's (prompt, response, token values) in a seeded shuffle, dealt into --num-minibatches
    minibatches; each gets its loss weights (loss_weights: the aggregation) and is packed for the
    data-parallel groups. Returns shares[rank][minibatch] = that rank's micro-batches (the --sp-size
    ranks of a group get the same share)."""
    seed, k = torch.Generator().manual_seed(args.seed + step), args.num_minibatches
    order = torch.randperm(len(sequences), generator=seed).tolist()
    shares, n = [[] for _ in range(args.num_trainers)], args.num_trainers
    for mini in [[sequences[j] for j in order[i::k]] for i in range(k)]:
        weights = loss_weights([len(v["advantages"]) for *_, v in mini], args)  # |o_i| each
        seqs = [make_sequence(p, r, loss_weights=w, **v) for (p, r, v), w in zip(mini, weights)]
        micros = data.split_for_ranks(seqs, n, args.max_tokens_per_micro_batch, args.sp_size)
        for share, micro in zip(shares, micros):
            share.append(micro)
    return shares


# SETUP AND CHECKS: once, before the loop; bad input stops here with one `error:` line.
def validate_args(args: Args) -> None:
    """Stop with one `error:` line on flags out of their range (declared in Args) or that cannot
    work together; fill the defaults that depend on others. Pure: no files, devices or Ray, so the
    docstring's commands are checked by a test on any machine."""
    check_flags(args)
    lora.check_args(args)
    dp_size = args.dp_size()  # data-parallel groups (each splits rows over SP)
    if (args.prompts_per_step * args.num_generations) % (args.num_minibatches * dp_size):
        raise InputError(
            "--prompts-per-step x --num-generations must divide into --num-minibatches x "
            "data-parallel groups"
        )
    if args.colocate and (args.engine_tp != 1 or args.num_engines != args.num_trainers):
        raise InputError(
            "--colocate pairs engine i with trainer rank i: use --engine-tp 1 and "
            "--num-engines = --num-trainers"
        )
    if not args.teacher and args.teacher_prompt == "same":  # DISTILL (teacher): no signal
        raise InputError("self-distillation's teacher is told the answer: no --teacher-prompt same")
    if args.live_teacher and args.teacher:  # DISTILL (teacher)
        raise InputError("--live-teacher makes the policy its own teacher: drop it or --teacher")
    longest = args.max_prompt_length + args.max_response_length
    if args.max_tokens_per_micro_batch is None:
        args.max_tokens_per_micro_batch = max(512, longest)
    if args.max_tokens_per_micro_batch < longest:
        raise InputError(
            f"--max-tokens-per-micro-batch must fit one prompt + response ({longest} tokens)"
        )


def check_machine(args: Args, script: str) -> tuple[bool, tuple | None]:
    """The checks that need the file system or the machine: the output dir or the run to resume
    (same script and model, a whole checkpoint), the wandb login, the GPUs and the layout (one GPU:
    colocated, which it prints). Returns whether to use GPUs, and (run dir, checkpoint, step) to
    resume or None."""
    resume = checkpoint.check_start(args, script, args.model, args.num_steps)  # or a new run
    apart = args.num_trainers + args.num_engines * args.engine_tp  # GPUs, every actor on its own
    pairs = args.engine_tp == 1 and args.num_engines == args.num_trainers  # engine i: rank i's GPU
    shared = args.num_trainers if pairs else None
    use_gpu, args.colocate = placement.choose_layout(apart, shared, args.colocate)
    args.dtype = choose_dtype(args.dtype, use_gpu)  # bf16; fp16 below compute capability 8
    memory.engine_memory(args, use_gpu)  # GPU: --engine-memory is a fraction, at most 1
    return use_gpu, resume


def prepare_inputs(args: Args, use_gpu: bool) -> tuple:
    """Read and check the data, the reward's terms (two test calls) and the model; plan the GPUs'
    memory; tokenize. Returns (model folder, tokenizer, {split: [Prompt]}, the reward's terms)."""
    terms = reward_terms(reward_fn, args.verifier_weight, args.reward_fn)  # {name: (fn, weight)}
    datasets = {"train": read_prompts(args.dataset, args.dataset_split)}
    if args.eval_dataset:  # held-out prompts: answered
        datasets["eval"] = read_prompts(args.eval_dataset, args.eval_split)
    answer = str(datasets["train"][0][0]["answer"])  # a broken reward function fails now, not later
    pairs = [("", answer), (answer, answer)]
    composed_reward(terms, pairs, "test calls before the run", args.reward_timeout)
    model_path = models.resolve_model(args.model)
    models.check_weights(model_path, "model")
    vlm = vision.check_model(args, model_path, "distill.py")  # DISTILL (teacher): text only
    lora.check_model(args, model_path, args.model)
    entropy = "entropy" in policy_values(args)  # the LM head's chunks: one more
    teacher = models.resolve_model(args.teacher) if args.teacher else None  # DISTILL (teacher)
    start_copy = not args.teacher and not args.live_teacher  # DISTILL (teacher): self-distill's
    memory.check_run(args, use_gpu, model_path, start_copy, entropy=entropy, teacher=teacher)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    processor = vision.processor(model_path, vlm)  # None for a language model
    limits = (args.max_prompt_length, args.drop_long)
    prompts = {
        k: encode_prompts(*rows, tokenizer, *limits, processor) for k, rows in datasets.items()
    }
    check_teacher(args, teacher or model_path, tokenizer, prompts)  # DISTILL (teacher)
    train, source = len(prompts["train"]), datasets["train"][1]
    data.check_batch(args.prompts_per_step, train, "--prompts-per-step", source, "prompts")
    return model_path, tokenizer, prompts, terms


def check_teacher(args: Args, folder: str, tokenizer, prompts: dict) -> None:
    """DISTILL (teacher): the teacher's weights, tokenizer (the student's) and prompts' lengths."""
    models.check_weights(folder, "teacher")
    if args.teacher and AutoTokenizer.from_pretrained(folder).get_vocab() != tokenizer.get_vocab():
        which = f"--teacher {args.teacher}'s tokenizer is not --model {args.model}'s"
        raise InputError(f"{which}: it must score the student's tokens")
    longest = max(len(teacher_prompt(p, tokenizer, args)) for ps in prompts.values() for p in ps)
    if longest > args.max_prompt_length:
        over = f"over --max-prompt-length {args.max_prompt_length}"
        raise InputError(f"the teacher's prompts (with the answer) reach {longest} tokens, {over}")


def start_actors(args: Args, use_gpu: bool, model_path: str, resume: str | None) -> tuple:
    """Start Ray, place the trainers and engines (common/placement.py's Layout), load the policy in
    both (the model, or the checkpoint to resume; π_ref is always the model), and connect them for
    the weight sync. Returns (trainers, engines)."""
    layout = placement.Layout(
        use_gpu, args.num_trainers, args.num_engines, args.engine_tp, args.colocate
    )
    placement.init_ray(len(layout.bundles))
    pg = placement.make_placement_group(layout.bundles, use_gpu)
    policy = resume or model_path
    shell = load_policy, policy, model_path, args  # the loader, what it loads, the start model
    frozen = frozen_models(args)  # the frozen models compute_loss reads (frozen_models)
    trainers = placement.spawn_trainers(Trainer, pg, layout.trainers, *shell, frozen=frozen)
    backend = weight_sync.choose_backend(use_gpu, args.colocate)
    served = model_path if args.lora_rank else policy  # LoRA: the base, the adapters apart
    engines = spawn_engines(pg, layout.engines, args, served, backend, use_gpu, loading=trainers)
    addr, port = placement.rendezvous_address(pg, 0)  # on trainer rank 0's node: the sender
    sync = (args.engine_tp, args.lora_merge_sync)
    call(trainers, "init_weight_sync", engines, backend, addr, port, *sync)
    return trainers, engines


if __name__ == "__main__":
    main(parse_args(Args))
