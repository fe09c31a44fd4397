"""LoRA (common/lora.py): adapters on a frozen base, π_ref as the base with the adapters off, the
adapter-only sync to vLLM (and --lora-merge-sync), PEFT-format checkpoints and a merged final
model, and a LoRA GRPO run end to end with an exact resume. Tiny fp32 models on CPU."""

import argparse
import os
import sys

import pytest
import ray
import torch
from conftest import (
    TOLERANCE,
    engine_flags,
    grpo_args,
    logprob_gap,
    only_run_dir,
    parity_reward,
    read_jsonl,
    run_script,
)
from test_weight_sync import sample_and_score
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import rm
import sft
from common import lora
from common.data import encode_prompt, pack
from common.engines import spawn_engines
from common.placement import (
    Layout,
    call,
    init_distributed,
    make_placement_group,
    rendezvous_address,
    spawn_trainers,
)
from common.weight_sync import init_weight_sync

RANK = 8
# The actor below travels by value: Ray's workers need not import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def lora_args(rank=RANK, **kw):
    flags = dict(lora_rank=rank, lora_alpha=None, lora_dropout=0.0, lora_merge_sync=False)
    return argparse.Namespace(**{**flags, "lora_target_modules": lora.DEFAULT_TARGETS, **kw})


def one_rank(one_rank_group):
    return init_distributed(0, 1, *one_rank_group)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@torch.no_grad()
def randomize_adapters(model, seed=0, scale=0.05):
    """Move every lora_B off zero, as training would (the local shard: one rank here)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(torch.randn(local.shape, generator=gen) * scale)


IDS = torch.tensor([[1, 5, 9, 33, 100, 7, 8, 200, 42, 3]])


def test_adapters_start_at_the_base_and_disabled_are_the_base(one_rank_group, tiny_model):
    """With B = 0 the policy's logits are bit-identical to the base model's; with trained adapters
    they differ, and with the adapters off (π_ref) they equal a separately loaded base within 1e-6.
    Only the adapters are trainable, and disabling them leaves that unchanged."""
    device = one_rank(one_rank_group)
    torch.manual_seed(1)
    policy = sft.load_policy(
        tiny_model, device, False, lora.adapters(lora_args(), tiny_model, tiny_model)
    )
    base = sft.load_policy(tiny_model, device, False)
    assert torch.equal(logits(policy, IDS), logits(base, IDS))
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert all(p.dtype == torch.float32 for p in policy.parameters())  # CPU: fp32 everywhere

    randomize_adapters(policy)
    assert (logits(policy, IDS) - logits(base, IDS)).abs().max() > 1e-2
    ref = lora.Disabled(policy)
    assert (logits(ref, IDS) - logits(base, IDS)).abs().max() <= 1e-6
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trained
    assert (logits(policy, IDS) - logits(base, IDS)).abs().max() > 1e-2  # on again


def test_adapter_folder_and_merged_model_load_in_peft_and_transformers(
    one_rank_group, tiny_model, tmp_path
):
    """adapter/ is a standard PEFT folder: PEFT puts it on the base and computes what we compute;
    the merged model (W + α/r B A) loads in transformers as is; the merged weights the fallback
    sync sends are those; a reward model's adapters carry its whole score head."""
    from peft import PeftModel
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    device = one_rank(one_rank_group)
    policy = sft.load_policy(
        tiny_model, device, False, lora.adapters(lora_args(), tiny_model, tiny_model)
    )
    randomize_adapters(policy)
    ours = logits(policy, IDS)
    lora.write_adapter(tmp_path / "adapter", lora.adapter_tensors(policy), lora.config_dict(policy))
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert (logits(peft_model, IDS) - ours).abs().max() <= 1e-5

    state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True))
    merged = dict(lora.merged(state, policy))
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    sent = dict(lora.merged(dict(policy.named_parameters()), policy, torch.float32))
    assert all(torch.allclose(sent[k], merged[k], atol=1e-7) for k in sent)
    merged.pop("lm_head.weight", None)  # tied
    policy.save_pretrained(tmp_path / "merged", state_dict=merged)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert (logits(reloaded, IDS) - ours).abs().max() <= 1e-5

    head = lora.adapters(lora_args(), tiny_model, tiny_model, ("score",))
    scorer = rm.load_reward_model(tiny_model, device, False, head, pad_token_id=0)
    trained = {n for n, p in scorer.named_parameters() if p.requires_grad}
    assert "score.weight" in trained and not any("modules_to_save" in n for n in trained)
    randomize_adapters(scorer)
    lora.write_adapter(tmp_path / "rm", lora.adapter_tensors(scorer), lora.config_dict(scorer))
    rm_base = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    rm_base.config.pad_token_id = 0
    rm_peft = PeftModel.from_pretrained(rm_base, tmp_path / "rm")
    assert (logits(rm_peft, IDS) - logits(scorer, IDS)).abs().max() <= 1e-5


