"""The memory plan (common/memory.py): the tables of docs/cluster.md are what it computes, a run
that cannot fit is refused with one line that names the numbers and a fix, a run that fits is not,
the hybrid engine parks idle models in host RAM exactly when that is what makes a run fit, and a
parked model trains on exactly as before."""

import os
import re
from dataclasses import replace

import pytest
import torch
from conftest import REPO

from benchmark import memory_plan
from common import memory, models
from common.memory import GiB, Job

H100 = memory_plan.H100


@pytest.fixture(scope="module")
def shapes():
    return {name: memory_plan.shape(name) for name in memory_plan.CONFIGS}


def test_parameter_counts_are_the_published_ones(shapes):
    billions = {name: round(s.params / 1e9, 2) for name, s in shapes.items()}
    assert billions == {
        "Qwen2.5-0.5B": 0.49,
        "Qwen2.5-1.5B": 1.54,
        "Qwen2.5-7B": 7.62,
        "Llama-3.1-70B": 70.55,
        "SmolVLM-256M": 0.26,
    }
    # the published count of the VLM, its vision tower and connector in
    assert shapes["SmolVLM-256M"].params == 256_484_928
    s7 = shapes["Qwen2.5-7B"]
    assert (
        s7.layers == 28 and s7.kv == 4 * 128 and s7.root == 2 * 152064 * 3584 + 3584
    )  # untied: two vocab matrices


def test_docs_tables_are_what_the_plan_computes():
    with open(os.path.join(REPO, "docs", "cluster.md")) as f:
        docs = f.read()
    for row in memory_plan.rows():
        assert row in docs, (
            f"docs/cluster.md is out of date (python benchmark/memory_plan.py): {row}"
        )


def test_a_plan_that_cannot_fit_is_refused_naming_the_numbers_and_a_fix(shapes):
    job = Job(shapes["Qwen2.5-7B"], trainers=1, tokens=8192, checkpointing=True, engines=1, engine_memory=0.4,
              colocate=True)  # fmt: skip
    with pytest.raises(SystemExit) as e:
        memory.check(job, H100)
    assert re.fullmatch(
        r"error: memory plan: GPU 0 training the policy needs 127\.1 GiB of 80 \(weights \+ grads \+ AdamW 113\.5, "
        r".*\): does not fit; it would fit with more GPUs: --num-trainers 2 --num-engines 2",
        str(e.value.code),
    ), e.value.code


def test_the_fix_offered_is_the_cheapest_that_fits(shapes):
    s = shapes["Qwen2.5-1.5B"]
    big_batch = Job(s, trainers=1, tokens=65536, checkpointing=False)  # activations dominate
    need = memory.peak(big_batch, H100)[3]
    with pytest.raises(
        SystemExit, match=r"fit with --gradient-checkpointing or --max-tokens-per-micro-batch \d+"
    ):
        memory.check(big_batch, H100)
    assert memory.fits(replace(big_batch, checkpointing=True), H100) and need > H100
    hungry_engine = Job(
        s, trainers=1, tokens=8192, checkpointing=True, engines=1, engine_memory=0.9, colocate=True
    )
    with pytest.raises(
        SystemExit, match=r"GPU 0 generating needs .*fit with --engine-memory 0\.45"
    ):
        memory.check(hungry_engine, H100)


def test_engine_weights_must_fit_their_share(shapes):
    job = Job(shapes["Llama-3.1-70B"], trainers=8, tokens=4096, checkpointing=True, engines=8, engine_memory=0.4,
              colocate=True)  # fmt: skip
    with pytest.raises(SystemExit, match=r"^error: memory plan: the engine's bf16 weights \(131\.4 GiB per GPU\) do not "
                                         r"fit --engine-memory 0\.4 of 80 GiB .*: raise --engine-memory$"):  # fmt: skip
        memory.check(job, H100)


def test_what_fits_is_never_refused(shapes):
    """For every run of docs/cluster.md and GPUs of 24 to 141 GiB: the check refuses exactly the
    runs whose peak (with idle models offloaded, where that is allowed) exceeds the GPU, and says so
    in its line otherwise."""
    for run, layout, job in memory_plan.cases():
        for capacity in (24 * GiB, 40 * GiB, H100, 141 * GiB):
            best = replace(job, offload=bool(job.colocate and (job.critic or job.reward_model)))
            fits = memory.fits(job, capacity) or memory.fits(best, capacity)
            try:
                _, line = memory.check(job, capacity)
            except SystemExit as e:
                assert not fits, (run, layout, capacity, e.code)
                assert re.match(r"error: memory plan: .*(does not fit|do not fit)", str(e.code))
                continue
            assert fits and line.startswith("memory plan: ") and ": fits" in line, (
                run,
                layout,
                capacity,
            )


