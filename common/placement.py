"""Ray placement: start Ray (joining a cluster never hangs), reserve a job's bundles (`Layout`) all
at once or wait (never deadlocked half-placed), place actors on them, join trainers' torch group."""

import atexit
import contextlib
import math
import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common import lifetime
from common.errors import InputError, RunError, stop_on_signals

RPC_TIMEOUT_S = float(os.environ.get("POSTTRAIN_RPC_TIMEOUT", 3600))
# A cold vLLM start on GPU (compile, autotune): 207 s for 0.5B on an H100; more with TP, big models
START_TIMEOUT_S = float(os.environ.get("POSTTRAIN_START_TIMEOUT", 1800))
WATCH_S = 5.0  # how often a call's wait checks the actors it watches


def count_gpus() -> tuple[int, str]:
    """How many GPUs the job may use, and where: this machine's, or on a Ray cluster ($RAY_ADDRESS,
    joined to count) the cluster's, whatever the driver's node has (a KubeRay head pod has none)."""
    if "RAY_ADDRESS" in os.environ:
        init_ray()
        gpus = int(ray.cluster_resources().get("GPU", 0))
        return gpus, f"the Ray cluster at {os.environ['RAY_ADDRESS']}"
    return (torch.cuda.device_count() if torch.cuda.is_available() else 0), "this machine"


def choose_layout(split: int, colocated: int | None, colocate: bool, why_apart="") -> tuple:
    """(use GPUs, colocate) for `split` GPUs apart or `colocated` shared (None: cannot; `why_apart`
    says why). Shared with --colocate or too few GPUs (one: the usual machine); never on CPU."""
    have, where = count_gpus()
    if have == 0:
        if colocate:
            raise InputError("--colocate needs GPUs (vLLM's sleep mode is CUDA-only)")
        return False, False
    if colocated is not None and (colocate or split > have) and colocated <= have:
        why = "" if colocate else f": {where} has {have}, too few to give every actor its own"
        print(f"layout: colocated on {colocated} GPU{'s' * (colocated > 1)}{why}", flush=True)
        return True, True
    if colocate:
        raise InputError(f"--colocate: this job needs {colocated} GPUs but {where} has {have}")
    if split > have:
        shared = f" ({colocated} colocated)" if colocated is not None else why_apart
        raise InputError(f"this job needs {split} GPUs{shared} but {where} has {have}")
    print(f"layout: {split} GPU{'s' * (split > 1)}, every actor on GPUs of its own", flush=True)
    return True, False


def init_ray(num_bundles: int = 0) -> None:
    """Start a private local Ray for `num_bundles` bundles, or join the cluster at $RAY_ADDRESS."""
    if ray.is_initialized():
        return
    if "RAY_ADDRESS" not in os.environ and (alive := lifetime.other_ray_processes()):
        named = ", ".join(alive[:4]) + (", ..." if len(alive) > 4 else "")
        print(
            f"note: {len(alive)} Ray processes not of this run are alive here ({named}): another "
            "run's or program's; `kill` them if you need their memory",
            flush=True,
        )
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")  # `ray job`'s env_vars: `env` wins
    # Actors import `common` and the scripts' modules: the repo is importable wherever they start.
    pythonpath = os.pathsep.join(p for p in (lifetime.REPO, os.environ.get("PYTHONPATH")) if p)
    quiet = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env = {"PYTHONPATH": pythonpath, **quiet, "TRANSFORMERS_VERBOSITY": "error"}
    env.update([lifetime.mark_run().split("=", 1)])  # every process of the run: its marker
    env |= {k: v for k, v in os.environ.items() if k.startswith("POSTTRAIN_")}  # the switches too
    opts = dict(runtime_env={"env_vars": env}, logging_level="ERROR")
    if "RAY_ADDRESS" in os.environ:  # a cluster, joined on purpose
        where = f"the Ray cluster at {os.environ['RAY_ADDRESS']} ($RAY_ADDRESS)"
        join_cluster(os.environ["RAY_ADDRESS"], where, opts)
    else:  # a private instance, also when someone's `ray start` runs on this machine
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token: it is ours alone
        num_cpus = max(os.cpu_count() or 1, num_bundles + 1)  # scheduling tokens, not cores
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **opts)
        where = "a private local Ray instance (set RAY_ADDRESS to join a cluster)"
    stop_on_signals()  # again: ray.init installs its own handlers
    atexit.register(lifetime.end_ray)  # before Ray's own exit hook: stop it, wait for the processes
    nodes, gpus = len(ray.nodes()), int(ray.cluster_resources().get("GPU", 0))
    print(f"ray: {where}: {nodes} node{'s' * (nodes > 1)}, {gpus} GPUs", flush=True)