@ray.remote
class LoraTrainer:
    """A trainer rank with LoRA adapters on the tiny model, and the weight sync of the scripts."""

    def __init__(self, model_path, merge, rank, world_size, addr, port):
        self.rank, self.merge = rank, merge
        self.device = init_distributed(rank, world_size, addr, port)
        torch.manual_seed(0)
        adapters = lora.adapters(lora_args(), model_path, model_path)
        self.model = sft.load_policy(model_path, self.device, False, adapters)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    def init_sync(self, engines, backend, addr, port):
        self.sync = init_weight_sync(self.model, self.tokenizer, engines, backend, self.rank,
                                     (addr, port), 1, torch.float32, self.merge)  # fmt: skip

    def perturb(self, seed):
        randomize_adapters(self.model, seed)

    def push(self):
        return self.sync.push()

    def check(self):
        self.sync.check()

    def sizes(self):
        params = dict(self.model.named_parameters())
        adapters = sum(p.numel() for n, p in params.items() if "lora_" in n)
        return adapters, sum(p.numel() for n, p in params.items() if "lora_" not in n)

    @torch.no_grad()
    def logprobs(self, sequences, temperature):
        mb = pack(sequences, 4096)[0]
        inputs = (mb["input_ids"], mb["position_ids"], mb["labels"], mb["loss_mask"])
        return sft.compute_logprobs(self.model, *inputs, temperature).cpu()


@pytest.mark.cpu_engine("fp32 engines: an exact comparison holds on CPU only")
@pytest.mark.parametrize("merge", [False, True], ids=["adapter-only", "merged"])
def test_sync_makes_the_engine_serve_the_trainers_adapters(ray_cpu, tiny_model, tokenizer, merge):
    """The engine (vLLM's CPU LoRA kernels, or merged weights) samples tokens whose logprobs equal
    the trainer's within 1e-4 after a sync, differ by more than 1e-3 before it (the adapters moved,
    the engine was not told), and each sync sends the adapters' bytes only (or the merged model's)."""
    layout = Layout(False, trainers=1, engines=1)
    pg = make_placement_group(layout.bundles, use_gpu=False)
    trainers = spawn_trainers(LoraTrainer, pg, layout.trainers, tiny_model, merge)
    flags = engine_flags(256, **vars(lora_args(lora_merge_sync=merge)))  # merged: no LoRA in vLLM
    engines = spawn_engines(pg, layout.engines, flags, tiny_model, "gloo", False, loading=trainers)
    call(trainers, "init_sync", engines, "gloo", *rendezvous_address(pg, 0))  # sends B = 0
    prompts = [
        encode_prompt(tokenizer, [{"role": "user", "content": f"{a} + 3?"}]) for a in range(4)
    ]
    trainer_lp, engine_lp, _ = sample_and_score(engines, trainers, prompts, 1.0)
    assert (trainer_lp - engine_lp).abs().max() < 1e-4
    for seed in (1, 2):
        call(trainers, "perturb", seed)
        trainer_lp, engine_lp, _ = sample_and_score(engines, trainers, prompts, 1.0)
        assert (trainer_lp - engine_lp).abs().max() > 1e-3  # before the sync: the check can fail
        sent = call(trainers, "push")[0]
        call(trainers, "check")
        trainer_lp, engine_lp, _ = sample_and_score(engines, trainers, prompts, 1.0)
        assert (trainer_lp - engine_lp).abs().max() < 1e-4
    adapters, base = call(trainers, "sizes")[0]
    assert sent == 4 * (base if merge else adapters)
    for a in trainers + engines:
        ray.kill(a)
    ray.util.remove_placement_group(pg)


