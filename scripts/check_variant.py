"""Check a variant script against its parent, as docs/variants.md's checklist asks (steps 3-4).

    python scripts/check_variant.py grpo.py my_gspo.py             # the tag is found in my_gspo.py
    python scripts/check_variant.py grpo.py dapo.py --tag DAPO --budget 120

A variant is its parent plus the paper's changes, each tagged with a comment `# TAG (section): why`
(or `# TAG: why`) on or beside every changed line. This prints the changed lines, the hunks without
a tag, the sections found, and the edits inside the parent's `# TRY NOT TO MODIFY:` blocks (the
plumbing: a change there means the algorithm is missing a hook); it exits 1 if there is any of the
last, or more changed lines than --budget. The tests check dapo.py, grpo_async.py and the worked
examples with these same functions.
"""

import argparse
import ast
import difflib
import re
import sys
from collections import Counter

BANNER = re.compile(r"^# (ALGO LOGIC|TRY NOT TO MODIFY|SETUP AND CHECKS):|^def main\(")


def tag_pattern(tag: str) -> re.Pattern:
    """`# TAG (section)` (the section is captured) or `# TAG: ...`."""
    return re.compile(rf"# {re.escape(tag)} \(([a-z0-9-]+)\)|# {re.escape(tag)}:()")


def tagged_diff(old: list[str], new: list[str], tag: re.Pattern) -> tuple[int, list[int], set]:
    """A variant's lines against its parent's: (changed lines, variant lines of hunks without a tag,
    sections found). A hunk is a run of changes with 2 lines of context around it (`diff -U2`): a tag
    on a changed line or right beside it counts. Hunks inside the module docstring (the paper
    header, rewritten) need no tag; their lines count."""
    changed = sum(
        1
        for d in difflib.unified_diff(old, new, lineterm="", n=0)
        if d[:1] in "+-" and d[:3] not in ("+++", "---")
    )
    doc_a, doc_b = (ast.parse("\n".join(lines)).body[0].end_lineno - 1 for lines in (old, new))
    untagged, found = [], set()
    for group in difflib.SequenceMatcher(None, old, new, autojunk=False).get_grouped_opcodes(2):
        edits = [op for op in group if op[0] != "equal"]
        if all(i2 - 1 <= doc_a and j2 - 1 <= doc_b for _, _, i2, _, j2 in edits):
            continue
        j1, j2 = group[0][3], group[-1][4]
        tags = {m if isinstance(m, str) else m[0] for line in new[j1:j2] for m in tag.findall(line)}
        found |= tags
        if not tags:
            untagged.append(j1 + 1)
    return changed, untagged, found


def protected_lines(lines: list[str]) -> set[int]:
    """Line numbers of a script's TRY NOT TO MODIFY blocks: from each such top-level banner to the
    next top-level banner (ALGO LOGIC, TRY NOT TO MODIFY, SETUP AND CHECKS) or `def main(`."""
    protected, inside = set(), False
    for number, line in enumerate(lines, 1):
        if BANNER.match(line):
            inside = line.startswith("# TRY NOT TO MODIFY:")
        if inside:
            protected.add(number)
    return protected


def touched_lines(diff: str) -> list[tuple[float, str]]:
    """(line of the parent, diff line) for every line a unified diff removes, and for every line it
    inserts the point between the two parent lines around it (an insertion inside a block touches
    the block)."""
    touched, old = [], 0
    for line in diff.splitlines():
        if hunk := re.match(r"^@@ -(\d+)", line):
            old = int(hunk.group(1))
        elif line.startswith("-") and not line.startswith("---"):
            touched.append((old, line))
            old += 1
        elif line.startswith("+") and not line.startswith("+++"):
            touched.append((old - 0.5, line))  # between parent lines old - 1 and old
        elif line.startswith(" "):
            old += 1
    return touched


def plumbing_edits(parent: list[str], diff: str) -> list[tuple[float, str]]:
    """The lines of a diff of `parent` that fall inside its TRY NOT TO MODIFY blocks."""
    protected = protected_lines(parent)
    return [
        (where, line)
        for where, line in touched_lines(diff)
        if (where in protected) or (where % 1 and {where - 0.5, where + 0.5} <= protected)
    ]


def guess_tag(parent: list[str], variant: list[str]) -> str | None:
    """The most frequent `# WORD (` / `# WORD:` comment tag of the variant's new lines."""
    new = set(variant) - set(parent)
    words = Counter(m for line in new for m in re.findall(r"# ([A-Z][A-Z0-9_-]+)(?: \(|:)", line))
    return words.most_common(1)[0][0] if words else None


def main(argv=None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("parent", help="the script the variant was copied from, e.g. grpo.py")
    cli.add_argument("variant", help="the variant script")
    cli.add_argument("--tag", help="its tag, e.g. DAPO (default: the variant's most frequent)")
    cli.add_argument("--budget", type=int, help="the most changed lines allowed")
    args = cli.parse_args(argv)
    texts = []
    for path in (args.parent, args.variant):
        try:
            with open(path) as f:
                texts.append(f.read().splitlines())
        except OSError as e:
            cli.error(f"{path}: {e.strerror}")
    parent, variant = texts
    tag = args.tag or guess_tag(parent, variant)
    if tag is None:
        cli.error(f"no `# TAG (section):` comment in {args.variant}'s changes: pass --tag")
    changed, untagged, found = tagged_diff(parent, variant, tag_pattern(tag))
    diff = "\n".join(difflib.unified_diff(parent, variant, lineterm=""))
    edits = sorted({int(where + 0.5) for where, _ in plumbing_edits(parent, diff)})
    over = args.budget is not None and changed > args.budget
    print(f"{args.variant} against {args.parent}: {changed} changed lines"
          + (f" (budget {args.budget})" if args.budget is not None else "")
          + f", tag {tag}, sections: {', '.join(sorted(s for s in found if s)) or '-'}")  # fmt: skip
    for line in untagged:
        print(f"  untagged hunk near {args.variant} line {line}: tag it `# {tag} (section): why`")
    for line in edits:
        print(f"  edits the plumbing: {args.parent} line {line} is in a TRY NOT TO MODIFY block")
    if over:
        print(f"  over budget: {changed} changed lines, at most {args.budget}")
    ok = not (untagged or edits or over)
    print("ok" if ok else "not a clean variant")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
