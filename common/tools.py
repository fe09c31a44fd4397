"""grpo_tools.py's tools: the tool turn's tokens, a call with a time limit whose failure is the
model's to read, and the built-in calculator (the Python tool's sandbox is common/sandbox.py)."""

import ast
import contextlib
import operator
import os
import re
import warnings
from concurrent.futures import ThreadPoolExecutor

from common.data import render
from common.errors import InputError
from common.isolate import Episode  # noqa: F401 (grpo_tools.py's: here with the tools)
from common.rewards import Late, time_limit


def tool_turn(tokenizer, content: str) -> list[int]:
    """A tool message's tokens as the chat template renders them after an assistant turn's
    end-of-turn token (the model's EOS, its last sampled token) up to the next assistant turn's
    generation prompt: the conversation with the message, past the assistant's EOS. Accepted when
    that part does not depend on what the assistant said (Qwen3's template drops an empty <think>
    from a turn that is no longer last: the turn changes, not the tool turn after it); refused
    when assistant turns do not end with EOS, are dropped, or shape the tool turn."""
    eos, user = tokenizer.eos_token_id, [{"role": "user", "content": "?"}]
    head, turns, why = render(tokenizer, user), set(), None
    for reply in ("!", "<think>\n?\n</think>\n\n!"):
        said = [{"role": "assistant", "content": reply}, {"role": "tool", "content": content}]
        after = render(tokenizer, user + said, gen_prompt=True)
        rest = after[len(head) :] if after[: len(head)] == head else []
        end = rest.index(eos) + 1 if eos in rest else 0  # the assistant's turn, its EOS included
        if eos not in after:
            why = "does not end assistant turns with EOS"
        elif not end or "!" not in tokenizer.decode(rest[:end]):
            why = "changes earlier turns"
        turns.add(tuple(rest[end:]))
    if why or len(turns) > 1:
        raise InputError(
            f"the chat template {why or 'renders it by what the assistant said'} when a tool "
            "message follows: tool turns cannot be appended to the sampled tokens; use a model "
            "whose does not"
        )
    return list(turns.pop())


def call_tool(fn, text: str, timeout: float | None) -> str:
    """A tool's output for the model's `text`: str(fn(text)); a raise or a hang over `timeout` s
    is the output instead (the model reads it), and the run goes on. None: fn keeps its own time."""
    try:
        with time_limit(timeout) if timeout else contextlib.nullcontext():
            return str(fn(text))
    except Late:
        return f"error: the tool did not return within {timeout:g} s"
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"


def call_tools(fn, texts: list[str], timeout: float, at_once: bool = False) -> list[str]:
    """call_tool for each of a turn's calls, the outputs in order. at_once: in threads, a core
    each, for a tool that waits on a process of its own and keeps its own time limit (the
    sandbox: ~59 ms a call, mostly the interpreter's start)."""
    if not at_once or len(texts) <= 1:
        return [call_tool(fn, text, timeout) for text in texts]
    with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:  # time_limit: main thread only
        return list(pool.map(lambda text: call_tool(fn, text, None), texts))


# The sandbox's last line when the program did not end well (common/sandbox.py's note)
ENDED = re.compile(r"exit status \d+|error: (timed out after|killed by signal) .*")


def clip_output(output: str, limit: int) -> tuple[str, bool]:
    """(at most `limit` characters of a tool's output for the model, the sandbox's note on how the
    program ended kept whole; whether the call failed: an error, a traceback's exit status)."""
    head, _, last = output.rpartition("\n")
    if not ENDED.fullmatch(last):
        return output[:limit], output.startswith("error")
    head = head[: max(0, limit - len(last) - 1)]
    return (head + "\n" if head else "") + last, True


OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // % ** and parentheses; × and ^
    read as * and **), from its syntax tree, never eval. Anything else, an exponent over 1000 or a
    value over 1e100 is an error the model reads; it never raises."""

    def value(node):  # every operand and result at most 1e100: no power runs for long
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            result = node.value
        elif isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            result = OPERATORS[type(node.op)](value(node.operand))
        elif isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 1000:
                raise ValueError("exponent over 1000")
            result = OPERATORS[type(node.op)](left, right)
        else:
            raise ValueError(f"not arithmetic: {ast.unparse(node)[:40]}")
        if isinstance(result, complex) or abs(result) > 1e100:
            raise ValueError("not a real number of at most 1e100")
        return result

    try:
        text = expression.replace("×", "*").replace("^", "**")
        with warnings.catch_warnings(action="ignore"):  # "1if": a SyntaxWarning on stderr
            result = value(ast.parse(text.strip(), mode="eval").body)
        return str(round(result, 10) if isinstance(result, float) else result)
    except Exception as e:  # a syntax error, 1/0, too deep, ...: the model reads what went wrong
        return f"error: {type(e).__name__}: {e}"
