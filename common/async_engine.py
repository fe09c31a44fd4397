"""grpo_async.py's engine: AsyncLLM in a Ray actor, updated between decoding steps (PipelineRL)."""

import asyncio
import time
import uuid

import ray

from common.engines import adapter_folder, engine_args, lora_request


@ray.remote
class AsyncEngine:
    """Weight updates pause the scheduler between steps, keeping running requests (`mode="keep"`:
    decoding layers mid-reload would fail), re-prefilled for the new policy unless `keep_old_kv`.
    `deterministic`: a call's requests are scheduled together, sharing no prefix cache with other
    calls: what a sequence is batched with, and so its numbers, do not depend on timing."""

    def __init__(self, *engine, keep_old_kv=False, lora=None, dtype="auto", deterministic=False):
        """engine: Engine's first arguments (model_path, seed, backend, tp, max_model_len, memory,
        sleep_mode; it never sleeps: it generates while the trainers train)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(*engine[:6], lora, dtype)
        self.adapter = adapter_folder() if lora else None
        # Ray runs an async actor's __init__ in its event loop, which AsyncLLM's output task joins.
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args, disable_log_stats=True))
        self.keep_old_kv, self.deterministic, self.version = keep_old_kv, deterministic, 0
        self.requests = 0  # running now
        self.stats = {"tokens": 0, "idle_s": 0.0, "paused_s": 0.0}  # running totals: get_stats
        self.intervals = []  # (what, start, end), wall clock: "idle" (no request) or "paused"
        self.idle_since, self.paused_at = time.time(), None

    async def generate(self, prompts, n, temperature, top_p, max_tokens, seeds=None, after=None):
        """As Engine.generate; each sample also has `versions`: the weight version of each token.
        `after`: an earlier call's result, which Ray waits for before this call starts."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        base = dict(temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0)
        base["detokenize"] = False  # the driver decodes the tokens it reads
        lora = lora_request(self.adapter)
        # deterministic: no prefix cache shared with other calls (a resumed engine has none)
        salt = uuid.uuid4().hex if self.deterministic else ""

        async def one(i: int, j: int) -> dict:  # sample j of prompt i
            seed = None if seeds is None else seeds[i] + j
            params = SamplingParams(n=1, seed=seed, output_kind=RequestOutputKind.DELTA, **base)
            request, token_ids, logprobs = self._request(prompts[i], salt), [], []
            async for out in self.llm.generate(
                request, params, uuid.uuid4().hex, lora_request=lora
            ):
                c = out.outputs[0]  # the new tokens of a step
                token_ids += c.token_ids
                logprobs += [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
                self.stats["tokens"] += len(c.token_ids)
            return dict(
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                versions=token_versions(len(token_ids), c.weight_versions),
            )

        if self.requests == 0:  # the engine had nothing to do since idle_since
            self._interval("idle", self.idle_since)
        self.requests += len(prompts) * n
        try:
            if self.deterministic:  # the scheduler holds the requests until all have arrived
                await self.llm.get_supported_tasks()  # cached: adding a request then never waits
                await self.llm.pause_generation(mode="keep", clear_cache=False)
            calls = [
                asyncio.ensure_future(one(i, j)) for i in range(len(prompts)) for j in range(n)
            ]
            if self.deterministic:
                await asyncio.sleep(0)  # each call runs until it waits for its first tokens
                await self.llm.resume_generation()  # sent after the requests, on their channel
            samples = await asyncio.gather(*calls)
        finally:
            self.requests -= len(prompts) * n
            if self.requests == 0:
                self.idle_since = time.time()
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _request(self, prompt, salt: str = ""):
        """A prompt (ids, or a VLM's request: with its pictures) through AsyncLLM's renderer, salted
        by weight version: no stale prefix cache."""
        prompt = prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt}
        prompt = {**prompt, "cache_salt": salt or f"v{self.version}"}
        return self.llm.renderer.render_cmpl([prompt])[0]  # one prompt in, one request out

    # The weight-transfer protocol; the update happens between start (pause) and finish (resume).
    async def init_weight_transfer_engine(self, init_info: dict):
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def start_weight_update(self):
        self.paused_at = time.time()
        await self.llm.pause_generation(mode="keep", clear_cache=not self.keep_old_kv)
        await self.llm.start_weight_update()

    async def update_weights(self, update_info: dict):
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish_weight_update(self, version: int):
        await self.llm.finish_weight_update(weight_version=str(version))  # labels the next tokens
        await self.llm.reset_encoder_cache()  # a VLM's image features: the old weights'
        self.version = version
        await self.llm.resume_generation()
        self._interval("paused", self.paused_at)

    async def load_adapter(self, tensors: dict, config: dict, version: int):
        """Adapter-only sync (--lora-rank), in place between two steps (requests keep its id)."""
        self.paused_at = time.time()
        await self.llm.pause_generation(mode="keep", clear_cache=not self.keep_old_kv)
        if not await self.llm.add_lora(lora_request(self.adapter, tensors, config)):
            raise RuntimeError(f"vLLM did not load the adapters of version {version}")
        await self.llm.update_weight_version(str(version))
        self.version = version
        await self.llm.resume_generation()
        self._interval("paused", self.paused_at)

    def _interval(self, what: str, start: float):
        self.intervals.append((what, start, end := time.time()))
        self.stats[f"{what}_s"] += end - start

    async def prompt_logprobs(self, prompt) -> list[float]:
        """As Engine.prompt_logprobs, served between the running requests' decoding steps."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        request, lora = self._request(prompt), lora_request(self.adapter)
        outs = self.llm.generate(request, params, uuid.uuid4().hex, lora_request=lora)
        outs = [out async for out in outs]
        ids = outs[-1].prompt_token_ids
        return [lp[t].logprob for t, lp in zip(ids[1:], outs[-1].prompt_logprobs[1:])]

    async def get_stats(self) -> dict:
        """Running totals: tokens sampled, seconds idle (no request), seconds paused by updates."""
        idle = time.time() - self.idle_since if self.requests == 0 else 0.0
        return dict(self.stats, idle_s=self.stats["idle_s"] + idle)

    async def get_timeline(self) -> list[tuple[str, float, float]]:
        """The idle and paused intervals so far (wall clock); the engine generated the rest."""
        return list(self.intervals)

    async def shutdown(self):
        self.llm.shutdown()  # stops the engine-core process now rather than at interpreter teardown


def token_versions(num_tokens: int, spans) -> list[int]:
    """Each token's weight version from vLLM's [start, end) spans ("default": 0); gaps raise."""
    versions = [None] * num_tokens
    for span in spans or []:
        version = int(span.version.replace("default", "0"))
        versions[span.start : span.end] = [version] * (span.end - span.start)
    if None in versions:
        labelled = num_tokens - versions.count(None)
        raise RuntimeError(
            f"vLLM gave a weight version to {labelled} of {num_tokens} sampled "
            "tokens: lags and the lag bound cannot be known"
        )
    return versions
