"""vLLM generation engines as Ray actors: create, generate, sleep/wake, and the weight-update entry points.

Each engine is one `vllm.LLM` living inside a Ray actor (vLLM runs in-process; with tensor parallelism > 1 its
worker processes are children of the actor). The driver sends token ids and gets back token ids and the
sampling log-probabilities, already temperature-processed (`logprobs_mode="processed_logprobs"`), which is
what the trainer recomputes for importance sampling.

CPU notes (measured, see docs): the in-process engine avoids shared-memory queues; the default OMP core binding
would fight the co-located trainers; CUDA graphs and torch.compile cost a minute of start-up for little gain.
"""

import os
import random
import time
import uuid

import ray

from common.placement import Slot, wait_all, wait_started

QUIET = {"VLLM_LOGGING_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore::FutureWarning", "TORCH_CPP_LOG_LEVEL": "ERROR"}
CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the actor's process: fast start, no /dev/shm
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # don't pin cores that the trainer ranks also use
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),  # trainers and engines take turns: each may use every core
    **QUIET,
}
GPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **QUIET}


def engine_args(model_path: str, seed: int, backend: str, tp: int, max_model_len: int, memory: float, on_gpu: bool):
    """vLLM's arguments, the same for both engines."""
    from vllm.config import WeightTransferConfig

    cpu = {
        "kv_cache_memory_bytes": int(memory * 2**30),
        # A prefill split over two steps rewinds the request's seeded generator, which a CPU generator cannot do
        # (vLLM crashes): prefill whole prompts only, with a token budget that fits many (the offline default).
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(8192, max_model_len),
    }
    return dict(
        model=model_path,
        seed=seed,  # per-request seeds crash with n > 1 on CPU; the engine's generator is seeded instead
        dtype="bfloat16" if on_gpu else "float32",
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        max_model_len=max_model_len,
        enforce_eager=not on_gpu,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
        weight_transfer_config=WeightTransferConfig(backend=backend),
        # Imported in every worker process; registers the CPU "gloo" weight-transfer backend with vLLM.
        worker_extension_cls="common.gloo_transfer.WorkerExtension",
        **({"gpu_memory_utilization": memory} if on_gpu else cpu),
    )


@ray.remote
class Engine:
    def __init__(
        self, model_path: str, seed: int, backend: str, tp: int, max_model_len: int, memory: float, sleep_mode: bool
    ):
        """`memory`: fraction of GPU memory for weights + KV cache on GPU, GiB of KV cache on CPU."""
        import torch
        from vllm import LLM

        on_gpu = torch.cuda.is_available()
        if not on_gpu:  # Ray gives a num_cpus=1 actor one thread; vLLM forbids changing it after start-up
            torch.set_num_threads(os.cpu_count() or 1)
        self.llm = LLM(
            **engine_args(model_path, seed, backend, tp, max_model_len, memory, on_gpu),
            enable_sleep_mode=sleep_mode,
            use_tqdm_on_load=False,
        )
        self.version = 0

    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float, max_tokens: int,
                 seeds: list[int] | None = None) -> list:  # fmt: skip
        """n samples for every prompt: [[{token_ids, logprobs, finish_reason}] * n] * len(prompts).

        With `seeds` (one per prompt), sample j of prompt i is a request of its own seeded seeds[i] + j: the same
        tokens whatever else is in the batch and whichever engine runs it, which makes --resume exact. (One
        request with n samples and a seed crashes vLLM on CPU.)
        """
        from vllm import SamplingParams, TokensPrompt

        base = dict(temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0)
        if seeds is None:
            requests, params = prompts, SamplingParams(n=n, **base)
        else:
            requests = [p for p in prompts for _ in range(n)]
            params = [SamplingParams(n=1, seed=s + j, **base) for s in seeds for j in range(n)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in requests], params, use_tqdm=False)
        samples = [
            {
                "token_ids": list(c.token_ids),
                "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                "finish_reason": c.finish_reason,
            }
            for out in outputs
            for c in out.outputs
        ]
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    # The four calls of vLLM's weight-transfer protocol, driven by the trainer's weight-transfer engine.
    def init_weight_transfer_engine(self, init_info: dict):
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self):
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: dict):
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, version: int):
        self.llm.collective_rpc("finish_weight_update")
        if not self.llm.reset_prefix_cache():  # cached KV blocks were computed by the old weights
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update (requests running?)")
        self.version = version

    def sleep(self):
        """Free the GPU for training. CUDA only. Level 2 drops the weights too, instead of copying them to host
        RAM and back (level 1): the trainer sends every weight before the engine runs again."""
        self.llm.sleep(level=2)

    def wake_up(self, tags: list[str] | None = None):
        self.llm.wake_up(tags)

    def get_version(self) -> int:
        return self.version


