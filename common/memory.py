"""The memory plan: what each GPU of a job must hold, checked before anything starts. Per parameter
a trainer rank holds (FSDP2-sharded) fp32 weights (4 B), gradients (4 B, freed after each step) and
AdamW's moments (8 B); a frozen reference (or distill.py's teacher, per its parameter) 4 B. While
computing it adds compute-dtype copies (2 B; fp32 4 B) of two decoder layers and the root, their
gradients, activations and the LM head's chunk. Engines take their --engine-memory share; a reward
model is whole; each process adds a CUDA context. LoRA: a frozen compute-dtype base (also π_ref) +
16 B per adapter parameter. --ema-beta: fp32 shards of θ_ema (4 B; on --resume its checkpoint's
copy is loaded first, 4 B more for a moment, before AdamW's state: below the training peak). A model
that needs SDPA's mask over a packed row (sliding windows, softcaps: common/packed_attn.py) keeps a
T x T bias per layer for the backward. All lower bounds: a plan that fits is never refused."""

import copy
import math
import os
from dataclasses import dataclass, replace

import torch

from common.errors import InputError
from common.lm_head import HEAD_CHUNK_BYTES
from common.precision import BYTES, SHORT, check_served_in, first_gpu

GiB = 2**30
CONTEXT = 1.0 * GiB  # per GPU process: its CUDA context, workspaces (0.8 on an H200: benchmarks.md)


@dataclass(frozen=True)
class Shape:
    """What the plan needs to know of a model: parameter counts, the sizes that set activations."""

    params: int  # all parameters (tied weights once)
    layer: int  # the largest decoder layer's parameters
    root: int  # parameters outside the decoder layers: embeddings, final norm, LM or score head
    layers: int
    hidden: int
    intermediate: int
    kv: int  # key/value heads x head dim
    vocab: int
    adapters: int = 0  # trained parameters of its LoRA adapters (and head); 0: fully trained
    masked: bool = False  # a packed row gets SDPA's T x T mask (common/packed_attn.needs_mask)


