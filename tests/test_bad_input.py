"""Bad input, by class, for every script: one `error:` line naming the flag, file, row or function,
raised before Ray starts (init_ray is replaced by a tripwire), and nothing written. In-process and
without loading a model (the tokenizer and config only), so the whole file runs in well under a
minute; a few subprocess runs check the real exit status and stderr."""

import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import tyro
from conftest import REPO, SCRIPTS
from safetensors.torch import save_file

from common import placement
from common.flags import parse_args

RL = ["grpo", "dapo", "ppo", "grpo_async", "grpo_tools", "distill"]
GOOD_ROW = {
    "sft": {"prompt": "What is 1 + 1?", "completion": "2"},
    "rm": {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"},
    "dpo": {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"},
    **{
        name: {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2"}
        for name in RL
    },
}
NO_EVAL = {
    "sft": ["--accuracy-dataset", ""],
    "dpo": ["--accuracy-dataset", ""],
}  # plus --eval-dataset "" for all


class RayStarted(Exception):
    """The tripwire: main() got as far as starting Ray."""


def tripwire(*args, **kwargs):
    raise RayStarted


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def run(monkeypatch, tmp_path, tiny_model):
    """run(name, *flags, rows=None) -> the one `error:` line of main(); dataset = `rows` (default:
    good rows)."""

    def go(name, *flags, rows=None, reach_ray=False):
        module = importlib.import_module(name)
        monkeypatch.setattr(placement, "init_ray", tripwire)
        data = flags_value(flags, "--dataset") or write_rows(
            tmp_path / "data.jsonl", rows or [GOOD_ROW[name]] * 16
        )
        out = tmp_path / "runs"
        argv = [
            "--model",
            tiny_model,
            "--dataset",
            data,
            "--eval-dataset",
            "",
            "--output-dir",
            str(out),
        ]
        argv += NO_EVAL.get(name, []) + [f for f in flags if f not in ("--dataset", data)]
        if reach_ray:
            with pytest.raises(RayStarted):
                module.main(tyro.cli(module.Args, args=argv))
            return None
        with pytest.raises(SystemExit) as e:
            module.main(tyro.cli(module.Args, args=argv))
        message = str(e.value.code)
        assert message.startswith("error: ") and "\n" not in message, message
        assert not out.exists(), "something was written before the error"
        return message

    return go


def flags_value(flags, name):
    return flags[flags.index(name) + 1] if name in flags else None


# ---- class 1 and 2: every numeric flag has its range checked, before anything starts ----


def numeric_fields(module):
    return [
        (f.name, f.type)
        for f in dataclasses.fields(module.Args)
        if any(t in str(f.type) for t in ("int", "float"))
        and "Literal" not in str(f.type)  # --dtype's choices: test_flags_that_do_not_parse
        and f.name != "max_tokens_per_micro_batch"
    ]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_numeric_flag_is_range_checked(name):
    """A class test: a flag added without a range fails here. -1 is out of range for every numeric
    flag of every script, and NaN and infinity for every float flag."""
    module = importlib.import_module(name)
    fields = numeric_fields(module)
    assert len(fields) >= 12
    for field, kind in fields:
        flag = "--" + field.replace("_", "-")
        for bad in ["-1"] + (["nan", "inf", "-inf"] if "float" in str(kind) else []):
            args = tyro.cli(module.Args, args=[flag, bad])
            with pytest.raises(SystemExit, match=f"^error: {flag} must be") as e:
                module.validate_args(args)
            assert "\n" not in str(e.value.code)


CASES = [  # (scripts, flags, what the line names)
    (SCRIPTS, ["--num-trainers", "0"], "--num-trainers must be >= 1"),
    (SCRIPTS, ["--learning-rate", "-1"], "--learning-rate must be > 0"),
    (SCRIPTS, ["--num-steps", "0"], "--num-steps must be >= 1"),
    (SCRIPTS, ["--eval-every", "0"], "--eval-every must be >= 1"),
    (SCRIPTS, ["--max-grad-norm", "0"], "--max-grad-norm must be > 0"),
    (["sft", "rm", "dpo"], ["--batch-size", "0"], "--batch-size must be >= 1"),
    (RL, ["--num-minibatches", "0"], "--num-minibatches must be >= 1"),
    (RL, ["--temperature", "0"], "--temperature must be > 0"),
    (RL, ["--max-response-length", "0"], "--max-response-length must be >= 1"),
    (RL, ["--prompts-per-step", "0"], "--prompts-per-step must be >= 1"),
    (RL, ["--num-engines", "0"], "--num-engines must be >= 1"),
    (RL, ["--top-p", "1.5"], "--top-p must be > 0, <= 1"),
    (RL, ["--reward-timeout", "0"], "--reward-timeout must be > 0"),
    (SCRIPTS, ["--dtype", "float16"], "--dtype float16 needs a GPU: on CPU every model runs in"),
    (SCRIPTS, ["--dtype", "bfloat16"], "--dtype bfloat16 needs a GPU"),
    # CPU: --engine-memory is GiB of KV cache, which must hold one prompt + response, and fit RAM
    (RL, ["--engine-memory", "1e-6"], "--engine-memory 1e-06 GiB of KV cache cannot hold one"),
    (RL, ["--engine-memory", "1e5"], "--engine-memory 100000 GiB of KV cache is more than this"),
    (["ppo"], ["--num-critics", "0"], "--num-critics must be >= 1"),
    (["ppo"], ["--lam", "1.5"], "--lam must be >= 0, <= 1"),
    (
        ["dapo"],
        ["--overlong-buffer", "30", "--max-response-length", "24"],
        "--overlong-buffer must be < --max-response-length 24",
    ),
    (["dpo"], ["--label-smoothing", "0.5"], "--label-smoothing must be >= 0, < 0.5"),
    (["rm"], ["--margin", "-0.5"], "--margin must be >= 0"),
    (RL, ["--verifier-weight", "-1"], "--verifier-weight must be >= 0"),
    (["ppo"], ["--reward-model", "rm", "--verifier-weight", "0"], "with --reward-model the reward"),
]


@pytest.mark.parametrize(
    "name,flags,expected", [(n, f, e) for scripts, f, e in CASES for n in scripts]
)
def test_out_of_range_flags_stop_before_ray(run, name, flags, expected):
    assert expected in run(name, *flags)


# ---- class 1 and 4: data files ----


def bad_file(kind, tmp_path, name):
    good = json.dumps(GOOD_ROW[name])
    if kind == "json_syntax":
        (tmp_path / "d.json").write_text("[" + good + ",\n" + good[:-5] + "]")
        return str(tmp_path / "d.json"), "not valid JSON at line 2"
    if kind == "json_not_rows":
        (tmp_path / "d.json").write_text(json.dumps({"prompt": "a", "answer": [1, 2]}))
        return str(tmp_path / "d.json"), "expected a JSON array of rows"
    if kind == "corrupt_parquet":
        (tmp_path / "d.parquet").write_bytes(b"PAR1" + os.urandom(200))
        return str(tmp_path / "d.parquet"), "is not a readable parquet file"
    if kind == "not_utf8":
        (tmp_path / "d.jsonl").write_bytes(good.encode() + b"\n" + b'{"prompt": "\xff\xfe"}\n')
        return str(tmp_path / "d.jsonl"), "is not UTF-8 text"
    if kind == "empty":
        (tmp_path / "d.jsonl").write_text("\n\n")
        return str(tmp_path / "d.jsonl"), "is empty"
    raise ValueError(kind)


@pytest.mark.parametrize(
    "kind", ["json_syntax", "json_not_rows", "corrupt_parquet", "not_utf8", "empty"]
)
@pytest.mark.parametrize("name", SCRIPTS)
def test_unreadable_data_files(run, tmp_path, name, kind):
    path, expected = bad_file(kind, tmp_path, name)
    message = run(name, "--dataset", path)
    assert expected in message and os.path.basename(path) in message


@pytest.mark.parametrize("name", SCRIPTS)
def test_rows_with_null_or_missing_fields_name_the_row(run, name):
    good = GOOD_ROW[name]
    assert "row 2 column 'prompt' is null" in run(name, rows=[good, {**good, "prompt": None}])
    missing = {k: v for k, v in good.items() if k != "prompt"}
    assert "row 3 has no column 'prompt'" in run(name, rows=[good, good, missing])
    messages = [{"role": "user", "content": None}]
    assert "row 2 column 'prompt': message 1 (user) has no text content" in run(
        name, rows=[good, {**good, "prompt": messages}]
    )
    empty = [{"role": "user", "content": "  "}]
    assert "row 1 column 'prompt': message 1 (user) has no text content" in run(
        name, rows=[{**good, "prompt": empty}]
    )
    assert "row 1 column 'prompt' is empty" in run(name, rows=[{**good, "prompt": ""}])


@pytest.mark.parametrize("name", RL)
def test_numeric_answers_are_accepted(run, name):
    rows = [{**GOOD_ROW[name], "answer": 2}, {**GOOD_ROW[name], "answer": 2.0}]
    run(name, "--prompts-per-step", "2", rows=rows, reach_ray=True)


@pytest.mark.parametrize("name", SCRIPTS)
def test_drop_long_that_drops_everything(run, name):
    flags = ["--max-prompt-length", "3"] if name in RL else ["--max-length", "3"]
    message = run(name, *flags, "--drop-long")
    assert "--max-prompt-length 3" in message if name in RL else "within --max-length" in message


def test_sft_counts_rows_without_an_assistant_turn(run, capsys):
    good = {
        "messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]
    }
    silent = {"messages": [{"role": "user", "content": "1 + 1?"}]}
    run("sft", "--batch-size", "2", rows=[good, silent, good, silent], reach_ray=True)
    assert "2 of 4 rows have no assistant turn; they are skipped" in capsys.readouterr().out


def test_rm_margin_must_be_a_number(run):
    message = run("rm", rows=[GOOD_ROW["rm"], {**GOOD_ROW["rm"], "margin": "big"}])
    assert "row 2 column 'margin' must be a number >= 0 (got 'big')" in message


PAIR = {"prompt": [{"role": "user", "content": "1 + 1?"}], "chosen": "2", "rejected": "3"}
ROW_CASES = [  # (script, rows, flags, what the line names): rows that only one script reads
    ("sft", [{"prompt": "hi"}], [], "no column 'completion'"),
    ("sft", None, ["--num-trainers", "2", "--batch-size", "3"], "not divisible"),
    (
        "sft",
        None,
        ["--max-length", "8", "--max-tokens-per-micro-batch", "8"],
        "longer than --max-length",
    ),
    ("rm", [PAIR, {**PAIR, "chosen": "  "}], [], "row 2 column 'chosen' is empty"),
    ("rm", [PAIR, {**PAIR, "rejected": " 2 "}], [], "row 2 has identical"),
    (
        "rm",
        [PAIR, {**PAIR, "rejected": [{"role": "assistant", "content": ""}]}],
        [],
        "row 2 column 'rejected': mes",
    ),
    ("dpo", [PAIR, {**PAIR, "rejected": ""}], [], "row 2 column 'rejected' is empty"),
    ("dpo", [PAIR, {**PAIR, "rejected": " 2 "}], [], "row 2 has identical"),
    ("dpo", None, ["--ipo", "--label-smoothing", "0.1"], "--ipo"),
    *[(n, None, ["--max-prompt-length", "10"], "longer than --max-prompt-length 10") for n in RL],
]


@pytest.mark.parametrize("name,rows,flags,expected", ROW_CASES)
def test_script_specific_rows_and_flags(run, name, rows, flags, expected):
    assert expected in run(name, *flags, rows=rows)


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_model_that_does_not_exist(run, tmp_path, name):
    assert "does not exist" in run(name, "--model", str(tmp_path / "no_such_model"))


# ---- class 2: model, tokenizer, output dir, tracking ----


@pytest.fixture
def model_copy(tmp_path, tiny_model):
    def make(drop_weights=False, drop_template=False, truncate=False):
        path = tmp_path / "model_copy"
        shutil.copytree(tiny_model, path)
        if drop_weights:
            os.remove(path / "model.safetensors")
        if truncate:
            data = (path / "model.safetensors").read_bytes()
            (path / "model.safetensors").write_bytes(data[: len(data) // 2])
        if drop_template:
            for f in path.glob("chat_template.*"):
                f.unlink()
            config = json.loads((path / "tokenizer_config.json").read_text())
            config.pop("chat_template", None)
            (path / "tokenizer_config.json").write_text(json.dumps(config))
        return str(path)

    return make


# ---- grpo_tools.py's tools: each in one line before anything starts ----


@pytest.mark.parametrize(
    "tool,expected",
    [("missing.py:tool", "expected an existing path/to/file.py:function"),
     ("TOOLS:not_callable", "has no function 'not_callable'"),
     ("TOOLS:absent", "has no function 'absent'"),
     ("calculator", "expected an existing path/to/file.py:function"),
     ("BROKEN:tool", "failed to import: ZeroDivisionError")],
)  # fmt: skip
def test_a_tool_that_cannot_be_called(run, tmp_path, tool, expected):
    (tmp_path / "tools.py").write_text("not_callable = 3\ndef tool(text):\n    return text\n")
    (tmp_path / "broken.py").write_text("1 / 0\n")
    spec = tool.replace("TOOLS", str(tmp_path / "tools.py"))
    assert expected in run(
        "grpo_tools", "--tool", spec.replace("BROKEN", str(tmp_path / "broken.py"))
    )


@pytest.mark.parametrize(
    "flags,expected",
    [(["--max-turns", "0"], "--max-turns must be >= 1"),
     (["--tool-timeout", "0"], "--tool-timeout must be > 0"),
     (["--max-tool-output", "0"], "--max-tool-output must be >= 1")],
)  # fmt: skip
def test_tool_flags_out_of_range(run, flags, expected):
    assert expected in run("grpo_tools", *flags)


def test_a_strict_sandbox_with_a_guarantee_missing(run, monkeypatch):
    from common import sandbox

    held = dict.fromkeys(sandbox.GUARANTEES, "test") | {"filesystem": None}
    monkeypatch.setattr(sandbox, "probe", lambda: held)
    message = run("grpo_tools", "--tool", "python", "--sandbox", "strict")
    assert "filesystem" in message and "bubblewrap" in message


def test_a_template_that_cannot_append_tool_turns(run, model_copy):
    path = model_copy()
    config = json.loads(open(os.path.join(path, "tokenizer_config.json")).read())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    for f in [f for f in os.listdir(path) if f.startswith("chat_template.")]:
        os.remove(os.path.join(path, f))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    assert "the chat template does not end assistant turns with EOS" in run(
        "grpo_tools", "--model", path
    )


@pytest.mark.parametrize("name", SCRIPTS)
def test_model_without_whole_weights(run, model_copy, name):
    assert "has no weights" in run(name, "--model", model_copy(drop_weights=True))


@pytest.mark.parametrize("name", SCRIPTS)
def test_truncated_model_weights(run, model_copy, name):
    assert "model.safetensors is missing or truncated" in run(
        name, "--model", model_copy(truncate=True)
    )


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo", "dapo", "ppo"])
def test_message_prompts_need_a_chat_template(run, model_copy, name):
    path = model_copy(drop_template=True)
    rows = None
    if name == "sft":  # plain-text columns train fine; the default accuracy set has message prompts
        message = run(
            name, "--model", path, "--accuracy-dataset", "data/arithmetic/prompts_test.jsonl"
        )
    else:
        rows = [{**GOOD_ROW[name], "prompt": [{"role": "user", "content": "1 + 1?"}]}]
        message = run(name, "--model", path, rows=rows)
    assert "no chat template" in message and "--accuracy-dataset ''" in message


@pytest.mark.parametrize("name", SCRIPTS)
def test_output_dir_that_cannot_be_written(run, tmp_path, name):
    (tmp_path / "a_file").write_text("x")
    assert "is a file, not a folder" in run(name, "--output-dir", str(tmp_path / "a_file" / "runs"))
    assert "cannot write in /proc" in run(name, "--output-dir", "/proc/posttrain-runs")


@pytest.mark.parametrize("name", SCRIPTS)
def test_track_without_a_wandb_login(run, monkeypatch, tmp_path, name):
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    assert "--track: no Weights & Biases login" in run(name, "--track")


# ---- class 2 and 3: --resume ----


def fake_run(tmp_path, script, model, ppo_critic=False, truncate=False, lora=None):
    """A run dir as the scripts write it, with a whole (or truncated) checkpoint at step 1; with
    `lora` (its LoRA flags) the checkpoint holds adapters (adapter/) instead of a model."""
    run_dir = tmp_path / "old_run"
    ckpt = run_dir / "checkpoints" / "step_1"
    weights = "adapter/adapter_model.safetensors" if lora else "model.safetensors"
    for folder in [ckpt] + ([ckpt / "critic"] if ppo_critic else []):
        (folder / weights).parent.mkdir(parents=True, exist_ok=True)
        save_file({"w": torch.zeros(64, 64)}, str(folder / weights))
        torch.save({"step": 1}, folder / "trainer_state.pt")
    if ppo_critic:
        (ckpt / "ppo_state.json").write_text(json.dumps({"kl_coef": 0.05}))
    if truncate:
        data = (ckpt / weights).read_bytes()
        (ckpt / weights).write_bytes(data[:-100])
    config = {"args": {"model": model, **(lora or {})}, "script": script}
    (run_dir / "config.json").write_text(json.dumps(config))
    return str(run_dir)


@pytest.mark.parametrize("name", SCRIPTS)
def test_resume_checks(run, tmp_path, tiny_model, name):
    other = "sft" if name != "sft" else "grpo"
    message = run(name, "--resume", fake_run(tmp_path / "a", f"{other}.py", tiny_model))
    assert f"was made by {other}.py, not {name}.py" in message
    message = run(name, "--resume", fake_run(tmp_path / "b", f"{name}.py", "some/other-model"))
    assert "the run was made with --model some/other-model" in message
    message = run(
        name, "--resume", fake_run(tmp_path / "c", f"{name}.py", tiny_model, truncate=True)
    )
    assert (
        "--resume: checkpoint" in message and "model.safetensors is missing or truncated" in message
    )
    message = run(
        name, "--resume", fake_run(tmp_path / "d", f"{name}.py", tiny_model), "--num-steps", "1"
    )
    assert "not before --num-steps 1" in message
    os.remove(tmp_path / "d" / "old_run" / "checkpoints" / "step_1" / "trainer_state.pt")
    assert "has no optimizer state" in run(name, "--resume", str(tmp_path / "d" / "old_run"))
    # another script's run is named as such, whatever its step
    message = run(name, "--resume", fake_run(tmp_path / "e", f"{other}.py", tiny_model),
                  "--num-steps", "1")  # fmt: skip
    assert f"was made by {other}.py, not {name}.py" in message


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_finished_run_is_extended_from_its_end_or_refused(run, tmp_path, tiny_model, name):
    """Resuming a finished run continues from its final checkpoint when it kept the optimizer
    state (--save-every > 0), and says which step it continues from; without it, the resume is
    refused rather than rewound to an older step_N (which would redo steps and replace the final
    model), naming the step_N to pass for that on purpose."""
    run_dir = fake_run(tmp_path / "a", f"{name}.py", tiny_model, ppo_critic=name == "ppo")
    final = os.path.join(run_dir, "checkpoints", "final")
    shutil.copytree(os.path.join(run_dir, "checkpoints", "step_1"), final)
    (tmp_path / "a" / "old_run" / "checkpoints" / "final" / "checkpoint.json").write_text(
        json.dumps({"step": 3})
    )
    os.remove(os.path.join(final, "trainer_state.pt"))
    message = run(name, "--resume", run_dir, "--num-steps", "5")
    assert "final (step 3), has no optimizer state" in message
    assert "resuming from step_1 would redo steps 2-3" in message
    assert os.path.join(run_dir, "checkpoints", "step_1") in message
    shutil.copy(os.path.join(run_dir, "checkpoints", "step_1", "trainer_state.pt"), final)
    message = run(name, "--resume", run_dir, "--num-steps", "3")
    assert "the checkpoint is at step 3, not before --num-steps 3: pass a larger" in message


LORA_RUN = {"lora_rank": 8, "lora_alpha": None, "lora_target_modules": "q_proj,v_proj"}


@pytest.mark.parametrize("name", SCRIPTS)
def test_lora_flags_that_cannot_apply(run, tiny_model, name):
    """LoRA flags the model or each other cannot take: one line before anything starts."""
    no_module = "--lora-target-modules: {} has no linear layer {!r} in its decoder layers (they "
    no_module += "have: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)"
    for module in ("c_attn", "lm_head", "embed_tokens", "self_attn"):  # absent, or not inside
        message = run(name, "--lora-rank", "8", "--lora-target-modules", f"q_proj,{module}")
        assert message == "error: " + no_module.format(tiny_model, module)
    message = run(name, "--lora-rank", "8", "--lora-target-modules", " , ")
    assert message == "error: --lora-target-modules is empty: name the linear layers to adapt"
    message = run(name, "--lora-rank", "1024")
    assert message == "error: --lora-rank must be >= 0, <= 512 (got 1024)"  # vLLM's limit
    message = run(name, "--lora-alpha", "16")
    assert message == "error: --lora-alpha needs --lora-rank (LoRA is off)"
    message = run(name, "--lora-dropout", "0.1")
    assert message == "error: --lora-dropout needs --lora-rank (LoRA is off)"
    message = run(name, "--lora-target-modules", "q_proj")
    assert message == "error: --lora-target-modules needs --lora-rank (LoRA is off)"
    assert "--lora-rank" in run(name, "--lora-rank", "-1") and "--lora-dropout" in run(
        name, "--lora-rank", "8", "--lora-dropout", "1"
    )
    if name in RL:
        message = run(name, "--lora-merge-sync")
        assert message == "error: --lora-merge-sync needs --lora-rank (LoRA is off)"


@pytest.mark.parametrize("name", SCRIPTS)
def test_resume_keeps_the_lora_flags_of_the_run(run, tmp_path, tiny_model, name):
    """A LoRA run resumes with its adapters (rank, scale, modules), a full fine-tuning run without
    LoRA; a LoRA checkpoint's adapters are checked whole."""
    critic = name == "ppo"
    lora_run = fake_run(tmp_path / "a", f"{name}.py", tiny_model, critic, lora=LORA_RUN)
    message = run(name, "--resume", lora_run)
    assert message == "error: --resume: the run trained LoRA adapters of rank 8: pass --lora-rank 8"
    message = run(name, "--resume", fake_run(tmp_path / "b", f"{name}.py", tiny_model, critic),
                  "--lora-rank", "8")  # fmt: skip
    assert message == "error: --resume: the run fine-tuned the full model: leave out --lora-rank"
    same = ("--lora-rank", "8", "--lora-target-modules", "q_proj,v_proj")
    message = run(name, "--resume", lora_run, *same, "--lora-alpha", "32")
    assert message == "error: --resume: the run was made with --lora-alpha 16, not 32"
    message = run(name, "--resume", lora_run, "--lora-rank", "8")
    assert message == (
        "error: --resume: the run was made with --lora-target-modules q_proj,v_proj, not "
        "down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj"
    )
    # the same modules in another order (or named twice) are the same adapters
    run(name, "--resume", lora_run, "--lora-rank", "8", "--lora-target-modules",
        "v_proj, q_proj,v_proj", reach_ray=True)  # fmt: skip
    cut = fake_run(tmp_path / "c", f"{name}.py", tiny_model, critic, truncate=True, lora=LORA_RUN)
    message = run(name, "--resume", cut, *same)
    assert message.endswith("step_1/adapter/adapter_model.safetensors is missing or truncated")


@pytest.mark.parametrize("name", SCRIPTS)
def test_resume_keeps_the_runs_own_flags_and_says_what_it_changes(
    tmp_path, tiny_model, capsys, name
):
    """A flag the resume does not give keeps what the run's command lines gave it (the first, then
    each resume's up to the checkpoint), not the default: a resume without --save-every still
    saves a final model that can be extended. What the resume changes is listed."""
    module = importlib.import_module(name)
    run_dir = fake_run(tmp_path, f"{name}.py", tiny_model)
    first = {"args": {"model": tiny_model, "save_every": 1, "num_steps": 5, "seed": 1,
                      "save_final": False, "learning_rate": 1e-3, "output_dir": "elsewhere"},
             "script": f"{name}.py", "argv": [f"{name}.py", "--save-every", "1", "--num-steps=5",
                                              "--learning-rate", "0.001", "--no-save-final", "--output-dir", "x"]}  # fmt: skip
    resumed = {**first, "args": {**first["args"], "seed": 7}, "argv": [f"{name}.py", "--seed", "7"]}
    later = {**first, "args": {**first["args"], "seed": 9}, "argv": [f"{name}.py", "--seed", "9"]}
    for file, config in (
        ("config.json", first),
        ("config.resume_1.json", resumed),
        ("config.resume_3.json", later),
    ):  # fmt: skip  (step 3: after step_1)
        (tmp_path / "old_run" / file).write_text(json.dumps(config))
    args = parse_args(module.Args, ["--resume", run_dir, "--learning-rate", "0.002"])
    assert (args.save_every, args.num_steps, args.seed, args.save_final) == (1, 5, 7, False)
    assert args.learning_rate == 0.002 and args.output_dir == "runs"
    out = capsys.readouterr().out
    kept = "--num-steps 5, --save-every 1, --no-save-final, --seed 7"
    assert f"resume: keeps the run's own {kept}" in out
    assert "resume: changes --learning-rate 0.002 (was 0.001)" in out
    assert "saves no model" not in out  # it saves: every step


@pytest.mark.parametrize("name", RL)
def test_resume_compares_reward_terms_as_the_run_saved_them(tmp_path, tiny_model, capsys, name):
    """--reward-fn's terms (a tuple here, a list in config.json): the same terms given again are no
    change; other terms are listed as one."""
    module = importlib.import_module(name)
    run_dir = fake_run(tmp_path, f"{name}.py", tiny_model)
    config = {"args": {"model": tiny_model, "reward_fn": ["t.py:f"]}, "script": f"{name}.py",
              "argv": [f"{name}.py", "--reward-fn", "t.py:f"]}  # fmt: skip
    (tmp_path / "old_run" / "config.json").write_text(json.dumps(config))
    parse_args(module.Args, ["--resume", run_dir, "--reward-fn", "t.py:f"])
    assert "resume: changes" not in capsys.readouterr().out
    parse_args(module.Args, ["--resume", run_dir, "--reward-fn", "t.py:f", "t.py:g=2"])
    out = capsys.readouterr().out
    assert "resume: changes --reward-fn ['t.py:f', 't.py:g=2'] (was ['t.py:f'])" in out


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_run_that_saves_no_model_says_so(capsys, name):
    module = importlib.import_module(name)
    parse_args(module.Args, ["--no-save-final"])
    assert (
        "note: this run saves no model (--no-save-final, --save-every 0)" in capsys.readouterr().out
    )
    parse_args(module.Args, ["--no-save-final", "--save-every", "2"])
    parse_args(module.Args, [])
    assert "saves no model" not in capsys.readouterr().out


def test_resume_says_which_step_it_continues_from(run, tmp_path, tiny_model, capsys):
    run_dir = fake_run(tmp_path, "sft.py", tiny_model)
    run("sft", "--resume", run_dir, "--num-steps", "4", reach_ray=True)
    assert "resume: from old_run/checkpoints/step_1, step 1 of 4" in capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_step_batch_larger_than_the_data_is_refused(run, name):
    flag = "--prompts-per-step" if name in RL else "--batch-size"
    message = run(name, flag, "17")  # the data has 16 rows
    assert f"{flag} 17 is more than the 16" in message and "use at most 16" in message


@pytest.mark.parametrize("name", SCRIPTS)
def test_flags_that_do_not_parse_get_one_line(name):
    """What tyro answers with a box and exit status 2 gets one `error:` line (the scripts' own
    parse_args); integers past INT_MAX are out of range like any other value."""
    from common.flags import parse_args

    module = importlib.import_module(name)
    cases = [
        (["--num-steps", "1.5"], "--num-steps takes an integer (got '1.5')"),
        (["--learning-rate", "abc"], "--learning-rate takes a number (got 'abc')"),
        (["--num-stepz", "3"], "no flag --num-stepz (did you mean --num-steps?)"),
        (["--seed"], "--seed needs a value"),
        (["--dtype", "fp8"], "--dtype takes one of auto, bfloat16, float16, float32 (got 'fp8')"),
    ]
    for argv, expected in cases:
        with pytest.raises(SystemExit) as e:
            parse_args(module.Args, argv)
        assert e.value.code.startswith(f"error: {expected}"), e.value.code
    args = parse_args(module.Args, ["--seed", str(10**20)])
    with pytest.raises(SystemExit, match=r"^error: --seed must be at most 2147483647 \(got 1000"):
        module.validate_args(args)


@pytest.mark.parametrize("name", SCRIPTS)
def test_weights_and_best_checkpoint_flags(run, name):
    """--optimizer, --ema-beta, --eval-ema, --best-metric, --best-mode, --is-correction: out of
    their range or not together, one line before anything starts."""
    cases = [
        (["--best-metric", "accuracy"], "--best-metric must be eval/<name> (got 'accuracy')"),
        (["--best-metric", "eval/"], "--best-metric must be eval/<name> (got 'eval/')"),
        (["--ema-beta", "1"], "--ema-beta must be >= 0, < 1 (got 1.0)"),
        (["--ema-beta", "0.9", "--lora-rank", "4"], "--ema-beta averages whole matrices"),
        (["--optimizer", "muon", "--lora-rank", "4"], "--optimizer muon orthogonalises whole"),
    ]
    cases.append(
        (["--eval-ema"], "--eval-ema: grpo_async.py's engines sample rollouts during evaluation")
        if name == "grpo_async"
        else (["--eval-ema"], "--eval-ema needs --ema-beta (the EMA is off)")
    )
    for flags, expected in cases:
        assert run(name, *flags).startswith(f"error: {expected}")
    module = importlib.import_module(name)
    choices = [("--optimizer", "sgd", "adamw, muon"), ("--best-mode", "avg", "max, min")]
    if name in ("grpo", "dapo", "grpo_async", "grpo_tools", "distill"):
        choices.append(("--is-correction", "clip", "tis, icepop, seq-mask"))
    if name == "ppo":
        choices.append(("--is-correction", "clip", "none, tis, icepop"))
    for flag, bad, allowed in choices:
        with pytest.raises(SystemExit) as e:
            parse_args(module.Args, [flag, bad])
        assert e.value.code.startswith(f"error: {flag} takes one of {allowed} (got '{bad}')")


def test_one_writer_per_run_dir(tmp_path, tiny_model):
    """A second run that would write in a run dir a live run holds is refused, naming it; when the
    holder dies (SIGKILL: no cleanup), its lock goes with it."""
    run_dir = fake_run(tmp_path, "sft.py", tiny_model)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from common.tracking import lock_run_dir; "
         f"lock_run_dir({run_dir!r}); print('locked', flush=True); time.sleep(300)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "locked"
    argv = [
        sys.executable,
        "sft.py",
        "--model",
        tiny_model,
        "--resume",
        run_dir,
        "--num-steps",
        "1",
    ]
    second = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert second.returncode == 1, second.stderr[-2000:]
    assert f"is in use by a live run (pid {holder.pid} on" in second.stderr
    holder.kill()
    holder.wait()
    second = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert "not before --num-steps 1" in second.stderr, second.stderr[-2000:]  # past the lock


def test_ppo_resume_needs_the_critic_checkpoint(run, tmp_path, tiny_model):
    message = run("ppo", "--resume", fake_run(tmp_path, "ppo.py", tiny_model))
    assert "critic has no weights" in message


# ---- reward functions (class 2, 3 and 4): checked on a test call before anything starts ----


@pytest.mark.parametrize("name", RL)
@pytest.mark.parametrize(
    "body,expected",
    [("return '1.0'", "returned '1.0', not a finite number"), ("return float('nan')", "returned nan"),
     ("return None", "returned None"), ("raise KeyError('x')", "failed (test calls before the run, row 1): KeyError"),
     ("import time; time.sleep(60)", "did not return within 1 s"),
     ("import os; os._exit(1)", "failed (test calls before the run, row 1): Crashed: the process running my_reward ended (exit status 1)"),
     ("import ctypes; ctypes.string_at(0)", "Crashed: the process running my_reward ended (signal SIGSEGV)")],
)  # fmt: skip
def test_bad_reward_functions_are_caught_by_the_test_call(run, tmp_path, name, body, expected):
    path = tmp_path / "my_reward.py"
    path.write_text(f"def my_reward(response, answer):\n    {body}\n")
    message = run(name, "--reward-fn", f"{path}:my_reward", "--reward-timeout", "1")
    assert "reward function my_reward" in message and expected in message


@pytest.mark.parametrize("name", RL)
@pytest.mark.parametrize(
    "terms,expected",
    [(["my_reward=abc"], "the weight after '=' must be a finite number"),
     (["my_reward=inf"], "the weight after '=' must be a finite number"),
     (["my_reward", "my_reward=2"], "the reward already has a term named my_reward"),
     (["verifier"], "the reward already has a term named verifier")],
)  # fmt: skip
def test_reward_terms_that_cannot_compose(run, tmp_path, name, terms, expected):
    path = tmp_path / "my_reward.py"
    path.write_text("def my_reward(response, answer):\n    return 1.0\nverifier = my_reward\n")
    message = run(name, "--reward-fn", *[f"{path}:{term}" for term in terms])
    assert message.startswith(f"error: --reward-fn {path}:") and expected in message, message


@pytest.mark.parametrize("name", RL)
def test_a_list_flag_given_twice_takes_every_value(name):
    """`--reward-fn a --reward-fn b` as other command lines write a list: both terms (argparse alone
    kept the last, silently)."""
    module = importlib.import_module(name)
    argv = [
        "--reward-fn",
        "a.py:f",
        "--seed",
        "2",
        "--reward-fn=b.py:g",
        "c.py:h",
        "--reward-fn",
        "d.py:i",
    ]
    args = parse_args(module.Args, argv)
    assert args.reward_fn == ("a.py:f", "b.py:g", "c.py:h", "d.py:i") and args.seed == 2


def test_a_repeated_reward_fn_is_read_whole_in_a_real_process(tmp_path):
    """The earlier occurrence is not dropped: its missing function stops the run before it starts."""
    path = tmp_path / "my_reward.py"
    path.write_text("def my_reward(response, answer):\n    return 1.0\n")
    argv = [sys.executable, "grpo.py", "--reward-fn", f"{path}:missing", "--reward-fn", f"{path}:my_reward",
            "--output-dir", str(tmp_path / "runs")]  # fmt: skip
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1 and out.stderr.strip() == f"error: {path} has no function 'missing'"


def test_a_reward_fn_that_crashes_its_process_is_one_line_in_a_real_process(tmp_path):
    """Before, a segfault in a --reward-fn term ended grpo_tools.py with exit 139 and no line
    (os._exit(1): exit 1, no line; in-process above for every script): the term ran in the driver.
    Now it runs in a process of its own."""
    how, ended = "import ctypes; ctypes.string_at(0)", "signal SIGSEGV"
    path = tmp_path / "crash.py"
    path.write_text(f"def crash(response, answer):\n    {how}\n")
    argv = [sys.executable, "grpo_tools.py", "--reward-fn", f"{path}:crash", "--output-dir",
            str(tmp_path / "runs")]  # fmt: skip
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == (
        "error: reward function crash failed (test calls before the run, row 1): Crashed: the "
        f"process running crash ended ({ended})"
    ), out.stderr[-2000:]
    assert not os.path.exists(tmp_path / "runs")


# ---- the peer-derived wrong numbers ----


@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_all_equal_groups_get_exactly_zero_advantage(name):
    module = importlib.import_module(name)
    for value in (0.9, 42.7, -3.3, 1e-3):
        rewards = torch.full((16,), value)
        assert torch.equal(module.compute_advantages(rewards, 8), torch.zeros(16)), value
    mixed = torch.tensor([0.9] * 8 + [1.0, 0.0] * 4)
    adv = module.compute_advantages(mixed, 8)
    assert torch.equal(adv[:8], torch.zeros(8)) and adv[8:].abs().min() > 0.5


def test_ppo_whitening_of_equal_advantages_is_zero():
    import ppo

    x, mask = torch.full((2, 5), 0.9), torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2])
    assert torch.equal(ppo.masked_whiten(x, mask), torch.zeros(2, 5))


@pytest.mark.parametrize("name", RL)
def test_huge_log_ratio_with_zero_advantage_is_not_nan(name):
    module = importlib.import_module(name)
    logprobs, old, adv = torch.tensor([0.0, 0.0]), torch.tensor([-500.0, 500.0]), torch.zeros(2)
    clip = (0.2,) if name == "ppo" else (0.2, 0.28)
    loss, _ = module.compute_policy_loss(logprobs, old, adv, *clip)
    assert torch.equal(loss, torch.zeros(2))


def test_reward_model_reads_where_rm_trained_it(tiny_model, tokenizer):
    """rm.py trains the score at the last token of encode_example's ids (the chat template's
    rendering, ending after the end-of-turn token); ppo.py must score the same ids, not vLLM's
    (which end at the end-of-turn)."""
    import ppo
    import rm
    from common import models
    from common.data import encode_example, encode_prompt

    prompt, response = [{"role": "user", "content": "What is 2 + 3?"}], "5"
    trained = encode_example(tokenizer, prompt, response)[0]
    assert ppo.reward_model_input(tokenizer, prompt, response) == trained
    vllm_like = (
        encode_prompt(tokenizer, prompt) + tokenizer(response, add_special_tokens=False).input_ids
    )
    vllm_like += [tokenizer.eos_token_id]  # what vLLM returns for a finished response
    assert (
        vllm_like != trained and trained[: len(vllm_like)] == vllm_like
    )  # the template adds after the EOS
    scorer = models.RewardModel.__ray_actor_class__(
        tiny_model, False
    )  # in-process, frozen, as ppo.py runs it
    torch.nn.init.normal_(scorer.model.score.weight)
    ids = torch.tensor([trained])
    as_rm = rm.compute_rewards(
        scorer.model, ids, torch.arange(len(trained))[None]
    )  # rm.py's reading
    assert scorer.rewards([trained])[0] == pytest.approx(as_rm.item(), abs=1e-5)
    assert (
        abs(scorer.rewards([vllm_like])[0] - as_rm.item()) > 1e-3
    )  # the old input read another token


# ---- a few real processes: the exit status and stderr as a user sees them ----


def test_one_error_line_in_a_real_process(tmp_path):
    """Every script as a user runs it, started together (each spends seconds importing torch and
    vLLM)."""
    (tmp_path / "d.json").write_text("[{]")
    argv = ["--dataset", str(tmp_path / "d.json"), "--output-dir", str(tmp_path / "runs")]
    procs = {
        name: subprocess.Popen(
            [sys.executable, f"{name}.py", *argv],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for name in SCRIPTS
    }
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=180)
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and len(errors) == 1 and "not valid JSON" in errors[0], (
            name,
            stderr[-2000:],
        )
        assert "Traceback" not in stderr, name
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_flag_of_another_script_is_named_with_the_script_that_has_it(name):
    """A flag this script lacks but a sibling has: the line names the scripts that have it (the
    parent first) and, where the script says why, the reason; a typo of its own flag: the closest."""
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as e:
        parse_args(
            module.Args, ["--max-lag", "2"] if name != "grpo_async" else ["--reward-model", "x"]
        )
    message = str(e.value.code)
    if name == "grpo_async":
        assert message == (
            "error: no flag --reward-model in grpo_async.py; ppo.py has it (python ppo.py --reward-model)"
        )
    else:
        want = f"error: no flag --max-lag in {name}.py; grpo_async.py has it (python grpo_async.py --max-lag)"
        assert message == want
    with pytest.raises(SystemExit) as e:
        parse_args(module.Args, ["--num-stepz", "2"])
    assert (
        str(e.value.code)
        == "error: no flag --num-stepz (did you mean --num-steps?); --help lists them"
    )


def test_colocate_on_grpo_async_says_why_and_where_it_is():
    for flag in ("--colocate", "--no-colocate"):
        out = subprocess.run([sys.executable, "grpo_async.py", flag], cwd=REPO, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert out.returncode == 1 and out.stderr.strip() == (
            f"error: no flag {flag} in grpo_async.py: the engines generate while the trainers "
            f"train, so they cannot share GPUs; grpo.py, dapo.py, distill.py, grpo_tools.py, "
            f"ppo.py have it (python grpo.py {flag})"
        )


def test_an_adapter_folder_as_model_says_what_to_pass(tmp_path):
    from common.models import resolve_model

    for folder in (tmp_path / "peft", tmp_path / "step_3"):  # PEFT's own folder, a LoRA step_N
        inner = folder if folder.name == "peft" else folder / "adapter"
        inner.mkdir(parents=True)
        (inner / "adapter_config.json").write_text("{}")
        with pytest.raises(SystemExit) as e:
            resolve_model(str(folder))
        assert str(e.value.code) == (
            f"error: --model {str(folder)!r} holds LoRA adapters (PEFT's adapter_config.json), not "
            "a model: a LoRA run's merged model is its checkpoints/final; to go on training the "
            "adapters, --resume the run (with --model its base)"
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        resolve_model(str(tmp_path / "empty"))
    assert (
        str(e.value.code) == f"error: model folder {str(tmp_path / 'empty')!r} has no config.json"
    )


@pytest.mark.parametrize("script", RL)
def test_engine_memory_over_one_gpu_stops_in_check_machine(script, monkeypatch, tmp_path):
    """On a GPU machine (the layout stood in for) --engine-memory 2 stops before Ray starts, in the
    scripts' check_machine, with common/memory.py's one line."""
    from common.errors import InputError

    module = importlib.import_module(script)
    monkeypatch.setattr(placement, "choose_layout", lambda *a: (True, False))
    monkeypatch.setattr(module, "choose_dtype", lambda dtype, use_gpu: "bfloat16")
    args = module.Args(engine_memory=2.0, output_dir=str(tmp_path))
    with pytest.raises(InputError, match="--engine-memory is a fraction of each GPU's memory"):
        module.check_machine(args, f"{script}.py")
    args = module.Args(engine_memory=0.5, output_dir=str(tmp_path))
    assert module.check_machine(args, f"{script}.py")[0] is True  # a fraction passes
