"""The RL scripts' prompts: rows read and checked (`prompt` + `answer`, or GSM8K's `question` +
`answer`), then tokenized with the chat template into data.Prompt."""

from common import data, vision
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


def encode_prompts(rows, source: str, tokenizer, max_length: int, drop_long: bool, processor=None):
    """Every prompt tokenized, as [Prompt] (a VLM's, `processor`: with its pictures, read and
    checked here). Prompts over max_length (--max-prompt-length) stop the run, naming the first, or
    with drop_long (--drop-long) are left out."""
    images = vision.row_images(rows, source, processor is not None, "prompt")
    prompts = []
    for row, (r, pictures) in enumerate(zip(rows, images), 1):
        ids = request = data.encode_prompt(tokenizer, r["prompt"])
        ids, pixels = vision.prompt(processor, ids, pictures) if pictures else (ids, None)
        if pictures:  # the engines expand the one image token of each picture themselves
            request = {"prompt_token_ids": request, "multi_modal_data": {"image": pictures}}
        prompts.append(Prompt(ids, str(r.get("answer")), r["prompt"], row, request, pixels))
    ids = [p.ids for p in prompts]
    lengths, flag = [len(p) for p in ids], "--max-prompt-length"
    return data.within(prompts, lengths, max_length, drop_long, source, "prompts", flag)