def shape_of(config, head: str = "lm", lora: tuple = (0, ())) -> Shape:
    """Exact counts from the model (HF config or folder) built on the meta device; head "lm" or
    "score" (one label); lora (rank, targets): r (in + out) per adapted linear, score head whole."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from common.packed_attn import needs_mask

    config = AutoConfig.from_pretrained(config) if isinstance(config, str) else config
    if head != "lm":
        config = copy.deepcopy(config)
        config.num_labels = 1
    auto_cls = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
    if hasattr(config, "vision_config"):  # a VLM: its vision tower and connector in the root
        from transformers import AutoModelForImageTextToText as auto_cls
    with torch.device("meta"):
        model = auto_cls.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.get_decoder().layers]
    text = config.get_text_config()
    heads, hidden = text.num_attention_heads, text.hidden_size
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    rank, targets = lora
    adapted = [
        m
        for layer in model.get_decoder().layers
        for name, m in layer.named_modules()
        if isinstance(m, torch.nn.Linear) and name.split(".")[-1] in targets
    ]
    adapters = sum(rank * (m.in_features + m.out_features) for m in adapted)
    adapters += hidden if rank and head != "lm" else 0
    return Shape(
        params=params,
        layer=max(layers),
        root=params - sum(layers),
        layers=len(layers),
        hidden=hidden,
        intermediate=getattr(text, "intermediate_size", 4 * hidden),
        kv=getattr(text, "num_key_value_heads", heads) * head_dim,
        vocab=text.vocab_size,
        adapters=adapters,
        masked=needs_mask(config),
    )


@dataclass(frozen=True)
class Job:
    """A run as the plan sees it: the models, how many ranks share each, the layout, the flags."""

    policy: Shape
    trainers: int  # FSDP2 ranks of the policy (the parameters are sharded over all of them)
    tokens: int  # --max-tokens-per-micro-batch
    sp: int = 1  # ring attention: a rank holds tokens / sp of every row
    checkpointing: bool = False  # --gradient-checkpointing
    reference: bool = False  # a frozen copy of the policy on the trainer ranks
    lm_head: float = 3  # chunks of logits its LM head holds (6.5 with --top-p < 1: it sorts them)
    engines: int = 0
    engine_tp: int = 1
    engine_memory: float = 0.0  # fraction of a GPU for each engine (vLLM's gpu_memory_utilization)
    colocate: bool = False
    critic: Shape | None = None  # ppo.py's critic, on its own ranks or colocated with the policy's
    critics: int = 0
    reward_model: Shape | None = None
    offload: bool = False  # colocated ppo.py: critic and reward model wait in host RAM when idle
    dtype: str = "bfloat16"  # the compute dtype (--dtype as chosen): 2 B per value, float32 4 B
    ema: bool = False  # --ema-beta: fp32 shards of θ_ema beside θ's
    teacher: Shape | None = None  # a frozen other model on the trainer ranks (distill.py)


def trainer(s: Shape, ranks, tokens, ckpt: bool, lm_head: float, dtype: str, ema=False, sp=1):
    """(resident between steps, training) bytes of one rank of a trained model, by part."""
    b, short = BYTES[dtype], SHORT[dtype]  # the compute dtype's bytes per value, its short name
    base = {f"frozen {short} base": b * s.params / ranks} if s.adapters else {}
    base |= {"EMA (fp32)": 4 * s.params / ranks} if ema else {}  # (LoRA has no EMA)
    trained, count = ("adapters", s.adapters) if s.adapters else ("weights", s.params)
    idle = {**base, f"{trained} + AdamW": 12 * count / ranks}  # grads: freed after each step
    busy = {**base, f"{trained} + grads + AdamW": 16 * count / ranks}
    if s.masked and sp == 1:  # ring attention has no mask; checkpointing keeps one layer's
        busy["packed-row masks"] = b * tokens**2 * (1 if ckpt else s.layers)
    # two decoder layers (in use, prefetched) and the root gathered, with their grads if trained
    busy[f"gathered {short} layers"] = b * (1 + (not s.adapters)) * (2 * s.layer + s.root)
    # what autograd keeps: per layer its input, normed inputs, q/k/v, attention output, MLP gate, up
    # and product; checkpointing: the layers' inputs + one layer's
    layer = tokens * (6 * s.hidden + 2 * s.kv + 4 * s.intermediate) * b
    busy["activations"] = s.layers * tokens * s.hidden * b + layer if ckpt else s.layers * layer
    if lm_head:  # the chunk's logits, probabilities and their gradient; the head's fp32 gradient
        busy["LM head"] = lm_head * HEAD_CHUNK_BYTES + (not s.adapters) * 4 * s.vocab * s.hidden
    return idle, busy


def needs(job: Job, capacity: float) -> list[tuple[str, str, dict]]:
    """(GPU, phase, {part: bytes}) for each kind of GPU of the job and each phase of its peak."""
    tokens, ckpt = job.tokens // job.sp, job.checkpointing
    policy = job.policy, job.trainers, tokens, ckpt, job.lm_head, job.dtype, job.ema, job.sp
    idle, busy = trainer(*policy)
    ref = {"reference": 4 * job.policy.params / job.trainers} if job.reference else {}
    ref |= {"teacher": 4 * job.teacher.params / job.trainers} if job.teacher else {}
    engine = {"vLLM (weights + KV cache)": job.engine_memory * capacity} if job.engines else {}
    parts = ({}, {})
    if job.critic:
        parts = trainer(job.critic, job.critics, tokens, ckpt, 0, job.dtype, sp=job.sp)  # no EMA
    critic_idle, critic_busy = ({f"critic {k}": v for k, v in p.items()} for p in parts)
    rm = {"reward model": BYTES[job.dtype] * job.reward_model.params} if job.reward_model else {}

    if not job.colocate:  # a GPU of each kind the job has (a kind it lacks: no parts)
        ctx = {"CUDA contexts": CONTEXT}
        rows = [
            ("trainer GPU", "training", {**busy, **ref}),
            ("critic GPU", "training", critic_busy),
            ("engine GPU", "generating", engine),
            ("reward-model GPU", "scoring", rm),
        ]
        return [(gpu, phase, {**ctx, **parts}) for gpu, phase, parts in rows if parts]
    # Colocated (hybrid engine): every model on GPU 0, taking turns; phases differ in what is held.
    ctx = {"CUDA contexts": (1 + bool(job.engines) + (job.critic is not None) + bool(rm)) * CONTEXT}
    parked = {} if job.offload else {**critic_idle, **rm}  # offloaded: in host RAM until needed
    rows = [
        ("GPU 0", "generating", {**ctx, **engine, **idle, **ref, **parked}),
        ("GPU 0", "training the policy", {**ctx, **busy, **ref, **parked}),
    ]
    if job.critic is not None:  # the reward model waits on the GPU unless offloaded to host RAM
        critic = {**ctx, **idle, **ref, **critic_busy, **({} if job.offload else rm)}
        rows.append(("GPU 0", "training the critic", critic))
    return rows


def peak(job: Job, capacity: float) -> tuple[str, str, dict, float]:
    """The GPU and phase that need the most, with their parts and total bytes."""
    return max(((*row, sum(row[2].values())) for row in needs(job, capacity)), key=lambda r: r[3])


def engine_weights_fit(job: Job, capacity: float) -> bool:
    """vLLM holds the model's weights (over --engine-tp GPUs) in its share, with KV room."""
    weights = BYTES[job.dtype] * job.policy.params / job.engine_tp
    return not job.engines or weights < 0.9 * job.engine_memory * capacity


