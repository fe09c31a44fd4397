"""Build the built-in arithmetic task in data/arithmetic/ (seeded: running it again writes the same files).

    python data/make_arithmetic.py

The task: "What is a + b? Give only the final number." with a, b in [0, MAX_OPERAND]. Every (a, b) pair is
one problem; a fixed random quarter of them is held out as the test split, so test questions are never seen
in training by any script. The answer is checked by the last number in the reply.

Files (TRL's column conventions, conversational format):
    sft_train.jsonl, sft_test.jsonl        {"messages": [user, assistant "a + b = c"]}
    prompts_train.jsonl, prompts_test.jsonl {"prompt": [user], "answer": "c"}
    prefs_train.jsonl, prefs_test.jsonl    {"prompt": [user], "chosen": [assistant], "rejected": [assistant]}

Rejected replies are the mistakes small models make on this task, one kind per pair: a sum that is off by a
little, the operands glued together ("12 + 5" -> "125"), the product, one operand repeated, or a rambling
reply that ends on the wrong number.
"""

import json
import os
import random

MAX_OPERAND = 15
SEED = 1234
PROMPT = "What is {a} + {b}? Give only the final number."
RAMBLES = [
    "Let me think. {a} and {b} make {w}.",
    "The sum of {a} and {b} is {w}.",
    "Adding {b} to {a} gives {w}, which is the final number.",
]


def wrong_reply(a: int, b: int, rng: random.Random) -> str:
    right = a + b
    kind = rng.choice(["off_by", "glued", "product", "operand", "ramble"])
    if kind == "off_by":
        wrong = right + rng.choice([-3, -2, -1, 1, 2, 3])
    elif kind == "glued":
        wrong = int(f"{a}{b}")
    elif kind == "product":
        wrong = a * b
    elif kind == "operand":
        wrong = rng.choice([a, b])
    else:
        wrong = right + rng.choice([-10, -5, 5, 10])
    if wrong == right or wrong < 0:
        wrong = right + 1
    if kind == "ramble":
        return rng.choice(RAMBLES).format(a=a, b=b, w=wrong)
    return f"{a} + {b} = {wrong}"


def main():
    rng = random.Random(SEED)
    problems = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    rng.shuffle(problems)
    n_test = len(problems) // 4
    splits = {"test": problems[:n_test], "train": problems[n_test:]}
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic")
    os.makedirs(out_dir, exist_ok=True)
    for split, items in splits.items():
        sft, prompts, prefs = [], [], []
        for a, b in items:
            user = [{"role": "user", "content": PROMPT.format(a=a, b=b)}]
            good = [{"role": "assistant", "content": f"{a} + {b} = {a + b}"}]
            bad = [{"role": "assistant", "content": wrong_reply(a, b, rng)}]
            sft.append({"messages": user + good})
            prompts.append({"prompt": user, "answer": str(a + b)})
            prefs.append({"prompt": user, "chosen": good, "rejected": bad})
        for name, rows in (("sft", sft), ("prompts", prompts), ("prefs", prefs)):
            with open(os.path.join(out_dir, f"{name}_{split}.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{split}: {len(items)} problems -> {out_dir}/{{sft,prompts,prefs}}_{split}.jsonl")


if __name__ == "__main__":
    main()
