"""The compute dtype and float16's loss scaling (common/precision.py), checked on CPU: the dtype
each GPU gets (faked names and compute capabilities), one line for what cannot run, in every script
before anything starts; the engines' and the memory plan's dtype; and float16 training steps (FSDP2
computes in fp16 on CPU too) whose loss scaling keeps the small gradients plain float16 loses,
skips an overflow without touching the weights, and stops where scaling cannot help."""

import importlib
import re
import sys
import types
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from conftest import SCRIPTS, trainer_rank
from transformers import AutoConfig

from benchmark import memory_plan
from common import lora, memory, placement, precision
from common.data import split_for_ranks

GPUS = {  # name, compute capability
    "H100": ("NVIDIA H100 80GB HBM3", (9, 0)), "A100": ("NVIDIA A100-SXM4-80GB", (8, 0)),
    "L4": ("NVIDIA L4", (8, 9)), "T4": ("Tesla T4", (7, 5)), "V100": ("Tesla V100-SXM2-16GB", (7, 0)),
}  # fmt: skip


@pytest.mark.parametrize(
    "gpu,flag,want",
    [("H100", "auto", "bfloat16"), ("A100", "auto", "bfloat16"), ("L4", "float16", "float16"),
     ("T4", "auto", "float16"), ("T4", "float32", "float32"), ("T4", "float16", "float16"),
     ("T4", "bfloat16", r"^error: --dtype bfloat16 needs compute capability 8\.0 or newer \(Ampere\); "
                        r"the Tesla T4 has 7\.5: use --dtype float16 \(its default\) or float32$"),
     ("V100", "auto", r"^error: the Tesla V100-SXM2-16GB \(compute capability 7\.0\) is older than the "
                      r"pinned CUDA 13 build of torch and vLLM supports .*POSTTRAIN_CPU=1 make demo$")],
)  # fmt: skip
def test_the_dtype_each_gpu_gets(gpu, flag, want):
    name, capability = GPUS[gpu]
    if want.startswith("^error"):
        with pytest.raises(SystemExit, match=want):
            precision.check_gpu(flag, name, capability)
    else:
        assert precision.check_gpu(flag, name, capability) == want


