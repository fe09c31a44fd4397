"""grpo_async.py and common/async_engine.py's AsyncEngine: an in-flight weight update seen inside
one sequence, the lag bound over real runs, faults, the diff against grpo.py, and an end-to-end
run."""

import json
import os
import re
import signal
import threading
import time
import uuid
from collections import Counter

import pytest
import ray
import torch
from conftest import engine_flags, only_run_dir, read_jsonl, run_script, start_ray_cpu, tagged_diff
from standins import Busy, StandInEngine
from test_faults import Run, processes, wait_for_phase
from test_weight_sync import SyncTrainer

import grpo_async
import sft
from common import placement
from common.async_engine import AsyncEngine
from common.data import encode_prompt, pack
from common.engines import spawn_engines
from common.placement import Layout, call, make_placement_group, rendezvous_address, spawn_trainers
from common.rewards import reward_terms
from common.weight_sync import EngineClient

# Lags and waits measured against stand-in timings (the tests marked `serial`): alone on the machine.


def trainer_logprobs(trainers, prompt, tokens):
    seq = sft.make_sequence(prompt + tokens, [0] * len(prompt) + [1] * len(tokens))
    assert len(pack([seq], 4096)) == 1
    return call(trainers, "logprobs", [seq], 1.0)[0]


@pytest.mark.cpu_engine(
    "CPU engines by design (gloo weight sync, a CPU layout); the GPU tier has its counterpart"
)
def test_in_flight_update_inside_one_sequence(tiny_model, tokenizer):
    """Two async engines decode one long response each; the trainer pushes new weights while they
    do. Each response holds tokens of versions 0 and 1. Re-prefill (the default): the tokens after
    the update have exactly the new weights' logprobs. keep_old_kv (PipelineRL): they attend to the
    old KV, so they do not."""
    start_ray_cpu()
    engines = []
    try:
        layout = Layout(False, trainers=1, engines=2)
        pg = make_placement_group(layout.bundles, use_gpu=False)
        trainers = spawn_trainers(SyncTrainer, pg, layout.trainers, tiny_model)
        common = (engine_flags(320), tiny_model, "gloo", False, AsyncEngine)  # CPU, in flight
        engines = [  # the trainer loads meanwhile
            spawn_engines(pg, layout.engines[i : i + 1], *common, t, keep_old_kv=keep)[0]
            for i, (keep, t) in enumerate([(False, trainers), (True, ())])
        ]
        addr, port = rendezvous_address(pg, 0)
        call(trainers, "init_sync", engines, "gloo", addr, port)
        prompt = encode_prompt(tokenizer, [{"role": "user", "content": "Count to one hundred."}])
        refs = [e.generate.remote([prompt], 1, 1.0, 1.0, 240, [7]) for e in engines]
        deadline = time.monotonic() + 120
        while min(s["tokens"] for s in ray.get([e.get_stats.remote() for e in engines])) < 40:
            assert time.monotonic() < deadline, "the engines did not sample 40 tokens in 120 s"
            time.sleep(0.05)
        call(trainers, "perturb", 0.03)
        call(trainers, "push")  # in flight: pause between two decoding steps, update, resume
        (recompute,), (kept,) = [out[0] for out in ray.get(refs)]
        for sample in (recompute, kept):
            assert (
                sample["finish_reason"] == "length" and len(sample["token_ids"]) == 240
            )  # nothing dropped
            versions = sample["versions"]
            switch = versions.index(1)
            assert 40 <= switch < 240 and versions == [0] * switch + [1] * (240 - switch), versions
        new = trainer_logprobs(trainers, prompt, recompute["token_ids"])
        engine = torch.tensor(recompute["logprobs"])
        switch = recompute["versions"].index(1)
        assert (
            new[switch:] - engine[switch:]
        ).abs().max() < 1e-4  # sampled by exactly the new weights
        assert (
            new[:switch] - engine[:switch]
        ).abs().max() > 1e-3  # ... and the earlier ones were not
        call(trainers, "perturb", -0.03)  # back to version 0 (the same noise, subtracted)
        old = trainer_logprobs(trainers, prompt, recompute["token_ids"])
        assert (
            old[:switch] - engine[:switch]
        ).abs().max() < 1e-4  # the behaviour logprobs before the update

        call(trainers, "perturb", 0.03)
        new_kept = trainer_logprobs(trainers, prompt, kept["token_ids"])
        switch = kept["versions"].index(1)
        stale = (new_kept[switch:] - torch.tensor(kept["logprobs"][switch:])).abs()
        assert stale.max() > 1e-3, (
            "keep_old_kv: the tokens after the update should see the old weights' KV"
        )
        # More prompt tokens at once (96 requests x 45) than vLLM's default budget of one step for
        # an async engine (2048): a prefill split over two steps rewinds its request's seeded
        # generator, which a CPU generator cannot do (the engine died here before engine_args turned
        # chunked prefill off on CPU).
        groups = [[list(range(5 + 100 * g, 50 + 100 * g))] for g in range(12)]
        outs = ray.get(
            [
                engines[0].generate.remote(p, 8, 1.0, 1.0, 4, [1000 * g])
                for g, p in enumerate(groups)
            ]
        )
        assert [len(s["token_ids"]) for out in outs for s in out[0]] == [4] * 96
    finally:
        ray.get([e.shutdown.remote() for e in engines])  # AsyncLLM's engine-core processes too


