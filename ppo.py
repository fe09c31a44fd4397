"""PPO for RLHF with a critic and GAE (Ouyang et al. 2022, InstructGPT, arXiv 2203.02155, §3.5;
Ziegler et al. 2019, arXiv 1909.08593; Schulman et al. 2017, arXiv 1707.06347).

Sample responses from the policy π_θ, score each whole response (a rule verifier, or an rm.py reward
model), and turn it into a per-token reward with a KL penalty to the frozen start policy π_ref (k1):
    r_t = -β (log π_θold(o_t) - log π_ref(o_t))  +  [t = last token] · score(q, o)
A critic V_φ (the backbone, a scalar head read at every token) is the baseline; GAE(γ, λ) gives Â:
    δ_t = r_t + γ V(s_t+1) - V(s_t),  Â_t = Σ_l (γλ)^l δ_t+l,  R_t = Â_t + V(s_t),  V = 0 at the end
    L_π = -min(ρ_t Â_t, clip(ρ_t, 1-ε, 1+ε) Â_t)      Â whitened over the batch, ρ_t = π_θ / π_θold
    L_V = ½ max((V_φ - R_t)², (clip(V_φ, V_old - ε_v, V_old + ε_v) - R_t)²)
Policy trainers (with π_ref) and critics are separate FSDP2 actor groups; vLLM engines sample and
get the policy's weights after every step. β is fixed, or adapted toward a target KL.

Run it:
    python ppo.py                                     # built-in model and arithmetic task, CPU/GPU
    python ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset my_prompts.jsonl --eval-dataset "" \\
        --reward-model runs/rm__1__<time>/checkpoints/final --max-response-length 512 \\
        --prompts-per-step 64 --gradient-checkpointing
        # 1 GPU: the hybrid engine (policy, critic, reward model, vLLM share it); 4 GPUs: one each
    python ppo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset openai/gsm8k:main --num-trainers 2 \\
        --num-critics 2 --num-engines 4 --max-response-length 1024 --prompts-per-step 128  # 8 GPUs
"""

import json
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from transformers import AutoConfig, AutoTokenizer
from transformers import AutoModelForSequenceClassification as AutoScoreModel  # the critic

# Setup-only plumbing is called through its module (placement.Layout, checkpoint.save, ...): each
# call says where it lives. The names below are what the math, the updates and the loop use.
from common import checkpoint, data, lora, memory, models, placement, vision, weight_sync
from common.data import Prompt, batch_rows, encode_example, make_sequence, response_values
from common.engines import generate, spawn_engines
from common.errors import InputError
from common.flags import Engines, Experiment, LoRA, Optimization, Resources, check_flags, parse_args
from common.lm_head import token_logprobs
from common.optim import ema_weights
from common.placement import call, wait_all
from common.precision import choose_dtype
from common.prompts import encode_prompts, read_prompts
from common.rewards import composed_reward, reward_terms, score_responses
from common.tracking import Run
from common.trainer import Critic, Trainer, load_model, load_policy
from common.weight_sync import sync_weights


@dataclass
class Args(Optimization, LoRA, Engines, Resources, Experiment):  # common/'s flags come first
    # Model and data
    model: str = models.BUILTIN_MODEL
    """HF hub id, local HF folder, or the built-in offline model"""
    critic_model: str | None = None
    """the critic's start: a causal LM (a new zero head) or an rm.py output (default: --model)"""
    reward_model: str | None = None
    """an rm.py output (one-label classifier, same tokenizer) scoring responses, not the verifier"""
    dataset: str = "data/arithmetic/prompts_train.jsonl"
    """prompts: local .jsonl/.json/.parquet file or folder, or hub id[:config]; `prompt`+`answer` or
    `question`+`answer`"""
    dataset_split: str = "train"
    """split to read when --dataset is a hub id"""
    eval_dataset: str = "data/arithmetic/prompts_test.jsonl"
    """held-out prompts for greedy accuracy with the rule verifier ("" to skip)"""
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
    num_critics: Annotated[int, ">= 1"] = 1
    """FSDP2 critic ranks, a separate actor group (one GPU each on GPU)"""
    colocate: bool = False
    """GPU: the hybrid engine, policy rank i, critic rank i and engine i on GPU i (the reward model
    on GPU 0), vLLM sleeping while the models train (the default when there are too few GPUs)"""

    # Algorithm
    samples_per_prompt: Annotated[int, ">= 1"] = 2
    """responses sampled per prompt (PPO needs no groups; more per prompt reuse its prefill)"""
    temperature: Annotated[float, "> 0"] = 1.0
    """sampling temperature; the trainer scores tokens at the same temperature"""
    top_p: Annotated[float, "> 0, <= 1"] = 1.0
    """nucleus sampling"""
    clip_eps: Annotated[float, "> 0, < 1"] = 0.2
    """ε: PPO clip range of the ratio π_θ / π_θold"""
    is_correction: Literal["none", "tis", "icepop"] = "none"
    """how tokens sampled by vLLM are reweighted: none (classic PPO-RLHF, docs/ppo.md); tis, by
    min(π_θold / π_vllm, C); icepop, by the ratio inside [1/C, C], 0 outside it (compute_loss)"""
    tis_cap: Annotated[float, ">= 1"] = 2.0
    """C: cap of the truncated importance weight (IcePop: its band is [1/C, C])"""
    value_clip_eps: Annotated[float, "> 0"] = 0.2
    """ε_v: a value prediction may move at most this far from V_old before its loss is clipped"""
    gamma: Annotated[float, ">= 0, <= 1"] = 1.0
    """γ: discount per token (1: the whole response counts, as in RLHF practice)"""
    lam: Annotated[float, ">= 0, <= 1"] = 0.95
    """λ: GAE trace decay (1: Monte-Carlo returns minus V, 0: one-step TD)"""
    kl_coef: Annotated[float, ">= 0"] = 0.01
    """β: weight of the k1 KL penalty to the frozen start policy in the per-token reward (the start
    value if adaptive)"""
    kl_target: Annotated[float | None, "> 0"] = None
    """adaptive β (Ziegler et al. 2019 §2.2): target KL per response, nats (None: β stays fixed)"""
    kl_horizon: Annotated[int, ">= 1"] = 10000
    """adaptive β: horizon H in responses; β moves by a factor 1 ± 0.2 · responses / H at most"""
    num_minibatches: Annotated[int, ">= 1"] = 2
    """optimizer steps per rollout batch and epoch, for both the policy and the critic"""
    num_epochs: Annotated[int, ">= 1"] = 1
    """passes over each rollout batch"""

    # Optimization
    num_steps: Annotated[int, ">= 1"] = 12
    """rollout + training steps"""
    prompts_per_step: Annotated[int, ">= 1"] = 8
    """prompts per rollout batch (each sampled --samples-per-prompt times)"""
    max_tokens_per_micro_batch: Annotated[int | None, ">= 1"] = None
    """token budget of one packed micro-batch on one rank (default: 512, or one longest prompt +
    response if more; raise it on GPU); gradients accumulate over micro-batches"""
    learning_rate: Annotated[float, "> 0"] = 2e-5
    """peak learning rate of the policy's AdamW"""
    critic_learning_rate: Annotated[float, "> 0"] = 5e-5
    """peak learning rate of the critic's AdamW (its new value head must move faster)"""


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


