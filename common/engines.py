"""vLLM engines as Ray actors, one in-process `vllm.LLM` each (TP > 1: its workers are the actor's
children): token ids in, token ids and their temperature-processed sampling log-probs (what the
trainer recomputes) out. CPU choices are measured (see docs); eager: compiling costs a minute."""

import atexit
import logging
import os
import random
import shutil
import tempfile

import ray

from common.placement import wait_all, wait_started

# vLLM's warnings reach the terminal, less the KnownWarnings; its info lines do not. To see them:
#     VLLM_LOGGING_CONFIG_PATH= VLLM_LOGGING_LEVEL=INFO python grpo.py ...
LOGGING_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_logging.json")
QUIET = {"VLLM_LOGGING_CONFIG_PATH": LOGGING_CONFIG, "PYTHONWARNINGS": "ignore::FutureWarning"}
# The engine core in the actor's process (VLLM_ENABLE_V1_MULTIPROCESSING=1: its own); quiet
GPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **QUIET, "TORCH_CPP_LOG_LEVEL": "ERROR"}
CPU_ENV = {
    **GPU_ENV,
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # don't pin cores the trainers use
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),
}  # in turns: all cores each


class KnownWarnings(logging.Filter):
    """vLLM warnings dropped as noise (by vllm_logging.json): settings made on purpose (fp32
    weights served in bf16), CPU hints, the layer-reload one (vllm_worker.Whole makes it fatal)."""

    TEXTS = (
        "Failed to load weights",
        "The global random seed is set",
        "does not officially support disabling chunked",
        "Enforce eager set",
        "Inductor compilation was disabled",
        "Triton is not installed",
        "Model Runner V2 requires",
        "libtcmalloc is not found",
        "libiomp is not found",
        "leaving Torch threads",
        "torch.set_num_threads` after",
        "Reset SSM cache type",
        "different tokenizers for different LoRAs",
        "float32 into parameter",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.TEXTS)


def engine_args(model_path, seed, backend, tp, max_model_len, memory, lora=None, dtype="auto"):
    """vLLM's arguments for both engines, built in their actor; `lora`: {rank, targets}."""
    import torch
    from vllm.config import WeightTransferConfig

    from common.lora import VLLM_RANKS  # lazy, as transformers: actors that only place import this
    from common.precision import compute_dtype

    on_gpu = torch.cuda.is_available()
    dtype = compute_dtype(torch.device("cuda" if on_gpu else "cpu"), dtype)
    if not on_gpu:  # Ray gives a num_cpus=1 actor one thread; vLLM forbids changing it later
        torch.set_num_threads(os.cpu_count() or 1)
    # CPU: whole prompts only (a split prefill rewinds the seeded generator: vLLM crashes on CPU)
    cpu = {
        "kv_cache_memory_bytes": int(memory * 2**30),
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(8192, max_model_len),
    }
    if lora:  # one adapter, the policy's; no LoRA buffers on modules it does not adapt (lm_head)
        lora = dict(
            enable_lora=True,
            max_loras=1,
            lora_target_modules=lora["targets"],
            max_lora_rank=next(r for r in VLLM_RANKS if r >= lora["rank"]),
        )
    return dict(
        model=model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,  # per-request seeds crash with n > 1 on CPU; the engine's generator is seeded
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        # POSTTRAIN_EAGER=1 (tests, smoke checks): no CUDA-graph capture, minutes less per start
        enforce_eager=not on_gpu or os.environ.get("POSTTRAIN_EAGER") == "1",
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
        # Imported in every worker process: registers the checked-* backends (whole updates only)
        weight_transfer_config=WeightTransferConfig(backend=f"checked-{backend}"),
        worker_extension_cls="common.vllm_worker.WorkerExtension",
        **({"gpu_memory_utilization": memory} if on_gpu else cpu),
        **(lora or {}),
    )


