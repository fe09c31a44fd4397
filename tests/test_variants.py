"""docs/variants.md's checklist, steps 1-4, on a copy of grpo.py: a Dr. GRPO variant (no std in the
advantages, a constant loss normaliser, one new flag) written the way the checklist says is a tagged
diff that leaves every TRY NOT TO MODIFY block alone, range-checks its flag, and trains on its new
aggregation with the unchanged trainer. A checklist whose steps stopped working fails here."""

import difflib
import importlib.util
import math
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO, tagged_diff, trainer_rank
from test_labs import plumbing_edits

from common.data import split_for_ranks
from common.flags import check_flags, flag_ranges
from common.ring_attn import Responses

TAG = re.compile(r"# DRGRPO \(([a-z-]+)\)")
EDITS = [  # (text of grpo.py, replacement): each hunk tagged, as step 3 asks
    (
        "    advantages = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)\n",
        "    advantages = r - r.mean(dim=1, keepdim=True)  # DRGRPO (no-std): no division by std\n",
    ),
    (
        "    n = len(response_lengths)\n    return [[1.0 / (n * length)] * length for length in "
        "response_lengths]\n",
        "    n = len(response_lengths)  # DRGRPO (constant-norm): 1/(n L_max), not 1/(n |o_i|)\n"
        "    return [[1.0 / (n * args.norm_length)] * length for length in response_lengths]\n",
    ),
    (
        '    """peak learning rate (both halves of Muon too)"""\n',
        '    """peak learning rate (both halves of Muon too)"""\n'
        '    norm_length: Annotated[int, ">= 1"] = 24  # DRGRPO (constant-norm): §3.2\n'
        '    """L: the constant every response\'s token sum is divided by"""\n',
    ),
]


def test_the_checklist_makes_a_variant_that_passes_the_variant_checks(tmp_path):
    with open(f"{REPO}/grpo.py") as f:
        text = f.read()
    doc = text[: text.index('"""', 3) + 3]
    variant = text.replace(
        doc, '"""Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): grpo.py, unbiased."""'
    )  # step 1
    for old, new in EDITS:  # step 2: the math and a flag, nowhere else
        assert text.count(old) == 1, old
        variant = variant.replace(old, new)
    path = tmp_path / "drgrpo.py"
    path.write_text(variant)

    changed, untagged, sections = tagged_diff("grpo.py", str(path), TAG)  # step 4
    assert 0 < changed < 40 and not untagged and sections == {"no-std", "constant-norm"}
    diff = difflib.unified_diff(text.splitlines(), variant.splitlines(), "a/grpo.py", "b/drgrpo.py",
                                lineterm="")  # fmt: skip
    (tmp_path / "drgrpo.diff").write_text("\n".join(diff) + "\n")
    assert not plumbing_edits(f"{REPO}/grpo.py", str(tmp_path / "drgrpo.diff"))

    spec = importlib.util.spec_from_file_location("drgrpo", path)
    drgrpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drgrpo)
    assert (
        flag_ranges(drgrpo.Args)["norm_length"] == ">= 1"
    )  # the new flag's range sits on the flag
    with pytest.raises(SystemExit, match="--norm-length must be >= 1"):
        check_flags(drgrpo.Args(norm_length=0))
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert drgrpo.compute_advantages(rewards, 4).tolist() == [0.75, -0.25, -0.25, -0.25]
    args = drgrpo.Args(norm_length=8)
    assert drgrpo.loss_weights([2, 4], args) == [[1 / 16] * 2, [1 / 16] * 4]
    # the unchanged compute_loss applies the new weights to every token: the trainer needs no edit
    weights = torch.tensor([w for row in drgrpo.loss_weights([2, 4], args) for w in row])
    values = {"old_logprobs": torch.zeros(6), "engine_logprobs": torch.zeros(6),
              "advantages": torch.ones(6), "loss_weights": weights}  # fmt: skip
    loss, _ = drgrpo.compute_loss(torch.zeros(6), values, args)
    assert loss.item() == pytest.approx(-6 / 16)


