"""GRPO with tools (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300): episodes the model acts in.

For every prompt q, sample a group of G responses o_1..o_G from the current policy, score them with
a rule verifier, and use the group itself as the baseline (no value network):
    Â_i = (r_i - mean(r_1..r_G)) / std(r_1..r_G)              the same for every token of o_i
    J(θ) = 1/G Σ_i 1/|o_i| Σ_t [ min(ρ_it Â_i, clip(ρ_it, 1-ε, 1+ε) Â_i) - β KL_k3(π_θ || π_ref) ],
    ρ_it = π_θ(o_it | q, o_i,<t) / π_θold(o_it | q, o_i,<t)
Responses are sampled by vLLM engines (Ray actors) whose numerics differ slightly from the
trainer's; truncated importance sampling (TIS, Yao et al. 2025) reweights each token by min(π_θold /
π_vllm, C). After every step the trainers push their weights to the engines through vLLM's
weight-transfer API.
A response is an episode: the policy samples until its turn ends or calls the tool, whose output
comes back as a tool turn (in the chat template), up to --max-turns; one token list that only grows,
as vLLM sampled it, never re-encoded. o_i is the sampled tokens: tool turns are context only.
The built-in model rarely calls a tool by itself: warm-start it on transcripts first,
    python sft.py --dataset data/multiply/sft_train.jsonl --eval-dataset "" --accuracy-dataset "" \\
        --num-steps 5 --warmup-steps 1 --output-dir runs/multiply-sft

Run it:
    python grpo_tools.py --model runs/multiply-sft/sft__1__*/checkpoints/final   # a × b, calculator
    python grpo_tools.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k:main \\
        --eval-dataset openai/gsm8k:main --max-response-length 512 --prompts-per-step 64 \\
        --gradient-checkpointing --tool python --tool-format hermes    # 1 GPU: shared with vLLM
    python grpo_tools.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset openai/gsm8k:main \\
        --num-trainers 4 --num-engines 4 --max-response-length 1024 \\
        --prompts-per-step 128 --tool python --tool-format hermes   # 8 GPUs: 4 train, 4 generate
"""

import json  # TOOLS: Hermes' calls
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
from common import checkpoint, data, isolate, lora, memory, models, placement, vision, weight_sync
from common.data import batch_rows, make_sequence, response_values
from common.engines import generate, spawn_engines
from common.errors import InputError, RunError  # TOOLS: RunError
from common.flags import Engines, Experiment, LoRA, Optimization, Resources, check_flags, parse_args
from common.lm_head import token_logprobs
from common.optim import ema_weights
from common.placement import call
from common.precision import choose_dtype
from common.prompts import encode_prompts, read_prompts
from common.rewards import composed_reward, reward_terms, score_responses
from common.tools import Episode, calculator, call_tools, clip_output, tool_turn  # TOOLS: the tools
from common.tracking import Run
from common.trainer import Trainer, load_policy
from common.weight_sync import sync_weights


