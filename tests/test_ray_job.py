"""`ray job submit` (docs/cluster.md): a script submitted as a Ray job to a cluster started with
`ray start --head` runs from the shipped working dir, joins that cluster (no private Ray of its
own), and a job stopped with `ray job stop` continues from its newest whole checkpoint when it is
submitted again with --resume."""

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import REPO, only_run_dir, read_jsonl

# A job stopped once its first checkpoint is written: alone on the machine.
pytestmark = pytest.mark.serial

BIN = os.path.dirname(sys.executable)  # the venv's: `ray`, and the `python` the jobs run with


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def head():
    """A one-node cluster of its own: `ray start --head` with the job server (the dashboard) on
    free ports and its own --temp-dir (short: Ray's socket paths have a length limit). One CPU:
    a trainer the stopped job left behind would starve the next job. Stopped at the end by
    signalling its own `ray start`, never with `ray stop`, which ends every Ray on the machine."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the job server needs {e.name} (requirements-cpu.txt: make setup)")
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    gcs, dashboard, client, agent = free_ports(4)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_API"))}
    env |= {"RAY_AUTH_MODE": "disabled", "PATH": BIN + os.pathsep + env.get("PATH", "")}
    log = open(os.path.join(temp, "head.log"), "w+")
    proc = subprocess.Popen(
        [os.path.join(BIN, "ray"), "start", "--head", "--block", f"--port={gcs}",
         f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
         f"--dashboard-agent-listen-port={agent}", "--num-cpus=1", f"--temp-dir={temp}",
         "--include-dashboard=true", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # ignored if run in bg
    )  # fmt: skip

    def up():  # called once the test's other fixtures are built: Ray starts meanwhile
        deadline = time.monotonic() + 120
        while "block forever" not in open(log.name).read():
            assert proc.poll() is None and time.monotonic() < deadline, open(log.name).read()
            time.sleep(0.5)
        return gcs, f"http://127.0.0.1:{dashboard}", env

    try:
        yield up
    finally:
        proc.send_signal(signal.SIGINT)  # `ray start --block` then ends its own processes
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of them (not the workers: they
        proc.wait()  # have process groups of their own and end with their raylet)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def ray_job(env, cwd, *args, timeout=300) -> subprocess.CompletedProcess:
    cmd = [os.path.join(BIN, "ray"), "job", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_job_joins_the_cluster_and_resumes_after_ray_job_stop(head, tiny_model, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    gcs, address, env = head()
    out = tmp_path / "runs"  # where the driver and the trainers both write (one machine here)
    flags = ["--model", tiny_model, "--output-dir", str(out), "--batch-size", "4",
             "--max-tokens-per-micro-batch", "512", "--eval-dataset", "",
             "--accuracy-dataset", ""]  # fmt: skip
    # from elsewhere than the repo: `python sft.py` finds sft.py (and data/) in the shipped copy
    # with a name the scripts also set for their actors: Ray refused the pair, before the scripts
    # let their own values win (RAY_OVERRIDE_JOB_RUNTIME_ENV)
    runtime_env = json.dumps(
        {"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "true"}}
    )
    submit = ["submit", "--address", address, "--working-dir", REPO,
              "--runtime-env-json", runtime_env]  # fmt: skip
    started = ray_job(env, tmp_path, *submit, "--submission-id", "first", "--no-wait", "--",
                      "python", "sft.py", *flags, "--num-steps", "40",
                      "--save-every", "1")  # fmt: skip
    assert started.returncode == 0, started.stderr[-3000:]

    # stop it once its first checkpoint is whole (checkpoint.json is written last)
    client, deadline = JobSubmissionClient(address), time.monotonic() + 120
    while not glob.glob(str(out / "*" / "checkpoints" / "step_1" / "checkpoint.json")):
        status = client.get_job_status("first")
        assert status == JobStatus.RUNNING or status == JobStatus.PENDING, (
            f"{status}: {client.get_job_logs('first')[-3000:]}"
        )
        assert time.monotonic() < deadline, client.get_job_logs("first")[-3000:]
        time.sleep(0.5)
    stopped = ray_job(env, tmp_path, "stop", "--address", address, "first")
    assert "Job 'first' was stopped" in stopped.stdout + stopped.stderr, stopped.stderr[-3000:]
    assert client.get_job_status("first") == JobStatus.STOPPED

    shown = ray_job(env, tmp_path, "logs", "--address", address, "first")
    logs = shown.stdout + shown.stderr
    run_dir = only_run_dir(out)
    assert re.search(rf"^ray: the Ray cluster at \S+:{gcs} \(\$RAY_ADDRESS\): 1 node, 0 GPUs$",
                     logs, re.M), logs[-3000:]  # fmt: skip
    assert "private local Ray" not in logs
    assert f"run dir: {run_dir}  model: {tiny_model}" in logs
    assert re.search(r"^step 1 \| train/loss \d", logs, re.M), logs[-3000:]
    assert "error: stopped by SIGTERM" in logs  # `ray job stop`'s signal, the script's last line
    assert "final model:" not in logs  # stopped, not finished
    whole = [
        int(os.path.basename(os.path.dirname(p))[len("step_") :])
        for p in glob.glob(os.path.join(run_dir, "checkpoints", "step_*", "checkpoint.json"))
    ]
    step = max(whole)  # the newest whole checkpoint; a half-written one is hidden (.partial)

    # submitted again with --resume (the run dir: its newest whole checkpoint) and waited for
    resumed = ray_job(env, tmp_path, *submit, "--submission-id", "resumed", "--", "python",
                      "sft.py", "--model", tiny_model, "--resume", run_dir,
                      "--num-steps", str(step + 2))  # fmt: skip
    logs = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and "Job 'resumed' succeeded" in logs, logs[-3000:]
    name = os.path.basename(run_dir)
    assert f"resume: from {name}/checkpoints/step_{step}, step {step} of {step + 2}" in logs
    assert re.search(rf"^ray: the Ray cluster at \S+:{gcs} \(\$RAY_ADDRESS\)", logs, re.M)
    assert re.search(rf"^step {step + 1} \| train/loss \d", logs, re.M), logs[-3000:]
    assert f"final model: {run_dir}/checkpoints/final" in logs
    assert f"step {step} |" not in logs  # it did not redo the checkpoint's steps
    steps = [r["step"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    assert steps == list(range(1, step + 3))  # each step once: the stopped job's later rows dropped
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "final", "config.json"))
    shutil.rmtree(out)  # ~80 MB a checkpoint
