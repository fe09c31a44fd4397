"""Grader of lab 08 (on-policy distillation: grpo.py with a teacher's per-token reverse KL).

python labs/08-on-policy-distillation/check.py my_distill.py [--no-run | --run-dir DIR]

The run part needs a teacher: the newest runs/lab08/teacher__*/checkpoints/final (the handout's first
command makes it).
"""

import glob
import math
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grader import REPO, Grader, close, expect, rounded, series  # noqa: E402

g = Grader("08", "grpo.py")
m = g.load()


def loss_args(**kw):
    base = dict(clip_eps=0.2, tis_cap=2.0, is_correction="tis", kl_coef=0.0, verifier_coef=0.0)
    return types.SimpleNamespace(**{**base, **kw})


with g.check(
    "reverse_kl(logprobs, teacher_logprobs): the k1 estimate log π_θ - log π_T at each token",
    hint="one subtraction per token; the student's log-probability first",
):
    kl = m.reverse_kl(torch.tensor([-0.5, -2.0, -1.0]), torch.tensor([-1.5, -0.5, -1.0]))
    expect(
        close(kl, [1.0, -1.5, 0.0]),
        f"{rounded(kl)} for student [-0.5, -2, -1], teacher [-1.5, -0.5, -1]",
    )

with g.check(
    "compute_loss with teacher_logprobs: Â_t = λ Â_i - k1_t (k1 from π_θold), logged as reverse_kl",
    hint="the advantage is a constant per token: compute k1 from values['old_logprobs'], not from the "
    "logprobs that carry the gradient; λ is args.verifier_coef",
):
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    values = {
        "old_logprobs": lp.detach(),
        "engine_logprobs": torch.tensor([-1.0, -2.5, -0.5]),
        "teacher_logprobs": torch.tensor([-0.5, -2.0, -1.5]),
        "advantages": torch.tensor([0.25, 0.25, -0.1]),
        "loss_weights": torch.tensor([0.5, 0.5, 1.0]),
    }
    loss, stats = m.compute_loss(lp, values, loss_args(verifier_coef=0.5))
    tis, weights = [1.0, min(math.exp(0.5), 2.0), 1.0], [0.5, 0.5, 1.0]
    adv = [0.5 * 0.25 + 0.5, 0.5 * 0.25 - 0.0, 0.5 * -0.1 - 1.0]
    want = -sum(w * t * a for w, t, a in zip(weights, tis, adv))
    expect(
        close(loss.item(), want),
        f"loss {loss.item():.5f} (λ = 0.5, three tokens, TIS on the second)",
    )
    expect("reverse_kl" in stats, f"compute_loss's stats have {sorted(stats)}: no reverse_kl")
    expect(
        close(float(stats["reverse_kl"]), 0.5),
        f"stats['reverse_kl'] {float(stats['reverse_kl']):.4f}",
    )
    lp.grad = None
    loss.backward()
    grad = [-w * t * a for w, t, a in zip(weights, tis, adv)]
    expect(close(lp.grad, grad), f"gradient {rounded(lp.grad)} on the log-probabilities")
    loss, stats = m.compute_loss(lp, {k: v for k, v in values.items() if k != "teacher_logprobs"},
                                 loss_args())  # fmt: skip
    expect("reverse_kl" not in stats, "without teacher_logprobs the loss still logs reverse_kl")

with g.check(
    "on-policy, the loss's expected gradient is exactly the reverse KL's (a 7-token vocabulary)",
    hint="with λ = 0 the loss is -Σ_t w_t Â_t ρ_t with Â_t = -k1_t; check the sign of k1",
):
    torch.manual_seed(0)
    z, teacher = torch.randn(7, requires_grad=True), torch.randn(7).log_softmax(-1)
    lp = z.log_softmax(-1)
    p = lp.exp().detach()
    values = {"old_logprobs": lp.detach(), "engine_logprobs": lp.detach(), "loss_weights": p,
              "teacher_logprobs": teacher, "advantages": torch.zeros(7)}  # fmt: skip
    (grad,) = torch.autograd.grad(m.compute_loss(lp, values, loss_args())[0], z)
    z2 = z.detach().clone().requires_grad_(True)
    (kl_grad,) = torch.autograd.grad((z2.softmax(-1) * (z2.log_softmax(-1) - teacher)).sum(), z2)
    expect(
        close(grad, kl_grad, 1e-5), f"∂loss/∂logits {rounded(grad)} against ∇KL {rounded(kl_grad)}"
    )

with g.check(
    "frozen_models(args): the teacher as ('teacher_logprobs', its folder) with --teacher, nothing new without",
    hint="the trainer shell loads a (name, folder) entry as a frozen model and train_step fills "
    "values[name] with its log-probabilities",
):
    with_teacher = m.frozen_models(m.Args(teacher="/some/teacher"))
    expect(
        ("teacher_logprobs", "/some/teacher") in with_teacher,
        f"{with_teacher} with --teacher /some/teacher",
    )
    expect(
        m.frozen_models(m.Args()) == [],
        f"{m.frozen_models(m.Args())} without --teacher (kl_coef 0)",
    )
    expect(m.Args().verifier_coef == 0.0, f"--verifier-coef defaults to {m.Args().verifier_coef}")

if g.needs_run():
    if not g.opts.run_dir and not (
        teachers := glob.glob(os.path.join(REPO, "runs/lab08/teacher__*/checkpoints/final"))
    ):
        g.fatal("no teacher: make it first with the handout's first command (python grpo.py ... "
                "--exp-name teacher --output-dir runs/lab08), or pass your run with --run-dir")  # fmt: skip
    teacher = [] if g.opts.run_dir else ["--teacher", max(teachers, key=os.path.getmtime)]
    rows = g.run(
        [*teacher, "--num-steps", "4", "--eval-every", "4"], required={"verifier_coef": 0.0}
    )
    with g.check(
        "the student approaches the teacher: train/reverse_kl falls and greedy accuracy rises",
        hint="a run with --teacher logs train/reverse_kl; if it rises, the advantage has the wrong sign",
    ):
        kl, acc = series(rows, "train/reverse_kl"), series(rows, "eval/accuracy")
        expect(len(kl) >= 2 and kl[-1] < kl[0], f"train/reverse_kl {[round(x, 4) for x in kl]}")
        expect(acc[-1] > acc[0], f"eval/accuracy {[round(x, 3) for x in acc]}")
g.finish()
