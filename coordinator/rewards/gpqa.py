"""slime's `gpqa` reward: the option letter a response chooses against the correct one, else the answer text.

Owns `gpqa_score`. The rules are slime's `slime/rollout/rm_hub/gpqa.py` (THUDM/slime 624b824a); the code is
ours. One deviation, where slime is plainly wrong (docs/rewards.md, its row and test): the letter a phrase
pattern finds must be a word of its own, else that pattern gives nothing. slime's take any letter (case ignored)
after the phrase, so "The answer is clearly B" reads C (from "clearly") and, with letters A-J, "The answer is
(B)" reads I (from "is"). slime's plain substring test for the answer text is kept (the choice "a" is found in
"answer"): a known quirk, not changed.

- the response's text after the last `</think>` is read;
- letters: metadata `valid_letters` (upper-cased), else A.. for each of metadata `choices` (a dict: its values
  in order), else A-J (slime; miles' default is A-H);
- the correct letter: metadata `correct_letter` (a string); a one-letter label among the letters when there is
  none; a numeric label (int, float, bool) is a choice index and wins over both; else the choice whose text
  equals the label's (lower-cased, runs of non-alphanumerics as one space);
- the chosen letter: the first match of each phrase pattern in turn ("answer/option/choice is X", "X is
  correct", "final answer is X"; slime's regexes, case ignored), kept when it is a valid letter, else the last
  standalone capital letter that is;
- both known: 1 when they agree, else 0; otherwise 1 when the correct choice's text, metadata
  `correct_answer`/`answer_text` or the label text appears in the (normalised) response, as a substring;
  otherwise, with no correct letter, 1 when the chosen letter is the label text.

Invariant: pure: slime's `metadata.setdefault("correct_answer", <the choice the label matched>)` is read as a
candidate, the metadata is not changed; the letter patterns are linear regexes.
"""

from __future__ import annotations

import re
import string
from typing import Any

from workers.boundary.json_input import JsonObject, JsonValue

DEFAULT_LETTERS = tuple(string.ascii_uppercase[:10])
_PHRASES = (
    re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
    re.compile(r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)", re.IGNORECASE),
    re.compile(r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
)
_WORD_CHAR = re.compile(r"\w")
_STANDALONE = re.compile(r"\b([A-Z])\b")
_NON_ALNUM = re.compile(r"[^a-z0-9]+")


def after_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[-1] if "</think>" in text else text


def normalize_text(text: str) -> str:
    """Lower case; every run of characters other than a-z and 0-9 as one space (so `1.5 m/s` is `1 5 m s`)."""
    return _NON_ALNUM.sub(" ", text.lower()).strip()


def _stands_alone(text: str, position: int) -> bool:
    """The letter at `position` is a word of its own: not the "c" of "clearly" nor the "i" of "is"."""
    before = text[position - 1 : position]
    after = text[position + 1 : position + 2]
    return not (_WORD_CHAR.fullmatch(before) or _WORD_CHAR.fullmatch(after))


def chosen_letter(response: str, letters: list[str]) -> str | None:
    """The option letter the response picks (see the module docstring), or None."""
    if not response:
        return None
    text = after_thinking(response)
    valid = {letter.upper() for letter in letters}
    for phrase in _PHRASES:
        match = phrase.search(text)
        if match is not None and _stands_alone(text, match.start(1)) and match.group(1).upper() in valid:
            return match.group(1).upper()
    for letter in reversed(_STANDALONE.findall(text)):
        if letter in valid:
            return letter
    return None


def _choices(metadata: JsonObject) -> list[JsonValue] | None:
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        return list(choices.values())
    return None if choices is None else list(choices)


def _letters(metadata: JsonObject, choices: list[JsonValue] | None) -> list[str]:
    valid = metadata.get("valid_letters")
    if valid:
        return [str(letter).upper() for letter in valid]
    if choices:
        return list(string.ascii_uppercase[: len(choices)])
    return list(DEFAULT_LETTERS)


def _correct_letter(label: JsonValue, metadata: JsonObject, letters: list[str],
                    choices: list[JsonValue] | None) -> tuple[str | None, str | None, Any]:
    """(the correct letter, the label's text when the label is text, the choice the label's text matched)."""
    given = metadata.get("correct_letter")
    correct = given.strip().upper() if isinstance(given, str) else None
    label_text = None
    if isinstance(label, str):
        label_text = label.strip()
        if len(label_text) == 1 and label_text.upper() in letters and not correct:
            correct = label_text.upper()
    elif isinstance(label, (int, float)):
        index = int(label)
        if 0 <= index < len(letters):
            correct = letters[index]
    matched = None
    if not correct and choices and label_text:
        wanted = normalize_text(label_text)
        for index, choice in enumerate(choices):
            if normalize_text(str(choice)) == wanted:
                correct, matched = letters[index], choice
                break
    return correct, label_text, matched


def gpqa_score(response: str, label: JsonValue, metadata: JsonObject | None) -> float:
    """slime's `gpqa` reward (1.0 / 0.0) of a response; see the module docstring."""
    metadata = metadata if isinstance(metadata, dict) else {}
    choices = _choices(metadata)
    letters = _letters(metadata, choices)
    correct, label_text, matched = _correct_letter(label, metadata, letters, choices)
    chosen = chosen_letter(response, letters)
    if chosen and correct:
        return 1.0 if chosen == correct else 0.0
    candidates = []
    if correct and choices and correct in letters and letters.index(correct) < len(choices):
        candidates.append(str(choices[letters.index(correct)]))
    # slime: metadata.setdefault("correct_answer", <the matched choice>), then both keys are read.
    answer = metadata.get("correct_answer") if "correct_answer" in metadata else matched
    candidates += [str(value) for value in (answer, metadata.get("answer_text")) if value]
    if label_text:
        candidates.append(label_text)
    text = normalize_text(after_thinking(response))
    if any(target and target in text for target in {normalize_text(c) for c in candidates if c}):
        return 1.0
    if chosen and not correct and label_text:
        return 1.0 if chosen == label_text.strip().upper() else 0.0
    return 0.0
