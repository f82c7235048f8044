"""slime's decision whether a math answer equals the label: same MATH form, else element-wise, else sympy.

Owns `answer_matches(given, truth)`, the check of slime's `math`, `deepscaler` and miles' `gemma_math` (slime's
`grade_answer_mathd(...) or grade_answer_sympy(...)` in `slime/rollout/rm_hub/math_utils.py`, THUDM/slime
624b824a; miles 31f1ca96 has the same rules). The rules, ours in code:

1. the two MATH normal forms (`math_normalize.mathd_form`) are equal; else
2. the two symbolic forms (`math_normalize.symbolic_form`) are equal; else, the label's form split into
   elements (a tuple or interval: same brackets required), element by element: two plain fractions must be
   written the same (`2/4` is not `1/2`); an integer only equals an integer written out (`2+3` is not `5`);
   otherwise sympy must simplify `(truth)-(given)` to 0, tried only on texts with at most two distinct letters,
   no `^{`, `^(`, chained or multi-digit exponents (slime's guard against sympy hanging).

slime parses with sympy's own names and no builtins; miles with sympy's defaults (which add Python's
builtins, so `all` and `id` mean something): `sympy_defaults` picks miles'.

Invariant: pure; sympy is imported on first use (module import stays cheap); sympy's own warnings are not
errors here (slime runs with them printed), so a run's warning filters cannot change a reward.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

from coordinator.rewards.math_normalize import (
    is_integer_text,
    mathd_form,
    strip_formatted_commas,
    symbolic_form,
)
from workers.boundary.json_input import JsonObject

MAX_LETTERS = 2
_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_PATTERNS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_TUPLE_CHARS = "()[]"
_PLAIN_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")

@functools.cache
def _sympy() -> Any:
    import sympy
    from sympy.parsing import sympy_parser

    return sympy, sympy_parser


@functools.cache
def _slime_names() -> JsonObject:
    sympy, _ = _sympy()
    return {"__builtins__": {}, **{name: value for name, value in vars(sympy).items() if not name.startswith("_")}}


def _may_evaluate(expression: str) -> bool:
    letters = {char for char in expression.replace("sqrt", "").replace("frac", "") if char.isalpha()}
    if len(letters) > MAX_LETTERS:
        return False
    if any(bad in expression for bad in _BAD_SUBSTRINGS):
        return False
    return not any(pattern.search(expression) for pattern in _BAD_PATTERNS)


_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]{0,99})")  # a plain integer literal, as sympy reads it exactly


@functools.lru_cache(maxsize=1 << 16)
def symbolically_equal(truth: str, given: str, *, sympy_defaults: bool = False) -> bool:
    """True when sympy simplifies `(truth)-(given)` to 0 (`^` read as power, implicit products allowed).
    Memoized: a pure function of its strings, and the costly step of grading (~1 ms), asked again and again for
    the same label and answer when a group's samples agree."""
    if _INTEGER.fullmatch(truth) and _INTEGER.fullmatch(given):
        # two integer literals: sympy's difference is exact, zero exactly when the integers are equal
        return int(truth) == int(given)
    expression = f"({truth})-({given})"
    if not _may_evaluate(expression):
        return False
    sympy, parser = _sympy()
    transformations = (*parser.standard_transformations, parser.implicit_multiplication_application)
    names = None if sympy_defaults else dict(_slime_names())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            parsed = parser.parse_expr(expression.replace("^", "**"), local_dict=None if sympy_defaults else {},
                                       global_dict=names, transformations=transformations)
            return bool(sympy.simplify(parsed) == 0)
        except Exception:  # slime: anything sympy cannot parse or simplify is "not equal"
            return False


def _elements(form: str) -> list[str]:
    """A tuple's or interval's elements (`(1,2]` → `1`, `2`), else the one form; formatted commas kept."""
    form = strip_formatted_commas(form)
    if not form:
        return []
    inner = form[1:-1]
    if (len(form) > 2 and form[0] in _TUPLE_CHARS and form[-1] in _TUPLE_CHARS
            and not any(char in inner for char in _TUPLE_CHARS)):
        return [element.strip() for element in inner.split(",")]
    return [form]


def _elements_equal(truth: str, given: str, sympy_defaults: bool) -> bool:
    if _PLAIN_FRACTION.search(truth) and _PLAIN_FRACTION.search(given):
        return truth == given  # an unreduced fraction is not the reduced one
    if is_integer_text(truth) != is_integer_text(given):
        return False  # an integer must be written as one: no credit for unevaluated arithmetic
    return symbolically_equal(truth, given, sympy_defaults=sympy_defaults)


def symbolic_match(given: str | None, truth: str | None, *, sympy_defaults: bool = False) -> bool:
    """slime's second check (`grade_answer_sympy`): the symbolic forms, element by element."""
    truth_form, given_form = symbolic_form(truth), symbolic_form(given)
    if truth_form is None or given_form is None:
        return False
    if truth_form == given_form:
        return True
    if not given_form:
        return False
    truth_elements, given_elements = _elements(truth_form), _elements(given_form)
    if len(truth_elements) > 1 and (truth_form[0] != given_form[0] or truth_form[-1] != given_form[-1]):
        return False  # `(1,2)` is not `[1,2]`
    if len(truth_elements) != len(given_elements):
        return False
    return all(_elements_equal(truth_element, given_element, sympy_defaults)
               for truth_element, given_element in zip(truth_elements, given_elements, strict=True))


def answer_matches(given: str, truth: str | None, *, sympy_defaults: bool = False) -> bool:
    """slime's verdict on an extracted answer against the label's answer (None: the label had no answer)."""
    if truth is not None and mathd_form(truth) == mathd_form(given):
        return True
    return symbolic_match(given, truth, sympy_defaults=sympy_defaults)