def test_the_hybrid_engine_parks_idle_models_only_when_that_makes_it_fit(shapes):
    """ppo.py, 1.5B policy + critic + reward model on one GPU: an 80 GB GPU holds everything at
    once; a 70 GB one only with the critic and the reward model in host RAM while vLLM generates and
    the policy trains; 40 GB not at all."""
    s15, score = shapes["Qwen2.5-1.5B"], memory_plan.shape("Qwen2.5-1.5B", "score")
    job = Job(s15, trainers=1, tokens=16384, checkpointing=True, reference=True, engines=1, engine_memory=0.4,
              colocate=True, critic=score, critics=1, reward_model=score)  # fmt: skip
    assert not memory.check(job, H100)[0].offload
    checked, line = memory.check(job, 70 * GiB)
    assert checked.offload and line.endswith(
        "the critic and reward model wait in host RAM when idle"
    )
    parked = dict((phase, parts) for _, phase, parts in memory.needs(checked, 70 * GiB))
    assert not any(k.startswith(("critic", "reward")) for k in parked["generating"])
    with pytest.raises(SystemExit, match="does not fit"):
        memory.check(job, 40 * GiB)
    # not parked, the reward model stays on the GPU in every phase, the critic's training included
    resident = dict((phase, parts) for _, phase, parts in memory.needs(job, H100))
    assert all("reward model" in parts for parts in resident.values()), resident.keys()


def test_the_ema_and_a_mask_over_packed_rows_are_counted(shapes, tmp_path):
    """--ema-beta: 4 B a parameter on each rank, between steps and while training, the policy's
    only (ppo.py's critic has none). A model that keeps SDPA's mask over a packed row (a sliding
    window, common/packed_attn.py): T x T compute-dtype bytes in every layer, one layer's with
    checkpointing, none under ring attention; plainly causal models (Qwen2.5, Llama) keep none."""
    s05 = shapes["Qwen2.5-0.5B"]
    critic = memory_plan.shape("Qwen2.5-0.5B", "score")
    base = Job(s05, 2, 8192, engines=1, engine_memory=0.4, colocate=True, critic=critic, critics=2)
    for phase, parts in (p[1:] for p in memory.needs(replace(base, ema=True), H100)):
        assert parts["EMA (fp32)"] == 4 * s05.params / 2, phase
        assert not any(k.startswith("critic EMA") for k in parts), phase
    assert not any("EMA (fp32)" in parts for *_, parts in memory.needs(base, H100))
    assert not any(s.masked for s in shapes.values())
    masked = replace(base, policy=replace(s05, masked=True), critic=None, critics=0)
    for ckpt, sp, want in ((False, 1, 2 * 8192**2 * 24), (True, 1, 2 * 8192**2), (False, 2, None)):
        job = replace(masked, checkpointing=ckpt, sp=sp)
        busy = dict((phase, parts) for _, phase, parts in memory.needs(job, H100))
        assert busy["training the policy"].get("packed-row masks") == want, (ckpt, sp)
    from transformers import MistralConfig

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=100)
    windowed = MistralConfig(
        num_attention_heads=2, num_key_value_heads=1, sliding_window=64, **small
    )
    assert memory.shape_of(windowed).masked


def test_check_run_plans_from_the_scripts_flags(monkeypatch, capsys, tiny_model):
    """A script's own flags, on a (pretended) GPU: the plan's line is printed, and too small a GPU
    refuses it."""
    import grpo

    args = grpo.Args(model=tiny_model, colocate=True)
    grpo.validate_args(args)
    monkeypatch.setenv("POSTTRAIN_GPU_MEMORY_GIB", "80")
    assert memory.check_run(args, True, tiny_model) is False
    assert re.fullmatch(
        r"memory plan: GPU 0 generating needs 34\.1 GiB of 80 \(.*\): fits\n",
        capsys.readouterr().out,
    )
    monkeypatch.setenv("POSTTRAIN_GPU_MEMORY_GIB", "1")
    with pytest.raises(SystemExit, match="^error: memory plan: GPU 0 .* of 1 "):
        memory.check_run(args, True, tiny_model)
    assert memory.check_run(args, False, tiny_model) is False  # CPU: no plan
    assert capsys.readouterr().out == ""
    planned = []
    monkeypatch.setattr(memory, "check", lambda job, *a: planned.append(job) or (job, ""))
    for beta in (0.0, 0.99):  # --ema-beta reaches the plan
        args.ema_beta = beta
        memory.check_run(args, True, tiny_model)
    assert [job.ema for job in planned] == [False, True]