def fits(job: Job, capacity: float) -> bool:
    return peak(job, capacity)[3] <= capacity and engine_weights_fit(job, capacity)


def describe(row: tuple, capacity: float | None) -> str:
    """One line, parts over 0.05 GiB: "GPU 0 training the policy needs 21.3 GiB of 79 (...)"."""
    gpu, phase, parts, total = row
    parts = sorted(parts.items(), key=lambda kv: -kv[1])
    detail = ", ".join(f"{k} {v / GiB:.1f}" for k, v in parts if v >= GiB / 20)
    of = f" of {capacity / GiB:.0f}" if capacity else ""
    return f"{gpu} {phase} needs {total / GiB:.1f} GiB{of} ({detail})"


def check(job: Job, capacity: float | None, lora_job: Job | None = None) -> tuple[Job, str]:
    """Refuse, in one line with the numbers and the remedies, a job that cannot fit; else return the
    job (colocated critic and reward model offloaded if that fits) and the plan line."""
    if capacity is None:
        return job, f"memory plan (GPU size unknown, not checked): {describe(peak(job, GiB), None)}"
    if job.colocate and (job.critic or job.reward_model) and not fits(job, capacity):
        job = offloaded if fits(offloaded := replace(job, offload=True), capacity) else job
    if not engine_weights_fit(job, capacity):
        need, short = BYTES[job.dtype] * job.policy.params / job.engine_tp / GiB, SHORT[job.dtype]
        raise InputError(
            f"memory plan: the engine's {short} weights ({need:.1f} GiB per GPU) do "
            f"not fit --engine-memory {job.engine_memory:g} of "
            f"{capacity / GiB:.0f} GiB with room for a KV cache: raise --engine-memory"
            + ("" if job.colocate else " or --engine-tp")
        )
    if (worst := peak(job, capacity))[3] > capacity:
        fixes = []  # up to three flag changes that make it fit, cheapest first
        if lora_job is not None and fits(lora_job, capacity):
            fixes.append("--lora-rank 16")
        if not job.checkpointing and fits(replace(job, checkpointing=True), capacity):
            fixes.append("--gradient-checkpointing")
        tokens = job.tokens // 2
        while tokens >= 256 and not fits(replace(job, tokens=tokens), capacity):
            tokens //= 2
        if tokens >= 256:
            fixes.append(f"--max-tokens-per-micro-batch {tokens}")
        half = replace(job, engine_memory=job.engine_memory / 2)
        if job.colocate and job.engines and fits(half, capacity):
            fixes.append(f"--engine-memory {half.engine_memory:.2g}")
        for ranks in [r for r in (2, 4, 8, 16, 32, 64, 128) if r > job.trainers]:
            if fits(replace(job, trainers=ranks, critics=ranks if job.critics else 0), capacity):
                extra = f" --num-engines {ranks}" if job.colocate and job.engines else ""
                fixes.append(f"more GPUs: --num-trainers {ranks}{extra}")
                break
        hint = f"; it would fit with {' or '.join(fixes[:3])}" if fixes else ""
        raise InputError(f"memory plan: {describe(worst, capacity)}: does not fit{hint}")
    note = ", the critic and reward model wait in host RAM when idle" if job.offload else ""
    return job, f"memory plan: {describe(worst, capacity)}: fits{note}"


