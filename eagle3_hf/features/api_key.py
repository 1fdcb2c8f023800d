"""The API key of `serve-features` and `serve-vllm`, and the rule for where a server may listen without one.

One key, one environment variable: the servers take it from `--api-key` or EAGLE3_HF_API_KEY, the clients
(`train --features http://...`, `extract --engine vllm --endpoint`) send it as `Authorization: Bearer KEY` from
EAGLE3_HF_API_KEY. A server without a key listens on loopback only: anything else is refused before a model
loads. The key itself is never printed, logged or put in an error message; where a command shows it, it shows
the variable's name.
"""

from __future__ import annotations

import ipaddress
import os

from ..constants import API_KEY_ENV
from ..errors import Eagle3Error

__all__ = ["API_KEY_ENV", "ApiKeyError", "api_key", "auth_headers", "check_bind", "is_loopback", "refused_line"]
LOOPBACK_NAMES = ("localhost",)


class ApiKeyError(Eagle3Error):
    """A server that would listen beyond loopback without a key, or a key a server refused; one line."""


def api_key(flag: str | None = None) -> str | None:
    """The key: the flag if given, else $EAGLE3_HF_API_KEY; None when neither holds one."""
    key = (flag if flag is not None else os.environ.get(API_KEY_ENV, "")).strip()
    return key or None


def is_loopback(host: str) -> bool:
    """Whether `host` is an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to any interface


def check_bind(host: str, key: str | None, command: str) -> None:
    """Refuse (one line) to listen on anything but loopback without a key."""
    if key is None and not is_loopback(host):
        raise ApiKeyError(f"{command} --host {host} without an API key would serve anyone who reaches that "
                          f"address: set {API_KEY_ENV} (or pass --api-key), or keep --host 127.0.0.1 and use an "
                          "SSH tunnel")


def auth_headers(key: str | None) -> dict[str, str]:
    """The header a client sends: `Authorization: Bearer KEY`, or none without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def refused_line(url: str, key: str | None) -> str:
    """What a client says when a server answers 401: whether it sent a key, never the key."""
    if key is None:
        return (f"{url} requires an API key (401): set {API_KEY_ENV} to the key the server was started with")
    return f"{url} refused the API key in {API_KEY_ENV} (401): set it to the key the server was started with"