TAG = re.compile(r"# ASYNC: \S")


def test_diff_to_grpo_is_small_and_every_hunk_is_tagged():
    changed, untagged, _ = tagged_diff("grpo.py", "grpo_async.py", TAG)
    # 200 until 2026-12-03; 300 since: the checkpoint of what was sent and not trained, and
    # --deterministic (a step's groups one call per engine, settle, calls one at a time): +69
    assert 0 < changed <= 300, f"grpo_async.py changes {changed} lines of grpo.py (budget 300)"
    assert not untagged, f"hunks without an `# ASYNC: ...` tag near grpo_async.py lines {untagged}"


def run_stand_in_steps(engines, builtin_dir, max_lag: int, steps: int, train_s: float):
    """grpo_async.Rollouts as main() drives it, a step taking `train_s` seconds of "training":
    (the long share of the groups each step took, every trained token's lag, the longest wait)."""
    args = grpo_async.Args(prompts_per_step=4, num_generations=2, max_lag=max_lag, seed=3,
                           num_steps=steps)  # fmt: skip
    train = [grpo_async.Prompt([i], "1", "q", i + 1) for i in range(50)]
    terms = reward_terms(grpo_async.reward_fn, 1.0)  # the verifier alone
    rollouts = grpo_async.Rollouts(engines, train, 0, args, (terms, builtin_dir))
    long_share, lags, waits = [], [], []
    for step in range(steps):
        assert len(rollouts.queue) <= (max_lag + 1) * args.prompts_per_step  # the bounded buffer
        started = time.monotonic()
        batch, outs, texts, rewards, _ = rollouts.take(step)
        waits.append(time.monotonic() - started)
        assert len(batch) == len(outs) == 4 and len(texts) == len(rewards) == 8
        long_share.append(sum(len(group[0]["token_ids"]) == 40 for group in outs) / 4)
        lags += [step - v for group in outs for s in group for v in s["versions"]]
        time.sleep(train_s)
        ray.get([e.set_version.remote(step + 1) for e in engines])  # the push
        rollouts.fill(step + 1)
    return rollouts, long_share, lags, waits