# ALGO LOGIC: the critic, the per-token reward, GAE, whitening, the two losses and the adaptive β.
def load_critic(
    path: str, device, gradient_checkpointing: bool, adapters=None, dtype="auto", pad_token_id=None
):
    """V_φ: a sequence classifier with one label (rm.py's class), its head read at every token. From
    a causal LM the head `score` is new: it starts at zero, so V = 0 and the first advantages are
    the whitened returns. From an rm.py output it starts as the reward model (OpenRLHF's default).
    Sharded as every model is (common/trainer.py's load_model); with `adapters` (--lora-rank) its
    own LoRA adapters on its own frozen copy of the base, the head trained whole."""
    model, missing = load_model(
        AutoScoreModel, path, device, gradient_checkpointing, adapters, dtype, num_labels=1
    )
    if model.config.pad_token_id is None:  # HF's own scoring needs it
        if pad_token_id is None:  # the tokenizer's pad token, else EOS
            tokenizer = AutoTokenizer.from_pretrained(path)
            pad_token_id = tokenizer.pad_token_id
            pad_token_id = tokenizer.eos_token_id if pad_token_id is None else pad_token_id
        model.config.pad_token_id = pad_token_id
    resumed = adapters is not None and adapters.resume is not None  # its head came with them
    if any(k.startswith("score.") for k in missing) and not resumed:
        with torch.no_grad():
            model.score.weight.zero_()  # each rank zeroes its shard
    return model


def compute_values(model, input_ids, position_ids, mask) -> torch.Tensor:
    """V_φ(s_t) at every position where mask is 1: (1, T) packed rows -> (N,). The classifier's
    output keeps one score per row; a hook catches the head's at every position. Position t holds
    the state before the response token it predicts, the same positions as compute_logprobs."""
    head_out = []
    hook = model.score.register_forward_hook(lambda module, inputs, out: head_out.append(out))
    try:
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    finally:
        hook.remove()
    return head_out[0][0, :, 0].float()[mask[0].bool()]  # (N,)


def compute_rewards(scores, logprobs, ref_logprobs, response_mask, kl_coef: float):
    """Per-token rewards (B, T), and the k1 KL: -β KL on every response token, plus the response's
    score on its last. scores (B,); logprobs, ref_logprobs, response_mask (B, T), left-aligned."""
    kl = (logprobs - ref_logprobs) * response_mask  # k1: log π_θold - log π_ref, unbiased
    rewards = -kl_coef * kl
    last = response_mask.sum(dim=1).long() - 1  # (B,) index of each response's last token
    rewards[torch.arange(len(scores)), last] += scores
    return rewards, kl


def compute_gae(rewards, values, response_mask, gamma: float, lam: float):
    """Generalized advantage estimation (Schulman et al. 2016) over (B, T) left-aligned responses.

    δ_t = r_t + γ V_t+1 - V_t and Â_t = δ_t + γλ Â_t+1, with V = 0 and Â = 0 past the last real
    token (the response ended: no future reward). Returns advantages and returns R = Â + V, both
    (B, T), zero on padding.
    """
    B, T = rewards.shape
    values = values * response_mask
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros(B)
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros(B)  # already 0 past the end
        next_alive = response_mask[:, t + 1] if t + 1 < T else torch.zeros(B)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_alive * next_advantage
        advantages[:, t] = next_advantage
    advantages = advantages * response_mask
    return advantages, (advantages + values) * response_mask