def check_run(
    flags,
    use_gpu: bool,
    policy: str,
    reference=False,
    critic=None,
    reward_model=None,
    *,
    head="lm",
    entropy=False,
    teacher=None,
) -> bool:
    """GPU: plan a run (model folders), print the plan, refuse it if it cannot fit; return whether
    idle models are offloaded. `flags`: the run's flags, read here (--max-tokens-per-micro-batch,
    the longest prompt + response, --top-p, --colocate, --num-critics where a script has them); by
    keyword what the script decides (entropy: H_t, a head chunk more; teacher: distill.py's frozen
    model's folder). CPU: each engine's KV cache holds a prompt + response (else vLLM won't start),
    and all fit in RAM."""
    tokens, critics = flags.max_tokens_per_micro_batch, getattr(flags, "num_critics", 0)
    longest = getattr(flags, "max_prompt_length", 0) + getattr(flags, "max_response_length", 0)
    top_p, colocate = getattr(flags, "top_p", 1.0), getattr(flags, "colocate", False)
    engines = getattr(flags, "num_engines", 0)  # the RL scripts'
    if not use_gpu and engines:
        shape = shape_of(policy)
        blocks = math.ceil(longest / 128) + 1  # vLLM's CPU blocks of 128 tokens, one kept empty
        need = 2 * shape.layers * shape.kv * 4 * 128 * blocks / GiB  # K, V of every layer, fp32
        size = engine_memory(flags, False)
        here = 1 if "RAY_ADDRESS" in os.environ else engines  # engines on this machine
        if size < need:
            raise InputError(
                f"--engine-memory {size:g} GiB of KV cache cannot hold one prompt + "
                f"response ({longest} tokens) of this model: give it at least "
                f"{math.ceil(need * 100) / 100:g}"
            )
        if here * size * GiB > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
            each = f" for each of {here} engines" if here > 1 else ""
            raise InputError(
                f"--engine-memory {size:g} GiB of KV cache{each} is more than this machine's RAM"
            )
    if not use_gpu:
        return False
    if engines:  # vLLM refuses some models in float16: before anything loads
        from transformers import AutoConfig

        check_served_in(flags.dtype, AutoConfig.from_pretrained(policy))
    chunks = (head == "lm") * ((6.5 if top_p < 1 else 3) + entropy)
    targets = [t.strip() for t in flags.lora_target_modules.split(",")]

    def plan(rank: int) -> Job:  # with LoRA adapters of this rank (0: every weight trained)
        return Job(
            policy=shape_of(policy, head, (rank, targets)),
            trainers=flags.num_trainers,
            sp=flags.sp_size,
            tokens=tokens,
            checkpointing=flags.gradient_checkpointing,
            reference=reference and not rank,
            lm_head=chunks,
            engines=engines,
            engine_tp=flags.engine_tp if engines else 1,
            colocate=colocate,
            critics=critics,
            engine_memory=engine_memory(flags, True, colocate) if engines else 0.0,
            critic=shape_of(critic, "score", (rank, targets)) if critic else None,
            reward_model=shape_of(reward_model, "score") if reward_model else None,
            dtype=flags.dtype if flags.dtype in BYTES else "bfloat16",  # "auto": 2 B, as bf16
            ema=getattr(flags, "ema_beta", 0) > 0,
            teacher=shape_of(teacher) if teacher else None,
        )

    # one GPU's bytes: $POSTTRAIN_GPU_MEMORY_GIB, else nvidia-smi's (no CUDA here), else unknown
    capacity = float(os.environ.get("POSTTRAIN_GPU_MEMORY_GIB") or 0) * GiB or None
    if capacity is None and (mib := first_gpu("memory.total")) and mib[0].isdigit():
        capacity = float(mib[0]) * 2**20
    rank = flags.lora_rank  # without LoRA, say whether rank-16 adapters would fit
    job, line = check(plan(rank), capacity, None if rank or not targets[0] else plan(16))
    print(line, flush=True)
    return job.offload


def engine_memory(flags, use_gpu: bool = True, colocate: bool = False) -> float:
    """--engine-memory: the GPU's fraction (default 0.85, colocated 0.4); CPU: KV-cache GiB (1)."""
    if use_gpu and (flags.engine_memory or 0) > 1:  # the one check of the flag, in check_machine
        raise InputError("--engine-memory is a fraction of each GPU's memory: at most 1")
    return flags.engine_memory or ((0.4 if colocate else 0.85) if use_gpu else 1.0)