@pytest.mark.serial
def test_rollouts_train_what_was_sampled_within_the_lag_bound(builtin_dir):
    """The driver's side (grpo_async.Rollouts) against stand-in engines whose long responses span
    updates: at K = 0, 1, 2 every step trains the groups sent for it, so the share of long groups
    trained is the same at every K (no length bias: none is dropped or overtaken); no token is
    older than step - K, while at K >= 1 some are older than the step (the overlap) and responses
    mix versions; at most (K + 1) x B groups are out; close() aborts what is in flight, and nothing
    is sampled for steps after the last."""
    start_ray_cpu()
    engines = [StandInEngine.remote() for _ in range(2)]
    try:
        shares = {}
        for max_lag in (0, 1, 2):
            rollouts, shares[max_lag], lags, _ = run_stand_in_steps(
                engines, builtin_dir, max_lag, steps=8, train_s=0.1
            )
            assert min(lags) >= 0 and max(lags) <= max_lag
            assert (max(lags) == max_lag) if max_lag <= 1 else max(lags) >= 1, (max_lag, set(lags))
            rollouts.close()
            ray.get([e.set_version.remote(0) for e in engines])
        assert shares[0] == shares[1] == shares[2] and 0 < sum(shares[0]) < 8
        ray.get([e.hold.remote() for e in engines])  # from now on a group never ends by itself
        held = grpo_async.Rollouts(engines, [grpo_async.Prompt([1], "1", "q", 1)] * 8, 0,
                                   grpo_async.Args(prompts_per_step=4, max_lag=1, num_steps=20),
                                   (reward_terms(grpo_async.reward_fn, 1.0), builtin_dir))  # fmt: skip
        time.sleep(1.0)  # the engines start them (a call cancelled before it starts never arrives)
        held.close()
        time.sleep(0.5)
        cancelled = sum(s["cancelled"] for s in ray.get([e.get_stats.remote() for e in engines]))
        assert cancelled >= 4  # the groups the engines had started, aborted there
        last = grpo_async.Rollouts(
            engines, [grpo_async.Prompt([1], "1", "q", 1)] * 8, 5,
            grpo_async.Args(prompts_per_step=4, max_lag=3, num_steps=6),
            (reward_terms(grpo_async.reward_fn, 1.0), builtin_dir),
        )  # fmt: skip
        assert last.sent - 5 * 4 == 4  # nothing is sampled for steps after the last
        last.close()
        # A dead engine in a weight update: trainer rank 0 reports it as a plain error that names
        # the engine.
        ray.kill(engines[1])
        with pytest.raises(ray.exceptions.RayActorError):  # dead (ray.kill returns before)
            for _ in range(100):
                ray.get(engines[1].__ray_ready__.remote())
                time.sleep(0.1)
        with pytest.raises(RuntimeError, match=r"^StandInEngine#1 died during start_weight_update"):
            EngineClient(engines, tp=1).start_weight_update()
    finally:
        for engine in engines:
            ray.kill(engine)


@pytest.mark.serial
def test_rewards_are_scored_while_the_trainers_train(builtin_dir, tmp_path):
    """A reward function that takes 2 s per response: the reward workers (one per engine) score
    each group as soon as it is sampled, during the step before (here 6 s of "training"), so from
    the second step on a step finds its groups scored; scoring them after take() would cost every
    step 2 s x 4 samples / 2 workers = 4 s."""
    start_ray_cpu()
    (tmp_path / "slow.py").write_text("import time\ndef r(response, answer):\n"
                                      "    time.sleep(2)\n    return 1.0\n")  # fmt: skip
    from common.isolate import UserFunction as load_function

    engines = [StandInEngine.remote() for _ in range(2)]
    try:
        args = grpo_async.Args(prompts_per_step=2, num_generations=2, max_lag=1, num_steps=3)
        train = [grpo_async.Prompt([i], "1", "q", i + 1) for i in range(1, 50, 4)]  # all short
        slow = ({"verifier": (load_function(f"{tmp_path / 'slow.py'}:r"), 1.0)}, builtin_dir)
        rollouts = grpo_async.Rollouts(engines, train, 0, args, slow)
        waits = []
        for step in range(3):
            started = time.monotonic()
            rollouts.take(step)
            waits.append(time.monotonic() - started)
            time.sleep(6)  # training
            ray.get([e.set_version.remote(step + 1) for e in engines])
            rollouts.fill(step + 1)
        assert waits[0] >= 4 and max(waits[1:]) < 0.5, waits
        rollouts.close()
    finally:
        for engine in engines:
            ray.kill(engine)


FLAGS = ("--num-generations", "4", "--prompts-per-step", "4", "--max-response-length", "16", "--engine-memory",
         "0.25", "--eval-every", "4")  # fmt: skip


def check_run(run_dir: str, steps: range, max_lag: int) -> list[dict]:
    """The metrics of `steps` are there and within the lag bound, recomputed from the engines'
    per-token versions logged with the samples (step s + 1's row holds tokens trained at step s)."""
    metrics = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "train/loss" in r]
    metrics = [r for r in metrics if r["step"] in steps]
    assert [r["step"] for r in metrics] == list(steps)
    for key in ("rollout/lag_mean", "rollout/lag_max", "time/wait_rollouts",
                "time/engine_idle", "time/engine_paused", "perf/generate_tokens_per_s", "perf/train_tokens_per_s"):  # fmt: skip
        assert all(key in r for r in metrics), key
    assert all(r["rollout/lag_max"] <= max_lag for r in metrics)
    samples = [s for s in read_jsonl(os.path.join(run_dir, "samples.jsonl")) if s["step"] in steps]
    assert {s["step"] for s in samples} == set(steps)
    lags = [s["step"] - 1 - v for s in samples for v in s["versions"]]
    assert lags and min(lags) >= 0 and max(lags) <= max_lag
    return metrics


