"""grpo.py: advantages, loss and its aggregation against hand-computed values; weight sync after a
real training step; end-to-end runs and early errors."""

import importlib
import math
import os
import shutil

import pytest
import ray
import torch
from conftest import (
    TOLERANCE,
    assert_resume_is_exact,
    engine_flags,
    grpo_args,
    logprob_gap,
    only_run_dir,
    parity_reward,
    read_jsonl,
    run_script,
    shell,
)
from ray.cluster_utils import Cluster
from transformers import AutoModelForCausalLM

import grpo
from common.data import encode_prompt, split_for_ranks
from common.engines import generate, spawn_engines
from common.placement import Layout, call, make_placement_group, rendezvous_address, spawn_trainers
from common.ring_attn import Responses


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # two groups of 4
    adv = grpo.compute_advantages(rewards, group_size=4)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as torch.std: sqrt(1/3)
    want = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6)
    torch.testing.assert_close(adv[:4], want)
    assert torch.equal(adv[4:], torch.zeros(4))  # an all-equal group has no signal
    assert grpo.keep_groups(rewards, 4).tolist() == [True, True]


def test_reward_terms_compose_and_log_apart_with_the_verifiers_accuracy(tmp_path):
    """--reward-fn adds named terms to the verifier (weights by hand); each is logged as
    rollout/reward/<name>; rollout/solved_* (and eval/accuracy) stay the verifier's, also at
    --verifier-weight 0, where the terms alone are the reward."""
    from common.rewards import composed_reward, reward_terms

    path = tmp_path / "terms.py"
    path.write_text("def short(response, answer):\n    return float(len(response) < 9)\n"
                    "def polite(response, answer):\n    return float('please' in response)\n")  # fmt: skip
    terms = reward_terms(grpo.reward_fn, 1.0, [f"{path}:short", f"{path}:polite=0.5"])
    assert list(terms) == ["verifier", "short", "polite"] and terms["polite"][1] == 0.5
    pairs = [("3 + 4 = 7", "7"), ("7 please", "7"), ("it is eight, please", "7"), ("6", "7")]
    totals, parts = composed_reward(terms, pairs, "a test", 5.0)
    assert parts == {"verifier": [1, 1, 0, 0], "short": [0, 1, 0, 1], "polite": [0, 1, 1, 0]}
    assert totals == [1.0, 2.5, 0.5, 1.0]  # 1 x verifier + 1 x short + 0.5 x polite
    alone = reward_terms(grpo.reward_fn, 0.0, [f"{path}:short"])
    totals, parts = composed_reward(alone, pairs, "a test", 5.0)
    assert totals == [0.0, 1.0, 0.0, 1.0] and parts["verifier"] == [1, 1, 0, 0]
    responses = [{"token_ids": [1, 2], "logprobs": [-0.5, -0.5], "finish_reason": "stop"}] * 4
    tensors = {name: torch.tensor(v) for name, v in parts.items()}
    metrics = grpo.rollout_metrics(torch.tensor(totals), tensors, responses, group_size=2)
    assert metrics["rollout/reward"] == 0.5 and metrics["rollout/reward/short"] == 0.5
    assert metrics["rollout/reward/verifier"] == 0.5  # its accuracy, weight 0 or not
    assert metrics["rollout/solved_all"] == 0.5 and metrics["rollout/solved_none"] == 0.5


def test_every_per_token_stat_of_the_update_is_logged_as_its_mean():
    """A stat a variant adds to compute_loss's (a sum over its tokens) is train/<name>, its mean per
    trained token over every rank, with no edit to train_metrics."""
    args = grpo.Args(num_minibatches=2)
    ranks = [{"loss": 0.5, "tokens": 6.0, "logprob_diff_sum": 0.0, "logprob_diff_max": 0.0,
              "grad_norms": 2.0, "lr": 1e-5, "token_sums": {"clipfrac": 1.0, "my_stat": 3.0}},
             {"loss": 0.1, "tokens": 4.0, "logprob_diff_sum": 0.0, "logprob_diff_max": 0.0,
              "grad_norms": 2.0, "lr": 1e-5, "token_sums": {"clipfrac": 0.0, "my_stat": 2.0}}]  # fmt: skip
    del ranks[1]["logprob_diff_sum"], ranks[1]["logprob_diff_max"]  # its micro-batches: fillers
    metrics = grpo.train_metrics(ranks, args)
    assert metrics["train/my_stat"] == 0.5 and metrics["train/clipfrac"] == 0.1
    assert metrics["train/loss"] == pytest.approx(0.3) and metrics["train/grad_norm"] == 1.0


