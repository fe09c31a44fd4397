"""The trainer shell: one FSDP2 rank of the model a script trains, driven by the script's functions
(composition, as nanoGPT's train.py drives model.py). What every script's trainer does around its
update lives here once: the sharded model, LoRA, ring attention, π_ref, the optimizer step, the
weight push, save and load. `call(trainers, train_step, ...)` runs train_step(trainer, ...) on every
rank with this object as `trainer` (model, frozen, optimizer, local_part, optimizer_step)."""

import copy
import importlib.util
import math

import ray
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as sd
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers import AutoModelForImageTextToText as AutoVLM

from common import checkpoint, lora, optim, packed_attn, placement, vision, weight_sync
from common.models import to_device
from common.precision import LossScale, compute_dtype
from common.ring_attn import Responses, enable_ring_attention, shard_micro_batch, sp_groups


def load_model(auto_cls, path, device, gradient_checkpointing, adapters=None, dtype="auto", **cfg):
    """(A model of `auto_cls` sharded with FSDP2, filled by load_weights; the weights it lacked).
    Built on meta, the RNG untouched (rm.py's new seeded head is drawn as from_pretrained draws it);
    on GPU it computes in `dtype`. `adapters`: LoRA on the frozen base; `cfg`: config overrides."""
    base = adapters.base if adapters else path
    compute = compute_dtype(device, dtype)  # fp32 on CPU
    config = AutoConfig.from_pretrained(base, **cfg)
    attn = attn_implementation(device, compute, config)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = auto_cls.from_config(config, dtype=torch.float32, attn_implementation=attn)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if adapters:
        adapters.add(model, compute)  # the frozen base in the compute dtype
    mp = MixedPrecisionPolicy(compute, reduce_dtype=torch.float32)  # fp32 masters and reduction
    # each decoder layer, then the root (a VLM's vision tower and connector: in the root's group)
    for module in [*model.get_decoder().layers, model]:
        fully_shard(module, mp_policy=mp)
    return model, load_weights(model, auto_cls, base, device, adapters)