def join_cluster(address: str, where: str, opts: dict) -> None:
    """ray.init(address), or one line: nothing listens (a 5 s TCP check), no token, or no answer
    within $POSTTRAIN_JOIN_TIMEOUT s (30; Ray's own connect would retry for minutes)."""
    host, _, port = address.split("://")[-1].rpartition(":")
    if host and port.isdigit():
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as e:
            why = f"nothing answers at {host}:{port} ({e.strerror or e}): is its head node up"
            raise InputError(f"could not join {where}: {why} (`ray start --head`)?") from None
    limit = float(os.environ.get("POSTTRAIN_JOIN_TIMEOUT", 30))

    def too_long():
        why = f"no answer within {limit:g} s ($POSTTRAIN_JOIN_TIMEOUT): is it a Ray head's GCS port"
        print(f"error: could not join {where}: {why}?", file=sys.stderr, flush=True)
        os._exit(1)

    (timer := threading.Timer(limit, too_long)).start()
    try:
        ray.init(address=address, **opts)
    except (ConnectionError, RuntimeError) as e:
        auth = "Authentication" in repr(e.__cause__) and os.getenv("RAY_AUTH_MODE") != "token"
        hint = "; it wants its token: set RAY_AUTH_MODE=token" if auth else ""  # sent only if told
        raise InputError(f"could not join {where}: {str(e).splitlines()[0]}{hint}") from None
    finally:
        timer.cancel()


@dataclass
class Slot:
    """Where one actor goes: bundle `bundle` of the job's placement group, and how much of it."""

    bundle: int
    num_gpus: float
    num_cpus: float = 1

    def options(self, pg, env: dict | None = None) -> dict:
        """Ray actor options that place the actor here. An actor without a GPU gets CUDA hidden:
        Ray (2.60) no longer hides the node's GPUs from it; torch, NCCL or vLLM would use cuda:0."""
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=self.bundle)
        env = {**(env or {}), **({} if self.num_gpus else {"CUDA_VISIBLE_DEVICES": ""})}
        opts = dict(num_cpus=self.num_cpus, num_gpus=self.num_gpus, scheduling_strategy=strategy)
        return opts | ({"runtime_env": {"env_vars": env}} if env else {})


class Layout:
    """A job's bundles and each actor's slot. With `colocate`: only trainer ranks have bundles;
    engine i, critic rank i and the reward model (bundle 0) share rank i's GPU equally (turns: vLLM
    sleeps while others train), not its CPU (asking twice hangs). CPU: a one-CPU bundle each."""

    def __init__(
        self,
        use_gpu: bool,
        trainers: int,
        engines=0,
        engine_tp=1,
        colocate=False,
        critics=0,
        reward_model=False,
    ):
        gpu = 1.0 if use_gpu else 0.0
        if not colocate:
            self.bundles = [1] * (trainers + critics) + [engine_tp] * engines + [1] * reward_model
            self.trainers = [Slot(r, gpu) for r in range(trainers)]
            self.critics = [Slot(trainers + r, gpu) for r in range(critics)]
            self.engines = [Slot(trainers + critics + i, gpu * engine_tp) for i in range(engines)]
            self.reward_model = Slot(len(self.bundles) - 1, gpu) if reward_model else None
            return
        self.bundles, shared = [1] * trainers, 1 + (engines > 0) + (critics > 0)
        tenants = [shared + (reward_model and r == 0) for r in range(trainers)]
        share = [math.floor(1e4 / n) / 1e4 for n in tenants]  # Ray counts to 4 decimals
        self.trainers = [Slot(r, share[r]) for r in range(trainers)]
        self.critics = [Slot(r, share[r], num_cpus=0) for r in range(critics)]
        self.engines = [Slot(i, share[i], num_cpus=0) for i in range(engines)]
        self.reward_model = Slot(0, share[0], num_cpus=0) if reward_model else None


def make_placement_group(gpus_per_bundle: list[int], use_gpu: bool):
    """Reserve one bundle per entry (its GPUs and a CPU on GPU; a CPU on CPU), wait for them."""
    bundles = [{"GPU": g, "CPU": 1} if use_gpu else {"CPU": 1} for g in gpus_per_bundle]
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=300)
    except ray.exceptions.GetTimeoutError:
        why = "(too few free GPUs or CPUs?)"
        raise RunError(f"Ray could not reserve the bundles {bundles} within 300 s {why}") from None
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    if len(set(nodes.values())) > 1:  # on a cluster, say where everything went
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        where = ", ".join(f"{i}: {nodes[i][:8]} ({ips.get(nodes[i], '?')})" for i in sorted(nodes))
        print(f"placement: bundle -> node: {where}", flush=True)
    return pg