@dataclass
class Args(Optimization, LoRA, Engines, Resources, Experiment):  # common/'s flags come first
    # Model and data
    model: str = models.BUILTIN_MODEL
    """HF hub id, local HF folder, or the built-in offline model"""
    dataset: str = "data/multiply/prompts_train.jsonl"  # TOOLS: a task where the tool matters
    """prompts: local .jsonl/.json/.parquet file or folder, or hub id[:config]; `prompt`+`answer` or
    `question`+`answer`"""
    dataset_split: str = "train"
    """split to read when --dataset is a hub id"""
    eval_dataset: str = "data/multiply/prompts_test.jsonl"  # TOOLS: its held-out quarter
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
    max_response_length: Annotated[int, ">= 1"] = 64  # TOOLS: the whole episode's
    """longest episode after the prompt in tokens: every turn's, and every tool turn"""
    drop_long: bool = False
    """drop prompts longer than --max-prompt-length instead of stopping with an error"""

    # Tools (TOOLS)
    tool: str = "calc"
    """the tool: `calc` (arithmetic), `python` (a program, in common/sandbox.py's sandbox) or
    `path/to/file.py:function` (str -> str; its docstring's first line tells the model of it)"""
    tool_format: Literal["tags", "hermes"] = "tags"
    """how the model calls it: `<calc>47*86</calc>` (tag: the tool's name) or Hermes' JSON (Qwen)"""
    max_turns: Annotated[int, ">= 1"] = 3
    """assistant turns per episode, at most (a tool call and its output between two)"""
    tool_timeout: Annotated[float, "> 0"] = 5.0
    """seconds one tool call may take; a slower call's output says so, and the episode goes on"""
    max_tool_output: Annotated[int, ">= 1"] = 200
    """characters of a tool's output the model reads (the rest is cut)"""
    sandbox: Literal["auto", "strict"] = "auto"
    """--tool python: `strict` starts only if the sandbox holds every guarantee; `auto`: any"""

    # Resources (and common/flags.py's: --num-trainers, --num-engines, ...)
    colocate: bool = False
    """GPU: trainer rank i and engine i share GPU i, vLLM sleeping while the trainers train (the
    default when there are too few GPUs to give each its own)"""

    # Algorithm
    num_generations: Annotated[int, ">= 2"] = 8
    """G: responses sampled per prompt (the group: at least 2, it is the baseline)"""
    temperature: Annotated[float, "> 0"] = 1.0
    """sampling temperature; the trainer scores tokens at the same temperature"""
    top_p: Annotated[float, "> 0, <= 1"] = 1.0
    """nucleus sampling"""
    clip_eps: Annotated[float, "> 0, < 1"] = 0.2
    """ε: PPO clip range of the ratio π_θ / π_θold"""
    kl_coef: Annotated[float, ">= 0"] = 0.0
    """β: weight of the k3 KL to the frozen reference model (0: no reference model is loaded)"""
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


# ALGO LOGIC: the environment (TOOLS: what the model is told, how its calls are read, the tools).
SYSTEM_PROMPT = {  # TOOLS: {name}, {about}: the tool's; {schema}: its JSON description
    "tags": "You can use a tool, {name}: {about}. To call it, write <{name}>input</{name}>. Its "
    "output comes back in the next message. Then give the final answer.",
    "hermes": "# Tools\n\nYou can call this function:\n<tools>\n{schema}\n</tools>\n\nTo call it, "
    'write <tool_call>\n{{"name": "{name}", "arguments": {{"input": "..."}}}}\n</tool_call>. Its '
    "output comes back in the next message. Then give the final answer.",
}
STOP = {"tags": "</{name}>", "hermes": "</tool_call>"}  # TOOLS: a call ends the model's turn


def parse_call(text: str, name: str, form: str) -> str | None:  # TOOLS: edit for your format
    """A turn's tool call: the tool's input, or None (the turn is an answer). `tags`: the first
    <name>...</name>; `hermes`: <tool_call>{"name": name, "arguments": {"input": ..}}</tool_call>"""
    if form == "tags":
        match = re.search(rf"<{name}>(.*?)</{name}>", text, re.S)
        return match.group(1).strip() if match else None
    try:
        call = json.loads(re.search(r"<tool_call>(.*?)</tool_call>", text, re.S).group(1))
        return str(call["arguments"]["input"]) if call["name"] == name else None
    except (AttributeError, TypeError, KeyError, ValueError):  # no call, or not one of this form
        return None


