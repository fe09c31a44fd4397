"""distill.py: the diff against grpo.py stays small and tagged; the reverse KL, the advantage and the
loss against hand computations and against the KL's own gradient over a whole vocabulary; the
teacher's prompt; the teacher's and the student's log-probabilities against a plain transformers
forward; bad input in one line; end-to-end runs (self-distillation on 2 ranks with its resume, a
teacher model with ring attention and G = 1)."""

import math
import os
import re
import types

import pytest
import torch
from conftest import (
    assert_resume_is_exact,
    make_tiny_model,
    only_run_dir,
    read_jsonl,
    run_script,
    tagged_diff,
    trainer_rank,
)

import distill
from common.data import Prompt, encode_prompt, split_for_ranks

TAG = re.compile(r"# DISTILL \(([a-z-]+)\)|# DISTILL:()")


def test_diff_to_grpo_is_small_and_every_hunk_is_tagged():
    changed, untagged, sections = tagged_diff("grpo.py", "distill.py", TAG)
    assert 0 < changed <= 200, f"distill.py changes {changed} lines of grpo.py (budget 200)"
    assert sections <= {"teacher", "advantage", ""}, sections
    assert not untagged, f"hunks without a `# DISTILL (<section>)` tag near lines {untagged}"
    fields = distill.Args.__dataclass_fields__
    assert "kl_coef" not in fields and not hasattr(distill, "compute_kl")  # no π_ref


def loss_args(**kw):
    base = dict(clip_eps=0.2, tis_cap=2.0, is_correction="tis", kl_estimator="k1")
    return types.SimpleNamespace(**{**base, **kw})


def test_reverse_kl_estimators_by_hand():
    student = torch.tensor([-0.5, -2.0, -1.0])
    teacher = torch.tensor([-1.5, -2.0 + math.log(10), -1.0])  # 10x more likely on token 2
    k1 = distill.reverse_kl(student, teacher, "k1")
    assert k1.tolist() == pytest.approx([1.0, -math.log(10), 0.0])
    k3 = distill.reverse_kl(student, teacher, "k3")
    # k3 = r - 1 - log r, r = π_T / π_θ
    assert k3.tolist() == pytest.approx([math.exp(-1) - 1 + 1, 10 - 1 - math.log(10), 0.0])
    assert (k3 >= 0).all()
    assert distill.reverse_kl(student, teacher).tolist() == k1.tolist()  # k1 by default


def test_verifier_advantage_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    got = distill.compute_advantages(rewards, 3, 0.5)  # λ (r - mean of the group)
    assert got.tolist() == pytest.approx([1 / 3, -1 / 6, -1 / 6, -1 / 3, 1 / 6, 1 / 6])
    assert distill.compute_advantages(rewards, 1, 0.5).tolist() == [0.5, 0, 0, 0, 0.5, 0.5]
    assert distill.compute_advantages(rewards, 3, 0.0).abs().sum() == 0


def test_loss_by_hand():
    """Â_t = λ(r - b) - k1_t at ratio 1 with TIS weights: the loss is -Σ_t w_t IS_t Â_t."""
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    old = lp.detach()
    values = {
        "old_logprobs": old,
        "engine_logprobs": torch.tensor([-1.0, -2.5, -0.5]),  # IS = min(e^0.5, 2) on token 2
        "teacher_logprobs": torch.tensor([-0.5, -2.0, -1.5]),
        "advantages": torch.tensor([0.25, 0.25, -0.1]),
        "loss_weights": torch.tensor([0.5, 0.5, 1.0]),
    }
    loss, stats = distill.compute_loss(lp, values, loss_args())
    k1 = [-0.5, 0.0, 1.0]
    adv = [0.25 + 0.5, 0.25 - 0.0, -0.1 - 1.0]
    tis = [1.0, min(math.exp(0.5), 2.0), 1.0]
    want = -sum(w * t * a for w, t, a in zip([0.5, 0.5, 1.0], tis, adv))
    assert loss.item() == pytest.approx(want)
    assert stats["reverse_kl"].item() == pytest.approx(sum(k1))
    loss.backward()  # at ratio 1: ∂L/∂lp_t = -w_t IS_t Â_t (no clip is active)
    want_grad = [-w * t * a for w, t, a in zip([0.5, 0.5, 1.0], tis, adv)]
    assert lp.grad.tolist() == pytest.approx(want_grad)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_expected_gradient_against_the_kl_over_a_vocabulary(estimator):
    """Every token v of a 7-token vocabulary as a sample, weighted by π_θ(v): the expected gradient of
    the loss on the logits is exactly ∇KL(π_θ || π_T) with k1; with k3 it is that plus π_T - π_θ
    (Σ_v π_T(v) ∇log π_θ(v)), the bias reverse_kl's docstring states."""
    torch.manual_seed(0)
    z, teacher = torch.randn(7, requires_grad=True), torch.randn(7).log_softmax(-1)
    lp = z.log_softmax(-1)
    p = lp.exp().detach()
    values = {"old_logprobs": lp.detach(), "engine_logprobs": lp.detach(), "loss_weights": p,
              "teacher_logprobs": teacher, "advantages": torch.zeros(7)}  # fmt: skip
    loss, _ = distill.compute_loss(lp, values, loss_args(kl_estimator=estimator))
    (grad,) = torch.autograd.grad(loss, z)
    z2 = z.detach().clone().requires_grad_(True)
    kl = (z2.softmax(-1) * (z2.log_softmax(-1) - teacher)).sum()
    (kl_grad,) = torch.autograd.grad(kl, z2)
    bias = teacher.exp() - p if estimator == "k3" else 0.0
    torch.testing.assert_close(grad, kl_grad + bias, atol=1e-6, rtol=1e-5)
    if estimator == "k3":
        assert (grad - kl_grad).abs().max() > 1e-2  # the bias is not negligible here


