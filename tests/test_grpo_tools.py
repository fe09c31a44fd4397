"""grpo_tools.py: the episode's tokens and masks, the loss over sampled tokens only, the template's
tool turn, the per-turn token check, the calculator; end to end, a same-seed repeat and an exact
resume with the trainer and the engines agreeing on every sampled token of every turn."""

import os
import random
import re

import pytest
import torch
from conftest import (
    REPO,
    assert_resume_is_exact,
    only_run_dir,
    read_jsonl,
    run_script,
    tagged_diff,
)

import grpo_tools
from common.data import Prompt, make_sequence, render
from common.errors import InputError, RunError
from common.isolate import UserFunction as load_function
from common.rewards import score_responses
from common.tools import calculator, call_tool, call_tools, clip_output, tool_turn

TAG = re.compile(r"# TOOLS: \S")
SMOL_TOOL_TURN = "\n<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n"


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


# ---- the episode's token list and its masks ----


def test_make_sequence_masks_all_but_sampled_tokens():
    """A made-up episode: prompt [1, 2], sampled [3, 4], a tool turn [5, 6], sampled [7]. The loss
    mask is 1 exactly at the positions that predict sampled tokens; the per-token values (one per
    sampled token) sit there, 0 elsewhere."""
    seq = make_sequence([1, 2], [3, 4, 5, 6, 7], trained=[1, 1, 0, 0, 1], advantages=[0.5] * 3,
                        engine_logprobs=[-1.0, -2.0, -3.0])  # fmt: skip
    assert seq["input_ids"] == [1, 2, 3, 4, 5, 6, 7]
    assert seq["labels"] == [2, 3, 4, 5, 6, 7, 0]
    assert seq["loss_mask"] == [0, 1, 1, 0, 0, 1, 0]  # position t predicts labels[t]
    assert seq["engine_logprobs"] == [0.0, -1.0, -2.0, 0.0, 0.0, -3.0, 0.0]
    assert seq["advantages"] == [0.0, 0.5, 0.5, 0.0, 0.0, 0.5, 0.0]
    assert make_sequence([1, 2], [3, 4])["loss_mask"] == [0, 1, 1, 0]  # single turn: unchanged


def test_loss_weights_count_sampled_tokens_only():
    """GRPO's 1/|o_i| divides by the tokens the policy sampled, not by the tool turns: two episodes
    of 3 and 1 sampled tokens (6 and 1 response tokens in all) weigh each sampled token 1/(2·3) and
    1/(2·1), and their weights sum to 1/2 each."""
    args = grpo_tools.Args(num_trainers=1, num_minibatches=1, max_tokens_per_micro_batch=64)
    sequences = [
        ([1, 2], [3, 4, 5, 6, 7, 8], {"advantages": [1.0] * 3, "trained": [1, 0, 0, 0, 1, 1]}),
        ([1, 2], [9], {"advantages": [-1.0], "trained": [1]}),
    ]
    shares = grpo_tools.plan_minibatches(sequences, 0, args)
    rows = [mb for mini in shares[0] for mb in mini]
    weights = torch.cat([mb["loss_weights"][0] for mb in rows])
    masks = torch.cat([mb["loss_mask"][0] for mb in rows])
    assert sorted(weights[masks.bool()].tolist()) == pytest.approx([1 / 6] * 3 + [1 / 2])
    assert weights[~masks.bool()].abs().sum() == 0  # nothing on tool tokens or prompts


