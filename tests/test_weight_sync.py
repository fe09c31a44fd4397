"""Trainer → vLLM weight sync: an update that leaves a weight out is refused (CPU, gloo); on GPU,
after a change and a push over nccl or CUDA IPC, engine logprobs equal trainer logprobs. The CPU
round trip after a real training step (tied and untied weights, ring attention) is test_grpo.py's
test_engine_matches_trainer_after_train_step_and_sync."""

import math
from types import SimpleNamespace

import pytest
import ray
import torch
from conftest import TOLERANCE, engine_flags
from standins import NoOpTrainer, SleepyEngine
from transformers import AutoTokenizer

import sft
from common.data import encode_prompt, pack
from common.engines import spawn_engines
from common.placement import (
    Layout,
    call,
    init_distributed,
    init_ray,
    make_placement_group,
    rendezvous_address,
    spawn_trainers,
)
from common.precision import compute_dtype
from common.weight_sync import init_weight_sync


@ray.remote
class SyncTrainer:
    def __init__(self, model_path, rank, world_size, addr, port):
        self.rank = rank
        self.device = init_distributed(rank, world_size, addr, port)
        self.model = sft.load_policy(model_path, self.device, gradient_checkpointing=False)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    def init_sync(self, engines, backend, addr, port):
        dtype = compute_dtype(self.device)  # the engines' (bf16 on GPU from compute capability 8.0)
        self.sync = init_weight_sync(
            self.model, self.tokenizer, engines, backend, self.rank, (addr, port), 1, dtype
        )

    @torch.no_grad()
    def perturb(self, scale):
        gen = torch.Generator().manual_seed(0)
        for p in self.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(torch.randn(local.shape, generator=gen).to(local.device) * scale)

    def push(self):
        self.sync.push()

    def check(self):
        return self.sync.check()

    def leave_out(self, name: str | None):
        """From now on the pushes skip the weight `name` (None: send everything again), like a
        broken sender."""
        source = self.sync.transfer.source
        parent = type(source) if name is not None else type(source).__mro__[1]

        class Skipping(parent):
            def metadata(self):
                return [m for m in parent.metadata(self) if m.name != name]

            def __iter__(self):
                return ((n, t) for n, t in parent.__iter__(self) if n != name)

        source.__class__ = Skipping if name is not None else parent

    @torch.no_grad()
    def logprobs(self, sequences, temperature):
        out = []
        for mb in pack(sequences, 4096):
            mb = {k: v.to(self.device) for k, v in mb.items()}
            out.append(
                sft.compute_logprobs(
                    self.model,
                    mb["input_ids"],
                    mb["position_ids"],
                    mb["labels"],
                    mb["loss_mask"],
                    temperature,
                )
            )
        return torch.cat(out).cpu()


def sample_and_score(engines, trainers, prompts, temperature):
    """Engine samples + its logprobs, and the trainers' logprobs of the same tokens (same packing
    order); the sequences too, to score them again."""
    outs = ray.get(engines[0].generate.remote(prompts, 2, temperature, 1.0, 8))
    seqs, engine_lp = [], []
    for p, samples in zip(prompts, outs):
        for s in samples:
            ids = p + s["token_ids"]
            mask = [0] * len(p) + [1] * len(s["token_ids"])
            seqs.append(sft.make_sequence(ids, mask))
            engine_lp.append(torch.tensor(s["logprobs"]))
    order = sorted(
        range(len(seqs)), key=lambda i: -len(seqs[i]["input_ids"])
    )  # pack() sorts longest first
    assert len(pack(seqs, 4096)) == 1
    trainer_lp = call(trainers, "logprobs", seqs, temperature)[0]
    return trainer_lp, torch.cat([engine_lp[i] for i in order]), seqs


