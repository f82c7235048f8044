"""rayless' lenient math grading (`math_lenient`, `math_last_number`): NOT slime's (that is `math_equal`).

Owns the checks of our own lenient math reward types. It accepts more than slime: unevaluated arithmetic
(`\\boxed{2+3}` for 5), unreduced fractions, `\\fbox{}`, `\\boxed 5`, an earlier complete box when the last is
cut off. Its rules:

- `extract_boxed`: the content of the last complete `\\boxed{...}` (brace-balanced; also `\\fbox{}` and
  `\\boxed 5`).
- `answers_equal(given, truth)`: true when the two agree after the MATH/"mathd" normalisation (`\\text{}`
  unwrapped, `\\left`/`\\right`, degrees, `$`, `%`, unit words and spaces dropped, `\\dfrac` → `\\frac`,
  `\\frac12` → `\\frac{1}{2}`, `x = 7` → `7`, `0.5` → `\\frac{1}{2}`, `a/b` → `\\frac{a}{b}`), or as exact
  numbers (`1,000` = `1000`, `\\frac{3}{4}` = `0.75`; an integer never equals a non-integer), or element-wise
  for tuples and intervals with the same brackets, or symbolically (`2\\sqrt{2}` = `\\sqrt{8}`) for small
  expressions with at most two variables — the last through our own parser into sympy objects, never `eval`.

Invariant: grading is bounded on hostile text (a 100k-digit "number", thousands of `\\boxed{`, a huge
exponent): numbers beyond float range compare as text, symbolic checks only see short expressions with small
exponents, and every scan is linear in the text.
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction
from typing import Any

MAX_NUMBER_CHARS = 64
MAX_EXPONENT = 308
MAX_SYMBOLIC_CHARS = 64  # longer answers are not simplified symbolically (sympy time grows fast)
MAX_SYMBOLIC_POWER = 12
MAX_SYMBOLIC_VARIABLES = 2

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")
_FRAC = r"\\[dt]?frac\s*(?:\{[^{}]*\}|\d)\s*(?:\{[^{}]*\}|\d)"
_NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+"
# The last "answer-like" thing in a response: a fraction command, a/b, or a number (with sign and percent).
_LAST_ANSWER = re.compile(rf"-?(?:{_FRAC}|(?:{_NUMBER})(?:\s*/\s*(?:{_NUMBER}))?)\s*(?:\\?%)?")
_FRAC_PARTS = re.compile(r"^\\frac\{([^{}]*)\}\{([^{}]*)\}$")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_UNIT_WORDS = ("degrees", "degree", "cm", "meters", "meter", "miles", "mile", "seconds", "second", "minutes",
               "minute", "hours", "hour", "days", "day", "weeks", "week", "months", "month", "years", "year",
               "feet", "foot", "inches", "inch", "yards", "yard", "units", "unit", "dollars", "cents")
_UNITS = re.compile(r"(?<=[\d}\s])\s*(?:" + "|".join(_UNIT_WORDS) + r")\b\.?$")
_SCALE_WORDS = {"thousand": 3, "million": 6, "billion": 9, "trillion": 12}


# ---------------------------------------------------------------------------------------------- extraction


def _closing_braces(text: str) -> dict[int, int]:
    """For every `{` that is closed, the index of its `}` (one pass: nested braces are matched properly)."""
    open_positions: list[int] = []
    closing: dict[int, int] = {}
    for position, char in enumerate(text):
        if char == "{":
            open_positions.append(position)
        elif char == "}" and open_positions:
            closing[open_positions.pop()] = position
    return closing


def extract_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`.

    Linear in the text (brace pairs are found in one pass), so a response of thousands of `\\boxed{` costs
    no more than its length.
    """
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    closing = _closing_braces(text)
    for match in reversed(matches):
        start = match.end()
        if start < len(text) and text[start] == "{":
            if start in closing:
                return text[start + 1 : closing[start]]
        elif text[start - 1].isspace():  # `\\boxed 5`: up to the next space, `$` or brace
            bare = re.match(r"[^\s${}]+", text[start:])
            if bare is not None:
                return bare.group(0)
    return None


def extract_last_number(text: str) -> str | None:
    """The last number-like span of `text` (`-3/4`, `\\frac{1}{2}`, `1,234.5`, `50%`), or None."""
    last = None
    for last in _LAST_ANSWER.finditer(text):  # noqa: B007 - the loop keeps the last match
        pass
    return last.group(0).strip() if last is not None else None


def label_answer(label: str) -> str:
    """A label's answer: the content of its `\\boxed{}` when it has one (slime's rule), else the label."""
    if "\\boxed" in label:
        boxed = extract_boxed(label)
        if boxed is not None:
            return boxed
    return label


# ------------------------------------------------------------------------------------------- normalisation