ENTROPY_BONUS = [  # an entropy bonus (-α H_t in the loss): the hook's values["entropy"], one flag
    (
        "    token_loss = tis * pg_loss\n",
        '    token_loss = tis * pg_loss - args.entropy_coef * values["entropy"]  # ENT (bonus)\n',
    ),
    (
        '    """peak learning rate (both halves of Muon too)"""\n',
        '    """peak learning rate (both halves of Muon too)"""\n'
        '    entropy_coef: Annotated[float, ">= 0"] = 0.01  # ENT (bonus): the weight α of H_t\n'
        '    """α: weight of the entropy bonus -α H_t in the loss"""\n',
    ),
]


def test_an_entropy_bonus_is_a_few_lines_and_its_gradient_raises_the_entropy(
    tmp_path, one_rank_group, tiny_model
):
    """docs/variants.md's entropy bonus on a copy of grpo.py: 4 changed lines, no plumbing edited.
    Its loss reaches the LM head's entropy gradient: with zero advantages (no policy-gradient
    signal), one update with the bonus raises the policy's entropy on the trained tokens, and
    without it (α = 0) leaves the loss unchanged by the entropy."""
    import torch.distributed as dist

    with open(f"{REPO}/grpo.py") as f:
        text = f.read()
    variant = text
    for old, new in ENTROPY_BONUS:
        assert text.count(old) == 1, old
        variant = variant.replace(old, new)
    path = tmp_path / "grpo_entropy.py"
    path.write_text(variant)
    changed, untagged, _ = tagged_diff("grpo.py", str(path), re.compile(r"# ENT \(bonus\)"))
    assert changed <= 5 and not untagged
    spec = importlib.util.spec_from_file_location("grpo_entropy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    addr, port = one_rank_group
    args = module.Args(entropy_coef=1.0, learning_rate=1e-4, warmup_steps=0, max_grad_norm=100.0)
    trainer = trainer_rank(module, args, tiny_model, addr, port)
    seq = module.make_sequence([5, 6, 7], [8, 9, 10, 11], advantages=[0.0] * 4,
                               loss_weights=[0.25] * 4, engine_logprobs=[-1.0] * 4)  # fmt: skip
    entropies = []
    for step in range(2):
        stats = module.train_step(trainer, [split_for_ranks([seq], 1, 64)[0]], step)
        entropies.append(
            stats["token_sums"]["entropy"] / stats["tokens"]
        )  # before this step's update
        assert stats["loss"] == pytest.approx(-entropies[-1], rel=1e-5)  # the loss is -α H
    assert entropies[1] > entropies[0] + 1e-5, entropies  # near log V already: a small rise
    dist.destroy_process_group()


def apply_variant(tmp_path, name: str, edits: list, tag: str, budget: int):
    """A copy of grpo.py with `edits` applied (each text once in grpo.py), checked as a tagged diff
    within `budget` changed lines, imported as a module."""
    with open(f"{REPO}/grpo.py") as f:
        text = f.read()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    changed, untagged, _ = tagged_diff("grpo.py", str(path), re.compile(rf"# {tag} \(([a-z-]+)\)"))
    assert changed <= budget and not untagged, (changed, untagged)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RLOO = [  # docs/variants.md's RLOO: the baseline of sample i is the mean of the group's others
    (
        "    advantages = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)\n",
        "    advantages = (r - r.mean(dim=1, keepdim=True)) * group_size / (group_size - 1)  # RLOO "
        "(baseline)\n",
    ),
]


def test_rloo_worked_example_is_one_line_and_leaves_one_out(tmp_path):
    rloo = apply_variant(tmp_path, "grpo_rloo", RLOO, "RLOO", 2)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.9, 0.0, 0.5])
    want = [r - (sum(g) - r) / 3 for g in ([1.0, 0.0, 0.0, 1.0], [0.3, 0.9, 0.0, 0.5]) for r in g]
    assert rloo.compute_advantages(rewards, 4).tolist() == pytest.approx(want, abs=1e-6)
    assert rloo.compute_advantages(torch.ones(4), 4).tolist() == [0.0] * 4  # no signal, exactly


