"""slime's `dapo` reward: the Minerva normal form of the last `Answer: ...` line against an integer label.

Owns `dapo_score` and `minerva_form`. The rules are slime's `slime/rollout/rm_hub/math_dapo_utils.py`
(THUDM/slime 624b824a; miles 31f1ca96 is the same), which follow lm-evaluation-harness' Minerva MATH check;
the code is ours:

- only the last 300 characters count; the answer is the last match of `(?i)Answer\\s*:\\s*([^\\n]+)` there
  (none: the text `[INVALID]`);
- the Minerva form: the text after the last `=`; fixed substitutions, then fixed words removed (both lists in
  slime's order: they are plain substring edits, so `"an "` is dropped inside words too); the first `$...$`
  kept; `\\text{}`, `\\textbf{}`, `\\overline{}`, `\\boxed{}` unwrapped; `\\fracab` → `\\frac{a}{b}`,
  `\\sqrta` → `\\sqrt{a}`; `$` dropped; commas dropped from a number made of digits and commas; stripped;
- the label goes through the same form and then `int(float(...))`: DAPO labels are integers (one that is not
  a number is an error, as in slime);
- right: `{score: 1, acc: 1}`, wrong: `{score: -1, acc: 0}`. slime's `pred` text is not a number, so it is
  left out of the reward (rewards here are numbers).

Invariant: pure; linear regexes only.
"""

from __future__ import annotations

import re

TAIL_CHARS = 300
ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INVALID = "[INVALID]"

SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
           "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
           "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
           "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
           r",\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>")
_REWRITES = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),
)


def minerva_form(answer: object) -> str:
    """The Minerva normal form of a final answer (of `str(answer)`)."""
    text = str(answer).split("=")[-1]
    for old, new in SUBSTITUTIONS:
        text = text.replace(old, new)
    for removed in REMOVED:
        text = text.replace(removed, "")
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def dapo_truth(label: object) -> str:
    """The label as DAPO compares it: its Minerva form read as a number, as an integer. ValueError (or
    OverflowError for an infinite one) when the label is not a number."""
    return str(int(float(minerva_form(label))))


def dapo_prediction(response: str) -> str:
    """The Minerva form of the last `Answer:` line in the response's last 300 characters."""
    answers = ANSWER_LINE.findall(response[-TAIL_CHARS:])
    return minerva_form(answers[-1] if answers else INVALID)


def dapo_score(response: str, label: object) -> dict[str, float]:
    """slime's `dapo` reward of a response; raises ValueError/OverflowError on a non-numeric label."""
    truth = dapo_truth(label)
    correct = dapo_prediction(response) == truth
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0}