@pytest.mark.cpu_engine("fp32 engines: exact logprobs and an exact resume hold on CPU only")
def test_grpo_with_lora_end_to_end_and_exact_resume(grpo_run, tiny_model, tmp_path):
    """A GRPO run with --lora-rank and a KL term (π_ref: the adapters off): trainer and engines
    agree on every sampled token after each adapter sync, the first step samples what full
    fine-tuning samples (B = 0), only the adapters travel (< 2 % of the full sync), step_N holds
    the adapters only, final also the merged model (which transformers loads and which equals
    the base plus the adapters in PEFT), and a resume from step_1 redoes step 2 exactly."""
    from peft import PeftModel

    extra = ("--save-every", "1", "--reward-fn", parity_reward(tmp_path), "--kl-coef", "0.1",
             "--learning-rate", "2e-3", "--num-trainers", "2")  # fmt: skip
    flags = grpo_args(
        tiny_model, tmp_path / "runs", *extra, "--lora-rank", str(RANK), "--num-steps", "2"
    )
    result = run_script("grpo.py", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs")
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    # B = 0: the run starts as full fine-tuning does, sample for sample (the engines with LoRA on):
    # conftest's grpo_run fine-tunes the full model from the same start, seed, data and reward
    _, full_dir, _ = grpo_run
    assert [r for r in read_jsonl(os.path.join(full_dir, "samples.jsonl")) if r["step"] == 1] == [
        r for r in read_jsonl(os.path.join(run_dir, "samples.jsonl")) if r["step"] == 1
    ]
    (first,) = [r for r in read_jsonl(os.path.join(full_dir, "metrics.jsonl")) if r["step"] == 1]
    assert first["rollout/reward"] == rows[1]["rollout/reward"]
    assert first["perf/sync_bytes"] == 4 * sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters()
    )
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["train/logprob_diff_max"] < 1e-4 for r in rows[1:])
    assert rows[2]["train/kl"] > 0  # the adapters moved the policy away from π_ref
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    sent = {r["perf/sync_bytes"] for r in rows[1:]}
    assert len(sent) == 1 and sent.pop() < 0.02 * first["perf/sync_bytes"]
    step_1, final = (os.path.join(run_dir, "checkpoints", name) for name in ("step_1", "final"))
    assert sorted(os.listdir(os.path.join(step_1, "adapter"))) == [
        "adapter_config.json", "adapter_model.safetensors"
    ]  # fmt: skip
    assert not os.path.exists(os.path.join(step_1, "model.safetensors"))
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assert (logits(merged, ids) - logits(model, ids)).abs().max() > 1e-4  # it learned something
    peft_model = PeftModel.from_pretrained(model, os.path.join(final, "adapter"))
    assert (logits(merged, ids) - logits(peft_model, ids)).abs().max() <= 1e-5

    from conftest import assert_resume_is_exact

    assert_resume_is_exact("grpo.py", flags, run_dir, step=1)


# GPU tier (not run yet: no GPU was available when it was written). One GPU: the trainer and its
# engine colocated, the engine asleep at level 1 while the trainer trains, the adapters loaded in
# place after every step; and the merged fallback over CUDA IPC. The reward has signal (parity), the
# adapters move far enough that an engine serving the base model, or stale adapters, fails the
# check of steps 2 and 3 (bf16 on both sides, so bf16's tolerance), and only the adapters travel.
@pytest.mark.gpu
@pytest.mark.parametrize("merge", [False, True], ids=["adapter-only", "merged"])
def test_grpo_with_lora_colocated_on_one_gpu(tiny_model, tokenizer, tmp_path, merge):
    from peft import PeftModel

    extra = ("--num-steps", "3", "--learning-rate", "3e-2", "--lora-rank", str(RANK), "--kl-coef",
             "0.1", "--save-every", "1", "--reward-fn", parity_reward(tmp_path))  # fmt: skip
    extra += ("--lora-merge-sync",) if merge else ()
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    out = tmp_path / "runs"
    result = run_script("grpo.py", *grpo_args(tiny_model, out, *extra), timeout=1800, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "layout: colocated on 1 GPU" in result.stdout
    run_dir = only_run_dir(out)
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["train/grad_norm"] > 0 and r["perf/sync_probe_gap"] <= 0.25 for r in rows[1:])
    adapter = os.path.join(run_dir, "checkpoints", "step_1", "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    step_1 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), adapter)
    samples = [s for s in read_jsonl(os.path.join(run_dir, "samples.jsonl")) if s["step"] == 2]
    moved = logprob_gap(base, step_1, tokenizer, samples)  # ~0.18 on CPU with these flags
    assert moved > 5 * TOLERANCE["logprob_mean"], f"the adapters barely moved: {moved:.3g}"
    assert all(r["train/logprob_diff_mean"] < TOLERANCE["logprob_mean"] for r in rows[2:])
    full = 2 * sum(p.numel() for p in base.parameters())  # bf16
    assert all((r["perf/sync_bytes"] < 0.02 * full) != merge for r in rows[1:])


@pytest.mark.cpu_engine("exact logprobs in fp32; on GPUs grpo_async.py needs two")
def test_grpo_async_takes_the_adapters_in_flight(tiny_model, tmp_path):
    """grpo_async.py with --lora-rank: the engines never stop, the adapters of every step are loaded
    between two decoding steps and label the tokens sampled after them (the lag bound holds when
    recomputed from those labels), and only the adapters travel."""
    from test_grpo_async import FLAGS, check_run

    flags = ("--model", tiny_model, "--output-dir", str(tmp_path), *FLAGS, "--num-steps", "3",
             "--max-lag", "1", "--lora-rank", str(RANK), "--no-save-final", "--eval-dataset", "")  # fmt: skip
    result = run_script("grpo_async.py", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = check_run(only_run_dir(tmp_path), range(1, 4), max_lag=1)
    assert (
        max(r["rollout/lag_mean"] for r in metrics) > 0
    )  # tokens of an older adapter were trained
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    adapters = sum(RANK * (m.in_features + m.out_features) for n, m in model.named_modules()
                   if n.split(".")[-1] in lora.targets(lora_args()))  # fmt: skip
    assert all(r["perf/sync_bytes"] == 4 * adapters for r in metrics)
