"""Checks of string-valued flags that have a shape: addresses, hosts and hook paths.

Owns the syntax each of them must have, checked when the value is converted (before any process starts).
Each check returns the value unchanged (what the user wrote is what the run uses) or raises ValueError with
a reason that `convert` puts after the flag's name. Whether a hook path names an importable callable is
checked later, at start-up (`preflight.check_hooks`), since it imports user code.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import SplitResult, urlsplit

from workers.boundary.exposure import key_problem

_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"^{_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?$")
_HOOK_PATH = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)?$")


def host(text: str) -> str:
    """An IP address or a host name (no port, no scheme)."""
    candidate = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        ipaddress.ip_address(candidate)
        return text
    except ValueError:
        pass
    if len(text) > 253 or not _HOSTNAME.match(text):
        raise ValueError("is not a host name or IP address")
    return text


def api_key(text: str) -> str:
    """A key sent as `Authorization: Bearer KEY`: printable ASCII without spaces, as an HTTP header carries it
    (any other character would fail in the client's encoder at the first request, not at start-up)."""
    problem = key_problem(text)
    if problem:
        raise ValueError(problem)
    return text


def host_port(text: str) -> str:
    """HOST:PORT (an IPv6 host in brackets), port 1-65535."""
    _split_url(f"//{text}", text)
    return text


def engine_address(text: str) -> str:
    """HOST:PORT or http(s)://HOST:PORT[/] of a running engine."""
    _split_url(text if "://" in text else f"//{text}", text)
    return text


def _url_parts(url: str, original: str, reason: str) -> tuple[SplitResult, int | None]:
    """The URL's parts and port; ValueError(reason) for whitespace or what urlsplit cannot read."""
    if any(character.isspace() for character in original):
        raise ValueError(reason)
    try:
        parts = urlsplit(url)
        return parts, parts.port
    except ValueError:
        raise ValueError(reason) from None


def _split_url(url: str, original: str) -> None:
    reason = "is not an address: expected HOST:PORT or http://HOST:PORT"
    parts, port = _url_parts(url, original, reason)
    if parts.scheme not in ("", "http", "https") or parts.query or parts.fragment or parts.username:
        raise ValueError(reason)
    if parts.path not in ("", "/") or not parts.hostname or port is None or port == 0:
        raise ValueError(reason)
    host(parts.hostname)


def http_url(text: str) -> str:
    """http(s)://HOST[:PORT][/PATH] of a service (a reward model)."""
    reason = "is not a URL: expected http://HOST[:PORT][/PATH]"
    parts, port = _url_parts(text, text, reason)
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0 or parts.username:
        raise ValueError(reason)
    host(parts.hostname)
    return text


def hook_path(text: str) -> str:
    """`package.module:Name` or `package.module.Name` (resolved at start-up, before any process starts)."""
    stripped = text.strip()
    if not _HOOK_PATH.match(stripped) or ("." not in stripped and ":" not in stripped):
        raise ValueError("is not a hook path: expected 'package.module:Name' or 'package.module.Name'")
    return text


def rollout_id_template(text: str) -> str:
    """A dump path template, which must contain `{rollout_id}`."""
    if "{rollout_id}" not in text:
        raise ValueError("must contain '{rollout_id}', e.g. 'dumps/{rollout_id}.rld'")
    return text


def _json(text: str) -> object:
    """A flag's JSON value, through the boundary layer (no RecursionError on a value nested 50k deep)."""
    from workers.boundary.errors import BoundaryError
    from workers.boundary.json_input import decode_json

    try:
        return decode_json(text, "value")
    except BoundaryError as error:
        raise ValueError(f"is not JSON: {error.reason}") from None


def _env_object(text: str) -> dict[str, object]:
    data = _json(text)
    if not isinstance(data, dict):
        raise ValueError("must be a JSON object of environment variable names to values")
    for name, value in data.items():
        if not name or "=" in name or "\0" in name:
            raise ValueError(f"names an invalid environment variable {name!r}")
        if not isinstance(value, str | int | float | bool) or "\0" in str(value):
            raise ValueError(f"gives {name} a {type(value).__name__}; values are strings, numbers or booleans")
    return data


def env_json(text: str) -> str:
    """slime's `--train-env-vars`: a JSON object of variable names to strings/numbers/booleans."""
    _env_object(text)
    return text


def env_pairs(text: str | None) -> tuple[tuple[str, str], ...]:
    """The (name, value) pairs of an `env_json` string (booleans as slime's Ray env: `true`/`false`)."""
    if text is None:
        return ()
    return tuple((name, str(value).lower() if isinstance(value, bool) else str(value))
                 for name, value in _env_object(text).items())


def json_object(text: str) -> str:
    """A JSON object (slime's `--apply-chat-template-kwargs`)."""
    data = _json(text)
    if not isinstance(data, dict):
        raise ValueError("must be a JSON object of keyword arguments")
    return text
