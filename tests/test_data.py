"""Dataset loading and validation, chat-template masks, packing."""

import json

import pytest
import torch

from common.data import (
    encode_example,
    encode_prompt,
    load_rows,
    pack,
    split_for_ranks,
    validate_rows,
)
from common.errors import InputError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_builtin_files_load_and_validate():
    for name, cols in [
        ("sft", ["messages"]),
        ("prompts", ["prompt", "answer"]),
        ("prefs", ["prompt", "chosen", "rejected"]),
    ]:
        for split in ("train", "test"):
            rows, source = load_rows(f"data/arithmetic/{name}_{split}.jsonl")
            validate_rows(rows, cols, source)
            assert len(rows) == (192 if split == "train" else 64)


def test_builtin_test_split_is_held_out():
    train = {json.dumps(r["prompt"]) for r in load_rows("data/arithmetic/prompts_train.jsonl")[0]}
    test = {json.dumps(r["prompt"]) for r in load_rows("data/arithmetic/prompts_test.jsonl")[0]}
    assert train and test and not (train & test)


def test_missing_column_names_file_row_and_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    rows, source = load_rows(path)
    with pytest.raises(InputError) as e:
        validate_rows(rows, ["prompt", "answer"], source)
    msg = str(e.value.code)
    assert "d.jsonl" in msg and "row 2" in msg and "'answer'" in msg and "\n" not in msg


def test_empty_value_and_bad_messages(tmp_path):
    rows = [{"prompt": "  ", "answer": "1"}]
    with pytest.raises(InputError, match="row 1 column 'prompt' is empty"):
        validate_rows(rows, ["prompt", "answer"], "x")
    rows = [{"prompt": [{"role": "user"}], "answer": "1"}]
    with pytest.raises(
        InputError, match=r"row 1 column 'prompt': message 1 \(user\) has no text content"
    ):
        validate_rows(rows, ["prompt", "answer"], "x")
    rows = [{"prompt": [{"content": "hi"}], "answer": "1"}]
    with pytest.raises(InputError, match=r"message 1 is not a \{role, content\} object"):
        validate_rows(rows, ["prompt", "answer"], "x")


def test_empty_file_and_bad_json(tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(InputError, match="is empty"):
        load_rows(str(tmp_path / "e.jsonl"))
    (tmp_path / "b.jsonl").write_text('{"a": 1}\n{oops\n')
    with pytest.raises(InputError, match="line 2 is not valid JSON"):
        load_rows(str(tmp_path / "b.jsonl"))
    with pytest.raises(InputError, match="does not exist"):
        load_rows(str(tmp_path / "missing.jsonl"))


def test_folder_prefers_split_file_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "train.jsonl", [{"x": 1}])
    write_jsonl(tmp_path / "test.jsonl", [{"x": 2}])
    assert load_rows(str(tmp_path), "test")[0] == [{"x": 2}]
    pq.write_table(pa.Table.from_pylist([{"x": 3}, {"x": 4}]), tmp_path / "p.parquet")
    assert load_rows(str(tmp_path / "p.parquet"))[0] == [{"x": 3}, {"x": 4}]


def test_mask_covers_exactly_the_assistant_turns(tokenizer):
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5"},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8"},
    ]
    ids, mask = encode_example(tokenizer, messages)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(ids) == full
    # the masked tokens, read as runs, are exactly the two assistant turns (content + end of turn)
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    if cur:
        runs.append(tokenizer.decode(cur))
    assert runs == ["2 + 3 = 5<|im_end|>\n", "8<|im_end|>\n"]
    # and the prompt rendered for generation is exactly the unmasked prefix before the first answer
    prompt_ids = encode_prompt(tokenizer, messages[:1])
    assert (
        ids[: len(prompt_ids)] == prompt_ids
        and not any(mask[: len(prompt_ids)])
        and mask[len(prompt_ids)] == 1
    )


def test_plain_text_completion_mask(tokenizer):
    ids, mask = encode_example(tokenizer, "Q: 1+1=", " 2")
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == " 2" + tokenizer.eos_token
    assert mask[: len(tokenizer("Q: 1+1=").input_ids)] == [0] * len(tokenizer("Q: 1+1=").input_ids)


def seqs(lengths):
    return [
        {"input_ids": list(range(100 * i, 100 * i + n)), "w": [float(i)] * n}
        for i, n in enumerate(lengths)
    ]


def test_pack_respects_budget_and_keeps_every_token():
    data = seqs([5, 3, 7, 2, 6, 1])
    rows = pack(data, max_tokens=8)
    assert all(r["input_ids"].shape[1] <= 8 for r in rows)
    assert sorted(torch.cat([r["input_ids"][0] for r in rows]).tolist()) == sorted(
        t for s in data for t in s["input_ids"]
    )
    for r in rows:  # position ids restart at each sequence start, fields stay aligned
        ids, pos, w = r["input_ids"][0], r["position_ids"][0], r["w"][0]
        for t, p, x in zip(ids.tolist(), pos.tolist(), w.tolist()):
            assert p == t % 100 and x == t // 100
    assert len(rows) == 3  # first-fit decreasing: [7, 1], [6, 2], [5, 3]
    with pytest.raises(ValueError, match="does not fit"):
        pack(seqs([9]), max_tokens=8)


def test_split_for_ranks_equal_micro_batch_counts():
    shares = split_for_ranks(seqs([6, 5, 4]), num_ranks=2, max_tokens=8)  # [6]; [5], [4]
    assert len(shares[0]) == len(shares[1]) == 2
    scales = sorted(mb["real"].item() for share in shares for mb in share)
    assert scales == [0.0, 1.0, 1.0, 1.0]
    real = [mb["input_ids"].shape[1] for share in shares for mb in share if mb["real"] > 0]
    assert sum(real) == 15
    sp = split_for_ranks(seqs([6, 5, 4]), num_ranks=4, max_tokens=8, sp_size=2)  # DP 2 x SP 2
    assert len(sp) == 4 and sp[0] is sp[1] and sp[2] is sp[3] and sp[0] is not sp[2]
    assert [len(s) for s in sp] == [2, 2, 2, 2]