@ray.remote(num_cpus=0)
def _free_address() -> tuple[str, int]:
    """A port free until rank 0 listens on it (seconds later, after loading a model): below the
    kernel's ephemeral range (bind(0)'s), which outgoing connections (Ray's) may take meanwhile."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for port in random.Random().sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s, contextlib.suppress(OSError):  # taken: the next one
            s.bind(("", port))
            return ray.util.get_node_ip_address(), port
    raise RuntimeError(f"no free port below the ephemeral range (it starts at {low})")


def rendezvous_address(pg, bundle: int = 0) -> tuple[str, int]:
    """An (ip, free port) on the node of `bundle`, for rank 0 of a torch.distributed group."""
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
    return ray.get(_free_address.options(scheduling_strategy=strategy).remote(), timeout=60)


def spawn_trainers(actor_cls, pg, slots: list[Slot], *args, **kwargs) -> list:
    """One `actor_cls` per slot (rank r in slots[r]) as actor_cls(*args, rank, world_size,
    master_addr (rank 0's node), master_port, **kwargs), still loading on return: wait_started, or
    hand them to spawn_engines (they load meanwhile). Its __init__ calls `init_distributed`."""
    addr, port = rendezvous_address(pg, slots[0].bundle)
    return [
        actor_cls.options(**s.options(pg)).remote(*args, r, len(slots), addr, port, **kwargs)
        for r, s in enumerate(slots)
    ]


def start_trainers(actor_cls, use_gpu: bool, num_trainers: int, *args, **kwargs) -> list:
    """Start Ray and place the trainer ranks alone (one GPU each, or a share of the CPU cores), as
    spawn_trainers, and wait for them: sft.py, rm.py, dpo.py. `args`: the shell's (trainer.py)."""
    layout = Layout(use_gpu, num_trainers)
    init_ray(len(layout.bundles))
    pg = make_placement_group(layout.bundles, use_gpu)
    trainers = spawn_trainers(actor_cls, pg, layout.trainers, *args, **kwargs)
    wait_started(trainers)
    return trainers


def wait_started(actors: list) -> None:
    """Wait for all actors' __init__: one that crashes or times out (hung, unplaceable) is named."""
    refs = [a.__ray_ready__.remote() for a in actors]
    wait_all(refs, actor_names(actors), "start-up", START_TIMEOUT_S)


def init_distributed(rank: int, world_size: int, addr: str, port: int):
    """Join the trainers' process group (NCCL on GPU, gloo on CPU); returns this rank's device."""
    env = dict(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(env)
    group = dict(rank=rank, world_size=world_size, timeout=timedelta(minutes=30))
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)  # Ray exposes exactly this actor's GPU as device 0
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **group)
    else:
        device = torch.device("cpu")
        # Ray gives a num_cpus=1 actor OMP_NUM_THREADS=1; the trainer ranks share the cores instead.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo", **group)
    return device


def call(actors: list, method: str, *args, per_rank=None, timeout=RPC_TIMEOUT_S, watch=(), **kw):
    """Call `method` (a name, or a script's function run on trainer shells) on every actor,
    `per_rank[i]` first if given: the results. One dead or silent for `timeout` s, or one of
    `watch` (busy: engines) dying, is a one-line RunError, not a hang (shutdown ends the rest)."""
    name, fn = (method, ()) if isinstance(method, str) else ("run", (method,))
    refs = [
        getattr(a, name).remote(*fn, *([per_rank[i]] if per_rank is not None else []), *args, **kw)
        for i, a in enumerate(actors)
    ]
    return wait_all(refs, actor_names(actors), getattr(method, "__name__", method), timeout, watch)


def wait_all(refs: list, names: list[str], what: str, timeout=RPC_TIMEOUT_S, watch=()) -> list:
    pending, watched = dict(zip(refs, names)), {}
    for actor, name in zip(watch, actor_names(watch)):  # a ping each, answered between its calls
        watched[actor.__ray_ready__.remote()] = (actor, name)
    left, deadline = list(refs), time.monotonic() + timeout
    while left:  # one at a time: a failure surfaces at once, even if peers hang in a collective
        wait_s = min(max(0.0, deadline - time.monotonic()), WATCH_S if watched else math.inf)
        ready, left = ray.wait(left, num_returns=1, timeout=wait_s, fetch_local=False)
        pings = ray.wait(list(watched), num_returns=len(watched), timeout=0)[0] if watch else []
        for ping in pings:
            actor, name = watched.pop(ping)
            _get(ping, name, what)  # a watched actor that died
            watched[actor.__ray_ready__.remote()] = (actor, name)
        if ready:
            _get(ready[0], pending[ready[0]], what)
        elif time.monotonic() >= deadline:
            late = ", ".join(pending[r] for r in left)
            hint = " (raise POSTTRAIN_START_TIMEOUT to wait longer)" if what == "start-up" else ""
            raise RunError(f"{late} did not finish {what} within {timeout:.0f} s{hint}")
    return ray.get(refs)


def _get(ref, name: str, what: str):
    try:
        return ray.get(ref)
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
        died = isinstance(e, ray.exceptions.RayActorError)
        cause, how = (e, "died during") if died else (e.cause or e, "failed in")
        line = (str(cause).strip().splitlines() or [""])[-1]
        raise RunError(f"{name} {how} {what}: {type(cause).__name__}: {line}") from None


def actor_names(actors: list) -> list[str]:  # "Trainer#0", "Engine#1": each class counts apart
    classes = [a._ray_actor_creation_function_descriptor.class_name for a in actors]
    return [f"{name}#{classes[:i].count(name)}" for i, name in enumerate(classes)]
