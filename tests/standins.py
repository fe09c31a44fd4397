"""Stand-in actors: the interfaces of the scripts' actors (trainers, critics, engines) without a
model, CUDA or vLLM. They live here, apart from the test files, because Ray starts each actor in a
fresh process that imports the module defining its class: this one imports Ray and the standard
library only (a test file imports torch, transformers and the scripts: seconds per actor)."""

import asyncio
import os
import time

import ray


class StandIn:
    """Takes any constructor arguments; reports where Ray put it."""

    def __init__(self, *args, crash: bool = False, delay: float = 0.0, **kwargs):
        self.began_at = time.time()
        time.sleep(delay)
        if crash:
            raise RuntimeError("stand-in failed to start")
        self.started_at = time.time()

    def where(self) -> dict:
        ctx = ray.get_runtime_context()
        resources = ctx.get_assigned_resources()
        return {
            "node": ctx.get_node_id(),
            "gpu_ids": ray.get_gpu_ids(),
            "gpus": resources.get("GPU", 0.0),
            "cpus": resources.get("CPU", 0.0),
            "began_at": self.began_at,
            "started_at": self.started_at,
            "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "vllm_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
        }


class Trainer(StandIn):  # Ray names actors by class: the errors name the role
    pass


class Critic(StandIn):
    pass


class Engine(StandIn):
    pass


class SlowEngine(StandIn):
    def __init__(self, *args, **kwargs):
        super().__init__(delay=3.0)


class SlowTrainer(StandIn):
    def __init__(self, *args, **kwargs):
        super().__init__(delay=3.0)


class CrashingEngine(StandIn):
    def __init__(self, *args, **kwargs):
        super().__init__(crash=True)


class CrashingTrainer(StandIn):
    def __init__(self, *args, **kwargs):
        super().__init__(crash=True)


@ray.remote
class StandInEngine:
    """AsyncEngine's interface without vLLM. A group's tokens come one by one, 0.02 s apart: 3 of
    them, or 40 for every 4th seed (a long response, which spans weight updates); each token carries
    the version the engine holds when it is sampled, so a response can mix versions. After hold(),
    a group never ends."""

    def __init__(self):
        self.version, self.cancelled, self.tokens, self.held = 0, 0, 0, False

    async def hold(self):
        self.held = True

    async def start_weight_update(self):
        pass

    async def generate(self, prompts, n, temperature, top_p, max_tokens, seeds, after=None):
        versions = []
        try:
            while self.held or len(versions) < (40 if seeds[0] % 4 == 0 else 3):
                await asyncio.sleep(0.02)
                versions.append(self.version)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.tokens += n * len(versions)
        sample = {"token_ids": [7] * len(versions), "logprobs": [0.0] * len(versions)}
        return [[{**sample, "versions": versions}] * n]

    async def set_version(self, version):
        self.version = version

    async def get_stats(self):
        return {"tokens": self.tokens, "cancelled": self.cancelled}

    async def shutdown(self):
        pass


@ray.remote
class Busy:
    def work(self, seconds: float):
        time.sleep(seconds)


@ray.remote(num_cpus=0)
class SleepyEngine:
    """A colocated engine whose last wake-up leaves it asleep (vLLM then schedules nothing)."""

    def wake_up(self, tags):
        return False


@ray.remote(num_cpus=0)
class NoOpTrainer:
    def push_weights(self):
        pass

    def probe_engines(self):
        pass


@ray.remote
class Echo:
    """A trainer rank for greedy.accuracy: its "completion" of a prompt is the prompt's last
    token."""

    def run(self, fn, prompts, max_new_tokens):  # the trainer shell runs greedy.generate
        assert fn.__module__ == "common.greedy" and fn.__name__ == "generate"
        return [[p[-1]] for p in prompts]
