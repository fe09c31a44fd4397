"""Datasets (TRL's columns) in, packed micro-batches out: loading, validation, token packing."""

import glob
import json
import logging
import os
from typing import NamedTuple

import torch

from common.errors import InputError
from common.lifetime import REPO
from common.vision import stack

NO_TEMPLATE = (
    "the model's tokenizer has no chat template, and the data has message lists: use "
    "plain-text columns (sft.py and dpo.py: also --accuracy-dataset '', whose prompts "
    "are messages) or a model with a chat template"
)
_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
STRUCTURE = ("input_ids", "labels", "loss_mask", "position_ids")  # a row's own fields, not values


def load_rows(spec: str, split: str = "train") -> tuple[list[dict], str]:
    """Rows and source of a local .jsonl/.json/.parquet file or folder, or a hub `name[:config]`."""
    for path in (spec, os.path.join(REPO, spec)):
        if os.path.exists(path):
            return _load_local(path, split), path
    if spec.endswith(_LOCAL_SUFFIXES) or spec.startswith((".", "/", "~")):
        raise InputError(f"dataset file {spec!r} does not exist")
    name, _, config = spec.partition(":")
    try:
        import datasets

        quiet_hub_logs()  # offline, the hub client logs a line per retry before the error we report
        rows = list(datasets.load_dataset(name, config or None, split=split))
    except Exception as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = f"dataset {spec!r} (split {split!r})"
        raise InputError(f"{where} is not a local file and could not be loaded: {why}") from None
    return rows, f"{spec} [{split}]"


def _load_local(path: str, split: str) -> list[dict]:
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "*")) if f.endswith(_LOCAL_SUFFIXES))
        files = [f for f in files if os.path.basename(f).split(".")[0] == split] or files
        if not files:
            raise InputError(f"dataset folder {path!r} has no .jsonl, .json or .parquet files")
        return [row for f in files for row in _load_local(f, split)]
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's errors for a damaged file vary
            why = f"{type(e).__name__}: {e}"
            raise InputError(f"{path} is not a readable parquet file: {why}") from None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text (bad byte at offset {e.start})") from None
    if path.endswith(".json") and text.lstrip().startswith(("[", "{")):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            where = f"line {e.lineno}, column {e.colno}"
            raise InputError(f"{path}: not valid JSON at {where} ({e.msg})") from None
        if not isinstance(rows, list):
            raise InputError(f"{path}: expected a JSON array of rows")
    else:  # jsonl (one object per line); blank lines are skipped
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}: line {i} is not valid JSON ({e.msg})") from None
    if not rows:
        raise InputError(f"dataset file {path!r} is empty")
    return rows


def validate_rows(rows: list[dict], columns: list[str], source: str, numeric: tuple = ()) -> None:
    """Rows are objects; columns non-empty text, role/content messages, or (`numeric`) numbers."""
    if not rows:
        raise InputError(f"dataset {source} has no rows")
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise InputError(f"{source}: row {i} is not a JSON object")
        for col in columns:
            where, value = f"{source}: row {i} column {col!r}", row.get(col)
            if col not in row:
                have = ", ".join(sorted(row)) or "none"
                raise InputError(f"{source}: row {i} has no column {col!r} (columns: {have})")
            if value is None:
                raise InputError(f"{where} is null")
            if col in numeric and isinstance(value, (int, float)) and not isinstance(value, bool):
                continue
            if isinstance(value, str):
                if not value.strip():
                    raise InputError(f"{where} is empty")
            elif isinstance(value, list) and value:
                for j, m in enumerate(value, 1):
                    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                        raise InputError(f"{where}: message {j} is not a {{role, content}} object")
                    if not content_ok(m.get("content")):
                        what = "(a string, or a list of text and image parts)"
                        raise InputError(
                            f"{where}: message {j} ({m['role']}) has no text content {what}"
                        )
            else:
                kinds = "a string, a number" if col in numeric else "a string"
                got = f"(got {value!r:.40})"
                raise InputError(f"{where} must be {kinds} or a non-empty list of messages {got}")


def content_ok(content) -> bool:
    """A message's content: text, or parts {"type": "text", "text"} and {"type": "image"} (its
    picture in the row's `images`), one at least."""
    if isinstance(content, str):
        return bool(content.strip())
    image = {"type": "image"}
    parts = isinstance(content, list) and content and all(isinstance(p, dict) for p in content)
    return bool(parts) and all(
        p == image or (p.get("type") == "text" and isinstance(p.get("text"), str)) for p in content
    )


