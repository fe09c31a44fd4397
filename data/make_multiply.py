"""Build the built-in tool-use task in data/multiply/ (seeded: running it again writes the same files).

    python data/make_multiply.py

The task: "What is a × b?" with a, b in [11, 99], for grpo_tools.py: out of reach of a 135M model's
mental arithmetic, one calculator call away. Every (a, b) pair is one problem; a fixed random quarter
is held out, so no test question is ever trained on. The answer is checked by the last number.

Files:
    prompts_train.jsonl, prompts_test.jsonl  {"prompt": [user], "answer": "c"}: 1,024 and 64 rows
    sft_train.jsonl  {"messages": [system, user, assistant call, tool, assistant answer]}: 256
        transcripts for sft.py's warm start (the built-in model almost never calls a tool by
        itself); the system message is grpo_tools.py's, the call in its tag format.
"""

import json
import os
import random
import sys

LOW, HIGH, SEED = 11, 99, 1234
QUESTION = "What is {a} × {b}?"


def main():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from grpo_tools import Args, make_tool, with_tool_prompt  # the prompt the RL run will show

    rng = random.Random(SEED)
    problems = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    rng.shuffle(problems)
    test, train = problems[: len(problems) // 4], problems[len(problems) // 4 :]
    tool = make_tool(Args())
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiply")
    os.makedirs(out_dir, exist_ok=True)

    def prompt(a, b):
        return [{"role": "user", "content": QUESTION.format(a=a, b=b)}]

    def transcript(a, b):
        messages = with_tool_prompt(prompt(a, b), tool, "tags")
        return messages + [
            {"role": "assistant", "content": f"<calc>{a}*{b}</calc>"},
            {"role": "tool", "content": tool[2](f"{a}*{b}")},
            {"role": "assistant", "content": str(a * b)},
        ]

    files = {
        "prompts_train.jsonl": [
            {"prompt": prompt(a, b), "answer": str(a * b)} for a, b in train[:1024]
        ],
        "prompts_test.jsonl": [
            {"prompt": prompt(a, b), "answer": str(a * b)} for a, b in test[:64]
        ],
        "sft_train.jsonl": [{"messages": transcript(a, b)} for a, b in train[-256:]],
    }
    for name, rows in files.items():
        with open(os.path.join(out_dir, name), "w") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        print(f"{name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
