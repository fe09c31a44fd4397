"""Trainer → engines weight sync through vLLM's weight-transfer API, the same code everywhere.

    backend  when                                          how the bytes move
    nccl     trainers and engines on different GPUs        NCCL broadcast from trainer rank 0
    ipc      colocated: a trainer rank, an engine per GPU  CUDA IPC handles to the trainer's tensors
    gloo     CPU                                           gloo broadcast (common/vllm_worker.py)

Each trainer rank calls `init_weight_sync` once, `.push()` after each optimizer step. No silent
stale or half-loaded weights: engines refuse an update missing one, `.check()` compares their
log-probs of a probe text to the trainer's. vLLM is imported lazily (the driver loads this too)."""

import time

import ray
import torch

from common import lora, vision
from common.errors import RunError
from common.placement import actor_names, call
from common.ring_attn import enable_ring_attention

PROBE_TEXT = "Weights check: 12 + 35 = 47, and the quick brown fox jumps over the lazy dog."
# Mean |log p_trainer - log p_engine| allowed on the probe by compute dtype (a stale layer: nats).
# fp32 (CPU): ~1e-6, measured; bf16/fp16: a few 1e-2, guessed (perf/sync_probe_gap, docs/errors.md)
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.25}


def sync_weights(trainers: list, engines: list, colocated: bool) -> dict:
    """After each optimizer step: trainers' weights into the engines, checked. Colocated: wake the
    weights, then (IPC copies freed) the KV cache. Returns perf/ metrics: bytes per engine, the
    probe's gap, and the seconds spent waking the engines, sending, probing."""
    start = time.perf_counter()
    if colocated:
        call(engines, "wake_up", ["weights"])
    woken = time.perf_counter()
    sent = call(trainers, "push_weights", watch=engines)  # an engine that dies in it: named
    sent_at = time.perf_counter()
    if colocated:  # an engine that is not fully awake schedules nothing: its generate would hang
        for i, awake in enumerate(call(engines, "wake_up", ["kv_cache"])):
            if not awake:
                raise RunError(f"{actor_names(engines)[i]} is still asleep after its wake-up")
    probing = time.perf_counter()
    gap = call(trainers, "probe_engines", watch=engines)[0]  # rank 0 compares
    wake = woken - start + probing - sent_at
    seconds = dict(wake_s=wake, transfer_s=sent_at - woken, probe_s=time.perf_counter() - probing)
    return {"perf/sync_bytes": sent[0], "perf/sync_probe_gap": gap} | {
        f"perf/sync_{k}": v for k, v in seconds.items()
    }


def choose_backend(use_gpu: bool, colocate: bool) -> str:
    return "gloo" if not use_gpu else ("ipc" if colocate else "nccl")


class EngineClient:
    """vLLM's `VLLMWeightSyncClient` over our engine actors, calls fanned out. In one NCCL/gloo
    group engine i's workers are ranks 1 + i * tp ... (0: the trainer): `rank_offset` per engine."""

    def __init__(self, engines: list, tp: int, version: int = 0):
        self.engines, self.tp, self.version = engines, tp, version  # the engines' weights' version

    def _all(self, method: str, per_engine: list | None = None, *args):
        try:
            return call(self.engines, method, *args, per_rank=per_engine, timeout=600)
        except RunError as e:  # in trainer rank 0: a plain exception reaches the driver, naming it
            raise RuntimeError(str(e.code).removeprefix("error: ")) from None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        infos = [dict(init_info) for _ in self.engines]
        for i, info in enumerate(infos if "rank_offset" in init_info else []):
            info["rank_offset"] += i * self.tp
        self._all("init_weight_transfer_engine", infos)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._all("update_weights", [update_info] * len(self.engines))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.version += 1
        self._all("finish_weight_update", [self.version] * len(self.engines))

    def prompt_logprobs(self, token_ids: list[int]) -> list[list[float]]:
        return self._all("prompt_logprobs", [token_ids] * len(self.engines))

    def load_adapter(self, tensors: dict, config: dict) -> None:
        self.version += 1
        tensors = ray.put(tensors)  # once in the object store, whatever the number of engines
        self._all("load_adapter", [tensors] * len(self.engines), config, self.version)


class AdapterTransfer:
    """Adapter-only transfer engine: all ranks gather the adapters (a collective), rank 0 sends."""

    def __init__(self, model, client: EngineClient, is_sender: bool, dtype: torch.dtype):
        self.model, self.client, self.is_sender, self.dtype = model, client, is_sender, dtype

    def send_weights(self) -> None:
        tensors = lora.adapter_tensors(self.model, self.dtype)
        if self.is_sender:
            self.client.load_adapter(tensors, lora.config_dict(self.model))


