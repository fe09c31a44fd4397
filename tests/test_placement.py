"""GPU and multi-node placements, proven on a CPU machine: Ray's logical GPUs and a simulated
cluster.

What each script picks on 1, 2 and 8 GPUs comes from the scripts' own checks; stand-in actors (no
CUDA, no model) are then placed with the scripts' own calls (Layout, make_placement_group,
spawn_trainers, spawn_engines), as each script would place its trainers, critics, engines and reward
model. Each layout must be scheduled within a minute (an actor that Ray cannot place waits forever),
every actor on its bundle's node with the GPU share meant for it, colocated actors on one GPU and
the others on GPUs of their own; an actor without a GPU must not see any (Ray 2.60 no longer hides
the node's GPUs from it).
"""

import importlib
import os
import re
import time

import pytest
import ray
from conftest import REPO, engine_flags
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table
from standins import (
    CrashingEngine,
    CrashingTrainer,
    Critic,
    Engine,
    SlowEngine,
    SlowTrainer,
    StandIn,
    Trainer,
)

from common import placement
from common.engines import spawn_engines
from common.placement import (
    Layout,
    choose_layout,
    make_placement_group,
    spawn_trainers,
    wait_started,
)

TESTS_ON_PATH = {
    "env_vars": {"PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}
}  # stand-ins
SCHEDULE_S = 60  # generous for starting a dozen worker processes on 2 cores; an unschedulable actor never starts


RemoteTrainer, RemoteCritic, RemoteEngine = (ray.remote(c) for c in (Trainer, Critic, Engine))


def place(layout: Layout, tp: int = 1, use_gpu: bool = True) -> dict[str, list[tuple]]:
    """Place every actor of `layout` as the scripts do; returns {role: [(slot, where)]}."""
    pg = make_placement_group(layout.bundles, use_gpu=use_gpu)
    trainers = spawn_trainers(RemoteTrainer, pg, layout.trainers, "args", "model")
    actors = {"trainer": trainers}
    if layout.critics:
        actors["critic"] = spawn_trainers(RemoteCritic, pg, layout.critics, "m")
    if layout.reward_model:
        actors["reward_model"] = [
            ray.remote(StandIn).options(**layout.reward_model.options(pg)).remote()
        ]
    loading = [a for group in actors.values() for a in group]  # all up once the engines are
    if layout.engines:
        flags = engine_flags(64, memory=0.4, engine_tp=tp)
        actors["engine"] = spawn_engines(
            pg, layout.engines, flags, "model", "nccl", use_gpu, RemoteEngine, loading
        )
    wait_started(loading)  # sft, rm, dpo: no engines
    slots = {"trainer": layout.trainers, "critic": layout.critics, "engine": layout.engines}
    slots["reward_model"] = [layout.reward_model]
    placed = {
        role: list(zip(slots[role], ray.get([a.where.remote() for a in group], timeout=SCHEDULE_S)))
        for role, group in actors.items()
    }
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    for role, group in placed.items():
        for slot, where in group:
            assert where["node"] == nodes[slot.bundle], (
                f"{role} on bundle {slot.bundle} is not on that bundle's node"
            )
            assert len(where["gpu_ids"]) == (max(1, int(where["gpus"])) if use_gpu else 0), (
                role,
                where,
            )
    by_bundle: dict[int, set] = {}
    for group in placed.values():
        for slot, where in group:
            by_bundle.setdefault(slot.bundle, set()).add(
                (where["node"], tuple(sorted(where["gpu_ids"])))
            )
    assert all(len(gpus) == 1 for gpus in by_bundle.values()), (
        f"actors of one bundle on different GPUs: {by_bundle}"
    )
    used = [(node, g) for gpus in by_bundle.values() for node, ids in gpus for g in ids]
    assert len(used) == len(set(used)), f"two bundles share a GPU: {by_bundle}"
    for group in actors.values():
        for a in group:
            ray.kill(a)
    ray.util.remove_placement_group(pg)
    return placed


def shares(placed, role):
    return [(slot.bundle, where["gpus"], where["cpus"]) for slot, where in placed[role]]


@pytest.fixture(autouse=True)
def short_start_timeout(monkeypatch):
    monkeypatch.setattr(placement, "START_TIMEOUT_S", SCHEDULE_S)


@pytest.fixture(autouse=True)
def gpus_are_logical(monkeypatch):
    """The test command hides CUDA (CUDA_VISIBLE_DEVICES=""), and Ray refuses logical GPUs beside an
    empty CUDA_VISIBLE_DEVICES; the stand-ins never touch CUDA, so the variable can go."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture(scope="module")
def logical_gpus():
    hidden = os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # see gpus_are_logical
    ray.shutdown()  # the session's CPU instance (conftest.start_ray_cpu), if it runs
    ray.init(
        address="local",  # not a Ray someone started here
        num_cpus=16,
        num_gpus=8,
        include_dashboard=False,
        logging_level="ERROR",
        runtime_env=TESTS_ON_PATH,
    )
    yield
    ray.shutdown()
    if hidden is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = hidden


def test_one_gpu_colocated(logical_gpus):
    """grpo.py --colocate on 1 GPU: trainer and engine share bundle 0; the engine asks for no
    CPU."""
    placed = place(Layout(True, trainers=1, engines=1, colocate=True))
    assert shares(placed, "trainer") == [(0, 0.5, 1.0)]
    assert shares(placed, "engine") == [(0, 0.5, 0.0)]
    assert placed["trainer"][0][1]["gpu_ids"] == placed["engine"][0][1]["gpu_ids"]


def test_actors_without_a_gpu_see_no_cuda(logical_gpus):
    """A CPU layout on a machine with GPUs (8 logical ones here): every actor gets
    CUDA_VISIBLE_DEVICES="" so torch, NCCL and vLLM cannot pick cuda:0; an actor with a GPU sees
    exactly its own."""
    placed = place(Layout(False, trainers=2, engines=1), use_gpu=False)
    for role in ("trainer", "engine"):
        assert [where["cuda_visible"] for _, where in placed[role]] == [""] * len(placed[role]), (
            role
        )
    placed = place(Layout(True, trainers=2, engines=1))
    for role in ("trainer", "engine"):
        for _, where in placed[role]:
            assert where["cuda_visible"] == ",".join(map(str, where["gpu_ids"])) != "", (
                role,
                where,
            )


def test_two_gpus_split(logical_gpus, monkeypatch):
    """Also: the engines log vLLM's warnings through the project's logging config, and the driver's
    VLLM_* settings reach them (the documented fallback to vLLM's previous model runner among
    them)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    placed = place(Layout(True, trainers=1, engines=1))
    assert shares(placed, "trainer") == [(0, 1.0, 1.0)]
    assert shares(placed, "engine") == [(1, 1.0, 1.0)]
    env = placed["engine"][0][1]["vllm_env"]
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert env["VLLM_LOGGING_CONFIG_PATH"] == os.path.join(REPO, "common", "vllm_logging.json")


def test_eight_gpus_four_trainers_two_tp2_engines(logical_gpus):
    placed = place(Layout(True, trainers=4, engines=2, engine_tp=2), tp=2)
    assert shares(placed, "trainer") == [(r, 1.0, 1.0) for r in range(4)]
    assert shares(placed, "engine") == [(4, 2.0, 1.0), (5, 2.0, 1.0)]


def test_ppo_critics_and_reward_model_apart(logical_gpus):
    """ppo.py on GPUs of their own: policy ranks, critic ranks, engines, then the reward model on
    the last GPU."""
    placed = place(
        Layout(True, trainers=2, engines=1, engine_tp=2, critics=2, reward_model=True), tp=2
    )
    assert shares(placed, "trainer") == [(0, 1.0, 1.0), (1, 1.0, 1.0)]
    assert shares(placed, "critic") == [(2, 1.0, 1.0), (3, 1.0, 1.0)]
    assert shares(placed, "engine") == [(4, 2.0, 1.0)] and shares(placed, "reward_model") == [
        (5, 1.0, 1.0)
    ]


def test_ppo_hybrid_engine_on_two_gpus(logical_gpus):
    """ppo.py --colocate: policy rank i, critic rank i and engine i on GPU i, the reward model on
    GPU 0 too; each asks for an equal share of its GPU and only the policy rank for the bundle's
    CPU."""
    placed = place(Layout(True, trainers=2, engines=2, colocate=True, critics=2, reward_model=True))
    assert shares(placed, "trainer") == [(0, 0.25, 1.0), (1, 0.3333, 1.0)]
    assert shares(placed, "critic") == [(0, 0.25, 0.0), (1, 0.3333, 0.0)]
    assert shares(placed, "engine") == [(0, 0.25, 0.0), (1, 0.3333, 0.0)]
    assert shares(placed, "reward_model") == [(0, 0.25, 0.0)]
    for role in ("critic", "engine"):
        for (_, mine), (_, trainer) in zip(placed[role], placed["trainer"]):
            assert mine["gpu_ids"] == trainer["gpu_ids"], role


@pytest.mark.parametrize("shared", [False, True], ids=["apart", "one-gpu"])
def test_trainers_load_while_the_engines_do_but_first_on_a_shared_gpu(logical_gpus, shared):
    """The scripts spawn their trainers without waiting and hand them to spawn_engines: on GPUs of
    their own (or on CPU) both load at once, every one up on return; sharing a GPU (sleep mode)
    the trainers are up before an engine starts (vLLM sizes its memory from what is left free). A
    trainer that fails meanwhile is named."""
    layout = Layout(True, trainers=1, engines=1, colocate=shared)
    pg = make_placement_group(layout.bundles, use_gpu=True)
    options = (engine_flags(64, memory=0.4, colocate=shared), "model", "nccl", True)
    trainers = spawn_trainers(ray.remote(SlowTrainer), pg, layout.trainers)
    engines = spawn_engines(pg, layout.engines, *options, ray.remote(SlowEngine), trainers)
    returned_at = time.time()
    trainer, engine = ray.get([trainers[0].where.remote(), engines[0].where.remote()])
    assert max(trainer["started_at"], engine["started_at"]) <= returned_at
    if shared:
        assert engine["began_at"] >= trainer["started_at"]
    else:  # the engine began before the trainer was up: they overlapped
        assert engine["began_at"] < trainer["started_at"]
    for actor in trainers + engines:
        ray.kill(actor)
    trainers = spawn_trainers(ray.remote(CrashingTrainer), pg, layout.trainers)
    with pytest.raises(SystemExit, match=r"^error: CrashingTrainer#0 died during start-up: "):
        spawn_engines(pg, layout.engines, *options, ray.remote(SlowEngine), trainers)
    ray.util.remove_placement_group(pg)


def test_engines_are_up_before_spawn_engines_returns(logical_gpus):
    """Nothing may rendezvous with an engine still loading: spawn_engines waits, and names one that
    crashed."""
    layout = Layout(True, trainers=1, engines=1)
    pg = make_placement_group(layout.bundles, use_gpu=True)
    options = (engine_flags(64, memory=0.4), "model", "nccl", True)
    engines = spawn_engines(pg, layout.engines, *options, engine_cls=ray.remote(SlowEngine))
    returned_at = time.time()
    assert ray.get(engines[0].where.remote())["started_at"] <= returned_at
    ray.kill(engines[0])
    with pytest.raises(
        SystemExit,
        match=r"^error: CrashingEngine#0 died during start-up: .*stand-in failed to start",
    ):
        spawn_engines(pg, layout.engines, *options, engine_cls=ray.remote(CrashingEngine))
    ray.util.remove_placement_group(pg)


# What each script does with its default flags on 1, 2 and 8 GPUs: True colocated, False apart, or
# its error.
PICKS = {
    "sft": {1: False, 2: False, 8: False}, "rm": {1: False, 2: False, 8: False}, "dpo": {1: False, 2: False, 8: False},
    "grpo": {1: True, 2: False, 8: False}, "dapo": {1: True, 2: False, 8: False},
    "ppo": {1: True, 2: True, 8: False},  # policy + critic + engine apart need 3 GPUs: the hybrid engine below that
    "grpo_async": {1: "this job needs 2 GPUs (its engines generate while its trainers train, so they cannot share "
                      "a GPU) but this machine has 1", 2: False, 8: False},
}  # fmt: skip


def script_layout(name: str, args, gpus: int, monkeypatch) -> Layout:
    """The script's own decision (its check_machine, or main's choose_layout call for sft/rm/dpo) on
    `gpus` GPUs, as the Layout it would place."""
    module = importlib.import_module(name)
    monkeypatch.setattr(placement, "count_gpus", lambda: (gpus, "this machine"))
    module.validate_args(args)
    if hasattr(module, "check_machine"):
        use_gpu, _ = module.check_machine(args, f"{name}.py")
    else:
        use_gpu, _ = placement.choose_layout(args.num_trainers, None, False)
    assert use_gpu
    engines = getattr(args, "num_engines", 0)
    critics, reward_model = (
        getattr(args, "num_critics", 0),
        getattr(args, "reward_model", None) is not None,
    )
    return Layout(True, args.num_trainers, engines, getattr(args, "engine_tp", 1), getattr(args, "colocate", False),
                  critics, reward_model)  # fmt: skip


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_what_each_script_picks_on_1_2_and_8_gpus(monkeypatch, capsys, tmp_path, gpus):
    """Default flags: with too few GPUs to give every actor its own, the RL scripts colocate
    (ppo.py: the hybrid engine) and say so in one line; grpo_async.py, which cannot share, is
    refused with one line saying why."""
    for name, picks in PICKS.items():
        args = importlib.import_module(name).Args(output_dir=str(tmp_path))
        if isinstance(picks[gpus], str):
            with pytest.raises(SystemExit, match=f"^error: {re.escape(picks[gpus])}$"):
                script_layout(name, args, gpus, monkeypatch)
            continue
        capsys.readouterr()
        layout = script_layout(name, args, gpus, monkeypatch)
        out = capsys.readouterr().out  # the layout line, then the precision line
        line = next(x for x in out.splitlines() if x.startswith("layout: "))
        assert getattr(args, "colocate", False) is picks[gpus], name
        if picks[gpus]:
            assert (
                line
                == f"layout: colocated on 1 GPU: this machine has {gpus}, too few to give every actor its own"
            )
            assert layout.bundles == [1]
        else:
            assert line.startswith("layout: ") and "own" in line, (name, line)
            assert len(layout.bundles) <= gpus


def test_one_gpu_places_every_script(monkeypatch, tmp_path):
    """On a Ray instance with exactly one (logical) GPU, every script's default layout is scheduled:
    grpo/dapo colocated, ppo.py's hybrid engine with and without a reward model, sft/rm/dpo on the
    GPU."""
    ray.shutdown()
    ray.init(
        address="local",  # not a Ray someone started here
        num_cpus=8,
        num_gpus=1,
        include_dashboard=False,
        logging_level="ERROR",
        runtime_env=TESTS_ON_PATH,
    )
    try:
        for name in ("sft", "rm", "dpo", "grpo", "dapo", "ppo", "ppo+rm"):
            module = importlib.import_module(name.split("+")[0])
            args = module.Args(
                output_dir=str(tmp_path), **({"reward_model": "rm"} if "+rm" in name else {})
            )
            placed = place(script_layout(module.__name__, args, 1, monkeypatch))
            gpus = {tuple(where["gpu_ids"]) for group in placed.values() for _, where in group}
            assert gpus == {(0,)}, (name, gpus)
            assert ("reward_model" in placed) == ("+rm" in name)
    finally:
        ray.shutdown()


def test_two_nodes_of_eight_gpus(monkeypatch):
    """8 trainer ranks and 4 engines of TP 2 over two simulated 8-GPU nodes, joined as the scripts
    join a cluster."""
    ray.shutdown()  # the logical-GPU instance of the tests above
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "num_gpus": 8})
    cluster.add_node(num_cpus=8, num_gpus=8)
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    monkeypatch.setenv(
        "PYTHONPATH", os.path.join(REPO, "tests")
    )  # init_ray adds it for the actors: the stand-ins
    try:
        # The driver's machine shows no GPU (like a KubeRay head pod): the cluster's GPUs decide.
        assert choose_layout(16, None, False) == (True, False)
        with pytest.raises(
            SystemExit, match=r"^error: this job needs 17 GPUs but the Ray cluster at .* has 16$"
        ):
            choose_layout(17, None, False)
        placed = place(Layout(True, trainers=8, engines=4, engine_tp=2), tp=2)
        nodes = {where["node"] for group in placed.values() for _, where in group}
        assert len(nodes) == 2
        assert shares(placed, "engine") == [(8 + i, 2.0, 1.0) for i in range(4)]
    finally:
        ray.shutdown()
        cluster.shutdown()