def test_loss_aggregation_by_hand():
    w = grpo.loss_weights([2, 4], grpo.Args())  # mean over tokens, then over the 2 responses
    assert w == [[0.25, 0.25], [0.125] * 4]
    per_token = torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0, 6.0])
    total = (per_token * torch.tensor([x for row in w for x in row])).sum()
    assert total.item() == pytest.approx(0.5 * (4 / 2) + 0.5 * (12 / 4))


def test_clipped_surrogate_by_hand():
    old = torch.zeros(4)
    logprobs = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))  # ratios 1.5, 0.5, 1.1, 0.7
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    loss, clipped = grpo.compute_policy_loss(logprobs, old, adv, eps_low=0.2, eps_high=0.2)
    # A>0: min(ρA, clip(ρ)A) -> 1.2 (clipped), 1.1, 0.7 (min picks the unclipped 0.7 < 0.8)
    # A<0: min(-0.5, -0.8) = -0.8 (clipped)
    torch.testing.assert_close(loss, torch.tensor([-1.2, 0.8, -1.1, -0.7]))
    assert clipped.tolist() == [True, True, False, False]


def test_k3_kl_is_an_unbiased_nonnegative_estimate_of_the_kl():
    """k3 (Schulman 2020) as a property, not its own formula restated: ≥ 0 on every token, 0 where
    the policy and the reference agree, and its mean over tokens sampled from π_θ is KL(π_θ ‖ π_ref)
    computed exactly from the two distributions."""
    gen = torch.Generator().manual_seed(0)
    policy = torch.log_softmax(torch.randn(50, generator=gen), dim=0)  # log π_θ over 50 tokens
    ref = torch.log_softmax(torch.randn(50, generator=gen), dim=0)  # log π_ref
    tokens = torch.multinomial(policy.exp(), 200_000, replacement=True, generator=gen)
    kl = grpo.compute_kl(policy[tokens], ref[tokens])
    assert (kl >= 0).all()
    exact = (policy.exp() * (policy - ref)).sum()
    assert kl.mean().item() == pytest.approx(exact.item(), rel=0.02)
    assert torch.equal(grpo.compute_kl(policy, policy), torch.zeros(50))


def test_make_sequence_alignment():
    seq = grpo.make_sequence(
        [10, 11, 12], [20, 21], advantages=[0.5, 0.5], engine_logprobs=[-1.0, -2.0]
    )
    assert seq["input_ids"] == [10, 11, 12, 20, 21]
    assert seq["labels"] == [11, 12, 20, 21, 0]
    assert seq["loss_mask"] == [0, 0, 1, 1, 0]  # positions 2, 3 predict the response tokens 20, 21
    assert seq["engine_logprobs"] == [0.0, 0.0, -1.0, -2.0, 0.0]
    assert all(len(v) == 5 for v in seq.values())


def rollout_batch(engines, prompts, G, args, sp_size=1):
    outs = generate(
        engines,
        prompts,
        n=G,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_response_length,
    )
    seqs = []
    for p, group in zip(prompts, outs):
        for s, adv in zip(group, torch.linspace(-1, 1, G).tolist()):
            n = len(s["token_ids"])
            per = {
                "advantages": [adv] * n,
                "engine_logprobs": s["logprobs"],
                "loss_weights": [1.0 / (n * len(prompts) * G)] * n,
            }
            seqs.append(grpo.make_sequence(p, s["token_ids"], **per))
    shares = split_for_ranks(seqs, 2, 512, sp_size)  # the same for the ranks of an SP group
    return [[share] for share in shares]  # [rank][minibatch] -> micro-batches


