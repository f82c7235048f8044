"""slime's math answer forms: finding the boxed answer, and the two normal forms its grader compares.

Owns the text side of the `math` / `deepscaler` / `gemma_math` grading (`math_equal` owns the decision). The
rules are those of slime's `slime/rollout/rm_hub/math_utils.py` (THUDM/slime 624b824a, itself deepscaler's
and Hendrycks' MATH code); the code is ours. Every step below is one of slime's, in slime's order, including
the ones that look odd (`"day"` is dropped from `"monday"`, `\\fbox` is never an answer, a mixed number
`2\\frac{1}{2}` reads as `2+1/2` only after the LaTeX pass), because a slime user's rewards depend on them.

Invariant: pure functions of their text; linear scans (the boxed search scans once from the last `\\boxed`).
"""

from __future__ import annotations

import re

BOXED = "\\boxed"
_BOXED_OPEN = "\\boxed{"
_WHOLE_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}$")  # slime's: the whole answer in one `\text{...}`
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
          "year", "foot", "feet", "inch", "yard")
_UNIT_PATTERNS = tuple(re.compile(rf"{unit}(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS)
_FORMATTED_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_MIXED_NUMBER = re.compile(r"([0-9]) +([0-9])")
_LATEX_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))


class _Unnormalisable(Exception):
    """slime's MATH normalisation raised on this text (slime then keeps the text as it was)."""


# ------------------------------------------------------------------------------------------------ the box


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `text`, by slime's rule, or None.

    slime takes the last occurrence of `\\boxed` (any continuation: `\\boxed 5`, `\\boxedx`), scans from it to
    the `}` that brings the brace count back to zero, and accepts the span only when it starts `\\boxed{`. So
    `\\boxed 42`, `\\fbox{42}` and a box cut off at the end (`\\boxed{42} ... \\boxed{4`) give None: the last
    box decides, there is no falling back to an earlier one.
    """
    if BOXED not in text:
        return None
    start = text.rfind(BOXED)
    depth = 0
    for position in range(start, len(text)):
        char = text[position]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                span = text[start : position + 1]
                return span[len(_BOXED_OPEN) : -1] if span.startswith(_BOXED_OPEN) else None
    return None


# ------------------------------------------------------------------------- the MATH ("mathd") normal form


def _brace_fracs(text: str) -> str:
    """`\\frac12` → `\\frac{1}{2}`, `\\frac1{2}` → `\\frac{1}{2}`; a `\\frac` with one character after it leaves
    the whole text as it was; a `\\frac` with nothing after it makes the normalisation fail (slime's)."""
    first, *rest = text.split("\\frac")
    out = [first]
    for part in rest:
        out.append("\\frac")
        if not part:
            raise _Unnormalisable
        if part[0] == "{":
            out.append(part)
            continue
        if len(part) < 2:
            return text
        numerator, second = part[0], part[1]
        if second != "{":
            out.append("{" + numerator + "}{" + second + "}" + part[2:])
        else:
            out.append("{" + numerator + "}" + second + part[2:])
    return "".join(out)


def _brace_sqrts(text: str) -> str:
    """`\\sqrt3` → `\\sqrt{3}` (one character); a `\\sqrt` with nothing after it fails (slime's)."""
    if "\\sqrt" not in text:
        return text
    first, *rest = text.split("\\sqrt")
    out = [first]
    for part in rest:
        if not part:
            raise _Unnormalisable
        out.append("\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:])
    return "".join(out)


def _slash_to_frac(text: str) -> str:
    """`3/4` → `\\frac{3}{4}` only when both sides are integers written canonically (`-3/4`, not `03/4`)."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{numerator}/{denominator}":
        return text
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def _drop_right_units(text: str) -> str:
    """Everything from `\\text{ ` (a unit, by the MATH convention); two of them make the normalisation fail."""
    if "\\text{ " not in text:
        return text
    parts = text.split("\\text{ ")
    if len(parts) != 2:
        raise _Unnormalisable
    return parts[0]


def _strip_math(text: str) -> str:
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        text = text.replace(old, new)
    text = _drop_right_units(text)
    text = text.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # `x = 5`, `k=3`: the value
        text = sides[1]
    text = _brace_sqrts(text).replace(" ", "")
    text = _brace_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_to_frac(text)


def mathd_form(answer: str | None) -> str | None:
    """The MATH ("mathd") normal form: slime's first check is that both answers have the same one."""
    if answer is None:
        return None
    answer = answer.strip()
    whole = _WHOLE_TEXT.search(answer)
    if whole is not None:
        answer = whole.group("text").strip()
    try:
        return _strip_math(answer)
    except _Unnormalisable:
        return answer


# ------------------------------------------------------------------------ the symbolic-check normal form


def strip_formatted_commas(text: str) -> str:
    """`1,000,000` → `1000000`, leaving commas that separate elements (`1,2`) alone; to a fixed point."""
    while True:
        stripped = _FORMATTED_COMMA.sub(r"\1\3\4", text)
        if stripped == text:
            return stripped
        text = stripped


def is_float_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_integral(value: float) -> bool:
    try:
        return abs(value - round(value)) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def is_integer_text(text: str) -> bool:
    """slime's "is an integer": a float within 1e-7 of an integer, once formatted commas are dropped."""
    text = strip_formatted_commas(text)
    return is_float_text(text) and _is_integral(float(text))


def integer_text(text: str) -> str:
    """slime's integer form of an integer text: every comma dropped, then truncated (`2.99999999` → `2`)."""
    return str(int(float(text.replace(",", ""))))


def latex_to_text(expression: str) -> str:
    """slime's LaTeX pass: pylatexenc's text rendering, with its symbols spelled as sympy reads them."""
    expression = expression.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expression = expression.replace("\\frac", " \\frac")  # a mixed number `2\frac12` becomes `2 1/2`
    from pylatexenc import latex2text  # here, not at the top: its tables cost every run's start-up ~40 ms

    expression = latex2text.LatexNodes2Text().latex_to_text(expression)
    for symbol, name in _LATEX_SYMBOLS:
        expression = expression.replace(symbol, name)
    return expression.strip()


def symbolic_form(expression: str | None) -> str | None:
    """The normal form slime compares (and hands to sympy) after the MATH form disagreed."""
    if expression is None:
        return None
    whole = _WHOLE_TEXT.search(expression)
    if whole is not None:
        expression = whole.group("text")
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expression = expression.replace(old, new)
    for unit in _UNIT_PATTERNS:
        expression = unit.sub("", expression)
    expression = re.sub(r"\^ *\\circ", "", expression)
    if expression and expression[0] == "{" and expression[-1] == "}":
        expression = expression[1:-1]
    expression = re.sub(r",\\! *", "", expression)
    if is_float_text(expression) and _is_integral(float(expression)):
        expression = str(round(float(expression)))
    if "\\" in expression:
        try:
            expression = latex_to_text(expression)
        except Exception:  # slime keeps the text when pylatexenc fails on it
            pass
    expression = re.sub("- *", "-", expression)
    expression = _MIXED_NUMBER.sub(r"\1+\2", expression)  # `7 3/4` → `7+3/4`
    expression = expression.replace(" ", "").replace("{", "").replace("}", "").lower()
    if is_integer_text(expression):
        expression = integer_text(expression)
    return expression