# grpo.py joining a running cluster through RAY_ADDRESS, its trainers and engine on nodes of their
# own (the weights and FSDP2's collectives crossing nodes): test_grpo.py's end-to-end test resumes
# its run on a simulated cluster of three one-CPU nodes.


CLUSTER_DRIVER = """
import os, sys, time, ray
from common import placement
placement.init_ray()
@ray.remote(num_cpus=0)
class Sleeper:
    def pid(self):
        return os.getpid()
actor = Sleeper.remote()
print("actor", ray.get(actor.pid.remote()), flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """Whether process `pid` runs (an ended one not yet reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


@pytest.mark.serial  # within seconds
def test_a_ray_started_on_the_machine_is_left_alone_or_joined_on_purpose(tiny_model, tmp_path):
    """Someone ran `ray start` here, with token authentication (docs/cluster.md). Without
    RAY_ADDRESS a script starts a private instance beside it and says so (Ray would otherwise try to
    join it and refuse the script's CPU count with a traceback), leaving it running; with
    RAY_ADDRESS and the token it joins it, and says that instead. A run joined to it and killed
    with SIGKILL takes its own actors along within seconds, never another job's or the cluster's."""
    import secrets
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
         "--include-dashboard=false", "--disable-usage-stats"],
        env={**env, **auth}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    drivers = []
    try:
        for line in head.stdout:
            if "block forever" in line:
                break
        flags = ("--model", tiny_model, "--output-dir", str(tmp_path), "--num-steps", "1",
                 "--batch-size", "4", "--eval-every", "100")  # fmt: skip
        alone = subprocess.run([sys.executable, "sft.py", *flags], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=600)  # fmt: skip
        assert alone.returncode == 0, alone.stderr[-3000:]
        assert (
            "ray: a private local Ray instance (set RAY_ADDRESS to join a cluster)" in alone.stdout
        )
        assert head.poll() is None  # theirs still runs
        joined = {**env, **auth, "RAY_ADDRESS": f"127.0.0.1:{port}"}
        pids = []
        for _ in range(2):  # two jobs on the cluster, each with an actor
            driver = subprocess.Popen([sys.executable, "-c", CLUSTER_DRIVER], cwd=REPO, env=joined,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
            drivers.append(driver)
            lines = []
            for line in driver.stdout:
                lines.append(line)
                if line.startswith("actor "):
                    break
            assert lines and lines[-1].startswith("actor "), driver.stderr.read()[-3000:]
            pids.append(int(lines[-1].split()[1]))
        assert f"ray: the Ray cluster at 127.0.0.1:{port} ($RAY_ADDRESS): 1 node" in "".join(lines)
        assert not any("not of this run" in line for line in lines)  # the cluster's own processes
        drivers[0].kill()  # SIGKILL: its actor goes, the other job's stays, and the cluster
        drivers[0].wait()
        deadline = time.monotonic() + 10
        while running(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(pids[0]), "the killed run's actor outlived it"
        assert running(pids[1]) and head.poll() is None
    finally:
        for driver in drivers:
            driver.kill()
            driver.wait()
        os.killpg(head.pid, signal.SIGKILL)  # `ray start` and everything it started
        head.wait()
        current = "/tmp/ray/ray_current_cluster"  # its address, which a plain ray.init would join
        if os.path.exists(current) and open(current).read().strip().endswith(f":{port}"):
            os.remove(current)


@pytest.mark.serial  # within seconds
def test_an_unreachable_ray_address_is_one_line_within_bounded_time():
    """RAY_ADDRESS where nothing listens (refused at once) or where something listens that is not a
    Ray head (Ray's own connect would retry for minutes): one `error:` line naming the address,
    within POSTTRAIN_JOIN_TIMEOUT."""
    import socket
    import subprocess
    import sys

    code = "from common import placement; placement.init_ray()"
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]  # closed again below: nothing listens there
        for port, says, limit in (
            (free, "nothing answers at", 20),
            (silent.getsockname()[1], "no answer within 3 s", 30),
        ):
            env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}", "POSTTRAIN_JOIN_TIMEOUT": "3"}
            start = time.monotonic()
            out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                                 text=True, timeout=limit)  # fmt: skip
            assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
            line = out.stderr.strip().splitlines()[-1]
            assert line.startswith(f"error: could not join the Ray cluster at 127.0.0.1:{port}")
            assert says in line and time.monotonic() - start < limit