def run_episodes(engines, ids: list, n: int, tool, tokenizer, args, sampling, draw=None) -> list:
    """The loop: n episodes per prompt (token ids), grouped as generate's samples, seeded by `draw`
    (None: greedy). Episode e samples on engine e % engines (whose prefix cache holds it), each turn
    until the turn ends or calls the tool, up to --max-turns turns and --max-response-length tokens
    in all; its "text" is the Episode the reward terms read."""
    (name, _, fn), limit, eos = tool, args.max_response_length, tokenizer.eos_token_id
    stop = STOP[args.tool_format].format(name=name)
    counts = dict(turns=0, tool_calls=0, tool_errors=0, tool_tokens=0)
    episodes = [dict(ids=list(p), start=len(p), **counts) for p in ids for _ in range(n)]
    for episode in episodes:  # what each turn appends to
        episode.update(trained=[], logprobs=[], messages=[])
    live, temperature = list(range(len(episodes))), 0.0 if draw is None else args.temperature
    sampling = sampling | dict(n=1, temperature=temperature, stop=[stop])
    for turn in range(args.max_turns):
        sent = [list(episodes[e]["ids"]) for e in live]
        room = [limit + episodes[e]["start"] - len(p) for e, p in zip(live, sent)]  # tokens left
        seeds = dict(draw=None if draw is None else f"{draw}/{turn}", index=live)  # a seed a turn
        outs = generate(engines, sent, **sampling | dict(max_tokens=room), **seeds)
        going, calls = [], []
        for e, prompt, left, (s,) in zip(live, sent, room, outs):
            episode, sampled = episodes[e], s["token_ids"]
            if s["prompt_ids"] != prompt:  # vLLM read other tokens than the episode holds
                why = "the engine's prompt differs from the episode's tokens"
                raise RunError(f"episode {e + 1}, turn {turn + 1}: {why} (prompt, sampled, tool)")
            episode["ids"] += sampled  # exactly what vLLM sampled, with its log-probabilities
            episode["trained"] += [1] * len(sampled)
            episode["logprobs"] += s["logprobs"]
            episode.update(final=sampled, finish_reason=s["finish_reason"], turns=turn + 1)
            text = tokenizer.decode(sampled, skip_special_tokens=True)
            episode["messages"].append({"role": "assistant", "content": text})
            call = parse_call(text, name, args.tool_format)
            cut = s["finish_reason"] == "length" and stop.replace("/", "", 1) in text  # begun
            episode["ended_on_call"] = call is not None or cut  # no answer: scored 0
            if call is None or s["finish_reason"] == "length" or turn + 1 == args.max_turns:
                continue
            calls.append((e, call, left - len(sampled)))
        at_once = args.tool == "python"  # the sandbox's calls together, a core each
        outputs = call_tools(fn, [c for _, c, _ in calls], args.tool_timeout + 1, at_once)
        for (e, _, left), output in zip(calls, outputs):
            episode, (output, failed) = episodes[e], clip_output(output, args.max_tool_output)
            episode["tool_calls"] += 1
            episode["messages"].append({"role": "tool", "content": output})
            episode["tool_errors"] += failed
            # the turn's end (EOS, unless a stop string ended it) and the tool turn: context only
            glue = [eos] * (episode["final"][-1:] != [eos]) + tool_turn(tokenizer, output)
            if len(glue) >= left:  # no room left for an answer
                episode["finish_reason"] = "length"
                continue
            episode["ids"] += glue
            episode["trained"] += [0] * len(glue)
            episode["tool_tokens"] += len(glue)
            going.append(e)
        if not (live := going):
            break
    for episode in episodes:  # what the reward terms read (the answer, the episode), the tokens
        episode.update(text=Episode(episode), token_ids=episode["ids"][episode["start"] :])
    return [episodes[i : i + n] for i in range(0, len(episodes), n)]