@pytest.mark.parametrize(
    "name", ["sft", "rm", "dpo", "grpo", "dapo", "ppo", "grpo_async", "distill"]
)
def test_every_script_is_planned_from_its_own_defaults(monkeypatch, capsys, tiny_model, name):
    """Each script's prepare_inputs, on its defaults as validate_args leaves them, plans its run on
    a (pretended) 80 GB GPU: the GPU path the CPU never takes, with the values the script passes
    (grpo_async.py has no --colocate; sft, rm and dpo no engines)."""
    import importlib

    module = importlib.import_module(name)
    args = module.Args(model=tiny_model)
    module.validate_args(args)
    monkeypatch.setenv("POSTTRAIN_GPU_MEMORY_GIB", "80")
    module.prepare_inputs(args, True, *([None] if name == "ppo" else []))  # ppo: no checkpoint
    assert re.search(r"^memory plan: .*: fits.*$", capsys.readouterr().out, re.M)


def test_a_parked_model_trains_on_as_before(one_rank_group, tiny_model):
    """to_host / to_device around a step (here host to host: the round trip's bookkeeping, the GPU
    tier moves real memory) leave FSDP2's shards and AdamW's references intact: the next steps equal
    those of a model never moved."""
    import torch.distributed as dist

    import grpo

    addr, port = one_rank_group
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    losses = {}
    for moved in (False, True):
        torch.manual_seed(0)
        model = grpo.load_policy(tiny_model, torch.device("cpu"), gradient_checkpointing=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[moved] = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[moved].append(loss.item())
            if moved:
                models.to_device(model, optimizer, "cpu")
                models.to_device(model, optimizer, torch.device("cpu"))
    assert losses[True] == losses[False] and losses[True][0] != losses[True][-1]


@pytest.mark.gpu
def test_a_parked_model_gives_its_gpu_memory_back(one_rank_group, tiny_model):
    """On the GPU: to_host frees the weights' and AdamW's memory (all but a few MiB of it),
    to_device brings it back and training goes on exactly as without the round trip (same seed, same
    losses)."""
    import torch.distributed as dist

    import grpo

    addr, port = one_rank_group
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0)).cuda()
    losses = {}
    for moved in (False, True):
        torch.manual_seed(0)
        model = grpo.load_policy(tiny_model, torch.device("cuda", 0), gradient_checkpointing=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[moved] = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[moved].append(loss.item())
            if moved:
                held = torch.cuda.memory_allocated()
                models.to_device(model, optimizer, "cpu")
                states = (
                    sum(p.numel() for p in model.parameters()) * 12
                )  # fp32 weights + AdamW's two moments
                assert held - torch.cuda.memory_allocated() >= 0.9 * states
                models.to_device(model, optimizer, torch.device("cuda", 0))
        del model, optimizer
    assert losses[True] == losses[False]


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_7b_fits_one_gpu_with_lora_and_full_fine_tuning_is_told_so(
    monkeypatch, capsys, tmp_path, name
):
    """Through a script's own flags on a (pretended) 80 GB GPU: Qwen2.5-7B colocated with its
    engine fits with --lora-rank 16 (ppo.py: its critic too, no reference copy), and full
    fine-tuning is refused with a line that suggests --lora-rank."""
    import importlib

    from transformers import AutoConfig

    fields = dict(memory_plan.CONFIGS["Qwen2.5-7B"])
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(tmp_path)
    module = importlib.import_module(name)
    flags = dict(model=str(tmp_path), colocate=True, gradient_checkpointing=True,
                 max_tokens_per_micro_batch=8192)  # fmt: skip
    monkeypatch.setenv("POSTTRAIN_GPU_MEMORY_GIB", str(H100 / GiB))
    paths = (str(tmp_path), str(tmp_path)) if name == "ppo" else ()
    args = module.Args(**flags, lora_rank=16)
    module.validate_args(args)
    memory.check_run(args, True, str(tmp_path), True, *paths)
    assert re.fullmatch(r"memory plan: GPU 0 .* needs \d+\.\d GiB of 80 \(.*frozen bf16 base 14\.2.*\): fits.*\n",
                        capsys.readouterr().out)  # fmt: skip
    args = module.Args(**flags)
    module.validate_args(args)
    with pytest.raises(SystemExit, match=r"does not fit; it would fit with --lora-rank 16"):
        memory.check_run(args, True, str(tmp_path), True, *paths)


def test_engine_memory_is_checked_and_defaulted_in_one_place():
    """--engine-memory: a fraction of a GPU (over 1 refused in one line, what every RL script's
    check_machine calls), GiB of KV cache on CPU (any size: check_kv_cache bounds it); defaults
    0.85, colocated 0.4, CPU 1."""
    from types import SimpleNamespace

    from common.errors import InputError
    from common.memory import engine_memory

    flags = SimpleNamespace(num_engines=1, engine_memory=2.0)
    with pytest.raises(InputError, match="--engine-memory is a fraction of each GPU's memory"):
        engine_memory(flags, use_gpu=True)
    assert engine_memory(flags, use_gpu=False) == 2.0
    for colocate, use_gpu, default in ((False, True, 0.85), (True, True, 0.4), (False, False, 1.0)):
        flags = SimpleNamespace(num_engines=1, engine_memory=None)
        assert engine_memory(flags, use_gpu, colocate) == default