@pytest.mark.parametrize("text", ["plain", "messages"])
def test_teacher_prompt_holds_the_answer_and_the_students_does_not(tokenizer, text):
    question = "What is 11 + 15? Give only the final number."
    written = question if text == "plain" else [{"role": "user", "content": question}]
    ids = encode_prompt(tokenizer, written)
    prompt = Prompt(ids, "26", written, 1)
    self_args = types.SimpleNamespace(teacher="", teacher_prompt="auto")
    teacher = tokenizer.decode(distill.teacher_prompt(prompt, tokenizer, self_args))
    student = tokenizer.decode(ids)
    assert "26" in teacher and "26" not in student and question in teacher
    assert teacher.index("26") < teacher.index(question)  # the answer comes first
    other = types.SimpleNamespace(teacher="some/teacher", teacher_prompt="auto")
    assert distill.teacher_prompt(prompt, tokenizer, other) == ids  # a model teacher: the same
    told = types.SimpleNamespace(teacher="some/teacher", teacher_prompt="answer")
    assert distill.teacher_prompt(prompt, tokenizer, told) != ids


@torch.no_grad()
def hf_logprobs(model_dir, prompt: list[int], response: list[int], temperature: float):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_teacher_and_student_logprobs_equal_a_plain_forward(
    one_rank_group, tiny_model, tiny_model_untied
):
    """score_teacher on one rank, the teacher another model (frozen in the shell) and, with
    --live-teacher, the policy itself: both equal a plain transformers forward of the teacher's
    prompt + the response, packed or not, at the sampling temperature."""
    addr, port = one_rank_group
    args = distill.Args(teacher=tiny_model_untied, temperature=0.7)
    distill.validate_args(args)
    trainer = trainer_rank(distill, args, tiny_model, addr, port)
    prompts, responses = [[5, 6, 7], [9, 10, 11, 12]], [[20, 21, 22, 23], [30, 31]]
    seqs = [distill.make_sequence(p, r, token=range(a, a + len(r)))
            for p, r, a in zip(prompts, responses, [0, 4])]  # fmt: skip
    for live, model_dir in [(False, tiny_model_untied), (True, tiny_model)]:
        trainer.args.live_teacher = live
        out = distill.score_teacher(trainer, split_for_ranks(seqs, 1, 64)[0])  # one packed row
        assert out[0].tolist() == [0, 1, 2, 3, 4, 5]
        want = torch.cat([hf_logprobs(model_dir, p, r, 0.7) for p, r in zip(prompts, responses)])
        torch.testing.assert_close(out[1], want, atol=2e-5, rtol=0)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, tokenizer, tiny_model):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(tiny_model)
    other.add_tokens(["<not-in-the-student>"])
    teacher = make_tiny_model(tmp_path / "teacher", other)
    result = run_script("distill.py", "--model", tiny_model, "--teacher", teacher,
                        "--output-dir", str(tmp_path / "runs"))  # fmt: skip
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"error: --teacher {teacher}'s tokenizer is not --model {tiny_model}'s: it "
                    "must score the student's tokens"), last  # fmt: skip
    assert not os.path.exists(tmp_path / "runs") or not os.listdir(tmp_path / "runs")


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--teacher-prompt", "same"), "self-distillation's teacher is told the answer"),
        (("--live-teacher", "--teacher", "x"), "--live-teacher makes the policy its own teacher"),
        (("--num-generations", "0"), "--num-generations"),
        (("--kl-estimator", "k2"), "k2"),
    ],
)
def test_bad_flags_stop_in_one_line(flags, message, tmp_path):
    result = run_script("distill.py", *flags, "--output-dir", str(tmp_path / "runs"))
    assert result.returncode != 0
    assert message in result.stderr.strip().splitlines()[-1] or message in result.stderr
    assert not os.path.exists(tmp_path / "runs")