def check_pairs(rows: list[dict], source: str) -> None:
    """Preference pairs (rm.py, dpo.py): two different responses (ties teach nothing)."""

    def text(value):
        return "".join(str(m["content"]) for m in as_messages(value, "assistant")).strip()

    for i, row in enumerate(rows, 1):  # after validate_rows: neither is empty
        if text(row["chosen"]) == text(row["rejected"]):
            raise InputError(f"{source}: row {i} has identical 'chosen' and 'rejected' responses")


def quiet_hub_logs() -> None:
    """Silence the Hugging Face clients' per-retry warnings; their final error still reaches us."""
    for name in ("huggingface_hub", "datasets", "urllib3", "fsspec", "filelock"):
        logging.getLogger(name).setLevel(logging.ERROR)


def as_messages(value, role: str) -> list[dict]:
    return value if isinstance(value, list) else [{"role": role, "content": value}]


def render(tokenizer, messages: list, gen_prompt=False) -> list[int]:
    """Token ids of `messages` in the tokenizer's chat template (+ the generation prompt)."""
    if tokenizer.chat_template is None:
        raise InputError(NO_TEMPLATE)
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen_prompt
        )
    except Exception as e:  # jinja's errors: e.g. a language model's template given image parts
        raise InputError(f"the model's chat template cannot render the messages ({e})") from None
    return tokenizer(text, add_special_tokens=False).input_ids


def encode_prompt(tokenizer, prompt) -> list[int]:
    """A prompt's token ids for generation: plain text, or messages + chat template + gen prompt."""
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    return render(tokenizer, prompt, gen_prompt=True)


def encode_example(tokenizer, prompt, completion=None) -> tuple[list[int], list[int]]:
    """Token ids of prompt + completion (None: `prompt` is a whole conversation) and a mask, 1 on
    the completion: text + EOS, or each assistant turn + end-of-turn (for the model to stop)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        ids = tokenizer(prompt).input_ids
        done = tokenizer(completion, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        return ids + done, [0] * len(ids) + [1] * len(done)
    answer = as_messages(completion, "assistant") if completion is not None else []
    messages, ids, mask = as_messages(prompt, "user") + answer, [], []
    for i, message in enumerate(messages):  # render one turn more: new tokens are message i's
        assistant = message["role"] == "assistant"
        pieces = [(render(tokenizer, messages[:i], True), 0)] if assistant and i > 0 else []
        pieces.append((render(tokenizer, messages[: i + 1]), int(assistant)))
        for upto, value in pieces:
            if upto[: len(ids)] != ids:
                how = "turn by turn (prefix changed)"
                raise InputError(f"the chat template does not render conversations {how}")
            mask += [value] * (len(upto) - len(ids))
            ids = upto
    return ids, mask


def pack(sequences: list[dict], max_tokens: int) -> list[dict[str, torch.Tensor]]:
    """First-fit, longest first: dicts of per-token lists into padding-free (1, T) rows of at most
    `max_tokens`. "position_ids" restart at 0 per sequence: how SDPA/flash-attn keep them apart.
    A VLM's sequences carry their images' tensors (n, ...): a row's are theirs, in its order."""
    rows, room = [], []  # the sequences of each row, and the tokens left in it
    for i in sorted(range(len(sequences)), key=lambda j: -len(sequences[j]["input_ids"])):
        if (n := len(sequences[i]["input_ids"])) > max_tokens:
            budget = f"the token budget of {max_tokens}"
            raise ValueError(f"a sequence of {n} tokens does not fit {budget}")
        j = next((j for j, r in enumerate(room) if r >= n), len(rows))
        if j == len(rows):  # no row has room: a new one
            rows.append([])
            room.append(max_tokens)
        rows[j].append(i)
        room[j] -= n
    seqs = [{**s, "position_ids": range(len(s["input_ids"]))} for s in sequences]
    per_token = [key for key in seqs[0] if not torch.is_tensor(seqs[0][key])]
    return [
        {key: torch.tensor([v for i in row for v in seqs[i][key]])[None] for key in per_token}
        | stack([{k: v for k, v in seqs[i].items() if torch.is_tensor(v)} for i in row])
        for row in rows
    ]


def check_batch(batch: int, available: int, flag: str, source: str, what: str) -> None:
    """A step's batch is no larger than the data (after --drop-long): a step would repeat rows."""
    if batch > available:
        why = f"a step would repeat {what}; use at most {available}"
        raise InputError(f"{flag} {batch} is more than the {available} {what} of {source}: {why}")