@pytest.mark.cpu_engine(
    "CPU engines by design (gloo weight sync, a CPU layout); the GPU tier has its counterpart"
)
@pytest.mark.parametrize("tied,sp_size", [(False, 1), (True, 2)], ids=["untied-top_p", "tied-sp2"])
def test_engine_matches_trainer_after_train_step_and_sync(
    ray_cpu, tied, sp_size, tiny_model, tiny_model_untied, tokenizer
):
    """The trainer's log-probabilities of the engine's samples equal the engine's (TIS weights of 1)
    before any update and after a push, not between. sp2: both trainer ranks split every row with
    ring attention (and the k3 KL's reference model too). top_p 0.9: vLLM's log-probabilities are
    renormalised over the nucleus, and so are the trainer's."""
    path = tiny_model if tied else tiny_model_untied
    args = grpo.Args(
        learning_rate=1e-3, warmup_steps=1, temperature=0.9, max_response_length=8, sp_size=sp_size,
        kl_coef=0.01 if sp_size > 1 else 0.0, top_p=1.0 if tied else 0.9,
    )  # fmt: skip
    layout = Layout(False, trainers=2, engines=1)
    pg = make_placement_group(layout.bundles, use_gpu=False)
    positional, kwargs = shell(grpo, args, path)
    trainers = spawn_trainers(grpo.Trainer, pg, layout.trainers, *positional, **kwargs)
    engines = spawn_engines(
        pg, layout.engines, engine_flags(64), path, "gloo", False, loading=trainers
    )
    addr, port = rendezvous_address(pg, 0)
    call(trainers, "init_weight_sync", engines, "gloo", addr, port, 1, False)
    prompts = [
        encode_prompt(tokenizer, [{"role": "user", "content": f"What is {a} + 1?"}])
        for a in range(3)
    ]

    batch = rollout_batch(engines, prompts, 4, args, sp_size)
    first = call(trainers, grpo.train_step, 0, per_rank=batch)
    assert max(r["logprob_diff_max"] for r in first) < 1e-4  # identical weights at the start
    micro_batches = [
        mb for share in batch[::sp_size] for mb in share[0]
    ]  # each data-parallel share once
    real_tokens = sum(mb["loss_mask"].sum().item() * mb["real"].item() for mb in micro_batches)
    assert (
        sum(r["tokens"] for r in first) == real_tokens
    )  # with SP every response token is trained on one rank
    # trained but not pushed: the engine samples from stale weights and the probe sees it
    stale = call(
        trainers, grpo.train_step, 1, per_rank=rollout_batch(engines, prompts, 4, args, sp_size)
    )
    assert max(r["logprob_diff_max"] for r in stale) > 1e-2
    call(trainers, "push_weights")
    call(trainers, "probe_engines")  # the probe after every push agrees
    synced = call(
        trainers, grpo.train_step, 2, per_rank=rollout_batch(engines, prompts, 4, args, sp_size)
    )
    assert max(r["logprob_diff_max"] for r in synced) < 1e-4
    for a in trainers + engines:
        ray.kill(a)
    ray.util.remove_placement_group(pg)