def load_weights(model, auto_cls, path: str, device, adapters=None) -> list[str]:
    """Allocate the sharded meta `model` on `device`, fill it from `path` (a collective): rank 0
    reads it with from_pretrained (key renames, tied weights, init of missing ones), broadcasts it
    tensor by tensor, each rank keeps its shard; buffers outside the state dict (RoPE's) too.
    `adapters`: rank 0 puts the same on its copy. Returns the keys the checkpoint lacked."""
    model.to_empty(device=device)
    full, buffers, missing = {}, {}, []
    if dist.get_rank() == 0:
        # "eager" attention: this copy only holds the weights; flash-attn would refuse a CPU model
        kwargs = dict(dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
        source, info = auto_cls.from_pretrained(path, config=copy.deepcopy(model.config), **kwargs)
        if adapters is not None:
            adapters.fill(source)
        full, buffers = source.state_dict(), dict(source.named_buffers())
        missing = sorted(info["missing_keys"])
    options = sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    sd.set_model_state_dict(model, full, options=options)
    in_state_dict = set(model.state_dict())
    with torch.no_grad():
        for name, buffer in [(n, b) for n, b in model.named_buffers() if n not in in_state_dict]:
            if dist.get_rank() == 0:
                buffer.copy_(buffers[name])
            dist.broadcast(buffer, src=0)
    message = [missing]
    dist.broadcast_object_list(message, src=0)
    return message[0]


def attn_implementation(device, dtype, config) -> str:
    """flash-attn 2 where it runs (installed, CUDA, Ampere or newer GPUs, 16-bit), else SDPA that
    attends each sequence of a packed row only to itself (common/packed_attn.py)."""
    half = dtype in (torch.float16, torch.bfloat16)
    if device.type != "cuda" or not half or importlib.util.find_spec("flash_attn") is None:
        return packed_attn.enable(config)
    ampere = torch.cuda.get_device_capability(device)[0] >= 8
    return "flash_attention_2" if ampere else packed_attn.enable(config)


def load_policy(path: str, device, gradient_checkpointing: bool, adapters=None, dtype="auto"):
    """The policy: a causal LM or a VLM (image-text-to-text), sharded by load_model (every script's
    model but rm.py's)."""
    base = adapters.base if adapters else path
    auto_cls = AutoVLM if vision.is_vlm(base, base) else AutoModelForCausalLM
    args = path, device, gradient_checkpointing, adapters, dtype
    return load_model(auto_cls, *args)[0]  # the model, not the weights it lacked


def lr_at(step: int, peak: float, warmup_steps: int, num_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up to the peak, then cosine decay to min_lr_ratio * peak at the last step."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step + 1 - warmup_steps) / max(1, num_steps - warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return peak * (min_lr_ratio + (1 - min_lr_ratio) * cosine)


class Trainer:
    averaged = True  # --ema-beta keeps θ_ema of this model (the Critic: no)

    def __init__(
        self,
        load,
        policy: str,
        start: str,
        args,
        rank,
        world,
        addr,
        port,
        *,
        frozen=(),
        whole=(),
        learning_rate=None,
        offload=False,
    ):
        """`load(path, device, gradient_checkpointing, adapters, dtype)`: the script's loader for
        `policy` (the model, or the checkpoint to resume); `start`: the start model (π_ref, LoRA's
        base). From `args`, the script's flags: Resources (seed, sp_size, dtype,
        gradient_checkpointing), LoRA, Optimization (optimizer, the schedule's warm-up and floor,
        weight decay, gradient clip, ema_beta), learning_rate, num_steps, colocate (an engine shares
        this GPU) where the script has it. By keyword: `frozen`, the frozen models (names, or (name,
        folder)s); `whole`, modules LoRA trains whole (a score head); `learning_rate` (the critic's
        own); `offload` (the memory plan's: the model waits in host RAM between calls)."""
        self.args, self.rank, self.world_size, self.offload = args, rank, world, offload
        self.learning_rate = learning_rate or args.learning_rate
        self.device = placement.init_distributed(rank, world, addr, port)
        torch.manual_seed(args.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(policy)
        adapters = lora.adapters(args, start, policy, whole)  # on the start model
        self.model = load(policy, self.device, args.gradient_checkpointing, adapters, args.dtype)
        self.processor = vision.freeze(self.model, policy, getattr(args, "train_vision", False))
        self.sp = sp_groups(world, args.sp_size)  # DP x SP: ranks [k*sp, (k+1)*sp) share shard k
        enable_ring_attention(self.model, self.sp.group)  # a no-op when --sp-size is 1
        # π_ref: a frozen copy of the start model (also on --resume), named by the values it gives;
        # (name, folder): a frozen other model (distill.py's teacher; folder None: the start model)
        frozen = [f if isinstance(f, tuple) else (f, None) for f in frozen]
        self.frozen = {n: self.frozen_model(load, p, start, adapters) for n, p in frozen}
        decay = args.weight_decay  # LoRA: only the adapters are trained
        self.optimizer = optim.make_optimizer(self.model, args.optimizer, self.learning_rate, decay)
        self.ema = None  # θ_ema (--ema-beta): this rank's shards of it
        if self.averaged and args.ema_beta:
            self.ema = optim.ema_start(self.model, load, policy, self.device, args.dtype)
        self.scaler = LossScale(compute_dtype(self.device, args.dtype))  # float16 only
        self.on_gpu(False)

    def frozen_model(self, load, path: str | None, start: str, adapters):
        if adapters and path is None:  # the start: the policy with its adapters off, no second copy
            return lora.Disabled(self.model)
        frozen = load(path or start, self.device, False, None, self.args.dtype)
        enable_ring_attention(frozen.eval().requires_grad_(False), self.sp.group)
        return frozen

    def run(self, fn, *args):
        """A script's function on this rank, as fn(trainer, *args): its update, its evaluation."""
        out = fn(self, *args)
        if getattr(self.args, "colocate", False):  # the cached memory back: the engine here wakes
            torch.cuda.empty_cache()
        return out

    def local_part(self, mb: dict) -> dict:
        """A micro-batch on this rank's device; with --sp-size k, its 2 of each row's 2k chunks.
        "responses": which sequence each of its loss tokens is (ring_attn.Responses)."""
        mb = {k: v.to(self.device) for k, v in mb.items()}
        index = (mb["position_ids"] == 0).cumsum(1) - 1  # (1, T): each token's sequence
        mb = shard_micro_batch({**mb, "seq": index}, self.sp.rank, self.sp.size)
        at = mb.pop("seq")[0, mb["loss_mask"][0].bool()]
        return {**mb, "responses": Responses(at, int(index[0, -1]) + 1, self.sp.group)}

    def optimizer_step(self, step: int) -> float:
        """Clip the global gradient norm and step; a non-finite norm (the same on every rank) stops
        every rank before the update: weights never NaN. float16: unscaled first; an overflow skips
        the update, lowers the loss scale. Returns the norm (0: skipped); sets self.lr, the rate."""
        a = self.args
        self.lr = lr_at(step, self.learning_rate, a.warmup_steps, a.num_steps, a.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        self.scaler.unscale(self.model.parameters())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if self.scaler.skip(grad_norm, step):
            self.optimizer.zero_grad(set_to_none=True)
            return 0.0
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(
                f"non-finite loss or gradient norm ({grad_norm.item()}) at step {step + 1}"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema:
            optim.ema_update(self.ema, self.model, a.ema_beta)
        return grad_norm.item()

    def on_gpu(self, needed: bool):
        """`offload` (the memory plan's choice): model and optimizer wait in host RAM when idle."""
        if self.offload:
            to_device(self.model, self.optimizer, self.device if needed else "cpu")

    def init_weight_sync(self, engines: list, backend: str, addr: str, port: int, tp, merge):
        dtype = compute_dtype(self.device, self.args.dtype)  # the engines'
        files = self.processor or self.tokenizer  # a VLM's probe holds a picture
        args = (self.model, files, engines, backend, self.rank, (addr, port), tp, dtype)
        self.weight_sync = weight_sync.init_weight_sync(*args, merge)

    def push_weights(self) -> int:
        return self.weight_sync.push()  # the bytes each engine received

    def probe_engines(self) -> float | None:  # rank 0: the gap; a stale engine stops the run
        return self.weight_sync.check()

    def save(self, path: str, step: int, with_optimizer=True):  # a collective: rank 0 writes
        scale = self.scaler.state_dict()
        files = self.processor or self.tokenizer  # a VLM's processor: its tokenizer and more
        args = self.model, self.optimizer, files, path, step, with_optimizer
        checkpoint.save(*args, loss_scale=scale)
        if self.ema:  # θ_ema beside it: an HF folder of its own, ema/
            optim.ema_swap(self)
            checkpoint.save(self.model, None, files, f"{path}/ema", step, False)
            optim.ema_swap(self)

    def load_optimizer(self, path: str):
        """Rank 0 reads the checkpoint's optimizer state, each rank keeps its shard; the loss scale
        to every rank (checkpoints from before it was saved: the start's)."""
        opts = sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        state = torch.load(f"{path}/trainer_state.pt", weights_only=False) if self.rank == 0 else {}
        optim = state.get("optimizer", {})
        sd.set_optimizer_state_dict(self.model, self.optimizer, optim, options=opts)
        scale = [state.get("loss_scale")]
        dist.broadcast_object_list(scale, src=0)
        if scale[0] is not None:
            self.scaler.load_state_dict(scale[0])


class Critic(Trainer):
    """ppo.py's value model V_φ: the same shell under its own name (errors say Critic#i), no EMA."""

    averaged = False


Trainer, Critic = ray.remote(Trainer), ray.remote(Critic)
