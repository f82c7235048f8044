"""Reading a status document for `rayless status`, from a status server or a file, as from a stranger.

Owns `fetch` (one GET of `/status`: the address checked first, the reply read in chunks under `MAX_BYTES` and a
total deadline, never whole), `read_capped` (a file read under the same cap), `check_shape` (every field the
terminal text reads has the type it is read as) and `printable` (every string of a document without control
or format characters: no ANSI escape, no carriage return or bidi override reaches the terminal).

Invariant: whatever a server or a file holds, `rayless status` holds at most `MAX_BYTES` of it (plus the
decoder's bounded structures) and ends with a `NoStatus` naming the source, never a traceback.
"""

from __future__ import annotations

import time
import unicodedata
from pathlib import Path
from urllib.parse import urlsplit

from workers.boundary.json_input import JsonObject, JsonValue

#: A status document is a few hundred KiB (500 metric rows, the timeline's last events); far past that is not one.
MAX_BYTES = 16 << 20
TIMEOUT_S = 5.0  # each connect and read
DEADLINE_S = 30.0  # the whole reply


class NoStatus(Exception):
    """Nothing to show; the message says what was tried."""


def status_endpoint(url: str) -> str:
    """`URL/status`, or NoStatus when `url` is not an http(s)://HOST[:PORT] address."""
    shown = url if len(url) <= 120 else url[:117] + "..."
    problem = NoStatus(f"{shown!r} is not a status server's address (expected http://HOST:PORT)")
    if any(not character.isprintable() or character.isspace() for character in url):
        raise problem
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not one
    except ValueError:
        raise problem from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise problem
    return url.rstrip("/") + "/status"


def fetch(url: str, api_key: str | None) -> bytes:
    """The body of `GET URL/status`, read under `MAX_BYTES` and `DEADLINE_S`."""
    import httpx

    endpoint = status_endpoint(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + DEADLINE_S
    try:
        with httpx.Client(timeout=TIMEOUT_S, follow_redirects=False) as client, \
                client.stream("GET", endpoint, headers=headers) as response:
            if response.status_code == 401:
                raise NoStatus(f"the status server at {url} wants the run's API key: give --api-key")
            if response.status_code != 200:
                raise NoStatus(f"the status server at {url} answered {response.status_code}")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_BYTES:
                raise NoStatus(f"{endpoint} declares {int(declared)} bytes, over the {MAX_BYTES >> 20} MiB a status "
                               "document may have: not a rayless status server")
            body = bytearray()
            for chunk in response.iter_raw():
                body += chunk
                if len(body) > MAX_BYTES:
                    raise NoStatus(f"{endpoint} sent more than the {MAX_BYTES >> 20} MiB a status document may "
                                   "have: not a rayless status server")
                if time.monotonic() > deadline:
                    raise NoStatus(f"{endpoint} did not finish its reply within {DEADLINE_S:.0f} s")
    except httpx.HTTPError as error:
        raise NoStatus(f"the status server at {url} does not answer: {error}") from None
    return bytes(body)


def read_capped(path: Path, *, tail: bool = False) -> bytes:
    """A file's bytes, at most `MAX_BYTES` of them: a larger file is refused, or with `tail` its last
    `MAX_BYTES` from a line's start are read (a long run's metrics.jsonl)."""
    with open(path, "rb") as file:
        size = file.seek(0, 2)
        if size <= MAX_BYTES:
            file.seek(0)
            return file.read(MAX_BYTES)
        if not tail:
            raise NoStatus(f"{path} holds {size} bytes, over the {MAX_BYTES >> 20} MiB a status file may have")
        file.seek(size - MAX_BYTES)
        data = file.read(MAX_BYTES)
    return data[data.find(b"\n") + 1:]


# --- the document's shape ---------------------------------------------------------------------------------
_NUMBER = (int, float)
_TEXT = (str,)
_NONE = (type(None),)
_RUN = {"run_dir": _TEXT, "state": _TEXT, "rollouts_done": (int,), "num_rollout": (int, *_NONE),
        "elapsed_s": (*_NUMBER, *_NONE), "eta_s": (*_NUMBER, *_NONE), "phase": (*_TEXT, *_NONE),
        "weight_version": (*_TEXT, int, *_NONE)}
_ENGINE = {"name": _TEXT, "state": _TEXT, "address": (*_TEXT, *_NONE), "in_flight": (int,),
           "weight_version": (*_TEXT, int, *_NONE), "tokens_per_s": (*_NUMBER, *_NONE),
           "dead_reason": (*_TEXT, *_NONE), "log_line": (*_TEXT, *_NONE)}
_RANK = {"rank": (int,), "node": (int, *_NONE), "state": _TEXT, "last_step_s": (*_NUMBER, *_NONE),
         "memory_bytes": (*_NUMBER, *_NONE)}
_EVENT = {"engine": _TEXT, "kind": _TEXT, "detail": (*_TEXT, *_NONE)}
_OPTIONAL = {"phase", "weight_version", "elapsed_s", "eta_s", "tokens_per_s", "dead_reason",
             "log_line", "last_step_s", "memory_bytes", "detail"}


def check_shape(document: JsonValue, source: str) -> JsonObject:
    """`document` when every field the terminal text reads has its type; NoStatus naming the first that does not."""
    if not isinstance(document, dict):
        raise NoStatus(f"{source} is not a rayless status document (a JSON {type(document).__name__}, not an object)")
    _fields(document.get("run"), _RUN, f"{source}: run", required=True)
    for key, shape in (("engines", _ENGINE), ("ranks", _RANK), ("events", _EVENT), ("metrics", None)):
        items = document.get(key)
        if items is None:
            continue
        if not isinstance(items, list):
            raise NoStatus(f"{source}: {key} is {type(items).__name__}, not a list: not a rayless status document")
        for index, item in enumerate(items):
            if shape is None:
                if not isinstance(item, dict):
                    raise NoStatus(f"{source}: {key}[{index}] is {type(item).__name__}, not an object")
            else:
                _fields(item, shape, f"{source}: {key}[{index}]", required=True)
    return document


def _fields(value: JsonValue, shape: dict[str, tuple[type, ...]], where: str, *, required: bool) -> None:
    if not isinstance(value, dict):
        raise NoStatus(f"{where} is {type(value).__name__}, not an object: not a rayless status document")
    for name, kinds in shape.items():
        if name not in value:
            if name in _OPTIONAL:
                continue
            raise NoStatus(f"{where} has no {name!r}: not a rayless status document")
        item = value[name]
        if isinstance(item, bool) or not isinstance(item, kinds):
            raise NoStatus(f"{where}.{name} is {type(item).__name__} ({str(item)[:40]!r}): not a rayless status "
                           "document")


# --- what reaches the terminal ----------------------------------------------------------------------------
def printable(value: JsonValue) -> JsonValue:
    """`value` with every string (keys too) stripped of control and format characters (ESC, CR, NUL, bidi
    overrides...; a line break becomes a space): a document cannot move the cursor or recolour the terminal."""
    if isinstance(value, str):
        return _clean(value)
    if isinstance(value, list):
        return [printable(item) for item in value]
    if isinstance(value, dict):
        return {_clean(str(key)): printable(item) for key, item in value.items()}
    return value


def _clean(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(" " if character in "\n\t" else character for character in text
                   if character in "\n\t" or unicodedata.category(character) not in ("Cc", "Cf", "Zl", "Zp"))