def trained(run_dir: str, steps: range) -> tuple[list[dict], list[dict]]:
    """The metrics that do not measure time, and every sample (every group a step trained)."""
    metrics = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r["step"] in steps]
    untimed = [
        {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in metrics
    ]
    samples = read_jsonl(os.path.join(run_dir, "samples.jsonl"))
    return untimed, [s for s in samples if s["step"] in steps]


def stopped_in_training(run, after: str):
    """SIGTERM once step `after` is logged and the trainers train the next one (the engines sample
    meanwhile): one line, exit status 1, no process left."""
    run.wait_for(after)
    wait_for_phase(run, "Trainer.run")
    run.proc.send_signal(signal.SIGTERM)
    status, error = run.finish(within=60)
    assert status == 1 and error == "error: stopped by SIGTERM", error


@pytest.mark.cpu_engine("exact logprobs in fp32; on GPUs grpo_async.py needs two")
def test_end_to_end_deterministic_repeats_and_resumes_exactly_default_loses_nothing(
    tiny_model, tmp_path
):
    """Real runs of 5 steps with a tiny model, K = 1 and a reward that varies (so the weights move).
    --deterministic: the lag bound holds and the pipeline overlapped; the final model and timeline
    are written; no process outlives the run. The same seed again, SIGTERM while step 3 trains
    (the engines sampling step 4), --resume from step 2: every non-timing metric and every sample
    of steps 1-5 equal the first run's (steps 1-2: a second run; 3-5: the resume). The default
    mode, stopped and resumed the same way: every step trained exactly the prompts the
    uninterrupted run did; the groups finished at the save were trained as sampled then (step 3's
    tokens from the weights of step 1), the others sampled again. Then its engine is killed: the
    run ends within 60 s naming it, leaving no process behind."""
    (tmp_path / "length.py").write_text(
        "def length(response, answer):\n    return len(response) / 50\n"
    )
    flags = (*FLAGS, "--reward-fn", f"{tmp_path / 'length.py'}:length", "--save-every", "2")
    det = (*flags, "--num-steps", "5", "--deterministic")
    marker = uuid.uuid4().hex  # every process of the run inherits it
    proc = run_script("grpo_async.py", "--model", tiny_model, "--output-dir", str(tmp_path / "a"),
                      *det, env={"POSTTRAIN_TEST_RUN": marker})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    deadline = time.monotonic() + 30
    while processes(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes(marker), "actors or vLLM engine-core processes outlived the run"
    first = only_run_dir(tmp_path / "a")
    metrics = check_run(first, range(1, 6), max_lag=1)
    assert (
        max(r["rollout/lag_mean"] for r in metrics) > 0
    )  # trained on groups sampled a step before
    assert "eval/accuracy" in metrics[-1] and "eval/accuracy" not in metrics[1]
    assert len({r["train/loss"] for r in metrics}) == 5 and metrics[-1]["train/loss"] != 0
    assert os.path.isfile(os.path.join(first, "checkpoints", "final", "model.safetensors"))
    with open(os.path.join(first, "timeline.json")) as f:
        timeline = json.load(f)
    assert len(timeline["steps"]) == 5 and any(w == "paused" for w, _, _ in timeline["engines"][0])

    again = tmp_path / "b"
    stopped_in_training(Run(tiny_model, again, *det, script="grpo_async.py", common=()), "step 2 ")
    step_2 = os.path.join(only_run_dir(again), "checkpoints", "step_2")
    proc = run_script("grpo_async.py", "--model", tiny_model, "--output-dir", str(again),
                      *det, "--resume", step_2)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert trained(only_run_dir(again), range(6)) == trained(first, range(6))

    default = tmp_path / "c"
    run = Run(tiny_model, default, *flags, "--num-steps", "5", script="grpo_async.py", common=())
    stopped_in_training(run, "step 2 ")
    step_2 = os.path.join(only_run_dir(default), "checkpoints", "step_2")
    kept = torch.load(os.path.join(step_2, "rollouts.pt"), weights_only=True)["kept"]
    assert 8 in kept  # step 3's first group (sent a step before the save) was finished
    run = Run(tiny_model, default, *flags, "--num-steps", "50", "--resume", step_2,
              script="grpo_async.py", common=())  # fmt: skip
    run.wait_for("step 4 ")
    run.kill("AsyncEngine")
    status, error = run.finish(within=60)  # also: no process of the run left
    assert status == 1 and "AsyncEngine#0 died during" in error, error
    check_run(only_run_dir(default), range(1, 5), max_lag=1)  # rows 3-4: the resumed run's
    prompts = [Counter((s["step"], json.dumps(s["prompt"])) for s in trained(d, range(5))[1])
               for d in (only_run_dir(default), first)]  # fmt: skip
    assert prompts[0] == prompts[1]
    restored = trained(only_run_dir(default), range(3, 4))[1][:4]  # step 3's first group
    assert [s["versions"] for s in restored] == [s["versions"] for s in kept[8]["groups"][0]]
    assert min(restored[0]["versions"]) == 1  # sampled before the checkpoint's weights (step 2)


def test_plot_overlays_runs_against_wall_clock(tmp_path):
    """`python plot.py A B --x time`: each run's curve against the running sum of its
    time/step."""
    from plot import plot_runs, step_seconds

    runs = []
    for name, seconds in (("sync", 40.0), ("async", 30.0)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": 0, "eval/accuracy": 0.4}] + [
            {"step": s, "rollout/reward": 0.1 * s, "time/step": seconds} for s in range(1, 4)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(str(run))
    assert step_seconds({"time/step": [(1, 40.0), (2, 35.0)]}) == {0: 0.0, 1: 40.0, 2: 75.0}
    written = plot_runs(runs, str(tmp_path / "plots"), x="time")
    assert sorted(os.path.basename(p) for p in written) == ["eval.png", "rollout.png", "time.png"]


def test_staleness_is_decided_by_the_oldest_token():
    """is_stale on responses that mix versions: one token older than step - K makes the group stale
    (a rule keyed on the newest token would let lag 3 through here at K = 1)."""
    mixed = [[3, 3, 4, 5], [5, 5]]  # the first response spans two updates
    assert grpo_async.is_stale(mixed, step=5, max_lag=1)
    assert not grpo_async.is_stale(mixed, step=5, max_lag=2)
    assert not grpo_async.is_stale([[4, 5]], step=5, max_lag=1)


def test_tokens_without_a_weight_version_stop_the_run():
    """vLLM's spans give each sampled token its weight version; a token left without one is not
    labelled 0 (which would make every lag wrong): the engine's generate fails, naming the count."""
    from types import SimpleNamespace as Span

    from common.async_engine import token_versions

    spans = [Span(start=0, end=2, version="default"), Span(start=2, end=5, version="3")]
    assert token_versions(5, spans) == [0, 0, 3, 3, 3]
    assert token_versions(0, None) == []
    with pytest.raises(RuntimeError, match="gave a weight version to 0 of 4 sampled tokens"):
        token_versions(4, None)
    with pytest.raises(RuntimeError, match="to 2 of 5 sampled tokens"):
        token_versions(5, spans[:1])


@pytest.mark.serial
def test_a_call_ends_when_an_actor_it_watches_dies():
    """The liveness watch: while the trainers train (or receive weights, or save) the engines work
    on their own; one that dies ends the driver's wait within seconds, naming it and the phase,
    instead of at the next call to it (or after a hung transfer's timeout)."""
    start_ray_cpu()
    trainer, engine = Busy.options(num_cpus=0).remote(), StandInEngine.remote()
    try:
        killer = threading.Timer(1.0, ray.kill, (engine,))
        killer.start()
        started = time.monotonic()
        with pytest.raises(SystemExit, match=r"^error: StandInEngine#0 died during work: "):
            call([trainer], "work", 60, watch=[engine])
        assert time.monotonic() - started < 1 + 2 * placement.WATCH_S
        ray.kill(trainer)
        trainer = Busy.options(num_cpus=0).remote()
        assert call([trainer], "work", 0.1, watch=[]) == [None]  # nothing watched: a plain call
    finally:
        ray.kill(trainer)