CISPO = [  # docs/variants.md's CISPO: a clipped, stopped-gradient IS weight on every token's log π
    (
        "    unclipped = ratio * advantages\n"
        "    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages\n"
        "    return -torch.min(unclipped, clipped), clipped < unclipped\n",
        "    weight = torch.clamp(ratio, 1 - eps_low, 1 + eps_high).detach()  # CISPO (is-clip): sg\n"
        "    return -weight * advantages * logprobs, weight != ratio  # CISPO (is-clip): no token "
        "dropped\n",
    ),
    (
        "    eps = (args.clip_eps, args.clip_eps)  # [1 - ε, 1 + ε]\n",
        "    eps = (1.0, args.clip_eps)  # CISPO (is-clip): ε_low = 1, no lower bound on the weight\n",
    ),
]


def test_cispo_worked_example_keeps_the_gradient_of_clipped_tokens(tmp_path):
    """CISPO's loss -sg(clip(ρ, 0, 1 + ε)) Â log π against hand-computed gradients; where GRPO's clip
    drops a token's gradient CISPO keeps it, and at ρ = 1 (one update per rollout) the two agree."""
    import grpo

    cispo = apply_variant(tmp_path, "grpo_cispo", CISPO, "CISPO", 7)
    args = cispo.Args()  # ε = 0.2
    old, adv = torch.zeros(3), torch.tensor([1.0, -1.0, 2.0])
    values = {"old_logprobs": old, "engine_logprobs": old, "advantages": adv,
              "loss_weights": torch.ones(3)}  # fmt: skip
    grads = {}
    for name, module in (("cispo", cispo), ("grpo", grpo)):
        lp = torch.tensor([math.log(2.0), math.log(0.5), 0.0], requires_grad=True)  # ρ = 2, 0.5, 1
        loss, stats = module.compute_loss(lp, values, args)
        loss.backward()
        grads[name] = lp.grad.tolist()
    # CISPO: d/d log π of -w Â log π is -w Â, with w = clip(ρ, 0, 1.2) = 1.2, 0.5, 1
    assert grads["cispo"] == pytest.approx([-1.2, 0.5, -2.0])
    # GRPO: ρ = 2 with Â > 0 is clipped (no gradient); ρ = 0.5 with Â < 0 too; -ρ Â at ρ = 1
    assert grads["grpo"] == pytest.approx([0.0, 0.0, -2.0])
    same = {}
    for name, module in (("cispo", cispo), ("grpo", grpo)):
        lp = torch.zeros(3, requires_grad=True)  # π_θ = π_θold: the only update of a rollout
        module.compute_loss(lp, values, args)[0].backward()
        same[name] = lp.grad.tolist()
    assert same["cispo"] == pytest.approx(same["grpo"])


GSPO = [  # docs/variants.md's GSPO: one ratio per response, s_i = exp(mean_t log ρ_it), clipped whole
    (
        '    clip_eps: Annotated[float, "> 0, < 1"] = 0.2\n',
        '    clip_eps: Annotated[float, "> 0, < 1"] = 4e-4  # GSPO (clip): ε of s_i (paper: 3e-4, '
        "4e-4)\n",
    ),
    (
        '    pg_loss, clipped = compute_policy_loss(logprobs, old, values["advantages"], *eps)\n',
        "    # GSPO (sequence-ratio): log s_i = 1/|o_i| Σ_t log ρ_it at every token of o_i\n"
        '    seq_logprobs = old + values["responses"].mean(logprobs - old)\n'
        '    pg_loss, clipped = compute_policy_loss(seq_logprobs, old, values["advantages"], *eps)\n',
    ),
]