def masked_whiten(x, mask, eps: float = 1e-8):
    """(x - mean) / std over the masked entries of the whole batch (biased variance); 0 outside."""
    n = mask.sum()
    mean = (x * mask).sum() / n
    var = ((x - mean) ** 2 * mask).sum() / n
    real = x[mask.bool()]
    if (real == real[0]).all():  # all equal: exactly 0, not rounding / sqrt(eps)
        return torch.zeros_like(x)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def explained_variance(values, returns, mask) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens: 1 perfect, 0 a constant critic, < 0 worse."""
    n = mask.sum()
    var = lambda x: (((x - (x * mask).sum() / n) ** 2) * mask).sum() / n  # noqa: E731
    return (1 - var(returns - values) / var(returns)).item() if var(returns) > 0 else float("nan")


def policy_values(args: Args) -> list[str]:
    """The per-token values the policy's own forward gives compute_loss besides log π_θ: "entropy"
    (H_t of π_θ at each response token, from the LM head's chunk loop, logged as train/entropy; a
    loss that uses it, e.g. an entropy bonus -α H_t, gets its gradient too). [] turns it off."""
    return ["entropy"]


def compute_policy_loss(logprobs, old_logprobs, advantages, clip_eps: float):
    """Per-token clipped surrogate (negated: a loss), all (N,); also where the clip was active."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20, 20))  # ρ, finite (inf·0 would be NaN)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    return -torch.min(unclipped, clipped), clipped < unclipped