def distill_args(model, out, *extra):
    return ("--model", model, "--output-dir", str(out), "--num-generations", "4", "--prompts-per-step",
            "4", "--max-response-length", "8", "--engine-memory", "0.25", "--learning-rate", "1e-3",
            *extra)  # fmt: skip


@pytest.mark.cpu_engine
def test_self_distillation_end_to_end_and_resume(tmp_path, tiny_model):
    """Self-distillation on 2 trainer ranks: the teacher (the start model told the answer) is scored
    every step, its accuracy logged at step 0, the student's reverse KL logged; the resume from
    step 1 replays step 2 exactly."""
    extra = ("--num-steps", "2", "--num-trainers", "2", "--save-every", "1", "--eval-every", "1")
    flags = distill_args(tiny_model, tmp_path / "runs", *extra)
    result = run_script("distill.py", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs")
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    first = next(r for r in rows if r["step"] == 0)
    assert 0 <= first["eval/teacher_accuracy"] <= 1 and "eval/accuracy" in first
    trained = [r for r in rows if "train/reverse_kl" in r]
    assert [r["step"] for r in trained] == [1, 2]
    # the start model told the answer differs from the student: a KL, and a gradient
    assert all(math.isfinite(r["train/reverse_kl"]) and r["train/grad_norm"] > 0 for r in trained)
    assert trained[0]["train/reverse_kl"] != 0
    assert_resume_is_exact("distill.py", flags, run_dir)


@pytest.mark.cpu_engine
def test_a_teacher_model_with_ring_attention_and_one_sample(
    tmp_path, tiny_model, tiny_model_untied
):
    """A teacher model (another model, the student's tokenizer), G = 1, --sp-size 2 (each rank
    scores its chunks of the teacher's rows), k3 and a verifier term: one step trains."""
    extra = ("--teacher", tiny_model_untied, "--num-generations", "1", "--num-trainers", "2",
             "--sp-size", "2", "--kl-estimator", "k3", "--verifier-coef", "0.5", "--num-steps", "1",
             "--eval-dataset", "", "--no-save-final")  # fmt: skip
    result = run_script("distill.py", *distill_args(tiny_model, tmp_path / "runs", *extra))
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = read_jsonl(os.path.join(only_run_dir(tmp_path / "runs"), "metrics.jsonl"))
    # two different random models: far from the ~1e-6 a teacher scoring with the student's own
    # weights would give (0.055 measured; k1 on sampled tokens, whose mean is the KL)
    assert row["train/reverse_kl"] > 0.01 and row["train/grad_norm"] > 0
    assert "eval/teacher_accuracy" not in row


def test_the_memory_plan_counts_the_teacher(monkeypatch, tiny_model, tiny_model_untied):
    """A teacher model: 4 B a parameter sharded over the trainer ranks, in every phase; distill.py
    plans a teacher model as that, self-distillation's frozen start as the reference (a copy of the
    policy) and --live-teacher as nothing."""
    from benchmark import memory_plan
    from common import memory

    s05, s7 = memory_plan.shape("Qwen2.5-0.5B"), memory_plan.shape("Qwen2.5-7B")
    job = memory.Job(s05, 2, 8192, engines=1, engine_memory=0.4, colocate=True, teacher=s7)
    for _, phase, parts in memory.needs(job, memory_plan.H100):
        assert parts["teacher"] == 4 * s7.params / 2, phase
    assert not any("teacher" in p for *_, p in memory.needs(memory.Job(s05, 2, 8192), 80 * 2**30))
    seen = []
    monkeypatch.setattr(distill.memory, "check_run", lambda *a, **kw: seen.append((a[3], kw)))
    for flags in (dict(teacher=tiny_model_untied), {}, dict(live_teacher=True)):
        args = distill.Args(model=tiny_model, **flags)
        distill.validate_args(args)
        distill.prepare_inputs(args, False)
    assert [(reference, kw["teacher"]) for reference, kw in seen] == [
        (False, tiny_model_untied),
        (True, None),
        (False, None),
    ]