@pytest.mark.cpu_engine(
    "CPU engines by design (gloo weight sync, a CPU layout); the GPU tier has its counterpart"
)
def test_a_push_that_leaves_a_weight_out_is_refused(ray_cpu, tiny_model):
    """An engine never serves a half-updated model in silence: a weight missing from an update fails
    the update, naming it (the engine's own parameter check), and a missing part of a fused weight
    (q of vLLM's qkv_proj, whose name the update does set) fails the probe that follows every
    push."""
    layout = Layout(False, trainers=1, engines=1)
    pg = make_placement_group(layout.bundles, use_gpu=False)
    trainers = spawn_trainers(SyncTrainer, pg, layout.trainers, tiny_model)
    engines = spawn_engines(
        pg, layout.engines, engine_flags(), tiny_model, "gloo", False, loading=trainers
    )
    call(trainers, "init_sync", engines, "gloo", *rendezvous_address(pg, 0))
    call(trainers, "perturb", 0.05)
    call(trainers, "leave_out", "model.layers.0.self_attn.q_proj.weight")
    call(trainers, "push")  # accepted: the engine's weight qkv_proj was set, in part
    # q's slice then holds what vLLM's reload left there: wrong numbers, or not even finite ones
    refused = r"Engine#0( does not serve the weights just pushed: .* differ from the trainer"
    with pytest.raises(SystemExit, match=refused + r"|: its log-probabilities .* are not finite)"):
        call(trainers, "check")
    call(trainers, "leave_out", None)
    call(trainers, "push")  # whole again: accepted, and the probe agrees
    call(trainers, "check")
    call(
        trainers, "leave_out", "model.layers.1.mlp.down_proj.weight"
    )  # last: a refused update ends a run
    with pytest.raises(SystemExit, match=r"^error: SyncTrainer#0 failed in push: .*set 13 of the engine's 14 weights; "
                                         r"missing: model\.layers\.1\.mlp\.down_proj\.weight$"):  # fmt: skip
        call(trainers, "push")
    for a in trainers + engines:
        ray.kill(a)
    ray.util.remove_placement_group(pg)


def test_an_engine_left_asleep_is_named_not_waited_on(ray_cpu):
    """Colocated, vLLM resumes scheduling only when an engine is fully awake: one that is not would
    make the next generate hang until the RPC timeout; sync_weights names it instead."""
    from common.weight_sync import sync_weights

    engine, trainer = SleepyEngine.remote(), NoOpTrainer.remote()
    with pytest.raises(
        SystemExit, match=r"^error: SleepyEngine#0 is still asleep after its wake-up$"
    ):
        sync_weights([trainer], [engine], colocated=True)
    synced = sync_weights([trainer], [engine], colocated=False)  # apart: no sleep, no wake-up
    times = ("wake_s", "transfer_s", "probe_s")  # where a sync's time goes, logged every step
    assert set(synced) == {
        "perf/sync_bytes",
        "perf/sync_probe_gap",
        *(f"perf/sync_{t}" for t in times),
    }
    assert all(synced[f"perf/sync_{t}"] >= 0 for t in times)


# GPU tier: the same check over nccl (trainer and engine on separate GPUs) and over CUDA IPC
# (colocated on one GPU, the engine asleep while the trainer changes its weights). Weights travel
# and run in bf16 there, so the tolerance is bf16's, and the perturbation is large enough that a
# missed update fails it.
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_gpu_sync_matches_trainer_logprobs(backend, tiny_model, tokenizer):
    colocate = backend == "ipc"
    if not colocate and torch.cuda.device_count() < 2:
        pytest.skip("nccl sync needs 2 GPUs (one trainer, one engine)")
    init_ray(num_bundles=2)
    try:
        layout = Layout(True, trainers=1, engines=1, colocate=colocate)
        pg = make_placement_group(layout.bundles, use_gpu=True)
        trainers = spawn_trainers(SyncTrainer, pg, layout.trainers, tiny_model)
        flags = engine_flags(256, memory=0.3, colocate=colocate)  # colocated: the trainer first
        engines = spawn_engines(
            pg, layout.engines, flags, tiny_model, backend, True, loading=trainers
        )
        addr, port = rendezvous_address(pg, 0)
        call(trainers, "init_sync", engines, backend, addr, port)
        prompts = [
            encode_prompt(tokenizer, [{"role": "user", "content": f"What is {a} + 3?"}])
            for a in range(4)
        ]
        trainer_lp, engine_lp, seqs = sample_and_score(engines, trainers, prompts, 0.8)
        assert (trainer_lp - engine_lp).abs().mean() < TOLERANCE["logprob_mean"]  # bf16 both

        if colocate:
            call(
                engines, "sleep"
            )  # as in training: the engine frees the GPU while the trainer updates
        call(trainers, "perturb", 0.05)
        # the check below can fail: on the engine's samples, the changed trainer is far off
        stale = call(trainers, "logprobs", seqs, 0.8)[0]
        assert (stale - engine_lp).abs().mean() > 5 * TOLERANCE["logprob_mean"]
        if colocate:
            call(engines, "wake_up", ["weights"])
        call(trainers, "push")
        if colocate:
            call(engines, "wake_up", ["kv_cache"])
        assert call(trainers, "check")[0] <= 0.25  # the probe, at bf16's tolerance: its gap
        trainer_lp, engine_lp, _ = sample_and_score(engines, trainers, prompts, 0.8)
        assert (trainer_lp - engine_lp).abs().mean() < TOLERANCE["logprob_mean"]

        # an update that leaves a weight out is refused by the engine (vLLM's own nccl/ipc backends,
        # checked)
        call(trainers, "leave_out", "model.layers.1.mlp.down_proj.weight")
        with pytest.raises(SystemExit, match=r"missing: model\.layers\.1\.mlp\.down_proj\.weight$"):
            call(trainers, "push")
    finally:
        ray.shutdown()


