"""The reward harness: named terms (the verifier, --reward-fn's) per response, summed by weight; a
broken one (raise, hang, non-number) ends the run in one line naming it, step and row."""

import contextlib
import math
import numbers
import signal
import threading

import ray
import torch
from transformers import AutoTokenizer

from common.errors import InputError, RunError
from common.isolate import UserFunction


def reward_terms(verifier, weight: float, specs=()) -> dict:
    """{name: (fn, weight)}: the verifier, each --reward-fn `file.py:name[=weight]` (1 if none)."""
    terms = {"verifier": (verifier, weight)}
    for spec in specs:
        path, _, w = spec.rpartition("=") if "=" in spec.rpartition(":")[2] else (spec, "", "1")
        try:
            w = float(w)
        except ValueError:
            w = math.nan
        if not math.isfinite(w):
            raise InputError(f"--reward-fn {spec}: the weight after '=' must be a finite number")
        if (name := path.rpartition(":")[2]) in terms:
            raise InputError(f"--reward-fn {spec}: the reward already has a term named {name}")
        terms[name] = (UserFunction(path), w)
    return terms


def composed_reward(terms: dict, pairs: list, where: str, timeout: float, labels=None) -> tuple:
    """Every term on every (response, answer) pair: (Σ weight × value per pair, {name: values})."""
    parts = {n: call_reward(fn, pairs, where, timeout, labels) for n, (fn, _) in terms.items()}
    return [sum(w * parts[n][i] for n, (_, w) in terms.items()) for i in range(len(pairs))], parts


def score_responses(terms: dict, batch: list, outs: list, tokenizer, where: str, timeout: float):
    """Decode the responses to a batch of Prompts (outs: n per prompt; a "text" is taken as is),
    score each against its prompt's answer: (texts, (B*n,) rewards, {term: (B*n,) values})."""
    n, decode = len(outs[0]), lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    texts = [s["text"] if "text" in s else decode(s["token_ids"]) for o in outs for s in o]
    pairs = [(text, batch[i // n].answer) for i, text in enumerate(texts)]
    labels = [f"prompt row {batch[i // n].row}, sample {i % n + 1}" for i in range(len(texts))]
    rewards, parts = composed_reward(terms, pairs, where, timeout, labels)
    return texts, torch.tensor(rewards), {name: torch.tensor(v) for name, v in parts.items()}


class Late(BaseException): ...  # time_limit's; a function's `except Exception` misses it


@contextlib.contextmanager
def time_limit(timeout: float):
    """Raise Late in the main thread after `timeout` s; a signal to the thread itself, so a call
    blocked in sleep() or I/O stops too (on the main thread: math-verify's timeouts need it)."""

    def late(*_):
        raise Late

    previous, to_main = signal.signal(signal.SIGUSR1, late), (threading.main_thread().ident,)
    (timer := threading.Timer(timeout, signal.pthread_kill, (*to_main, signal.SIGUSR1))).start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)


def call_reward(fn, pairs: list[tuple[str, str]], where: str, timeout: float, labels=None):
    """fn(response, answer) per pair -> floats; a raise, a hang over `timeout` s or a non-finite
    value ends the run: a line naming the pair."""
    name, out = f"reward function {getattr(fn, '__name__', repr(fn))}", []
    for row, (response, answer) in enumerate(pairs, 1):
        at = f"{where}, {labels[row - 1]}" if labels else f"{where}, row {row}"
        try:
            with time_limit(timeout):
                value = fn(response, answer)
        except Late:
            raise RunError(f"{name} did not return within {timeout:g} s ({at})") from None
        except Exception as e:
            raise RunError(f"{name} failed ({at}): {type(e).__name__}: {e}") from None
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RunError(f"{name} returned {value!r}, not a finite number ({at})")
        out.append(float(value))
    return out


@ray.remote(num_cpus=0)
class RewardWorker:
    """composed_reward on an actor's main thread (where math-verify's and the timeout's signals
    work), for grpo_async.py: a failure's line returns as a RuntimeError (a RunError is silent)."""

    def __init__(self, terms: dict, tokenizer_path: str, timeout: float):
        self.terms, self.timeout = terms, timeout
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    def score(self, outs: list, prompts: list, where: str) -> tuple:
        """score_responses of the Prompts' groups: outs, their engine.generate result."""
        try:
            return score_responses(self.terms, prompts, outs, self.tokenizer, where, self.timeout)
        except RunError as e:
            raise RuntimeError(str(e.code).removeprefix("error: ")) from None
