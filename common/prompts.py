"""The RL scripts' prompts: rows read and checked (`prompt` + `answer`, or GSM8K's `question` +
`answer`), then tokenized with the chat template into data.Prompt."""

from common import data
from common.data import Prompt


def read_prompts(path: str, split: str, answered: bool = True) -> tuple[list[dict], str]:
    """(rows, source) of a prompt file, checked row by row; `question` rows become a user
    message. answered=False: the rows need no answer (a reward model scores them). "": none."""
    if not path:
        return [], path
    rows, source = data.load_rows(path, split)
    if rows and "prompt" not in rows[0] and "question" in rows[0]:
        asked = [[{"role": "user", "content": r["question"]}] for r in rows]
        rows = [{"prompt": q, "answer": r.get("answer")} for q, r in zip(asked, rows)]
    columns = ["prompt", "answer"] if answered else ["prompt"]
    data.validate_rows(rows, columns, source, numeric=("answer",))
    return rows, source


def encode_prompts(rows: list[dict], source: str, tokenizer, max_length: int, drop_long: bool):
    """Every prompt tokenized, as [Prompt]. Prompts over max_length (--max-prompt-length) stop the
    run, naming the first, or with drop_long (--drop-long) are left out."""
    ids = [data.encode_prompt(tokenizer, r["prompt"]) for r in rows]
    prompts = [
        Prompt(p, str(r.get("answer")), r["prompt"], row)
        for row, (p, r) in enumerate(zip(ids, rows), 1)
    ]
    lengths, flag = [len(p) for p in ids], "--max-prompt-length"
    return data.within(prompts, lengths, max_length, drop_long, source, "prompts", flag)