@pytest.mark.cpu_engine("fp32 engines: exact logprobs and an exact resume hold on CPU only")
def test_grpo_two_ranks_end_to_end_checkpoint_loads_in_vllm_and_resumes_exactly(grpo_run, tmp_path):
    """conftest's grpo_run (2 ranks, IcePop, Muon, θ_ema evaluated every step, a KL term) logs every
    step, shows the update's per-token stats on the console, samples step 2 from the weights pushed
    after step 1, writes a final model, and a resume from step_1 repeats step 2 exactly.

    The resume runs on a simulated cluster of three one-CPU nodes, joined through RAY_ADDRESS: each
    trainer rank and the engine land on a node of their own, so FSDP2's collectives, the
    rendezvous (from trainer rank 0's node) and the weights pushed after step 2 cross nodes, and the
    resume is exact all the same."""
    flags, run_dir, stdout = grpo_run
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["train/kl"] > 0
    # the console shows every per-token stat of the update (main lists none of them) but plumbing's
    line = next(line for line in stdout.splitlines() if line.startswith("step 2 |"))
    for key in ("train/loss", "train/clipfrac", "train/tis_weight", "train/icepop_masked",
                "train/entropy", "train/kl"):  # fmt: skip
        assert f"{key} " in line, (key, line)
    assert "train/lr" not in line and "train/grad_norm" not in line, line
    assert (
        rows[-1]["train/logprob_diff_max"] < 1e-4
    )  # step 2 sampled from the weights pushed after step 1
    assert read_jsonl(os.path.join(run_dir, "samples.jsonl"))
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "final", "model.safetensors"))
    # the resumed run's engines load checkpoints/step_1 (written as the final model is) and sample
    # from it; it resumes a copy (of the same name), which the other readers of the run never see;
    # its π_ref is the start model, not the checkpoint it loads (the KL term says so)
    copy = tmp_path / os.path.basename(run_dir)
    shutil.copytree(run_dir, copy)
    ray.shutdown()  # this process's local Ray, if a test here started one
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        address = cluster.address
        stdout = assert_resume_is_exact(
            "grpo.py", flags, str(copy), env={"RAY_ADDRESS": address}
        )  # seeded sampling
    finally:
        cluster.shutdown()
    assert f"ray: the Ray cluster at {address} ($RAY_ADDRESS): 3 nodes" in stdout
    line = next(x for x in stdout.splitlines() if x.startswith("placement: bundle -> node: "))
    nodes = [part.split(": ")[1].split()[0] for part in line.split("node: ", 1)[1].split(", ")]
    assert len(nodes) == 3 == len(set(nodes)), line  # bundles 0-1: the trainers, 2: the engine
    resumed = read_jsonl(os.path.join(copy, "metrics.jsonl"))[-1]
    assert resumed["perf/sync_probe_gap"] < 1e-4  # step 2's weights, sent across nodes, served


# GPU tier: the recommended one-GPU mode end to end, as the default flags pick it on one GPU and
# with --colocate on two. The engine shares its trainer's GPU (each asks Ray for half of it), sleeps
# while the trainer trains, and takes the weights by CUDA IPC. The reward has signal (the parity of
# the response's length: a random tiny model never solves the arithmetic task, and all-zero rewards
# would train nothing), the weights move (gradient norms > 0, step_1 is far from the start model:
# an engine left with stale weights would fail the check of steps 2 and 3), and the engines serve
# the pushed weights (bf16 on both sides: bf16's tolerance).
@pytest.mark.gpu
@pytest.mark.parametrize("trainers", [1, 2], ids=["1gpu-default", "2gpu-colocate"])
def test_grpo_colocated_on_gpu(trainers, tiny_model, tokenizer, tmp_path):
    if torch.cuda.device_count() < trainers:
        pytest.skip(f"needs {trainers} GPUs")
    extra = ("--num-steps", "3", "--learning-rate", "1e-3", "--warmup-steps", "0", "--save-every",
             "1", "--reward-fn", parity_reward(tmp_path))  # fmt: skip
    extra += ("--colocate", "--num-trainers", "2", "--num-engines", "2") if trainers == 2 else ()
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(trainers))}
    out = tmp_path / "runs"
    result = run_script("grpo.py", *grpo_args(tiny_model, out, *extra), timeout=1800, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"layout: colocated on {trainers} GPU" in result.stdout
    assert "precision: bfloat16 compute" in result.stdout or "precision: float16" in result.stdout
    run_dir = only_run_dir(out)
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["train/grad_norm"] > 0 and r["rollout/reward_std"] > 0 for r in rows[1:])
    assert all(r["perf/sync_probe_gap"] <= 0.25 for r in rows[1:])  # measured at every push
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    step_1 = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "checkpoints", "step_1"))
    samples = [s for s in read_jsonl(os.path.join(run_dir, "samples.jsonl")) if s["step"] == 2]
    stale = logprob_gap(start, step_1, tokenizer, samples)  # ~0.14 on CPU with these flags
    assert stale > 5 * TOLERANCE["logprob_mean"], f"the weights barely moved: {stale:.3g}"
    # steps 2 and 3 sampled from the weights pushed after steps 1 and 2, not from stale ones
    assert all(r["train/logprob_diff_mean"] < TOLERANCE["logprob_mean"] for r in rows[2:])
    assert rows[-1]["time/sync"] < 60