# ALGO LOGIC: the advantages, which groups to train on, the loss and how it is aggregated.
def compute_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages: (B*G,) rewards, grouped by prompt -> (B*G,) Â_i = (r_i - mean) /
    (std + eps). A group whose rewards are all equal gets zero advantage: it carries no learning
    signal.
    """
    r = rewards.view(-1, group_size)  # (B, G)
    advantages = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)
    # Exactly 0 for an all-equal group: in fp32 its mean can be an ulp off, and std ≈ 0 magnifies it
    return torch.where((r == r[:, :1]).all(dim=1, keepdim=True), 0.0, advantages).view(-1)


def keep_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups to train on, (B,) bool. GRPO keeps them all (an all-equal group has Â = 0)."""
    return torch.ones(rewards.numel() // group_size, dtype=torch.bool)


def frozen_models(args: Args) -> list[str]:
    """The frozen copies of the starting model that the trainers hold, each named by the per-token
    values it gives compute_loss: π_ref's log-probabilities, only for the KL term."""
    return ["ref_logprobs"] if args.kl_coef > 0 else []


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


def compute_kl(logprobs, ref_logprobs):
    """k3 estimator of KL(π_θ || π_ref) per token (Schulman 2020): e^(r - lp) - (r - lp) - 1 ≥ 0,
    with r the reference's log-probability and lp the policy's."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


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
        L = Σ_t w_t [ IS_t · clipped surrogate_t  +  β KL_k3,t ]
    logprobs (N,) are π_θ's; `values` holds the micro-batch's other per-token values, (N,) each:
    those the loop gave make_sequence (advantages, engine_logprobs), the aggregation's loss_weights
    w_t, old_logprobs (π_θold) and, with a reference, ref_logprobs. TIS: the tokens were sampled by
    vLLM, whose numerics differ from the trainer's, not by π_θold itself; each token is reweighted
    by IS_t, its likelihood ratio capped (TIS) or masked (IcePop): importance_weights.
    """
    old = values["old_logprobs"]
    tis = importance_weights(old, values["engine_logprobs"], args, values.get("responses"))
    eps = (args.clip_eps, args.clip_eps)  # [1 - ε, 1 + ε]
    pg_loss, clipped = compute_policy_loss(logprobs, old, values["advantages"], *eps)
    token_loss = tis * pg_loss
    # clipfrac: the clip cut the gradient (ρ left [1-ε, 1+ε] the way Â pushes it); tis_weight: 1
    # when the trainer and vLLM agree on every token
    stats = {"clipfrac": clipped.sum(), "tis_weight": tis.sum()}
    if "ref_logprobs" in values:
        kl = compute_kl(logprobs, values["ref_logprobs"])
        token_loss = token_loss + args.kl_coef * kl
        stats["kl"] = kl.sum()
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
        **tool_metrics([responses], "rollout"),  # TOOLS: turns and tool calls
    }


def tool_metrics(groups: list[list[dict]], split: str) -> dict:  # TOOLS: rollout/ and eval/
    """Means per episode (never per turn: failing episodes run longer) of each count and flag."""
    episodes = [e for group in groups for e in group]
    keys = ("turns", "tool_calls", "tool_errors", "tool_tokens", "ended_on_call")
    return {f"{split}/{key}": sum(e[key] for e in episodes) / len(episodes) for key in keys}


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
            for name, frozen in trainer.frozen.items():  # ref_logprobs: π_ref's
                values[name] = compute_logprobs(frozen, *inputs, *sampled, **images)
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


