"""Who may reach a server, decided before it listens: an API key's shape, and whether an address leaves the machine.

Owns `key_problem` (a key must be printable ASCII: it travels in an HTTP header), `beyond_loopback` and
`exposure_problem`, the rule every rayless server keeps (the engine, the status server, the session server, the
hook endpoint): beyond loopback only with a key, or with an explicit `--allow-unauthenticated`. Standard
library only, so the coordinator's flag checks use it without importing the HTTP stack.
Invariant: no message here shows a key.
"""

from __future__ import annotations

import ipaddress


def beyond_loopback(host: str) -> bool:
    """Whether a server listening on `host` can be reached from another machine: anything but a loopback
    address (127.0.0.0/8, ::1) or `localhost`. A wildcard (0.0.0.0, ::) and a host name count as beyond."""
    name = host.strip("[]")
    if name == "localhost":
        return False
    try:
        return not ipaddress.ip_address(name).is_loopback
    except ValueError:
        return True


def key_problem(key: str) -> str | None:
    """Why `key` cannot be an API key sent as `Authorization: Bearer KEY`, or None: it must be non-empty printable
    ASCII without spaces (the message never shows the key)."""
    if not key:
        return "is empty"
    bad = next((position for position, char in enumerate(key) if not 0x21 <= ord(char) <= 0x7E), None)
    if bad is not None:
        return (f"has a character that is not printable ASCII (position {bad + 1}): an API key travels in an HTTP "
                "header, so it must be printable ASCII without spaces")
    return None


def exposure_problem(host: str, *, has_key: bool, allowed: bool, host_flag: str, key_flag: str,
                     allow_flag: str = "--allow-unauthenticated") -> str | None:
    """Why a server may not listen on `host`, or None: beyond loopback it needs a key, or an explicit
    `allow_flag` (the message names the three flags)."""
    if has_key or allowed or not beyond_loopback(host):
        return None
    return (f"{host_flag} {host} listens beyond this machine's loopback without a key: give {key_flag} KEY (the "
            f"server then asks every client for it), or {allow_flag} to serve without one")