def test_tool_tokens_get_no_loss_and_no_gradient(tiny_model, tokenizer):
    """compute_logprobs gives log π at the sampled positions only, exactly the full forward's there
    (the loss is a function of these alone: no tool-turn logit gets a gradient); the hand-computed
    GRPO loss of one episode (one update, so ρ = 1: L = -Σ_t w_t min(π_θold/π_vllm, C) Â) matches
    compute_loss; values that do not match the sampled tokens are refused."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    args = grpo_tools.Args()
    prompt, response, trained = [5, 6, 7], [8, 9, 10, 11, 12], [1, 0, 0, 1, 1]
    engine = [-3.0, -4.0, -5.0]

    def loss_for(advantages, engine_logprobs):
        seq = make_sequence(prompt, response, trained=trained, advantages=advantages,
                            engine_logprobs=engine_logprobs, loss_weights=[1 / 3] * 3)  # fmt: skip
        t = {k: torch.tensor([v]) for k, v in seq.items()}
        inputs = (t["input_ids"], torch.arange(len(seq["input_ids"]))[None], t["labels"],
                  t["loss_mask"])  # fmt: skip
        logprobs = grpo_tools.compute_logprobs(model, *inputs)
        mask = t["loss_mask"][0].bool()
        values = {k: t[k][0, mask] for k in ("advantages", "engine_logprobs", "loss_weights")}
        values["old_logprobs"] = logprobs.detach()
        loss, _ = grpo_tools.compute_loss(logprobs, values, args)
        return loss, logprobs

    loss, logprobs = loss_for([1.0, 1.0, 1.0], engine)
    assert logprobs.shape == (3,)  # the 3 sampled tokens: no tool-turn position reaches the loss
    tis = torch.exp(logprobs.detach() - torch.tensor(engine)).clamp(max=args.tis_cap)
    assert loss.item() == pytest.approx(-(tis * 1.0 / 3).sum().item(), rel=1e-6)
    full = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0], -1)
    sampled = [p for p, m in enumerate(make_sequence(prompt, response, trained)["loss_mask"]) if m]
    labels = (prompt + response)[1:]
    expected = torch.stack([full[p, labels[p]] for p in sampled])
    assert torch.allclose(logprobs, expected, atol=1e-5)
    # one value per sampled token: a list of another length is refused, never shifted onto a token
    with pytest.raises(ValueError, match="4 advantages for 3 tokens"):
        loss_for([1.0, 1.0, 1.0, 99.0], engine)


# ---- the template's tool turn ----


def test_tool_turn_is_the_template_difference(tokenizer):
    """The built-in template: the tool turn is exactly what the template puts between the model's
    EOS and the next generation prompt, and prompt + call + EOS + tool turn + answer + EOS is the
    whole conversation as the template renders it."""
    assert tokenizer.decode(tool_turn(tokenizer, "4042")) == SMOL_TOOL_TURN.format("4042")
    messages = [{"role": "user", "content": "What is 47 × 86?"}]
    prompt = render(tokenizer, messages, gen_prompt=True)
    call, answer = encode(tokenizer, "<calc>47*86</calc>"), encode(tokenizer, "4042")
    eos = [tokenizer.eos_token_id]
    episode = prompt + call + eos + tool_turn(tokenizer, "4042") + answer + eos
    messages += [{"role": "assistant", "content": "<calc>47*86</calc>"},
                 {"role": "tool", "content": "4042"}, {"role": "assistant", "content": "4042"}]  # fmt: skip
    whole = render(tokenizer, messages)
    assert whole[: len(episode)] == episode and tokenizer.decode(whole[len(episode) :]) == "\n"


# A Qwen2.5-style template (written for this test): a tool message is a user turn wrapping
# <tool_response>, consecutive tool messages share one turn.
HERMES_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}"
    "{% endif %}{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}"
    "{% endif %}{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_hermes_template_renders_the_tool_turn_through_its_tool_role(tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = HERMES_TEMPLATE
    expected = "\n<|im_start|>user\n<tool_response>\n4042\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tool_turn(tokenizer, "4042")) == expected
    call = '<tool_call>\n{"name": "calc", "arguments": {"input": "47*86"}}\n</tool_call>'
    assert grpo_tools.parse_call(call, "calc", "hermes") == "47*86"
    assert grpo_tools.STOP["hermes"] == "</tool_call>"


# A Qwen3-style template (written for this test, after Qwen3's rule): an assistant turn after the
# last user query shows its <think> block when it is the last message, or when it reasons; a turn
# that is no longer last loses an empty one. The tool turn after it does not change.
QWEN3_TEMPLATE = (
    "{% set ns = namespace(last=messages|length - 1) %}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% set c = m['content'] %}"
    "{% set r = c.split('</think>')[0].split('<think>')[-1].strip('\\n') if '</think>' in c else '' %}"
    "{% set c = c.split('</think>')[-1].lstrip('\\n') %}{{ '<|im_start|>assistant\\n' }}"
    "{% if loop.index0 > ns.last and (loop.last or r) %}{{ '<think>\\n' + r + '\\n</think>\\n\\n' }}"
    "{% endif %}{{ c + '<|im_end|>\\n' }}{% elif m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_qwen3_template_that_changes_an_empty_think_block_is_accepted(tokenizer):
    """Qwen3's template renders the same assistant turn differently once a tool message follows
    (the empty <think> goes): the sampled tokens stay as sampled and the tool turn, which does not
    depend on the turn, is appended. Both reasoning and not, the episode equals what the template
    renders for the conversation from the tool turn on."""
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = QWEN3_TEMPLATE
    expected = "\n<|im_start|>user\n<tool_response>\n4042\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tool_turn(tokenizer, "4042")) == expected
    messages = [{"role": "user", "content": "What is 47 × 86?"}]
    for said in ("<calc>47*86</calc>", "<think>\nmultiply\n</think>\n\n<calc>47*86</calc>"):
        turns = [
            *messages,
            {"role": "assistant", "content": said},
            {"role": "tool", "content": "4042"},
        ]
        whole = tokenizer.decode(render(tokenizer, turns, gen_prompt=True))
        assert whole.endswith("<|im_end|>" + expected)


@pytest.mark.parametrize(
    "template,why",
    [("{% for m in messages %}{{ m['content'] }}\n{% endfor %}", "does not end assistant turns"),
     ("{% for m in messages %}{% if loop.last or m['role'] != 'assistant' %}{{ m['role'] }}: "
      "{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}", "changes earlier turns"),
     ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% if m['role'] == 'tool' %}"
      "{{ messages[loop.index0 - 1]['content'] }}{% endif %}{% endfor %}", "renders it by what the assistant")],
    ids=["no-eos", "drops-history", "echoes-the-turn"],
)  # fmt: skip
def test_a_template_that_cannot_append_a_tool_turn_is_refused(tokenizer, template, why):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = template
    with pytest.raises(InputError, match=why):
        tool_turn(tokenizer, "4042")


# ---- the turn loop, with a stand-in engine ----


class ScriptedEngine:
    """Stands in for common/engines.generate: each call is one turn; episode e's turn answers with
    script[e][turn] (text), logprob -0.5 per token; `corrupt` (turn, episode) echoes a prompt with
    one token changed, as an engine that re-encoded it would."""

    def __init__(self, tokenizer, script, corrupt=None):
        self.tokenizer, self.script, self.corrupt, self.calls = tokenizer, script, corrupt, []

    def __call__(self, engines, prompts, *, n, temperature, top_p, max_tokens, seed, draw, index,
                 stop):  # fmt: skip
        turn = len(self.calls)
        self.calls.append(dict(prompts=[list(p) for p in prompts], index=list(index), draw=draw,
                               max_tokens=list(max_tokens), stop=stop))  # fmt: skip
        out = []
        for e, prompt, room in zip(index, prompts, max_tokens):
            text = self.script[e][turn]
            ids = encode(self.tokenizer, text.replace("<EOS>", ""))
            ids = (ids + [self.tokenizer.eos_token_id] * text.endswith("<EOS>"))[:room]
            echo = list(prompt)
            if self.corrupt == (turn, e):
                echo[-1] += 1
            out.append([dict(token_ids=ids, logprobs=[-0.5] * len(ids), prompt_ids=echo,
                             finish_reason="length" if len(ids) == room else "stop")])  # fmt: skip
        return out


def episodes_with(
    monkeypatch, tokenizer, script, corrupt=None, fn=("calc", "", calculator), draw=3, **flags
):
    """The two episodes of one prompt (run_episodes' one group), the engine, the prompt's ids."""
    engine = ScriptedEngine(tokenizer, script, corrupt)
    monkeypatch.setattr(grpo_tools, "generate", engine)
    args = grpo_tools.Args(num_generations=2, **flags)
    prompt = render(tokenizer, [{"role": "user", "content": "What is 47 × 86?"}], gen_prompt=True)
    sampling = dict(top_p=args.top_p, max_tokens=args.max_response_length, seed=args.seed)
    (group,) = grpo_tools.run_episodes([None], [prompt], 2, fn, tokenizer, args, sampling, draw)
    return group, engine, prompt


def test_an_episode_is_prompt_sampled_tool_turn_sampled(monkeypatch, tokenizer):
    """Episode 0 calls the calculator (its turn ends at the stop string, so the loop adds the EOS),
    reads 4042, answers; episode 1 answers at once. Each turn sends the previous prompt + the
    sampled tokens + the tool turn, and the mask, log-probs and metrics follow."""
    script = [["<calc>47*86</calc>", "4042<EOS>"], ["4000<EOS>"]]
    (first, second), engine, prompt = episodes_with(monkeypatch, tokenizer, script)
    eos = tokenizer.eos_token_id
    call, answer = encode(tokenizer, "<calc>47*86</calc>"), encode(tokenizer, "4042") + [eos]
    glue = [eos] + tool_turn(tokenizer, "4042")
    assert first["ids"] == prompt + call + glue + answer
    assert first["trained"] == [1] * len(call) + [0] * len(glue) + [1] * len(answer)
    assert first["logprobs"] == [-0.5] * (len(call) + len(answer))  # the sampled tokens' only
    assert first["final"] == answer and first["turns"] == 2 and first["tool_calls"] == 1
    assert first["tool_tokens"] == len(glue) and not first["ended_on_call"]
    assert second["ids"] == prompt + encode(tokenizer, "4000") + [eos] and second["turns"] == 1
    turn1, turn2 = engine.calls
    assert turn1["index"] == [0, 1] and turn2["index"] == [0]  # episode 0 keeps its engine
    assert turn2["prompts"] == [prompt + call + glue]
    assert (turn1["draw"], turn2["draw"]) == ("3/0", "3/1") and turn1["stop"] == ["</calc>"]
    _, engine, _ = episodes_with(monkeypatch, tokenizer, script, draw=0)  # step 0: a seed a turn
    assert [turn["draw"] for turn in engine.calls] == ["0/0", "0/1"]
    _, engine, _ = episodes_with(monkeypatch, tokenizer, script, draw=None)  # greedy: no seed
    assert [turn["draw"] for turn in engine.calls] == [None, None]
    room = grpo_tools.Args().max_response_length
    assert turn2["max_tokens"] == [room - len(call) - len(glue)]  # the episode's budget, shared


def test_a_tool_error_is_its_output_and_the_turn_cap_ends_an_episode(monkeypatch, tokenizer):
    script = [["<calc>47 plus 86</calc>", "<calc>1/0</calc>"], ["<calc>2*3</calc>", "6<EOS>"]]
    (first, second), engine, _ = episodes_with(monkeypatch, tokenizer, script, max_turns=2)
    text = tokenizer.decode(first["ids"])
    assert "<|im_start|>tool\nerror: SyntaxError" in text and first["tool_errors"] == 1
    assert first["ended_on_call"] and first["turns"] == 2  # its second call is never run
    assert "ZeroDivisionError" not in text and second["tool_errors"] == 0
    metrics = grpo_tools.tool_metrics([[first, second]], "rollout")
    assert metrics["rollout/tool_calls"] == 1.0 and metrics["rollout/ended_on_call"] == 0.5


def test_a_prompt_the_engine_read_otherwise_stops_the_run(monkeypatch, tokenizer):
    """The per-turn check: an engine that reads the second turn's prompt with one token changed
    (as a re-encoding would) stops the run in one line naming the episode and the turn."""
    script = [["<calc>47*86</calc>", "4042<EOS>"], ["4000<EOS>"]]
    with pytest.raises(RunError) as error:
        episodes_with(monkeypatch, tokenizer, script, corrupt=(1, 0))
    message = str(error.value.code)
    assert "episode 1, turn 2: the engine's prompt differs" in message and "\n" not in message


def test_no_room_for_an_answer_ends_the_episode(monkeypatch, tokenizer):
    script = [["<calc>47*86</calc>"], ["<calc>47*86</calc>"]]
    call = len(encode(tokenizer, "<calc>47*86</calc>"))
    episodes, engine, _ = episodes_with(monkeypatch, tokenizer, script,
                                        max_response_length=call + 3)  # fmt: skip
    assert all(e["finish_reason"] == "length" and e["turns"] == 1 for e in episodes)
    assert len(engine.calls) == 1 and all(len(e["trained"]) == call for e in episodes)


def test_an_episode_that_ends_on_a_call_scores_0_and_reward_terms_see_the_episode(
    monkeypatch, tokenizer, tmp_path
):
    """The design: an episode whose last turn is a call gave no answer and scores 0, whatever the
    call holds (the turn cap: `<calc>4042</calc>`; a call the length limit cut: `<calc>4042`), and
    rollout/ended_on_call counts both. A --reward-fn term receives the answer as a str with the
    whole episode: its turns, the tool's outputs, the number of calls."""
    seen = []

    def uses_the_tool(response, answer):  # a --reward-fn term: "answer correctly using the tool"
        seen.append(response)
        return float(response.tool_calls > 0)

    (tmp_path / "terms.py").write_text(  # a --reward-fn term: the episode reaches its process
        "def shape(response, answer):\n"
        "    return len(response.messages) + 10 * response.tool_calls + 100 * response.ended_on_call\n"
    )
    terms = {"verifier": (grpo_tools.reward_fn, 1.0), "uses_the_tool": (uses_the_tool, 0.5),
             "shape": (load_function(f"{tmp_path}/terms.py:shape"), 0.0)}  # fmt: skip
    batch = [Prompt([0], "4042", "", 1)]
    script = [["<calc>47*86</calc>", "<calc>4042</calc>"], ["<calc>47*86</calc>", "4042<EOS>"]]
    capped, _, _ = episodes_with(monkeypatch, tokenizer, script, max_turns=2)
    room = len(encode(tokenizer, "<calc>4042"))
    script = [["<calc>4042*1</calc>"], ["4042<EOS>"]]
    cut, _, _ = episodes_with(monkeypatch, tokenizer, script, max_response_length=room)
    assert tokenizer.decode(cut[0]["final"]) == "<calc>4042" and cut[0]["finish_reason"] == "length"
    for episodes in (capped, cut):
        assert [e["ended_on_call"] for e in episodes] == [True, False]
        assert grpo_tools.tool_metrics([episodes], "rollout")["rollout/ended_on_call"] == 0.5
        outs = [episodes]  # as run_episodes gives them: each episode's "text" is its Episode
        texts, rewards, parts = score_responses(terms, batch, outs, tokenizer, "step 1", 5.0)
        assert texts == ["", "4042"] and parts["verifier"].tolist() == [0.0, 1.0]
        shapes = [len(e["messages"]) + 10 * e["tool_calls"] + 100 for e in episodes]
        assert parts["shape"].tolist() == [shapes[0], shapes[1] - 100]
    called, answered = seen[:2]  # the turn-capped pair
    assert called == "" and called.ended_on_call and called.tool_calls == 1
    assert [m["role"] for m in called.messages] == ["assistant", "tool", "assistant"]
    assert called.messages[1]["content"] == "4042" and rewards.tolist() == [0.0, 1.0]
    assert answered.messages == [
        {"role": "assistant", "content": "<calc>47*86</calc>"},
        {"role": "tool", "content": "4042"},
        {"role": "assistant", "content": "4042"},
    ]
    assert (
        parts["uses_the_tool"].tolist() == [0.0, 0.0]
        and seen[2].messages[0]["content"] == "<calc>4042"
    )


def test_a_user_tool_that_crashes_is_a_failed_call_and_the_episode_goes_on(
    monkeypatch, tokenizer, tmp_path
):
    """--tool path.py:function runs in a process of its own (common/isolate.py): a function that
    calls os._exit or segfaults is a failed call the model reads (counted in tool_errors), the
    driver (this process) lives on, and the next call gets a fresh process."""
    (tmp_path / "tools.py").write_text(
        "import ctypes, os\ndef crash(text):\n    if text == '1':\n        os._exit(1)\n"
        "    if text == '2':\n        ctypes.string_at(0)\n    return 'fine'\n"
    )
    tool = ("crash", "", load_function(f"{tmp_path}/tools.py:crash"))
    script = [["<crash>1</crash>", "<crash>2</crash>", "<crash>3</crash>", "done<EOS>"]] * 2
    (first, _), _, _ = episodes_with(
        monkeypatch, tokenizer, script, fn=tool, max_turns=4, max_response_length=400
    )
    outputs = [m["content"] for m in first["messages"] if m["role"] == "tool"]
    assert outputs == [
        "error: Crashed: the process running crash ended (exit status 1)",
        "error: Crashed: the process running crash ended (signal SIGSEGV)",
        "fine",
    ]
    assert first["tool_errors"] == 2 and first["turns"] == 4 and not first["ended_on_call"]


# ---- tools ----


def random_expression(rng: random.Random, depth: int = 0) -> str:
    atoms = [str(rng.randint(-99, 10**6)), f"{rng.random() * 100:.3f}", "0", "x", "__import__('os')",
             "9" * rng.randint(1, 400), "()", "[1]", "'a'", "1e308", "True", "", "(", "**"]  # fmt: skip
    if depth > 3 or rng.random() < 0.3:
        return rng.choice(atoms)
    op = rng.choice(["+", "-", "*", "/", "//", "%", "**", "^", "×", " ", ".", "<<", "and", ","])
    left, right = random_expression(rng, depth + 1), random_expression(rng, depth + 1)
    return rng.choice([f"{left}{op}{right}", f"({left}{op}{right})", f"-{left}"])


def test_the_calculator_never_raises_and_is_exact_on_arithmetic():
    rng = random.Random(0)
    for _ in range(1000):
        expression = random_expression(rng)
        out = calculator(expression)
        assert isinstance(out, str) and out, expression
    for _ in range(200):  # whitelisted arithmetic: Python's own value, as text
        a, b, c = (rng.randint(-999, 999) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice(["+", "-", "*", "//", "%"])
        expression = f"({a}{op1}{b}){op2}{c if c else 7}"
        assert calculator(expression) == str(eval(expression)), expression
    assert calculator("47 × 86") == "4042" and calculator("2^10") == "1024"
    assert calculator("7/2") == "3.5"
    for bad in ("__import__('os').system('true')", "x", "(1).real", "abs(-1)", "9**9**9",
                "10**101", "(-8)**0.5", "9" * 4000 + "**1000", "1/0", "(" * 1000 + "1" + ")" * 1000, "-" * 100_000 + "1"):  # fmt: skip
        assert calculator(bad).startswith("error:"), bad


def test_a_tools_failure_or_hang_is_its_output(tmp_path):
    def boom(text):
        raise KeyError(text)

    def hang(text):
        import time

        time.sleep(30)

    assert call_tool(boom, "x", 5) == "error: KeyError: 'x'"
    assert call_tool(hang, "x", 0.5) == "error: the tool did not return within 0.5 s"
    assert call_tool(lambda text: 42, "x", 5) == "42"


def test_a_cut_output_keeps_how_the_program_ended_and_failures_are_counted():
    """--max-tool-output keeps the sandbox's last line (a time-out, a signal, an exit status) and a
    traceback's exit status counts as a tool error, as an `error:` output does."""
    assert clip_output("42\n", 200) == ("42\n", False)
    assert clip_output("error: ZeroDivisionError: division by zero", 10) == ("error: Zer", True)
    text, failed = clip_output("x" * 500 + "\nerror: timed out after 5 s", 100)
    assert failed and len(text) == 100 and text == "x" * 73 + "\nerror: timed out after 5 s"
    assert clip_output("exit status 1", 5) == ("exit status 1", True)  # the note whole, even so
    assert (
        clip_output("the answer: exit status 1 or 2", 200)[1] is False
    )  # a line that only looks so
    from common import sandbox

    if unsafe := sandbox.probe().get("unsafe"):  # root, no bubblewrap, a Python under /root
        pytest.skip(f"no safe sandbox here: {unsafe}; {sandbox.HOW_TO_GET}")
    text, failed = clip_output(sandbox.run_python("1 / 0"), 200)
    assert failed and "ZeroDivisionError" in text and text.endswith("exit status 1")
    slow = sandbox.run_python("print('x' * 300, flush=True)\nimport time\ntime.sleep(5)", timeout=1)
    text, failed = clip_output(slow, 100)
    assert failed and len(text) <= 100 and text.endswith("\nerror: timed out after 1 s"), text


def test_parse_call_reads_both_formats():
    parse = grpo_tools.parse_call
    assert parse("I will <calc> 47*86 </calc> now", "calc", "tags") == "47*86"
    assert parse("<calc>47*86", "calc", "tags") is None and parse("4042", "calc", "tags") is None
    hermes = '<tool_call>\n{"name": "calc", "arguments": {"input": "47*86"}}\n</tool_call>'
    assert parse(hermes, "calc", "hermes") == "47*86"
    assert parse(hermes.replace('"calc"', '"web"'), "calc", "hermes") is None
    assert parse("<tool_call>{not json}</tool_call>", "calc", "hermes") is None


# ---- end to end: engines, trainers, a same-seed repeat, an exact resume ----

RUNNER = """import sys
sys.path.insert(0, {repo!r})
import grpo_tools
from common.flags import parse_args

# The functions a user edits, edited for a random tiny model, which never writes a call: a turn
# ends at a space (the stop string) and calls the tool when its text has an odd length.
grpo_tools.STOP = {{"tags": " "}}
grpo_tools.parse_call = lambda text, name, form: text.strip() if len(text) % 2 else None
grpo_tools.main(parse_args(grpo_tools.Args))
"""


@pytest.mark.cpu_engine("CPU engines by design (gloo weight sync); the GPU tier runs grpo.py's")
def test_grpo_tools_end_to_end_repeats_and_resumes_exactly(tiny_model, tmp_path):
    """Two trainer ranks and two engines; episodes of up to 3 turns with real tool turns. The
    trainer and the engines agree on every sampled token of every turn (fp32: 1e-4), and a resumed
    run repeats the steps after its checkpoint exactly: in a fresh process with fresh engines, step
    2's episodes (each turn seeded by seed, step, turn and episode) come out token for token, so a
    second run of the same seed is not needed to show that one seed logs the same."""
    (tmp_path / "edited").mkdir()  # named as the script: its runs are grpo_tools.py's
    runner = tmp_path / "edited" / "grpo_tools.py"
    runner.write_text(RUNNER.format(repo=REPO))
    # user code, each in a process of its own: a tool, and a reward term that reads the episode
    (tmp_path / "user.py").write_text("def count(text):\n    return f'ok:{len(text)}'\n"
                                      "def per_call(response, answer):\n"
                                      "    return response.tool_calls + 0 * len(response.messages)\n")  # fmt: skip
    flags = ("--tool", f"{tmp_path}/user.py:count", "--reward-fn", f"{tmp_path}/user.py:per_call=0.1",
             "--model", tiny_model, "--num-steps", "2", "--prompts-per-step", "2",
             "--num-generations", "2", "--num-trainers", "2", "--num-engines", "2",
             "--max-response-length", "48", "--save-every", "1", "--no-save-final", "--seed", "3",
             "--dataset", "data/multiply/prompts_train.jsonl",
             "--eval-dataset", "data/multiply/prompts_test.jsonl",
             "--output-dir", str(tmp_path / "a"))  # fmt: skip
    result = run_script(str(runner), *flags, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "a")
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    steps = [row for row in metrics if row["step"] > 0]
    assert [row["step"] for row in metrics] == [0, 1, 2]
    assert all(row["train/logprob_diff_max"] <= 1e-4 for row in steps), steps
    assert sum(row["rollout/tool_calls"] for row in steps) > 0  # tool turns were trained beside
    assert all(row["rollout/reward/per_call"] == row["rollout/tool_calls"] for row in steps)
    assert "eval/turns" in metrics[0]
    samples = read_jsonl(os.path.join(run_dir, "samples.jsonl"))
    assert any("<|im_start|>tool\nok:" in row["response"] for row in samples)
    assert any(row["step"] == 2 and "<|im_start|>tool\n" in row["response"] for row in samples)
    assert_resume_is_exact(str(runner), flags, run_dir)  # step 2's multi-turn samples again


def test_the_built_in_task_holds_out_a_quarter():
    train = read_jsonl(os.path.join(REPO, "data/multiply/prompts_train.jsonl"))
    test = read_jsonl(os.path.join(REPO, "data/multiply/prompts_test.jsonl"))
    sft = read_jsonl(os.path.join(REPO, "data/multiply/sft_train.jsonl"))
    question = {row["prompt"][0]["content"] for row in test}
    assert not question & {row["prompt"][0]["content"] for row in train}
    assert not question & {row["messages"][1]["content"] for row in sft}
    for row in sft:  # the transcripts: the calculator's value is the answer
        call, result, answer = (m["content"] for m in row["messages"][2:])
        assert calculator(call.removeprefix("<calc>").removesuffix("</calc>")) == result == answer


def test_diff_to_grpo_is_within_its_budget_and_every_hunk_is_tagged():
    changed, untagged, _ = tagged_diff("grpo.py", "grpo_tools.py", TAG)
    # 200 -> 205: grpo.py's pictures (prompts, rollouts, batches), which text episodes leave out
    assert 0 < changed <= 205, f"grpo_tools.py changes {changed} lines of grpo.py (budget 205)"
    assert not untagged, f"hunks without a `# TOOLS: ...` tag near grpo_tools.py lines {untagged}"


def test_engines_decode_text_only_for_stop_strings():
    """vLLM decodes every sampled token unless told not to: Engine.generate asks for text only
    where a stop string needs it (grpo_tools.py's tool calls); the driver decodes what it reads."""
    from types import SimpleNamespace

    from common.engines import Engine

    asked = []

    def generate(requests, params, **kwargs):
        asked.extend(params)
        out = SimpleNamespace(
            token_ids=[7], finish_reason="length", logprobs=[{7: SimpleNamespace(logprob=-1.0)}]
        )
        return [SimpleNamespace(outputs=[out] * p.n, prompt_token_ids=[1]) for p in params]

    engine = Engine.__ray_actor_class__.__new__(Engine.__ray_actor_class__)
    engine.llm, engine.adapter = SimpleNamespace(generate=generate), None
    engine.generate([[1, 2]], 2, 1.0, 1.0, 4)
    engine.generate([[1, 2]], 1, 1.0, 1.0, 4, seeds=[3])
    assert [p.detokenize for p in asked] == [False, False]
    asked.clear()
    engine.generate([[1, 2]], 1, 1.0, 1.0, 4, stop=["</tool_call>"])
    assert [(p.detokenize, p.stop) for p in asked] == [(True, ["</tool_call>"])]


def test_a_turns_tool_calls_run_at_once_in_order_with_their_outputs():
    """call_tools at once: calls that each wait for all the others (a barrier; as many as there
    are cores, the threads call_tools starts) all return, in order; one at a time, they cannot."""
    import threading

    n = min(len(os.sched_getaffinity(0)), 4)
    if n < 2:
        pytest.skip("one core: the calls run one at a time anyway")
    barrier, texts = threading.Barrier(n, timeout=2), [chr(97 + i) for i in range(n)]

    def meet(text):
        barrier.wait()
        return text.upper()

    assert call_tools(meet, texts, 10, at_once=True) == [t.upper() for t in texts]
    barrier.reset()
    assert call_tools(meet, texts, 10, at_once=False)[0] == "error: BrokenBarrierError: "


def test_sandboxed_calls_at_once_give_the_episodes_one_at_a_time_gives(monkeypatch, tokenizer):
    """--tool python: a turn's programs run together (a core each), and the episodes are the same
    tokens as when they run one by one."""
    from common import sandbox

    if unsafe := sandbox.probe().get("unsafe"):  # root, no bubblewrap, a Python under /root
        pytest.skip(f"no safe sandbox here: {unsafe}; {sandbox.HOW_TO_GET}")
    script = [
        ["<python>print(6*7)</python>", "42<EOS>"],
        ["<python>print(2**10)</python>", "1<EOS>"],
    ]
    run = lambda code: sandbox.run_python(code, timeout=5.0)  # noqa: E731  (as grpo_tools.py's)
    tool, seen = ("python", "", run), []
    real = grpo_tools.call_tools
    monkeypatch.setattr(grpo_tools, "call_tools", lambda *a: seen.append(a[3]) or real(*a))
    together, _, _ = episodes_with(monkeypatch, tokenizer, script, fn=tool, tool="python")
    monkeypatch.setattr(grpo_tools, "call_tools", lambda *a: seen.append(False) or real(*a[:3]))
    alone, _, _ = episodes_with(monkeypatch, tokenizer, script, fn=tool, tool="python")
    assert seen == [True, True, False, False]  # two turns a run (the second calls nothing)
    assert "1024" in tokenizer.decode(together[1]["ids"]) and together[0]["tool_calls"] == 1
    assert together == alone