class ProbeModel(torch.nn.Module):
    """A model whose next-token logits are fixed (uniform, or NaN from `nan_at` on)."""

    def __init__(self, vocab: int = 8, nan_at: int | None = None):
        super().__init__()
        self.weight, self.vocab, self.nan_at = torch.nn.Parameter(torch.zeros(1)), vocab, nan_at
        self.config = SimpleNamespace(_attn_implementation="sdpa")  # what ring attention reads

    def forward(self, input_ids, use_cache=False):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        if self.nan_at is not None:
            logits[:, self.nan_at :] = float("nan")
        return SimpleNamespace(logits=logits)


def probe_check(model, engine_logprobs: list[list[float]], dtype=torch.float16):
    """WeightSync.check on rank 0 against stand-in engines that return `engine_logprobs`."""
    from common.weight_sync import PROBE_TOLERANCE, WeightSync

    engines = [
        SimpleNamespace(
            _ray_actor_creation_function_descriptor=SimpleNamespace(class_name="Engine")
        )
        for _ in engine_logprobs
    ]
    client = SimpleNamespace(engines=engines, prompt_logprobs=lambda probe: engine_logprobs)
    sync = WeightSync.__new__(WeightSync)
    ids = [1, 2, 3, 4]  # (ids, no pixels, the engines' request): vision.probe's for a tokenizer
    sync.model, sync.probe, sync.tolerance = model, (ids, {}, ids), PROBE_TOLERANCE[dtype]
    sync.transfer = SimpleNamespace(is_sender=True, client=client)
    return sync.check()


def test_the_probe_names_the_side_that_is_not_finite():
    """A trainer whose own probe log-probs are NaN (fp16 overflow) is named, not the engine that
    served what it was sent; an engine's NaN names that engine; both say what to do; agreeing
    finite sides pass with their gap, and a finite mismatch is still the engine's."""
    uniform = [-math.log(8)] * 3  # the trainer's log p of tokens 2..4 under uniform logits
    assert probe_check(ProbeModel(), [uniform, uniform]) == pytest.approx(0.0, abs=1e-6)
    fix = r"are not finite \(an overflow, a diverged step\): train in --dtype float32"
    with pytest.raises(RuntimeError, match=rf"^the trainer: its log-probabilities .* {fix}"):
        probe_check(ProbeModel(nan_at=2), [uniform, uniform])
    with pytest.raises(RuntimeError, match=rf"^Engine#1: its log-probabilities .* {fix}"):
        probe_check(ProbeModel(), [uniform, [uniform[0], float("nan"), uniform[2]]])
    with pytest.raises(RuntimeError, match=r"^Engine#0 does not serve the weights just pushed"):
        probe_check(ProbeModel(), [[0.0] * 3, uniform])