@pytest.mark.parametrize("script", ["grpo", "dapo", "grpo_async", "grpo_tools", "ppo"])
def test_icepop_masks_outside_the_band_and_is_exact_at_ratio_one(script):
    """IcePop keeps r_t = π_θold / π_vllm inside [1/C, C] (the boundaries included) as the weight
    and gives 0 outside it on both sides; TIS caps the top only. At r_t = 1 the weight is exactly 1:
    the loss is the unweighted surrogate's to the bit."""
    module = importlib.import_module(script)
    icepop = module.Args(is_correction="icepop", tis_cap=4.0)
    tis = module.Args(is_correction="tis", tis_cap=4.0)
    ratio = torch.tensor([0.25 * (1 - 1e-4), 0.25, 1.0, 3.0, 4.0, 4.0 * (1 + 1e-4), 1e-30, 1e30])
    old = torch.log(ratio.double()).float()  # π_vllm = 1: the ratio is π_θold
    engine = torch.zeros(len(ratio))
    weights = module.importance_weights(old, engine, icepop)
    r = torch.exp(old)  # the ratio as float32 gives it, compared to the band as it is
    assert weights.tolist() == [0.0, r[1].item(), 1.0, r[3].item(), r[4].item(), 0.0, 0.0, 0.0]
    assert r[1] == 0.25 and r[4] == 4.0  # the boundaries are in the band, exactly
    capped = module.importance_weights(old, engine, tis).tolist()
    assert capped == [r[0].item(), 0.25, 1.0, r[3].item(), 4.0, 4.0, r[6].item(), 4.0]
    # the loss: the masked tokens carry nothing, the rest their weight; the share masked is logged
    logprobs = torch.log(torch.tensor([1.1, 0.9, 1.0, 1.05]))  # ρ inside the clip
    values = {
        "old_logprobs": torch.zeros(4),
        "engine_logprobs": torch.log(torch.tensor([1.0, 5.0, 0.2, 2.0])),  # r: 1, 0.2, 5, 0.5
        "advantages": torch.tensor([1.0, -1.0, 1.0, 2.0]),
        "loss_weights": torch.tensor([0.1, 0.2, 0.3, 0.4]),
    }
    loss, stats = module.compute_loss(logprobs, values, icepop)
    assert loss.item() == pytest.approx(0.1 * -1.1 + 0.4 * 0.5 * -2 * 1.05, rel=1e-6)
    assert stats["icepop_masked"].item() == 2 and stats["tis_weight"].item() == pytest.approx(1.5)
    assert "icepop_masked" not in module.compute_loss(logprobs, values, tis)[1]
    # r = 1 everywhere (fp32 CPU, the trainer's weights in the engine): exactly no correction
    same = {**values, "engine_logprobs": values["old_logprobs"].clone()}
    loss, stats = module.compute_loss(logprobs, same, icepop)
    plain = -(torch.exp(logprobs) * values["advantages"]) * values["loss_weights"]
    assert loss.item() == plain.sum().item() and stats["icepop_masked"].item() == 0
    if script == "ppo":  # ppo.py's default: no correction, whatever the ratio
        loss, stats = module.compute_loss(logprobs, values, module.Args())
        assert loss.item() == plain.sum().item() and "tis_weight" not in stats