@ray.remote
class Engine:
    def __init__(self, *engine, lora=None, dtype="auto"):
        """engine: (model_path, seed, backend, tp, max_model_len, memory, sleep_mode); `memory`: on
        GPU the fraction for weights + KV cache, on CPU GiB of KV cache."""
        from vllm import LLM

        args = engine_args(*engine[:6], lora, dtype)
        self.llm = LLM(**args, enable_sleep_mode=engine[6], use_tqdm_on_load=False)
        self.adapter = adapter_folder() if lora else None

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        temperature: float,
        top_p: float,
        max_tokens,
        seeds: list[int] | None = None,
        stop=None,
    ) -> list:
        """n samples for every prompt: [[{token_ids, logprobs, finish_reason}] * n] * len(prompts).
        `seeds[i] + j` seeds sample j of prompt i (its own request) in any batch, on any engine;
        `max_tokens`: a list, per prompt; `stop` strings end a sample (kept), add `prompt_ids`."""
        from vllm import SamplingParams, TokensPrompt

        # no text unless a stop string needs it (else vLLM decodes every token): the driver decodes
        base = dict(temperature=temperature, top_p=top_p, logprobs=0, detokenize=bool(stop))
        base |= dict(stop=stop, include_stop_str_in_output=True) if stop else {}
        limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        if seeds is None:
            requests, params = prompts, [SamplingParams(n=n, max_tokens=m, **base) for m in limits]
        else:
            requests = [p for p in prompts for _ in range(n)]
            params = [
                SamplingParams(n=1, seed=s + j, max_tokens=m, **base)
                for s, m in zip(seeds, limits)
                for j in range(n)
            ]
        # a VLM's prompt: its request (ids with one image token an image, its pictures)
        requests = [
            TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in requests
        ]
        lora = lora_request(self.adapter)
        outs = self.llm.generate(requests, params, use_tqdm=False, lora_request=lora)
        samples = [
            dict(
                token_ids=list(c.token_ids),
                finish_reason=c.finish_reason,
                logprobs=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                **({"prompt_ids": list(out.prompt_token_ids)} if stop else {}),
            )
            for out in outs
            for c in out.outputs
        ]
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    # The four calls of vLLM's weight-transfer protocol, driven by the trainer's transfer engine.
    def init_weight_transfer_engine(self, init_info: dict):
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self):
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: dict):
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, version: int):
        self.llm.collective_rpc("finish_weight_update")
        self.llm.llm_engine.reset_encoder_cache()  # a VLM's image features: the old weights'
        if not self.llm.reset_prefix_cache():  # cached KV blocks were computed by the old weights
            why = "after a weight update (requests running?)"
            raise RuntimeError(f"vLLM could not reset its prefix cache {why}")

    def prompt_logprobs(self, prompt) -> list[float]:
        """log p(token_i | tokens < i), i >= 1 (weight_sync's check); greedy: no generator draw.
        `prompt`: token ids, or a VLM's request (the tokens: as vLLM expands its images)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        request = TokensPrompt(prompt_token_ids=prompt) if isinstance(prompt, list) else prompt
        lora = lora_request(self.adapter)
        out = self.llm.generate([request], params, use_tqdm=False, lora_request=lora)[0]
        ids = out.prompt_token_ids
        return [lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:])]

    # Adapter-only sync (--lora-rank): the trainers' adapters, loaded in place by vLLM's LoRA API.
    def load_adapter(self, tensors: dict, config: dict, version: int):
        if not self.llm.llm_engine.add_lora(lora_request(self.adapter, tensors, config)):
            raise RuntimeError(f"vLLM did not load the adapters of version {version}")
        self.llm.llm_engine.reset_encoder_cache()
        if not self.llm.reset_prefix_cache():  # cached KV blocks were computed by the old adapters
            raise RuntimeError("vLLM could not reset its prefix cache after an adapter update")

    def sleep(self):
        """Free the GPU (CUDA only): level 2 drops weights (all resent), LoRA's 1 keeps the base."""
        self.llm.sleep(level=1 if self.adapter else 2)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Whether the engine is fully awake: vLLM resumes scheduling only then."""
        return self.llm.wake_up(tags)


def adapter_folder() -> str:
    """The engine's PEFT folder on its node (trainers may be elsewhere) for the trainers' adapters,
    rewritten at every sync, loaded in place under one id: requests in flight get the new ones."""
    import psutil  # a dependency of vLLM

    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):  # the folders of engines that are gone (Ray kills actors)
        pid = name.split("-")[2] if name.startswith("posttrain-adapter-") else ""
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    folder = tempfile.mkdtemp(prefix=f"posttrain-adapter-{os.getpid()}-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def lora_request(folder: str | None, tensors=None, config=None):
    """vLLM's request for the adapters in `folder` (None: no LoRA); with `tensors` and `config`
    (a sync) they are written first and vLLM reloads them in place (add_lora's)."""
    from vllm.lora.request import LoRARequest

    from common.lora import write_adapter

    if tensors is not None:
        write_adapter(folder, tensors, config)
    return folder and LoRARequest("policy", 1, folder, load_inplace=tensors is not None)


def sample_seeds(seed: int, draw, prompts) -> list[int]:
    """A sampling seed for each prompt of draw `draw` (a step, or one round or turn of a step): a
    function of the run's seed, the draw and the prompt's number only (`prompts`: a count, or the
    numbers), so a resumed run samples the same."""
    numbers = range(prompts) if isinstance(prompts, int) else prompts
    return [random.Random(f"{seed}/{draw}/{i}").getrandbits(48) for i in numbers]


def generate(
    engines: list,
    prompts: list[list[int]],
    *,
    n: int,
    temperature: float,
    top_p: float,
    max_tokens,
    seed=None,
    draw=None,
    index=None,
    stop=None,
) -> list:
    """Deal the prompts to the engines, n responses each, in order; seeded by `draw`. `index`: each
    prompt's own number (default: its place), which picks its engine (number % engines: an
    episode's turns meet their prefix in that engine's cache) and its seed."""
    k, index = len(engines), list(range(len(prompts)) if index is None else index)
    seeds = sample_seeds(seed, draw, index) if draw is not None else None
    rows = [[i for i, number in enumerate(index) if number % k == e] for e in range(k)]
    part = lambda v, mine: [v[i] for i in mine] if isinstance(v, list) else v  # noqa: E731
    refs = [
        e.generate.remote(
            part(prompts, mine),
            n,
            temperature,
            top_p,
            part(max_tokens, mine),
            part(seeds, mine),
            **({"stop": stop} if stop else {}),
        )
        for e, mine in zip(engines, rows)
    ]  # no stop: AsyncEngine's too
    outs = wait_all(refs, [f"Engine#{i}" for i in range(k)], "generate")
    placed = {i: samples for mine, out in zip(rows, outs) for i, samples in zip(mine, out)}
    return [placed[i] for i in range(len(prompts))]


def spawn_engines(pg, slots, args, model, backend, use_gpu, engine_cls=Engine, loading=(), **kw):
    """One engine per Slot as the flags say (--seed, --engine-tp, the longest prompt + response,
    --engine-memory, --colocate's sleep mode, LoRA's adapters, --dtype), up on return with the
    actors `loading` (the trainers load meanwhile, or first if they share a GPU: vLLM sizes its
    memory by what is free): a failed start is named. kw: the engine class's own arguments."""
    from common import lora, memory  # lazy, as in engine_args

    sleep_mode = getattr(args, "colocate", False)  # grpo_async.py's engines never sleep
    if sleep_mode:
        wait_started(list(loading))
    # The driver's VLLM_* settings go to all engines, e.g. VLLM_USE_V2_MODEL_RUNNER=0 (old runner)
    own = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    env = {**(GPU_ENV if use_gpu else CPU_ENV), **own}
    longest, kv = args.max_prompt_length + args.max_response_length, memory.engine_memory
    config = (backend, args.engine_tp, longest, kv(args, use_gpu, sleep_mode), sleep_mode)
    kw = kw | {"dtype": args.dtype}
    if args.lora_rank and not args.lora_merge_sync:  # adapter-only sync: LoRA in vLLM
        kw |= {"lora": {"rank": args.lora_rank, "targets": lora.targets(args)}}
    engines = [
        engine_cls.options(**s.options(pg, env)).remote(model, args.seed + i, *config, **kw)
        for i, s in enumerate(slots)
    ]
    wait_started([*loading, *engines])
    return engines