def _brace_short_arguments(text: str) -> str:
    """`\\frac12` → `\\frac{1}{2}`, `\\frac1{b}`, `\\frac{a}2`, `\\sqrt2` → `\\sqrt{2}` (regexes: linear)."""
    text = re.sub(r"\\sqrt(?![{\[])\s*([^\s{\\])", r"\\sqrt{\1}", text)
    text = re.sub(r"\\frac(?!\{)\s*([^\s{\\])\s*([^\s{\\])", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac(?!\{)\s*([^\s{\\])\s*\{", r"\\frac{\1}{", text)
    return re.sub(r"\\frac(\{[^{}]*\})\s*([^\s{\\])", r"\\frac\1{\2}", text)


def normalize_math(text: str) -> str:
    """The MATH ("mathd") normal form of an answer; two answers with the same form are equal."""
    text = text.strip()
    whole_text = re.fullmatch(r"\\text\{(.*)\}", text)
    if whole_text is not None:
        text = whole_text.group(1)
    text = text.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°", "", text)
    text = text.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    text = re.sub(r"\\text\{\s[^{}]*\}$", "", text)  # a trailing unit: `5\text{ cm}`
    text = _TEXT.sub(r"\1", text)
    text = _UNITS.sub("", text)
    text = re.sub(r"\\[,;:]", "", text).replace("\\displaystyle", "")
    text = re.sub(r"(^|[\s{(])\.(\d)", r"\g<1>0.\2", text)
    lhs = re.fullmatch(r"\s*([A-Za-z]\w?|\\[A-Za-z]+)\s*=\s*(.+)", text)  # `x = 7`, `\theta = 2`: the value
    if lhs is not None:
        text = lhs.group(2)
    text = _brace_short_arguments(text)
    text = re.sub(r"\s+", "", text).rstrip(".")
    if text == "0.5":
        text = "\\frac{1}{2}"
    simple_fraction = re.fullmatch(r"(-?\d+)/(\d+)", text)
    if simple_fraction is not None:
        text = f"\\frac{{{simple_fraction.group(1)}}}{{{simple_fraction.group(2)}}}"
    return text


def _parse_plain_number(text: str) -> Fraction | None:
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    # Bounded: a model can emit a 100k-digit "number" or `1e999999`; exact arithmetic on those would be
    # slow (or refused by int()), so anything beyond float range is not a number and compares as text.
    if len(text) > MAX_NUMBER_CHARS:
        return None
    match = re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE]([-+]?\d+))?", text)
    if match is None or (match.group(1) is not None and abs(int(match.group(1))) > MAX_EXPONENT):
        return None
    return Fraction(text)


def parse_number(text: str) -> Fraction | None:
    """The exact value of a numeric answer (`1,234.5`, `-3/4`, `\\frac{1}{2}`, `2 million`), else None."""
    words = re.fullmatch(r"(.*?)\s*(thousand|million|billion|trillion)", text.strip())
    scale = 0
    if words is not None:
        text, scale = words.group(1), _SCALE_WORDS[words.group(2)]
    text = normalize_math(text)
    sign = Fraction(1)
    if text.startswith("-"):
        sign, text = Fraction(-1), text[1:]
    elif text.startswith("+"):
        text = text[1:]
    frac = _FRAC_PARTS.match(text)
    if frac is not None:
        numerator, denominator = _parse_plain_number(frac.group(1)), _parse_plain_number(frac.group(2))
        if numerator is None or denominator is None or denominator == 0:
            return None
        value = numerator / denominator
    else:
        parsed = _parse_plain_number(text) if text else None
        if parsed is None:
            return None
        value = parsed
    return sign * value * 10**scale


# ------------------------------------------------------------------------------------------------ grading


def _split_tuple(text: str) -> tuple[str, list[str]] | None:
    """`(1, 2]` → (`(]`, [`1`, `2`]): the brackets and the top-level elements of a tuple or interval."""
    text = text.strip().replace("\\left", "").replace("\\right", "")
    if len(text) < 2 or text[0] not in "([" or text[-1] not in ")]":
        return None
    depth, parts, current = 0, [], []
    for char in text[1:-1]:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    if len(parts) < 2 or depth != 0:
        return None
    return text[0] + text[-1], parts


def answers_equal(given: str, truth: str) -> bool:
    """Whether `given` is the same answer as `truth` (see the module docstring for the rules)."""
    if not given.strip() or not truth.strip():
        return False
    normal_given, normal_truth = normalize_math(given), normalize_math(truth)
    if normal_given and normal_given == normal_truth:
        return True
    given_tuple, truth_tuple = _split_tuple(given), _split_tuple(truth)
    if given_tuple is not None and truth_tuple is not None:
        return (given_tuple[0] == truth_tuple[0] and len(given_tuple[1]) == len(truth_tuple[1])
                and all(answers_equal(g, t) for g, t in zip(given_tuple[1], truth_tuple[1], strict=True)))
    if given_tuple is not None or truth_tuple is not None:
        return False
    value_given, value_truth = parse_number(given), parse_number(truth)
    if value_given is not None and value_truth is not None:
        return value_given == value_truth
    return symbolically_equal(normal_given, normal_truth)


# ---------------------------------------------------------------------------------------- symbolic check

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(sqrt|pi|[a-z])|([-+*/^()]))")


def latex_to_expression(text: str) -> str | None:
    """A normalised LaTeX answer in a small infix syntax (`\\frac{a}{b}` → `(a)/(b)`), or None when it uses
    anything else (the symbolic check is then skipped)."""
    if len(text) > MAX_SYMBOLIC_CHARS:
        return None
    text = text.replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", " pi ")
    for _ in range(MAX_SYMBOLIC_CHARS):  # innermost first; each pass removes at least one command
        new = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", text)
        new = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", new)
        new = re.sub(r"\\sqrt\[([^\[\]{}]*)\]\{([^{}]*)\}", r"((\2)^(1/(\1)))", new)
        if new == text:
            break
        text = new
    text = text.replace("{", "(").replace("}", ")")
    if "\\" in text or re.search(r"[^0-9a-z.+\-*/^()\s]", text):
        return None
    return text


class _Parser:
    """Recursive descent over `_TOKEN`s into sympy objects: numbers, ≤2 variables, + - * / ^, sqrt, pi,
    implicit multiplication (`2x`, `3sqrt(2)`). Builds objects directly; nothing is evaluated as code."""

    def __init__(self, text: str, sympy: Any) -> None:
        self.sympy = sympy
        self.tokens: list[tuple[str, str]] = []
        position = 0
        while position < len(text):
            match = _TOKEN.match(text, position)
            if match is None or match.end() == position:
                if text[position:].strip():
                    raise ValueError(f"unexpected {text[position:]!r}")
                break
            number, name, operator = match.groups()
            self.tokens.append(("num", number) if number else ("name", name) if name else ("op", operator))
            position = match.end()
        self.position = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token is None:
            raise ValueError("unexpected end")
        self.position += 1
        return token

    def parse(self) -> Any:
        value = self.expression()
        if self.peek() is not None:
            raise ValueError(f"unexpected {self.peek()}")
        return value

    def expression(self) -> Any:
        value = self.term()
        while self.peek() in (("op", "+"), ("op", "-")):
            operator = self.take()[1]
            right = self.term()
            value = value + right if operator == "+" else value - right
        return value

    def term(self) -> Any:
        value = self.unary()
        while True:
            token = self.peek()
            if token in (("op", "*"), ("op", "/")):
                self.take()
                right = self.unary()
                if token[1] == "/" and right == 0:
                    raise ValueError("division by zero")
                value = value * right if token[1] == "*" else value / right
            elif token is not None and (token[0] in ("num", "name") or token == ("op", "(")):
                value = value * self.power()  # implicit multiplication
            else:
                return value

    def unary(self) -> Any:
        if self.peek() in (("op", "-"), ("op", "+")):
            sign = self.take()[1]
            value = self.unary()
            return -value if sign == "-" else value
        return self.power()

    def power(self) -> Any:
        base = self.atom()
        if self.peek() == ("op", "^"):
            self.take()
            exponent = self.unary()
            if not exponent.is_Rational or abs(exponent.p) > MAX_SYMBOLIC_POWER or exponent.q > MAX_SYMBOLIC_POWER:
                raise ValueError("exponent too large or not a small rational")
            return base**exponent
        return base

    def atom(self) -> Any:
        kind, text = self.take()
        sympy = self.sympy
        if kind == "num":
            return sympy.Rational(text)
        if kind == "name":
            if text == "pi":
                return sympy.pi
            if text == "sqrt":
                if self.take() != ("op", "("):
                    raise ValueError("sqrt needs parentheses")
                inner = self.expression()
                if self.take() != ("op", ")"):
                    raise ValueError("unbalanced parentheses")
                return sympy.sqrt(inner)
            return sympy.Symbol(text)
        if text == "(":
            inner = self.expression()
            if self.take() != ("op", ")"):
                raise ValueError("unbalanced parentheses")
            return inner
        raise ValueError(f"unexpected {text!r}")


@functools.cache
def _sympy() -> Any:
    try:
        import sympy
    except ImportError:  # the symbolic check is an extra; without sympy it is skipped
        return None
    return sympy


def symbolically_equal(given: str, truth: str) -> bool:
    """`simplify(truth - given) == 0` for two normalised answers our parser reads; False otherwise."""
    sympy = _sympy()
    expressions = [latex_to_expression(given), latex_to_expression(truth)]
    if sympy is None or None in expressions:
        return False
    try:
        left, right = (_Parser(expression, sympy).parse() for expression in expressions)  # type: ignore[arg-type]
    except (ValueError, ZeroDivisionError, TypeError):
        return False
    symbols = left.free_symbols | right.free_symbols
    if len(symbols) > MAX_SYMBOLIC_VARIABLES:
        return False
    try:
        return bool(sympy.simplify(left - right) == 0)
    except Exception:  # sympy may give up on odd input; that is "not shown equal"
        return False