def within(
    items: list,
    lengths: list[int],
    limit: int,
    drop_long: bool,
    source: str,
    what: str,
    flag: str = "--max-length",
) -> list:
    """The items of at most `limit` tokens. Longer ones stop the run, naming the first, or with
    drop_long (--drop-long) are left out; none left stops it too."""
    if (too_long := [i + 1 for i, n in enumerate(lengths) if n > limit]) and not drop_long:
        raise InputError(
            f"{source}: {len(too_long)} of {len(items)} {what} are longer than {flag} "
            f"{limit} tokens (first: row {too_long[0]}); raise {flag} or pass "
            "--drop-long"
        )
    if not (kept := [item for item, n in zip(items, lengths) if n <= limit]):
        raise InputError(f"{source}: no {what} left within {flag} {limit}")
    return kept


def batch_rows(step: int, num_rows: int, batch_size: int, seed: int) -> list[int]:
    """Row indices of global step `step`: the data in a fresh seeded permutation every epoch. A pure
    function of the step, so --resume replays exactly the order an uninterrupted run would see."""
    rows = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(pos, num_rows)
        epoch_seed = torch.Generator().manual_seed(seed * 100_003 + epoch)
        rows.append(int(torch.randperm(num_rows, generator=epoch_seed)[i]))
    return rows


class Prompt(NamedTuple):
    """An RL prompt: token ids, reference answer, text as written, row in its file (from 1). A VLM's
    also: the engines' request (one image token an image, the pictures) and the pixel values; its
    ids have each image's tokens in, as the model sees them (common/vision.py)."""

    ids: list[int]
    answer: str
    text: str | list
    row: int
    request: dict | None = None
    pixels: dict | None = None


def make_sequence(prompt: list[int], response: list[int], trained=None, **per_response) -> dict:
    """One RL training sequence, shifted once here: position t predicts labels[t] = ids[t+1].
    Per-token values (advantages, logprobs, returns, loss weights, ...) sit at the positions that
    predict response tokens, lined up with what compute_logprobs (ppo.py: compute_values) returns
    for the masked positions; `response_values` reads them back, (N,) by name. `trained` (0/1 per
    response token, default 1s): what the policy sampled (not tool output), each with a value."""
    ids, trained = prompt + response, [1] * len(response) if trained is None else list(trained)
    pad, mask = [0.0] * (len(prompt) - 1), [0] * (len(prompt) - 1) + trained + [0]
    seq = {"input_ids": ids, "labels": ids[1:] + [0], "loss_mask": mask}
    for key, values in per_response.items():
        if torch.is_tensor(values):  # a VLM's pixel values: the sequence's, not a token's
            seq[key] = values
            continue
        if len(values) != sum(trained):  # one per trained token: never shifted onto another
            raise ValueError(f"make_sequence: {len(values)} {key} for {sum(trained)} tokens")
        values = iter(values)
        seq[key] = pad + [next(values) if t else 0.0 for t in trained] + [0.0]
    return seq


def response_values(mb: dict, *names: str) -> dict:
    """{name: (N,)} at response tokens (loss_mask 1): `names`, else all (1, T) but STRUCTURE, and
    "responses" (Trainer.local_part's: which response each token is)."""
    m, rows = mb["loss_mask"][0].bool(), [k for k, v in mb.items() if getattr(v, "ndim", 0) == 2]
    out = {k: mb[k][0, m] for k in names or [k for k in rows if k not in STRUCTURE]}
    return out if names or "responses" not in mb else {**out, "responses": mb["responses"]}


def split_for_ranks(sequences: list[dict], num_ranks: int, max_tokens: int, sp_size: int = 1):
    """Deal sequences to the num_ranks // sp_size data-parallel groups (balanced by tokens), pack
    each group's share; a group's --sp-size ranks get the same (ring attention splits each row)."""
    dp_size = num_ranks // sp_size
    shares, loads = [[] for _ in range(dp_size)], [0] * dp_size
    for seq in sorted(sequences, key=lambda s: -len(s["input_ids"])):
        r = loads.index(min(loads))
        shares[r].append(seq)
        loads[r] += len(seq["input_ids"])
    packed = [pack(share, max_tokens) if share else [] for share in shares]
    num_micro = max(len(p) for p in packed)
    for p in packed:
        for mb in p:
            mb["real"] = torch.tensor(1.0)
        while len(p) < num_micro:  # FSDP's collectives need equal counts; repeats add no gradient
            filler = p[-1] if p else pack([sequences[0]], max_tokens)[0]
            p.append({**filler, "real": torch.tensor(0.0)})
    return [p for p in packed for _ in range(sp_size)]  # per rank: [micro-batch]