@pytest.mark.parametrize("script", ["grpo", "dapo", "grpo_async", "grpo_tools", "distill"])
def test_seq_mask_weights_a_response_by_its_geometric_mean_ratio_or_masks_it_whole(script):
    """--is-correction seq-mask: a response's r̄_i = exp(mean_t log(π_θold / π_vllm)) weights all its
    tokens inside [1/c, c]; outside it, the whole response is masked (weight 0), also the tokens
    whose own ratio is 1. By hand: response 0 has log-ratios 0.004, -0.002, 0.001 (mean 0.001: in
    the band of c = 1.01), response 1 has 0.02, 0, 0 (mean 0.00667: in it), response 2 -0.03, 0
    (mean -0.015: below 1/1.01, masked)."""
    module = importlib.import_module(script)
    args = module.Args(is_correction="seq-mask", seq_mask_cap=1.01)
    log_ratio = torch.tensor(
        [0.004, -0.002, 0.001, 0.02, 0.0, 0.0, -0.03, 0.0], dtype=torch.float64
    )
    responses = Responses(torch.tensor([0, 0, 0, 1, 1, 1, 2, 2]), 3)
    old, engine = log_ratio.float(), torch.zeros(8)
    weights = module.importance_weights(old, engine, args, responses)
    r0, r1 = math.exp(0.003 / 3), math.exp(0.02 / 3)
    assert weights.tolist() == pytest.approx([r0] * 3 + [r1] * 3 + [0.0] * 2, rel=1e-6)
    assert weights[6:].tolist() == [0.0, 0.0]  # masked whole, its ratio-1 token too
    # the loss and the logged share: 2 of 8 tokens masked; the rest weighted by their response's r̄
    logprobs = torch.zeros(8)  # ρ = 1 (π_θ = π_θold = 1 where old is 0): the surrogate is -Â
    values = {
        "old_logprobs": torch.zeros(8),
        "engine_logprobs": -old,
        "responses": responses,
        "advantages": torch.ones(8),
        "loss_weights": torch.full((8,), 0.125),
        "teacher_logprobs": torch.zeros(8),
    }  # fmt: skip  (distill.py: k1 0, Â as given)
    loss, stats = module.compute_loss(logprobs, values, args)
    assert loss.item() == pytest.approx(-0.125 * (3 * r0 + 3 * r1), rel=1e-6)
    assert stats["seq_masked"].item() == 2 and "icepop_masked" not in stats
    # at r = 1 everywhere the weight is exactly 1: the loss is the uncorrected one to the bit
    same = {**values, "engine_logprobs": torch.zeros(8)}
    assert module.compute_loss(logprobs, same, args)[0].item() == -1.0
    assert module.compute_loss(logprobs, same, args)[1]["seq_masked"].item() == 0


def test_compute_loss_by_hand():
    """TIS weight x clipped surrogate + β k3 KL, weighted per token and summed; the stats count what
    it used."""
    args = grpo.Args(clip_eps=0.2, tis_cap=2.0, kl_coef=0.5)
    logprobs = torch.log(torch.tensor([1.5, 1.0, 0.5]))  # ratios 1.5 (clipped to 1.2), 1.0, 0.5
    values = {
        "old_logprobs": torch.zeros(3),
        "engine_logprobs": torch.tensor(
            [0.0, -math.log(3.0), math.log(2.0)]
        ),  # TIS: 1, 3 -> cap 2, 0.5
        "advantages": torch.tensor([1.0, 1.0, -1.0]),
        "loss_weights": torch.tensor([0.5, 0.25, 0.25]),
        "ref_logprobs": logprobs.clone(),  # KL 0 on every token
    }
    loss, stats = grpo.compute_loss(logprobs, values, args)
    # surrogate: -1.2, -1.0, -max(-0.5, -0.8) = 0.8 -> x TIS (1, 2, 0.5): -1.2, -2.0, 0.4
    assert loss.item() == pytest.approx(0.5 * -1.2 + 0.25 * -2.0 + 0.25 * 0.4)
    assert stats["clipfrac"].item() == 2 and stats["tis_weight"].item() == pytest.approx(3.5)
    assert stats["kl"].item() == pytest.approx(0.0)
    # one token with ref - logp = -1: k3 = e^-1 + 1 - 1
    loss_kl, stats = grpo.compute_loss(
        logprobs, {**values, "ref_logprobs": logprobs - torch.tensor([0.0, 0.0, 1.0])}, args
    )
    assert (loss_kl - loss).item() == pytest.approx(0.25 * 0.5 * math.exp(-1), rel=1e-5)
    no_ref = {k: v for k, v in values.items() if k != "ref_logprobs"}
    assert "kl" not in grpo.compute_loss(logprobs, no_ref, args)[1]  # β = 0: no reference model