class WeightSync:
    """A trainer rank's end of the weight sync (`transfer`: vLLM's trainer-side engine)."""

    def __init__(self, transfer, colocated: bool, model, probe: list[int], dtype, nbytes: int):
        self.transfer, self.colocated, self.nbytes = transfer, colocated, nbytes
        # probe: (ids, a VLM's pixels, the engines' request): vision.probe's
        self.model, self.probe, self.tolerance = model, probe, PROBE_TOLERANCE[dtype]
        if lora.on(model):  # the engines loaded only the base model: the first push, checked
            self.push()
            self.check()

    def push(self) -> int:
        """Send; returns the bytes each engine receives (perf/sync_bytes)."""
        if on_cuda := torch.cuda.is_available():  # vLLM reads on its own streams: finish the step
            torch.cuda.synchronize()
        self.transfer.send_weights()
        if on_cuda and self.colocated:  # free the gathered copies: the KV cache wakes next
            torch.cuda.empty_cache()
        return self.nbytes

    @torch.no_grad()
    def check(self) -> float | None:
        """Every rank: the trainer's log p of the probe (plain forward, no ring attention; under
        FSDP2 a collective); rank 0 returns the largest mean |log p_trainer - log p_engine|."""
        ring = next((m.sp_group for m in self.model.modules() if hasattr(m, "sp_group")), None)
        training, _ = self.model.training, self.model.eval()  # no dropout (--lora-dropout)
        enable_ring_attention(self.model, None)
        try:
            device = next(self.model.parameters()).device
            ids, pixels = torch.tensor([self.probe[0]], device=device), self.probe[1]
            images = {k: v.to(device) for k, v in vision.inputs(pixels).items()}
            logits = self.model(input_ids=ids, use_cache=False, **images).logits[0, :-1].float()
        finally:
            self.model.train(training)
            enable_ring_attention(self.model, ring)  # None: stays off
        mine = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None]).squeeze(1).cpu()
        if not self.transfer.is_sender:
            return None
        client, gap = self.transfer.client, 0.0
        engines = dict(zip(actor_names(client.engines), client.prompt_logprobs(self.probe[2])))
        for name, theirs in {"the trainer": mine, **engines}.items():  # the trainer's first
            if not (theirs := torch.as_tensor(theirs, dtype=mine.dtype)).isfinite().all():
                raise RuntimeError(
                    f"{name}: its log-probabilities of the probe text are not finite (an "
                    "overflow, a diverged step): train in --dtype float32 or lower --learning-rate"
                )
            gap = max(gap, diff := (theirs - mine).abs().mean().item())
            if not diff <= self.tolerance:
                raise RuntimeError(
                    f"{name} does not serve the weights just pushed: its "
                    "log-probabilities of a probe text differ from the trainer's "
                    f"by {diff:.3g} on average (allowed {self.tolerance:g})"
                )
        return gap


def init_weight_sync(
    model,
    tokenizer,
    engines: list,
    backend: str,
    rank: int,
    address: tuple,
    tp: int,
    dtype,
    merge_lora: bool = False,
) -> WeightSync:
    """The trainer side, built on every rank (a collective); rank 0 meets the engines at `address`.
    Weights travel in the engines' `dtype` (bf16 on GPU: half fp32's bytes). LoRA models send only
    the adapters (`merge_lora`: merged weights), once here: engines loaded only the base model."""
    probe = vision.probe(tokenizer, PROBE_TEXT)  # a VLM's (`tokenizer`: its processor): a picture
    if lora.on(model) and not merge_lora:
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        client = EngineClient(engines, tp, -1)  # the first push, the start (B = 0): version 0
        transfer = AdapterTransfer(model, client, rank == 0, dtype)
        return WeightSync(transfer, backend == "ipc", model, probe, dtype, trained * dtype.itemsize)
    addr, port = address
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ParamMeta, materialize_full_tensor
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    class CastSource(ModuleSource):
        """The engines' dtype: each FSDP2 shard cast, then gathered; with LoRA, W + (α / r) B A."""

        def metadata(self):
            return [
                ParamMeta(n.replace(".base_layer.", "."), dtype, tuple(p.shape))
                for n, p in self._module.named_parameters()
                if ".lora_" not in n
            ]

        def __iter__(self):
            if lora.on(self._module):
                yield from lora.merged(dict(self._module.named_parameters()), self._module, dtype)
            else:
                for name, param in self._module.named_parameters():
                    yield name, materialize_full_tensor(param.detach().to(dtype))
            if torch.cuda.is_available():  # over CUDA IPC another process reads the copies
                torch.cuda.current_stream().synchronize()

    group = dict(master_address=addr, master_port=port, world_size=1 + len(engines) * tp, rank=rank)
    if backend in ("gloo", "nccl"):  # one group: trainer rank 0 and every engine worker
        from common.vllm_worker import GlooTrainerInitInfo

        info = (GlooTrainerInitInfo if backend == "gloo" else NCCLTrainerInitInfo)(**group)
    else:  # ipc (choose_backend's three)
        # packed: one reused buffer (1 GiB, or the largest tensor) for all, not a copy on every GPU
        size = max(2**30, max(p.numel() for p in model.parameters()) * dtype.itemsize)
        info = IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=size)
    source, client = CastSource(model), EngineClient(engines, tp)
    transfer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    sent = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n)
    return WeightSync(transfer, backend == "ipc", model, probe, dtype, sent * dtype.itemsize)