def main(args: Args):
    # ---- check everything cheap, then start Ray and the actors (SETUP AND CHECKS, below) ----
    validate_args(args)
    G = args.num_generations  # the group size
    use_gpu, resume = check_machine(args, os.path.basename(__file__))
    run_dir, resume_ckpt, resume_step = resume or (None, None, 0)
    model_path, tokenizer, prompts, terms, tool = prepare_inputs(args, use_gpu)  # TOOLS: tool
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
        outs = run_episodes(engines, ids, 1, tool, tokenizer, args, sampling)  # TOOLS: greedy
        where = f"eval at step {step}"
        _, _, parts = score_responses(terms, prompts["eval"], outs, tokenizer, where, timeout)
        return {"eval/accuracy": parts["verifier"].mean().item(), **tool_metrics(outs, "eval")}

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
        outs = run_episodes(engines, ids, G, tool, tokenizer, args, sampling, step)  # TOOLS: turns
        if args.colocate:
            call(engines, "sleep")  # free the GPUs for training
        t_gen = time.time()

        # ALGO LOGIC: rewards and advantages, per group; the values each trained token carries
        responses = [s for group in outs for s in group]  # (B*G,) prompt-major
        _, rewards, parts = score_responses(terms, batch, outs, tokenizer, where, timeout)
        texts = [tokenizer.decode(s["token_ids"]) for s in responses]  # TOOLS: whole episodes
        advantages = compute_advantages(rewards, G)  # (B*G,)
        kept = keep_groups(rewards, G).repeat_interleave(G)
        sequences = []
        for i in kept.nonzero().squeeze(-1).tolist():
            s = responses[i]
            values = {"advantages": [advantages[i].item()] * len(s["logprobs"])}  # |o_i| of Â
            values["engine_logprobs"] = s["logprobs"]  # what vLLM sampled with, for TIS
            values |= batch[i // G].pixels or {}  # a VLM's: the prompt's pictures
            values["trained"] = s["trained"]  # TOOLS: the loss mask: tool turns are context only
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
    memory; tokenize. Returns (model folder, tokenizer, {split: [Prompt]}, reward terms, tool)."""
    terms = reward_terms(reward_fn, args.verifier_weight, args.reward_fn)  # {name: (fn, weight)}
    tool = make_tool(args)  # TOOLS: a tool file that does not exist stops here
    datasets = {"train": read_prompts(args.dataset, args.dataset_split)}
    if args.eval_dataset:  # held-out prompts: answered
        datasets["eval"] = read_prompts(args.eval_dataset, args.eval_split)
    for row in [row for rows, _ in datasets.values() for row in rows]:  # TOOLS: tell of the tool
        row["prompt"] = with_tool_prompt(row["prompt"], tool, args.tool_format)
    answer = str(datasets["train"][0][0]["answer"])  # a broken reward function fails now, not later
    pairs = [(Episode.of(""), answer), (Episode.of(answer), answer)]  # TOOLS: as the run's
    composed_reward(terms, pairs, "test calls before the run", args.reward_timeout)
    model_path = models.resolve_model(args.model)
    models.check_weights(model_path, "model")
    vlm = vision.check_model(args, model_path, "grpo_tools.py")  # TOOLS: text episodes only
    lora.check_model(args, model_path, args.model)
    entropy = "entropy" in policy_values(args)  # the LM head's chunks: one more
    memory.check_run(args, use_gpu, model_path, bool(frozen_models(args)), entropy=entropy)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    processor = vision.processor(model_path, vlm)  # None for a language model
    tool_turn(tokenizer, "0")  # TOOLS: a template that cannot append a tool turn stops here
    limits = (args.max_prompt_length, args.drop_long)
    prompts = {
        k: encode_prompts(*rows, tokenizer, *limits, processor) for k, rows in datasets.items()
    }
    train, source = len(prompts["train"]), datasets["train"][1]
    data.check_batch(args.prompts_per_step, train, "--prompts-per-step", source, "prompts")
    return model_path, tokenizer, prompts, terms, tool  # TOOLS: tool


def make_tool(args: Args) -> tuple:  # TOOLS: --tool
    """--tool as (name, what it does, str -> str); --tool python prints what its sandbox holds."""
    if args.tool == "calc":
        return "calc", "arithmetic, e.g. 12*(3+4)", calculator
    if args.tool == "python":
        from common import sandbox  # the model's programs run in it

        print(sandbox.check(args.sandbox))  # --sandbox strict: stops here if one is missing
        run = lambda code: sandbox.run_python(code, timeout=args.tool_timeout)  # noqa: E731
        return "python", "runs a Python program and returns what it prints", run
    fn = isolate.UserFunction(args.tool)  # run in a process of its own; a missing file stops here
    return fn.__name__, (fn.__doc__ or fn.__name__).strip().split("\n")[0], fn


def with_tool_prompt(prompt, tool: tuple, form: str):  # TOOLS: SYSTEM_PROMPT first
    """The prompt (text or messages) as messages, SYSTEM_PROMPT's system message first."""
    name, about, _ = tool
    schema = json.dumps({"name": name, "description": about, "parameters": {"input": "string"}})
    text = SYSTEM_PROMPT[form].format(name=name, about=about, schema=schema)
    return [{"role": "system", "content": text}, *data.as_messages(prompt, "user")]


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