@ray.remote
class AsyncEngine:
    """An engine that never stops: vLLM's AsyncLLM, for grpo_async.py. Requests stream in and out while new
    weights arrive between two decoding steps (PipelineRL's in-flight weight update).

    Engine's constructor and methods, all async: Ray runs them concurrently, so a weight update is served while
    `generate` calls are in flight. AsyncLLM always runs vLLM's engine core in a child process of the actor.

    An update pauses the scheduler between two steps, keeping the running requests (`mode="keep"`); the layers
    are reloaded in place, so decoding them mid-update would fail. Then, by default (`keep_old_kv` False), every
    running request is preempted and its prompt + tokens so far are prefilled again with the new weights: the
    tokens after the update are sampled by exactly the new policy (what the trainer can recompute). With
    `keep_old_kv` (PipelineRL), the KV cache computed by the old weights is kept: no re-prefill, but the new
    tokens attend to old-weight keys and values. Prompts carry `cache_salt` = the version, so no request reuses
    prefix-cache blocks of an older version in either mode.
    """

    def __init__(
        self, model_path: str, seed: int, backend: str, tp: int, max_model_len: int, memory: float, sleep_mode: bool,
        keep_old_kv: bool = False,
    ):  # fmt: skip
        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            torch.set_num_threads(os.cpu_count() or 1)
        assert not sleep_mode, "AsyncEngine never sleeps: it generates while the trainers train"
        args = engine_args(model_path, seed, backend, tp, max_model_len, memory, on_gpu)
        # Ray runs an async actor's __init__ in its event loop, which AsyncLLM's output handler joins.
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args, disable_log_stats=True))
        self.keep_old_kv, self.version, self.requests = keep_old_kv, 0, 0
        self.stats = {"tokens": 0, "idle_s": 0.0, "paused_s": 0.0}  # running totals, read by `get_stats`
        self.intervals = []  # (what, start, end) in wall-clock seconds: "idle" (no request) and "paused" (update)
        self.idle_since, self.paused_at = time.time(), None

    async def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float, max_tokens: int,
                       seeds: list[int] | None = None) -> list:  # fmt: skip
        """As Engine.generate, and each sample also has `versions`: the weight version of every token."""
        import asyncio

        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        async def one(prompt: list[int], seed: int | None) -> dict:
            params = SamplingParams(n=1, seed=seed, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                    logprobs=0, output_kind=RequestOutputKind.DELTA)  # fmt: skip
            request = {"prompt_token_ids": prompt, "cache_salt": f"v{self.version}"}
            token_ids, logprobs = [], []
            async for out in self.llm.generate(request, params, uuid.uuid4().hex):  # the new tokens of each step
                c = out.outputs[0]
                token_ids += c.token_ids
                logprobs += [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
                self.stats["tokens"] += len(c.token_ids)
            versions = [0] * len(token_ids)
            for span in c.weight_versions or []:  # tokens [start, end) were sampled by `version`; "default" is 0
                versions[span.start : span.end] = [int(span.version.replace("default", "0"))] * (span.end - span.start)
            return dict(token_ids=token_ids, logprobs=logprobs, finish_reason=c.finish_reason, versions=versions)

        if self.requests == 0:  # the engine had nothing to do since idle_since
            self._interval("idle", self.idle_since)
        self.requests += len(prompts) * n
        try:
            samples = await asyncio.gather(
                *[one(p, None if seeds is None else seeds[i] + j) for i, p in enumerate(prompts) for j in range(n)]
            )
        finally:
            self.requests -= len(prompts) * n
            if self.requests == 0:
                self.idle_since = time.time()
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    # The weight-transfer protocol; the update happens between start (pause) and finish (resume).
    async def init_weight_transfer_engine(self, init_info: dict):
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def start_weight_update(self):
        self.paused_at = time.time()
        # Waits for the decoding step in progress; running requests stay. Without keep_old_kv they are
        # preempted and prefilled again after the resume (and the prefix cache is emptied).
        await self.llm.pause_generation(mode="keep", clear_cache=not self.keep_old_kv)
        await self.llm.start_weight_update()

    async def update_weights(self, update_info: dict):
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish_weight_update(self, version: int):
        await self.llm.finish_weight_update(weight_version=str(version))  # labels the tokens sampled from now on
        self.version = version
        await self.llm.resume_generation()
        self._interval("paused", self.paused_at)

    def _interval(self, what: str, start: float):
        end = time.time()
        self.intervals.append((what, start, end))
        self.stats[f"{what}_s"] += end - start

    async def get_stats(self) -> dict:
        """Running totals: tokens sampled, seconds with no request (waiting for work), seconds paused by updates."""
        idle = time.time() - self.idle_since if self.requests == 0 else 0.0
        return dict(self.stats, idle_s=self.stats["idle_s"] + idle)

    async def get_timeline(self) -> list[tuple[str, float, float]]:
        """The idle and paused intervals so far (wall clock): the engine generated the rest of the time."""
        return list(self.intervals)

    async def shutdown(self):
        self.llm.shutdown()  # stops the engine-core process now rather than at interpreter teardown


def sample_seeds(seed: int, draw: int, num_prompts: int) -> list[int]:
    """A sampling seed for each prompt of draw `draw` (a step, or one round of a step): a pure function of the
    run's seed, the draw and the prompt's place in it, so a resumed run samples what the uninterrupted run did."""
    return [random.Random(f"{seed}/{draw}/{i}").getrandbits(48) for i in range(num_prompts)]


def generate(engines: list, prompts: list[list[int]], *, n: int, temperature: float, top_p: float, max_tokens: int,
             seed: int | None = None, draw: int | None = None) -> list:  # fmt: skip
    """Deal the prompts round-robin to the engines, sample n responses each; results in prompt order.

    With `draw` (the step, or one round of a step) each prompt's samples are seeded by the run's seed, the draw
    and the prompt's place in it (sample_seeds), so a resumed run samples the tokens the uninterrupted run did.
    An engine that dies is named (wait_all).
    """
    k = len(engines)
    seeds = sample_seeds(seed, draw, len(prompts)) if draw is not None else None
    refs = [
        e.generate.remote(prompts[i::k], n, temperature, top_p, max_tokens, seeds and seeds[i::k])
        for i, e in enumerate(engines)
    ]
    outs = wait_all(refs, [f"Engine#{i}" for i in range(k)], "generate")
    results = [None] * len(prompts)
    for i, out in enumerate(outs):
        results[i::k] = out
    return results


def spawn_engines(
    pg, slots: list[Slot], *, model_path: str, seed: int, backend: str, tp: int, max_model_len: int, memory: float,
    use_gpu: bool, sleep_mode: bool = False, engine_cls=Engine, **engine_kwargs,
) -> list:  # fmt: skip
    """Start one engine per slot (Layout.engines) and wait until every one has loaded its model.

    On GPU the engine owns its slot's `tp` GPUs (vLLM's TP workers are child processes and see the actor's
    GPUs), or, colocated, half of a trainer rank's GPU, sleeping while the trainers train (`sleep_mode`).
    The wait comes before anything rendezvouses with the engines, so an engine that fails to start is named
    here rather than surfacing as a weight-sync timeout. `engine_cls`: AsyncEngine (with its `engine_kwargs`),
    or a stand-in for placement tests.
    """
    env = GPU_ENV if use_gpu else CPU_ENV
    engines = [
        engine_cls.options(**slot.options(pg, env)).remote(
            model_path, seed + i, backend, tp, max_model_len, memory, sleep_mode, **engine_kwargs
        )
        for i, slot in enumerate(slots)
    ]
    wait_started(engines)
    return engines