def test_gspo_worked_example_clips_whole_responses(tmp_path, one_rank_group, tiny_model):
    """GSPO's sequence ratio from values["responses"] (Trainer.local_part's response index): by hand,
    a response whose s_i leaves [1 - ε, 1 + ε] loses the gradient of every token, one inside keeps
    every token's, whatever each token's own ratio; through the real update with one update per
    rollout (ratio 1) its loss and gradient are grpo.py's."""
    import grpo

    gspo = apply_variant(tmp_path, "grpo_gspo", GSPO, "GSPO", 6)
    args = gspo.Args()  # ε = 4e-4
    old, ones = torch.zeros(5), torch.ones(5)
    values = {"old_logprobs": old, "engine_logprobs": old, "advantages": ones,
              "loss_weights": torch.tensor([1 / 4, 1 / 4, 1 / 6, 1 / 6, 1 / 6]),
              "responses": Responses(torch.tensor([0, 0, 1, 1, 1]), 2)}  # fmt: skip
    grads = {}
    for name, module in (("gspo", gspo), ("grpo", grpo)):
        lp = torch.tensor([0.1, -0.1, 0.3, 0.0, 0.0], requires_grad=True)  # s = 1, e^0.1
        module.compute_loss(lp, values, args)[0].backward()
        grads[name] = lp.grad.tolist()
    # GSPO: response 0 has s = 1: each token -Â s / (n |o|) = -1/4; response 1 is clipped whole
    assert grads["gspo"] == pytest.approx([-0.25, -0.25, 0.0, 0.0, 0.0])
    # GRPO clips token by token: ρ = e^0.1 and e^0.3 clipped, e^-0.1 raised by the clip, 1 kept
    assert grads["grpo"] == pytest.approx([0.0, -math.exp(-0.1) / 4, 0.0, -1 / 6, -1 / 6])

    addr, port = one_rank_group
    args = gspo.Args(learning_rate=1e-12, warmup_steps=0)  # the weights stay where they are
    trainer = trainer_rank(gspo, args, tiny_model, addr, port)
    seqs = [gspo.make_sequence([5, 6, 7], list(r), advantages=[a] * len(r), loss_weights=[w] * len(r),
                               engine_logprobs=[-100.0] * len(r))  # TIS weight: C, all
            for r, a, w in (([8, 9], 1.0, 1 / 4), ([10, 11, 12], -1.0, 1 / 6))]  # fmt: skip
    stats = [module.train_step(trainer, [split_for_ranks(seqs, 1, 64)[0]], 0)
             for module in (gspo, grpo)]  # fmt: skip
    assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], rel=1e-5)
    assert stats[0]["grad_norms"] == pytest.approx(stats[1]["grad_norms"], rel=1e-5)


def test_the_variant_command_passes_dapo_and_names_what_is_wrong(tmp_path):
    """scripts/check_variant.py, the user's command for checklist step 4: dapo.py passes (its tag
    found by itself); a copy with an untagged change, an edit of the plumbing and too many lines
    fails, each named in one line, with exit code 1; a missing file is one usage error."""
    command = [sys.executable, f"{REPO}/scripts/check_variant.py", "grpo.py"]
    ok = subprocess.run([*command, "dapo.py", "--budget", "120"], cwd=REPO, capture_output=True,
                        text=True)  # fmt: skip
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1] == "ok", ok.stdout + ok.stderr
    assert "tag DAPO, sections: clip-higher, dynamic-sampling, no-kl" in ok.stdout
    with open(f"{REPO}/grpo.py") as f:
        text = f.read()
    bad = text.replace("    kl_coef: Annotated", "    kl_coef: Annotated", 1)
    bad = bad.replace(
        "    return torch.ones(", "    return torch.zeros(", 1
    )  # keep_groups: untagged
    shuffle = "    order = torch.randperm(len(sequences), generator=seed).tolist()"  # plumbing
    bad = bad.replace(shuffle + "\n", shuffle + "  # MINE: x\n", 1)
    bad = bad.replace(
        "    eps = (args.clip_eps, args.clip_eps)", "    eps = (0.1, 0.1)  # MINE: a", 1
    )
    (tmp_path / "mine.py").write_text(bad)
    out = subprocess.run([*command, str(tmp_path / "mine.py"), "--budget", "2"], cwd=REPO,
                         capture_output=True, text=True)  # fmt: skip
    lines = out.stdout.splitlines()
    assert out.returncode == 1 and lines[-1] == "not a clean variant", out.stdout + out.stderr
    assert "6 changed lines (budget 2), tag MINE" in lines[0]
    assert any(line.startswith("  untagged hunk near") for line in lines), lines
    step = text.splitlines().index(shuffle) + 1  # in plan_minibatches
    assert f"  edits the plumbing: grpo.py line {step} is in a TRY NOT TO MODIFY block" in lines
    assert "  over budget: 6 changed lines, at most 2" in lines
    missing = subprocess.run([*command, "nope.py"], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 2 and "nope.py: No such file or directory" in missing.stderr