def compute_value_loss(predicted, old_values, returns, value_clip_eps: float):
    """Per-token clipped value loss ½ max((V - R)², (V_clip - R)²), all (N,); also where the clipped
    term won. V_clip = V_old + clip(V - V_old, -ε_v, ε_v): like the policy's ratio clip, a bound
    that keeps one rollout from moving the critic far (baselines' ppo2; OpenRLHF's ValueLoss)."""
    clipped_values = old_values + (predicted - old_values).clamp(-value_clip_eps, value_clip_eps)
    unclipped_loss, clipped_loss = (predicted - returns) ** 2, (clipped_values - returns) ** 2
    return 0.5 * torch.max(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss


def loss_weights(response_lengths: list[int], args: Args) -> list[list[float]]:
    """Both losses' aggregation over one minibatch: a token mean, L = 1/Σ_i|o_i| Σ_i Σ_t ℓ_it. One
    weight per token, so packed micro-batches on any number of ranks add up to exactly this."""
    total = sum(response_lengths)
    return [[1.0 / total] * length for length in response_lengths]


def importance_weights(old_logprobs, engine_logprobs, args: Args) -> torch.Tensor:
    """Each token's weight for the sampler's mismatch (N,): vLLM sampled the tokens, not π_θold.
    With r_t = π_θold / π_vllm, TIS (Yao et al. 2025) weights by min(r_t, C); IcePop (Ring-1T,
    arXiv 2510.18855) by r_t inside [1/C, C] and 0 outside it (a mask on both sides, not a clip)."""
    ratio = torch.exp(old_logprobs - engine_logprobs)
    if args.is_correction == "icepop":
        return torch.where((ratio >= 1 / args.tis_cap) & (ratio <= args.tis_cap), ratio, 0.0)
    return ratio.clamp(max=args.tis_cap)


def compute_loss(logprobs: torch.Tensor, values: dict, args: Args) -> tuple[torch.Tensor, dict]:
    """The policy's loss on one micro-batch's response tokens, and per-token stats (train/<name>):
        L = Σ_t w_t IS_t · clipped surrogate_t    (w_t: the token mean; IS_t: importance_weights)
    logprobs (N,) are π_θ's; `values` holds the micro-batch's other per-token values, (N,) each:
    old_logprobs (π_θold), advantages (whitened GAE) and loss_weights w_t. approx_kl: the k3
    estimate of KL(π_θold‖π_θ); expm1 keeps it accurate for the tiny ratios of a first update."""
    old = values["old_logprobs"]
    pg_loss, clipped = compute_policy_loss(logprobs, old, values["advantages"], args.clip_eps)
    log_ratio = (logprobs - old).detach()
    approx_kl = torch.expm1(log_ratio) - log_ratio
    # approx_kl: how far the updates moved the policy from π_θold (large: the clip does the work)
    stats = {"clipfrac": clipped.sum(), "approx_kl": approx_kl.sum()}
    if args.is_correction != "none":  # the mean weight; IcePop: the share of tokens it dropped
        weight = importance_weights(old, values["engine_logprobs"], args)
        pg_loss, stats["tis_weight"] = weight * pg_loss, weight.sum()
        if args.is_correction == "icepop":
            stats["icepop_masked"] = (weight == 0).sum()
    return (pg_loss * values["loss_weights"]).sum(), stats


def compute_critic_loss(predicted: torch.Tensor, values: dict, args: Args):
    """The critic's loss on one micro-batch's response tokens: Σ_t w_t · clipped value loss_t, from
    its predictions V_φ (N,) and the micro-batch's old_values, returns, loss_weights, (N,) each."""
    old, returns = values["old_values"], values["returns"]
    v_loss, clipped = compute_value_loss(predicted, old, returns, args.value_clip_eps)
    return (v_loss * values["loss_weights"]).sum(), {"value_clipfrac": clipped.sum()}


def update_kl_coef(kl_coef: float, kl: float, target: float, horizon: int, num_responses: int):
    """Ziegler et al. 2019 §2.2 adaptive β: e_t = clip(KL / KL_target - 1, -0.2, 0.2);
    β ← β (1 + e_t n / H). kl: mean KL per response of this batch (nats, summed over its tokens);
    n: responses in the batch."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    return kl_coef * (1 + error * num_responses / horizon)


# ALGO LOGIC: what each step logs (docs/ppo.md lists every key).
def rollout_metrics(scores, parts: dict, responses: list[dict], values, returns, mask) -> dict:
    """What was sampled and what the critic made of it: scores (and each reward term's), lengths,
    truncations, the mean value and return per response token (critic's guess vs GAE targets)."""
    tokens, lengths = mask.sum(), [len(s["token_ids"]) for s in responses]
    truncated = sum(s["finish_reason"] == "length" for s in responses)
    return {
        "rollout/reward": scores.mean().item(),
        **{f"rollout/reward/{name}": term.mean().item() for name, term in parts.items()},
        "rollout/reward_std": scores.std().item(),
        "rollout/response_length": sum(lengths) / len(lengths),
        "rollout/truncated": truncated / len(responses),
        "rollout/value_mean": ((values * mask).sum() / tokens).item(),
        "rollout/return_mean": ((returns * mask).sum() / tokens).item(),
    }


def train_metrics(policy: list[dict], critic: list[dict], args: Args, values, returns, mask):
    """From both groups' sums (each rank its share of tokens; grad norms and lr are global). Every
    per-token stat of the two updates (their losses', train/entropy) is logged as its mean."""
    total, sums = defaultdict(float), defaultdict(float)
    for rank in [*policy, *critic]:
        for key in ("policy_loss", "value_loss", "tokens"):
            total[key] += rank.get(key, 0.0)
        for key, value in rank["token_sums"].items():
            sums[key] += value
    updates, tokens = args.num_minibatches * args.num_epochs, total["tokens"]
    return {
        "train/policy_loss": total["policy_loss"] / updates,
        "train/value_loss": total["value_loss"] / updates,
        **{f"train/{key}": value / tokens for key, value in sums.items()},
        "train/explained_variance": explained_variance(values, returns, mask),
        "train/grad_norm": policy[0]["grad_norm_sum"] / updates,
        "train/critic_grad_norm": critic[0]["grad_norm_sum"] / updates,
        "train/lr": policy[0]["lr"],
    }


def engine_metrics(engine, logprobs, mask) -> dict:
    """|log π_θold - log π_vllm| per token: what vLLM sampled with against the trainer on the same
    weights (float noise when the weight sync works, far more when the engines serve stale ones)."""
    diff = (logprobs - engine).abs() * mask
    mean, worst = (diff.sum() / mask.sum()).item(), diff.max().item()
    return {"train/logprob_diff_mean": mean, "train/logprob_diff_max": worst}


def time_metrics(times: tuple, generated_tokens: int, trained_tokens: int) -> dict:
    """Seconds per phase (the step's times); throughput (training: the policy's and critic's)."""
    t0, t_gen, t_score, t_fwd, t_train, t_sync = times
    return {
        "time/generate": t_gen - t0,
        "time/score": t_score - t_gen,
        "time/forward": t_fwd - t_score,
        "time/train": t_train - t_fwd,
        "time/sync": t_sync - t_train,
        "time/step": t_sync - t0,
        "perf/generate_tokens_per_s": generated_tokens / (t_gen - t0),
        "perf/train_tokens_per_s": 2 * trained_tokens / (t_train - t_fwd),
    }


# TRY NOT TO MODIFY: the data plumbing the loop and the actor share.
def reward_model_input(tokenizer, prompt, response: str) -> list[int]:
    """The ids a reward model scores, as rm.py trained it (encode_example: the chat template's
    rendering, end-of-turn tokens included); vLLM's own ids stop short of them."""
    return encode_example(tokenizer, prompt, response)[0]


def to_padded(results: list[list[dict]], key: str, lengths: list[int]) -> torch.Tensor:
    """(B, T) left-aligned per-token values from the actors' forward outputs: results[rank], per
    micro-batch, (N,) tensors over the response tokens the rank holds (--sp-size: a row's tokens
    are spread over the SP group), with each one's sequence and place in it, `seq_id` and `tok`."""
    out = torch.zeros(len(lengths), max(lengths))
    for mb in [mb for per_rank in results for mb in per_rank]:
        out[mb["seq_id"].long(), mb["tok"].long()] = mb[key]
    return out


# ALGO LOGIC: the two groups' passes, run on every rank of each (common/trainer.py's shells hold the
# models, π_ref and the optimizers): π_θold, π_ref and V_old, then the two updates.
@torch.no_grad()
def policy_forward(trainer, minibatches: list[list[dict]]) -> list[dict]:
    """π_θold and π_ref logprobs of the response tokens this rank holds, with their place (seq_id,
    tok). Filler micro-batches run too: FSDP's collectives must stay in step."""
    trainer.model.eval()
    out, sampled = [], (trainer.args.temperature, trainer.args.top_p)  # as vLLM sampled
    for mb in [trainer.local_part(mb) for mini in minibatches for mb in mini]:
        inputs = (mb["input_ids"], mb["position_ids"], mb["labels"], mb["loss_mask"])
        logprobs = compute_logprobs(trainer.model, *inputs, *sampled).cpu()
        ref_logprobs = compute_logprobs(trainer.frozen["ref_logprobs"], *inputs, *sampled).cpu()
        if mb["real"].item():  # each token's sequence and place in it, for to_padded
            where = {k: v.cpu() for k, v in response_values(mb, "seq_id", "tok").items()}
            out.append({**where, "logprobs": logprobs, "ref_logprobs": ref_logprobs})
    return out


def train_step(trainer, minibatches: list[list[dict]], step: int) -> dict:
    """num_epochs passes, an optimizer step per minibatch of micro-batches. Returns sums."""
    args, model = trainer.args, trainer.model
    stats, sums = defaultdict(float), defaultdict(float)  # sums: per-token stats, train/<name>
    sampled = (args.temperature, args.top_p)  # the distribution vLLM sampled from
    # With --sp-size k this rank holds 2 of each row's 2k zigzag chunks; a token is on one rank
    minibatches = [[trainer.local_part(mb) for mb in mini] for mini in minibatches]
    model.train()
    for _ in range(args.num_epochs):
        for mini in minibatches:
            for i, mb in enumerate(mini):
                model.set_requires_gradient_sync(i == len(mini) - 1)
                inputs = (mb["input_ids"], mb["position_ids"], mb["labels"], mb["loss_mask"])
                values = response_values(mb)
                entropy = "entropy" in policy_values(args)  # H_t, from the same forward
                logprobs = compute_logprobs(model, *inputs, *sampled, entropy=entropy)
                if entropy:  # a pair: (N,) log π_θ and (N,) H_t
                    logprobs, values["entropy"] = logprobs
                loss, token_stats = compute_loss(logprobs, values, args)
                real = mb["real"].item()  # 0: a filler micro-batch (ranks in lock-step)
                loss = loss * mb["real"]
                # FSDP averages over ranks: undo it; float16: × the loss scale S
                trainer.scaler.backward(loss * trainer.world_size)
                stats["policy_loss"] += loss.item()
                stats["tokens"] += len(logprobs) * real
                if "entropy" in values:  # falling fast: entropy collapse
                    token_stats["entropy"] = values["entropy"].sum()
                for key, value in token_stats.items():
                    sums[key] += value.item() * real
            stats["grad_norm_sum"] += trainer.optimizer_step(step)
    stats["lr"] = trainer.lr
    return {**stats, "token_sums": dict(sums)}


@torch.no_grad()
def critic_forward(critic, minibatches: list[list[dict]]) -> list[dict]:
    """V_old of every response token this rank holds, with its place (seq_id, tok), for GAE."""
    critic.on_gpu(True)
    critic.model.eval()
    out = []
    for mb in [critic.local_part(mb) for mini in minibatches for mb in mini]:
        inputs = (mb["input_ids"], mb["position_ids"], mb["loss_mask"])
        predicted = compute_values(critic.model, *inputs)
        if mb["real"].item():  # each token's sequence and place in it, for to_padded
            where = {k: v.cpu() for k, v in response_values(mb, "seq_id", "tok").items()}
            out.append({**where, "values": predicted.cpu()})
    critic.on_gpu(False)
    return out


def critic_train_step(critic, minibatches: list[list[dict]], step: int) -> dict:
    """Regress V_φ on the GAE returns: the policy's minibatches and epochs. Returns sums."""
    args, model, stats, sums = critic.args, critic.model, defaultdict(float), defaultdict(float)
    critic.on_gpu(True)
    minibatches = [[critic.local_part(mb) for mb in mini] for mini in minibatches]
    model.train()
    for _ in range(args.num_epochs):
        for mini in minibatches:
            for i, mb in enumerate(mini):
                model.set_requires_gradient_sync(i == len(mini) - 1)
                inputs = (mb["input_ids"], mb["position_ids"], mb["loss_mask"])
                predicted = compute_values(model, *inputs)
                loss, token_stats = compute_critic_loss(predicted, response_values(mb), args)
                loss = loss * mb["real"]  # 0 for a filler micro-batch
                critic.scaler.backward(loss * critic.world_size)
                stats["value_loss"] += loss.item()
                for key, value in token_stats.items():
                    sums[key] += value.item() * mb["real"].item()
            stats["grad_norm_sum"] += critic.optimizer_step(step)
    critic.on_gpu(False)
    return {**stats, "token_sums": dict(sums)}


def main(args: Args):
    # ---- check everything cheap, then start Ray and the actors (SETUP AND CHECKS below) ----
    validate_args(args)
    n = args.samples_per_prompt
    use_gpu, resume = check_machine(args, os.path.basename(__file__))
    run_dir, resume_ckpt, resume_step = resume or (None, None, 0)
    paths, tokenizer, prompts, terms, offload = prepare_inputs(args, use_gpu, resume_ckpt)
    trainers, critics, reward_model, engines = start_actors(args, use_gpu, paths, offload)
    kl_coef = args.kl_coef
    if args.resume:
        call(trainers, "load_optimizer", resume_ckpt)
        call(critics, "load_optimizer", paths["critic"])
        with open(os.path.join(resume_ckpt, "ppo_state.json")) as f:
            kl_coef = json.load(f)["kl_coef"]
    run = Run(args, run_dir, resume_step, args.num_steps)
    reward = f"reward model {args.reward_model}" if args.reward_model else "rule verifier"
    what = f"prompts: {len(prompts['train'])}  reward: {reward}"
    run.print(f"run dir: {run.dir}  model: {args.model}  {what}")
    sampling = dict(top_p=args.top_p, max_tokens=args.max_response_length, seed=args.seed)
    timeout = args.reward_timeout  # seconds one reward call may take

    @ema_weights(trainers, lambda: sync_weights(trainers, engines, colocated=False), args.eval_ema)
    def evaluate(step: int) -> dict:
        if "eval" not in prompts:
            return {}
        ids, where = [p.ids for p in prompts["eval"]], f"eval at step {step}"
        outs = generate(engines, ids, n=1, temperature=0.0, **sampling)  # greedy
        _, _, parts = score_responses(terms, prompts["eval"], outs, tokenizer, where, timeout)
        return {"eval/accuracy": parts["verifier"].mean().item()}  # the verifier's alone

    def save(step: int, name: str | None = None, with_optimizer: bool = True):
        """A checkpoint, whole or absent: the policy, and to resume, the critic and adaptive β."""
        with checkpoint.staged(run.checkpoint_dir(name or step), step) as folder:
            call(trainers, "save", folder, step, with_optimizer=with_optimizer)
            if with_optimizer:
                call(critics, "save", os.path.join(folder, "critic"), step)
                checkpoint.write_json(os.path.join(folder, "ppo_state.json"), {"kl_coef": kl_coef})

    # ---- training loop: generate -> score -> π_θold, π_ref, V_old -> rewards, GAE -> train ----
    # the console line: the reward, the losses and every per-token stat of the updates, eval, time
    quiet = ("train/kl_coef", "train/explained_variance", "train/grad_norm", "train/lr")
    quiet += ("train/critic_grad_norm", "train/logprob_diff_mean", "train/logprob_diff_max")
    first = evaluate(0) if resume_step == 0 else {}
    if first:
        run.log(0, first, ("eval/accuracy",))
    train = prompts["train"]
    for step in range(resume_step, args.num_steps):
        t0 = time.time()
        batch = [train[i] for i in batch_rows(step, len(train), args.prompts_per_step, args.seed)]
        ids, where = [p.ids for p in batch], f"step {step + 1}"
        outs = generate(engines, ids, n=n, temperature=args.temperature, draw=step, **sampling)
        if args.colocate:
            call(engines, "sleep")  # free the GPUs for training
        t_gen = time.time()

        # ALGO LOGIC: one scalar score r(x, y) per response, from the verifier or the reward model
        responses = [s for group in outs for s in group]  # (B,) prompt-major, B = prompts x samples
        texts = [tokenizer.decode(s["token_ids"], skip_special_tokens=True) for s in responses]
        if reward_model is not None:
            asked = [batch[i // n].text for i in range(len(texts))]
            full = [reward_model_input(tokenizer, q, t) for q, t in zip(asked, texts)]
            scores, parts = torch.tensor(call([reward_model], "rewards", full)[0]), {}  # (B,)
        else:
            _, scores, parts = score_responses(terms, batch, outs, tokenizer, where, timeout)
        t_score = time.time()

        # ALGO LOGIC: π_θold, π_ref and V_old on every response token (no grad), then the per-token
        # rewards, GAE and whitening; both groups then train on the same micro-batches
        lengths = [len(s["token_ids"]) for s in responses]
        shares = plan_minibatches(batch, responses, step, args)  # packed once, for both passes
        apart = use_gpu and not args.colocate  # on GPUs of their own: side by side
        policy_out, critic_out = call_groups(
            trainers, critics, (policy_forward, critic_forward), shares, parallel=apart
        )
        logprobs = to_padded(policy_out, "logprobs", lengths)  # (B, T)
        ref_logprobs = to_padded(policy_out, "ref_logprobs", lengths)
        values = to_padded(critic_out, "values", lengths)
        mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).float()  # (B, T)
        rewards, kl = compute_rewards(scores, logprobs, ref_logprobs, mask, kl_coef)
        advantages, returns = compute_gae(rewards, values, mask, args.gamma, args.lam)
        advantages = masked_whiten(advantages, mask)
        engine = torch.zeros_like(logprobs)  # log π_vllm, as sampled: for --is-correction
        for i, sample in enumerate(responses):
            engine[i, : len(sample["logprobs"])] = torch.tensor(sample["logprobs"])
        fill_token_values(
            shares,
            advantages=advantages,
            returns=returns,
            old_logprobs=logprobs,
            old_values=values,
            engine_logprobs=engine,
        )
        t_fwd = time.time()

        results = call_groups(
            trainers, critics, (train_step, critic_train_step), shares, step, parallel=apart
        )
        t_train = time.time()

        # wake (colocated), push, check the engines serve the new weights (common/weight_sync.py)
        synced = sync_weights(trainers, engines, args.colocate)
        t_sync = time.time()

        # ALGO LOGIC: adapt β toward the target KL per response (Ziegler et al. 2019)
        kl_per_response = kl.sum(dim=1).mean().item()
        metrics = {"train/kl_coef": kl_coef, "train/kl": kl_per_response}
        if args.kl_target is not None:
            target, horizon = args.kl_target, args.kl_horizon
            kl_coef = update_kl_coef(kl_coef, kl_per_response, target, horizon, len(responses))

        # ---- log ----
        times = (t0, t_gen, t_score, t_fwd, t_train, t_sync)
        trained = args.num_epochs * sum(len(batch[i // n].ids) + k for i, k in enumerate(lengths))
        metrics |= {
            **rollout_metrics(scores, parts, responses, values, returns, mask),
            **train_metrics(*results, args, values, returns, mask),
            **engine_metrics(engine, logprobs, mask),
            **time_metrics(times, sum(lengths), trained),
            **synced,  # perf/sync_*: bytes, the probe's gap, seconds waking, sending, probing
        }
        done = step + 1
        if done % args.eval_every == 0 or done == args.num_steps:
            metrics.update(evaluate(done))
        update = [k for k in metrics if k.startswith("train/") and k not in quiet]
        run.log(done, metrics, ("rollout/reward", *update, "eval/accuracy", "time/step"))
        rows = [
            {
                "prompt": batch[i // n].text,
                "response": texts[i],
                "answer": batch[i // n].answer,
                "reward": scores[i].item(),
            }
            for i in range(min(len(texts), 2 * n))
        ]
        run.log_samples(done, rows)
        checkpoint.keep_best(args, run, metrics, done, trainers)  # --best-metric
        if args.save_every and done % args.save_every == 0 and done < args.num_steps:
            save(done)

    # ---- teardown: the final policy in HF format, the accuracy line (checkpoint.finish) ----
    accuracy = {"eval/accuracy": "greedy accuracy on the held-out prompts"}
    checkpoint.finish(args, run, trainers, first, metrics, accuracy, save)


# TRY NOT TO MODIFY: the loop's plumbing.
def call_groups(trainers: list, critics: list, fns: tuple, shares: tuple, *args, parallel: bool):
    """fns[0] on the policy group, fns[1] on the critic group, each rank with its share: side by
    side on GPUs of their own, one after the other sharing GPUs (the hybrid engine) or CPU cores."""
    if not parallel:
        policy = call(trainers, fns[0], *args, per_rank=shares[0])
        return policy, call(critics, fns[1], *args, per_rank=shares[1])
    refs = [a.run.remote(fns[0], s, *args) for a, s in zip(trainers, shares[0])]
    refs += [a.run.remote(fns[1], s, *args) for a, s in zip(critics, shares[1])]
    names = placement.actor_names(trainers) + placement.actor_names(critics)
    out = wait_all(refs, names, fns[0].__name__)
    return out[: len(trainers)], out[len(trainers) :]


def plan_minibatches(batch: list[Prompt], responses: list[dict], step: int, args: Args) -> tuple:
    """The step's sequences, packed once: the forward passes (π_θold, π_ref, V_old) and the training
    passes run on the same micro-batches. Responses, shuffled (seeded), are dealt into minibatches,
    each token weighted by loss_weights, packed for each group's ranks: shares[group][rank][mini]
    (0: policy, 1: critic); each response token carries (seq_id, tok) for fill_token_values."""
    n, lengths = args.samples_per_prompt, [len(s["token_ids"]) for s in responses]
    seed = torch.Generator().manual_seed(args.seed + step)
    order = torch.randperm(len(responses), generator=seed).tolist()
    sizes = (args.num_trainers, args.num_critics)
    shares = ([[] for _ in range(sizes[0])], [[] for _ in range(sizes[1])])
    for mini in [order[k :: args.num_minibatches] for k in range(args.num_minibatches)]:
        weights = loss_weights([lengths[i] for i in mini], args)
        seqs = [
            make_sequence(
                batch[i // n].ids,
                responses[i]["token_ids"],
                seq_id=[i] * lengths[i],
                tok=range(lengths[i]),
                loss_weights=w,
            )
            for i, w in zip(mini, weights)
        ]
        for size, share in zip(sizes, shares):
            micros = data.split_for_ranks(seqs, size, args.max_tokens_per_micro_batch, args.sp_size)
            for rank, micro in enumerate(micros):
                share[rank].append(micro)
    return shares


def fill_token_values(shares: tuple, **values: torch.Tensor) -> None:
    """Write per-token values (B, T) into every micro-batch at its response tokens (seq_id, tok)."""
    unique = {id(mb): mb for group in shares for rank in group for mini in rank for mb in mini}
    for mb in unique.values():  # an SP group's ranks share their micro-batches
        m = mb["loss_mask"][0].bool()
        seq_id, tok = mb["seq_id"][0, m].long(), mb["tok"][0, m].long()
        for key, v in values.items():
            mb[key] = torch.zeros_like(mb["loss_weights"])
            mb[key][0, m] = v[seq_id, tok]


# SETUP AND CHECKS: once, before the loop; bad input stops here with one `error:` line.
def validate_args(args: Args) -> None:
    """Stop with one `error:` line on flags out of their range (declared in Args) or that cannot
    work together; fill the defaults that depend on others. Pure: no files, devices or Ray, so the
    docstring's commands are checked by a test on any machine."""
    check_flags(args)
    lora.check_args(args)
    if args.num_trainers % args.sp_size or args.num_critics % args.sp_size:
        raise InputError(
            f"--num-trainers and --num-critics must be multiples of --sp-size {args.sp_size}"
        )
    dp_sizes = (args.num_trainers // args.sp_size, args.num_critics // args.sp_size)  # data shards
    if (args.prompts_per_step * args.samples_per_prompt) % (args.num_minibatches * max(dp_sizes)):
        raise InputError(
            "--prompts-per-step x --samples-per-prompt must divide into --num-minibatches x "
            "data-parallel groups"
        )
    same = args.num_engines == args.num_critics == args.num_trainers
    if args.colocate and (args.engine_tp != 1 or not same):
        raise InputError(
            "--colocate puts policy rank i, critic rank i and engine i on GPU i: use --engine-tp 1 "
            "and --num-engines = --num-critics = --num-trainers"
        )
    if args.reward_model and (args.reward_fn or args.verifier_weight != 1):
        raise InputError(
            "--reward-fn and --verifier-weight make the rule reward; with "
            "--reward-model the reward model's score is the reward"
        )
    longest = args.max_prompt_length + args.max_response_length
    if args.max_tokens_per_micro_batch is None:
        args.max_tokens_per_micro_batch = max(512, longest)
    if args.max_tokens_per_micro_batch < longest:
        raise InputError(
            f"--max-tokens-per-micro-batch must fit one prompt + response ({longest} tokens)"
        )


def check_machine(args: Args, script: str) -> tuple[bool, tuple | None]:
    """The checks that need the file system or the machine: the output dir or the run to resume
    (whole checkpoints of the policy and the critic), the wandb login, the GPUs and the layout (too
    few: the hybrid engine). Returns whether to use GPUs and (run dir, checkpoint, step) or None."""
    resume = checkpoint.check_start(args, script, args.model, args.num_steps)  # or a new run
    if resume:  # the critic and β resume too
        checkpoint.check(os.path.join(resume[1], "critic"))
        if not os.path.isfile(os.path.join(resume[1], "ppo_state.json")):
            raise InputError(f"--resume: {resume[1]} has no ppo_state.json (the adaptive β)")
    rm = int(args.reward_model is not None)
    apart = args.num_trainers + args.num_critics + rm + args.num_engines * args.engine_tp
    # Hybrid engine: policy rank i, critic rank i and engine i share GPU i (the reward model GPU 0)
    same = args.engine_tp == 1 and args.num_engines == args.num_critics == args.num_trainers
    shared = args.num_trainers if same else None
    use_gpu, args.colocate = placement.choose_layout(apart, shared, args.colocate)
    args.dtype = choose_dtype(args.dtype, use_gpu)  # bf16; fp16 below compute capability 8
    memory.engine_memory(args, use_gpu)  # GPU: --engine-memory is a fraction, at most 1
    return use_gpu, resume


def prepare_inputs(args: Args, use_gpu: bool, resume_ckpt: str | None) -> tuple:
    """Read and check the data, the reward (the function's two test calls, or the reward model) and
    the models; plan the GPUs' memory; tokenize. Returns ({role: model folder}, tokenizer, {split:
    [Prompt]}, reward function, whether idle models wait in host RAM)."""
    terms = reward_terms(reward_fn, args.verifier_weight, args.reward_fn)  # {name: (fn, weight)}
    datasets = {"train": read_prompts(args.dataset, args.dataset_split, args.reward_model is None)}
    if args.eval_dataset:  # held-out prompts: answered
        datasets["eval"] = read_prompts(args.eval_dataset, args.eval_split)
    reward_model_path = None
    if args.reward_model is not None:
        reward_model_path = models.resolve_model(args.reward_model)
        models.check_weights(reward_model_path, "--reward-model")
        if AutoConfig.from_pretrained(reward_model_path).num_labels != 1:
            raise InputError(f"--reward-model {args.reward_model}: not one label (an rm.py output)")
    else:  # a broken reward function fails now, not after a rollout
        answer = str(datasets["train"][0][0]["answer"])
        pairs = [("", answer), (answer, answer)]
        composed_reward(terms, pairs, "test calls before the run", args.reward_timeout)
    model_path = models.resolve_model(args.model)
    models.check_weights(model_path, "model")
    vision.check_model(args, model_path, "ppo.py")  # a language model: no pictures here
    critic_path = models.resolve_model(args.critic_model) if args.critic_model else model_path
    models.check_weights(critic_path, "--critic-model")
    lora.check_model(args, model_path, args.model)
    lora.check_model(args, critic_path, args.critic_model or args.model)
    # a run that cannot fit stops here; colocated, the critic and reward model may wait in host RAM
    entropy = "entropy" in policy_values(args)  # the LM head's chunks: one more
    folders = model_path, True, critic_path, reward_model_path  # True: π_ref too
    offload = memory.check_run(args, use_gpu, *folders, entropy=entropy)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    limits = (args.max_prompt_length, args.drop_long)
    prompts = {k: encode_prompts(*rows, tokenizer, *limits) for k, rows in datasets.items()}
    train, source = len(prompts["train"]), datasets["train"][1]
    data.check_batch(args.prompts_per_step, train, "--prompts-per-step", source, "prompts")
    paths = {
        "policy": resume_ckpt or model_path,
        "reference": model_path,
        "critic_start": critic_path,
        "reward_model": reward_model_path,
    }
    paths["critic"] = os.path.join(resume_ckpt, "critic") if resume_ckpt else critic_path
    return paths, tokenizer, prompts, terms, offload


def start_actors(args: Args, use_gpu: bool, paths: dict, offload: bool) -> tuple:
    """Start Ray; place (placement.Layout) and start the policy trainers, critics, reward model (if
    any) and engines; connect trainers and engines for the weight sync. `paths`: where each loads
    from (--resume: the checkpoint; π_ref: the start model). `offload`: the memory plan's choice."""
    rm = args.reward_model is not None
    sizes = (args.num_trainers, args.num_engines, args.engine_tp, args.colocate, args.num_critics)
    layout = placement.Layout(use_gpu, *sizes, rm)
    placement.init_ray(len(layout.bundles))
    pg = placement.make_placement_group(layout.bundles, use_gpu)
    policy = load_policy, paths["policy"], paths["reference"], args  # loader, what, start model
    trainers = placement.spawn_trainers(
        Trainer, pg, layout.trainers, *policy, frozen=["ref_logprobs"]
    )
    critic = load_critic, paths["critic"], paths["critic_start"], args  # the score head whole
    lr = args.critic_learning_rate  # its own optimizer
    critics = placement.spawn_trainers(
        Critic, pg, layout.critics, *critic, whole=["score"], learning_rate=lr, offload=offload
    )
    reward_model = None
    if rm:
        reward_model = models.RewardModel.options(**layout.reward_model.options(pg)).remote(
            paths["reward_model"], offload, args.dtype
        )
    backend = weight_sync.choose_backend(use_gpu, args.colocate)
    served = paths["reference" if args.lora_rank else "policy"]  # LoRA: the base, adapters apart
    loading = [*trainers, *critics, *([reward_model] if rm else [])]  # they load meanwhile
    engines = spawn_engines(pg, layout.engines, args, served, backend, use_gpu, loading=loading)
    addr, port = placement.rendezvous_address(pg, 0)  # on trainer rank 0's node: the sender
    sync = (args.engine_tp, args.lora_merge_sync)
    call(trainers, "init_weight_sync", engines, backend, addr, port, *sync)
    return trainers, critics, reward_model, engines


if __name__ == "__main__":
    main(parse_args(Args))