def fake_gpu(monkeypatch, gpu: str, count: int = 8, memory_gib: float = 15.0):
    """This process sees `count` GPUs of kind `gpu`: nvidia-smi's answers (the driver's checks) and
    torch.cuda's (an actor's), without CUDA."""
    name, capability = GPUS[gpu]
    smi = {"name": name, "compute_cap": "{}.{}".format(*capability),
           "memory.total": str(int(memory_gib * 1024))}  # fmt: skip
    monkeypatch.setattr(precision, "first_gpu", lambda *fields: [smi[f] for f in fields])
    monkeypatch.setattr(memory, "first_gpu", lambda *fields: [smi[f] for f in fields])
    monkeypatch.setattr(placement, "count_gpus", lambda: (count, "this machine"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_chooses_and_checks_the_dtype_before_anything_starts(
    monkeypatch, capsys, tmp_path, script
):
    """On a T4 the run computes in float16 and says so; --dtype bfloat16 there, and any run on a
    V100, stop in check_machine with one line (before the data, the model or Ray)."""
    module = importlib.import_module(script)
    fake_gpu(monkeypatch, "T4")
    args = module.Args(output_dir=str(tmp_path))
    module.validate_args(args)
    module.check_machine(args, f"{script}.py")
    assert args.dtype == "float16"
    assert re.search(r"^precision: float16 compute, fp32 master weights, dynamic loss scaling "
                     r"\(Tesla T4, compute capability 7\.5\)$", capsys.readouterr().out, re.M)  # fmt: skip
    for gpu, flag, want in (("T4", "bfloat16", "needs compute capability 8.0"),
                            ("V100", "auto", "older than the pinned CUDA 13 build")):  # fmt: skip
        fake_gpu(monkeypatch, gpu)
        args = module.Args(output_dir=str(tmp_path), dtype=flag)
        module.validate_args(args)
        with pytest.raises(SystemExit, match=f"^error: .*{re.escape(want)}"):
            module.check_machine(args, f"{script}.py")
    monkeypatch.undo()  # CPU: only float32
    args = module.Args(output_dir=str(tmp_path), dtype="float16")
    with pytest.raises(
        SystemExit, match=r"^error: --dtype float16 needs a GPU: on CPU every model"
    ):
        module.check_machine(args, f"{script}.py")


def test_the_engines_run_in_the_run_dtype_checked_on_their_gpu(monkeypatch):
    """engine_args (in the engine's actor) passes the driver's dtype to vLLM, resolves "auto" on
    its own GPU, and refuses bfloat16 on a T4 (a cluster's driver may not have seen the GPUs). vLLM
    is not imported: its config class is a stand-in that keeps what it is given."""
    from common.engines import engine_args

    stub = types.ModuleType("vllm.config")
    stub.WeightTransferConfig = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm.config", stub)
    fake_gpu(monkeypatch, "T4")
    given = dict(model_path="m", seed=0, backend="ipc", tp=1, max_model_len=64, memory=0.4)
    assert engine_args(**given, dtype="auto")["dtype"] == torch.float16
    assert engine_args(**given, dtype="float32")["dtype"] == torch.float32
    with pytest.raises(SystemExit, match="--dtype bfloat16 needs compute capability 8.0"):
        engine_args(**given, dtype="bfloat16")
    fake_gpu(monkeypatch, "H100")
    assert engine_args(**given, dtype="auto")["dtype"] == torch.bfloat16


def test_the_memory_plan_counts_the_dtype(monkeypatch, capsys, tmp_path):
    """16-bit copies (bf16 or fp16) take 2 B per value, float32 4 B: the gathered layers, the
    activations, LoRA's frozen base, the engine's weights. Qwen2.5-0.5B with LoRA, GRPO colocated
    on a T4 (15 GiB): float16 fits, and the plan names what it counted."""
    shape = memory_plan.shape("Qwen2.5-0.5B", lora_rank=16)
    busy = {d: memory.trainer(shape, 1, 4096, False, 3, d)[1] for d in precision.SHORT}
    for dtype, short in precision.SHORT.items():
        assert {f"frozen {short} base", f"gathered {short} layers"} <= set(busy[dtype])
    for part in ("frozen {} base", "gathered {} layers"):
        assert busy["float16"][part.format("fp16")] == busy["bfloat16"][part.format("bf16")]
        assert busy["float32"][part.format("fp32")] == 2 * busy["bfloat16"][part.format("bf16")]
    assert busy["float32"]["activations"] == 2 * busy["bfloat16"]["activations"]
    job = memory.Job(policy=shape, trainers=1, tokens=512, engines=1, engine_memory=0.012)
    assert memory.engine_weights_fit(job, 100 * memory.GiB)  # 2 B per weight: 0.9 of 1.2 GiB
    assert not memory.engine_weights_fit(replace(job, dtype="float32"), 100 * memory.GiB)

    import grpo

    fields = dict(memory_plan.CONFIGS["Qwen2.5-0.5B"])
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(tmp_path)
    monkeypatch.setenv("POSTTRAIN_GPU_MEMORY_GIB", "15")
    args = grpo.Args(model=str(tmp_path), colocate=True, dtype="float16", lora_rank=16)
    grpo.validate_args(args)
    memory.check_run(args, True, str(tmp_path))
    assert re.fullmatch(r"memory plan: GPU 0 generating needs [\d.]+ GiB of 15 \(.*frozen fp16 "
                        r"base 0\.9.*\): fits\n", capsys.readouterr().out)  # fmt: skip


def one_micro_batch(module, weight: float) -> list[dict]:
    seq = module.make_sequence([5, 6, 7], [8, 9, 10, 11], advantages=[1.0] * 4,
                               loss_weights=[weight] * 4, engine_logprobs=[-1.0] * 4)  # fmt: skip
    return split_for_ranks([seq], 1, 64)[0]


def test_float16_training_scales_the_loss_skips_overflows_and_stops_where_scaling_cannot_help(
    one_rank_group, tiny_model, tmp_path
):
    """grpo.py's trainer with --dtype float16, on CPU: FSDP2 computes in fp16 and keeps fp32
    master weights. A loss of ~1e-6 gives gradients that underflow to 0 in plain float16 (scale 1)
    and that the default scale 2^16 keeps, equal to fp32's to a few %. A scale so large that the
    gradients overflow skips the update (weights untouched) and halves the scale; the next steps go
    on. The scale doubles after `interval` clean updates; an overflow at scale 1 stops the run, a
    non-finite loss at once. The scale is saved with the optimizer and resumed."""
    import grpo

    addr, port = one_rank_group
    norms, trainers = {}, {}
    for name, dtype, scale in (("fp32", "float32", None), ("fp16", "float16", None),
                               ("fp16 unscaled", "float16", 1.0)):  # fmt: skip
        if dist.is_initialized():
            dist.destroy_process_group()
        args = grpo.Args(dtype=dtype, learning_rate=1e-3)
        trainer = trainer_rank(grpo, args, tiny_model, addr, port)
        if scale is not None:
            trainer.scaler.value = scale
        norms[name] = grpo.train_step(trainer, [one_micro_batch(grpo, 1e-6)], 0)["grad_norms"]
        trainers[name] = trainer
    assert trainers["fp16"].scaler.value == 2.0**16 and not trainers["fp32"].scaler.on
    assert norms["fp32"] > 0 and norms["fp16"] == pytest.approx(norms["fp32"], rel=0.1)
    assert norms["fp16 unscaled"] < 0.1 * norms["fp32"]  # float16 alone loses them
    seen = []  # the compute really is fp16: what the first decoder layer's projections get
    layer = trainer.model.base_model.layers[0].self_attn.q_proj
    hook = layer.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].dtype))
    grpo.train_step(trainer, [one_micro_batch(grpo, 0.5)], 1)
    hook.remove()
    assert seen and set(seen) == {torch.float16}

    trainer = trainers["fp16"]  # overflow: no update, half the scale, then on
    before = [p.detach().to_local().clone() for p in trainer.model.parameters()]
    trainer.scaler.value = 2.0**40
    assert grpo.train_step(trainer, [one_micro_batch(grpo, 0.5)], 1)["grad_norms"] == 0.0
    assert trainer.scaler.value == 2.0**39
    after = [p.detach().to_local() for p in trainer.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    trainer.scaler.value = 2.0**10
    assert grpo.train_step(trainer, [one_micro_batch(grpo, 0.5)], 2)["grad_norms"] > 0
    # a non-finite loss (the forward overflowed) stops at once, the scale untouched: not 16 halvings
    with pytest.raises(FloatingPointError, match="non-finite loss in float16.*--dtype float32"):
        grpo.train_step(trainer, [one_micro_batch(grpo, float("nan"))], 3)
    assert trainer.scaler.value == 2.0**10
    # the scale is in the checkpoint: a resumed float16 run goes on at it, not at 2^16 again
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.scaler.good = 7
    trainer.save(str(tmp_path / "step_3"), 3, with_optimizer=True)
    dist.destroy_process_group()
    args = grpo.Args(dtype="float16", learning_rate=1e-3)
    resumed = trainer_rank(grpo, args, tiny_model, addr, port)
    assert resumed.scaler.value == 2.0**16
    resumed.load_optimizer(str(tmp_path / "step_3"))
    assert (resumed.scaler.value, resumed.scaler.good) == (2.0**10, 7)

    scale = precision.LossScale(torch.float16, scale=1.0, interval=2)
    assert not scale.skip(torch.tensor(1.0), 0) and scale.value == 1.0
    assert not scale.skip(torch.tensor(1.0), 1) and scale.value == 2.0  # doubled after 2
    assert scale.skip(torch.tensor(float("inf")), 2) and scale.value == 1.0
    with pytest.raises(FloatingPointError, match="non-finite gradients in float16 at a loss scale"):
        scale.skip(torch.tensor(float("nan")), 3)


def test_lora_keeps_its_frozen_base_in_the_compute_dtype(one_rank_group, tiny_model):
    import argparse

    import sft

    placement.init_distributed(0, 1, *one_rank_group)
    flags = argparse.Namespace(lora_rank=4, lora_alpha=None, lora_dropout=0.0,
                               lora_target_modules=lora.DEFAULT_TARGETS)  # fmt: skip
    adapters = lora.adapters(flags, tiny_model, tiny_model)
    model = sft.load_policy(tiny_model, torch.device("cpu"), False, adapters, "float16")
    dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
    assert dtypes == {(False, torch.float16), (True, torch.float32)}  # adapters: fp32 masters


@pytest.mark.parametrize("script", ["grpo", "dapo", "ppo", "grpo_async"])
def test_engine_memory_reaches_the_engines_on_cpu(monkeypatch, script):
    """--engine-memory on CPU is GiB of KV cache per engine (default 1): each RL script's flags reach
    its engines (spawn_engines reads them), with the run's dtype, and engine_args makes it vLLM's
    KV cache size."""
    from common import engines

    module = importlib.import_module(script)
    handed = {}
    monkeypatch.setattr(placement, "init_ray", lambda *a: None)
    monkeypatch.setattr(placement, "make_placement_group", lambda *a: None)
    monkeypatch.setattr(placement, "spawn_trainers", lambda *a, **k: [])
    monkeypatch.setattr(placement, "wait_started", lambda *a: None)
    monkeypatch.setattr(placement, "rendezvous_address", lambda *a: ("127.0.0.1", 0))
    monkeypatch.setattr(module, "call", lambda *a, **k: [])

    class Recorder:  # an engine class: what its constructor is handed
        options = staticmethod(lambda **_: Recorder)

        @staticmethod
        def remote(model, seed, backend, tp, longest, memory, sleep_mode, **kw):
            return handed.update(memory=memory, **kw)

    slot = types.SimpleNamespace(options=lambda pg, env: {})
    monkeypatch.setattr(engines, "wait_started", lambda *a: None)

    def spawn(pg, slots, *a, **k):  # the script's call, an engine class it gives replaced
        return engines.spawn_engines(
            pg, [slot] * len(slots), *a[:4], **k | {"engine_cls": Recorder}
        )

    monkeypatch.setattr(module, "spawn_engines", spawn)
    paths = {k: "m" for k in ("policy", "reference", "critic", "critic_start", "reward_model")}
    for given, want in ((0.25, 0.25), (None, 1.0)):
        args = module.Args(engine_memory=given, dtype="float32")
        module.validate_args(args)
        extra = (paths, False) if script == "ppo" else ("m", None)
        module.start_actors(args, False, *extra)
        assert handed["memory"] == want and handed["dtype"] == "float32"
    stub = types.ModuleType("vllm.config")
    stub.WeightTransferConfig = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm.config", stub)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    vllm_args = engines.engine_args("m", 0, "gloo", 1, 64, 0.25, None, "float32")
    assert vllm_args["kv_cache_memory_bytes"] == 2**28 and vllm_args["dtype"] == torch.float32


@pytest.mark.parametrize(
    "kind,dtype,refused",
    [
        ("gemma2", "float16", True),
        ("glm4", "float16", True),
        ("gemma2", "bfloat16", False),
        ("gemma2", "float32", False),
        ("qwen2", "float16", False),
    ],
)
def test_models_vllm_will_not_serve_in_float16_are_refused_before_anything_loads(
    monkeypatch, tmp_path, kind, dtype, refused
):
    """vLLM refuses float16 for gemma2/gemma3/glm4: an RL script on a GPU says so in one line from
    the model's config (memory.check_run, before the plan), not in an engine's start-up."""
    import grpo

    path = str(tmp_path / kind)
    AutoConfig.for_model(kind, num_hidden_layers=2).save_pretrained(path)
    args = grpo.Args(model=path, dtype=dtype)
    monkeypatch.setattr(memory, "check", lambda job, *a: (job, "planned"))  # the plan: not here
    monkeypatch.setattr(memory, "shape_of", lambda *a, **k: None)
    args.max_tokens_per_micro_batch = 512
    call = lambda: memory.check_run(args, True, path)  # noqa: E731
    if refused:
        with pytest.raises(SystemExit, match=f"^error: vLLM does not serve {kind} models in "):
            call()
    else:
        call()
    sft_args = grpo.Args(model=path, dtype=dtype, num_engines=0)  # no engines: not vLLM's concern
    sft_args.max_tokens_per_micro_batch = 512
    memory.check_run(sft_args, True, path)
