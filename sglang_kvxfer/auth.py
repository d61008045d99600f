"""Where the shared authentication key comes from.

Owns ``resolve_key``: ``KVXFER_AUTH=off`` (no key, logged at WARNING), ``KVXFER_AUTH_KEY``,
``KVXFER_AUTH_KEY_FILE``, or the per-user key file ``~/.config/kvxfer/auth_key``, created
with mode 0600 on first use (the way X11 and Jupyter cookies work: every process of one
user on one host shares it with no configuration, other users cannot read it). A process
that binds a non-loopback address with no explicit key refuses to start. The key bytes
are ``SHA-256`` of the secret text, so any secret of 16 or more characters works.

Must not: open sockets or start threads. Frame sealing lives in ``protocol/envelope.py``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import secrets
import socket
import stat
from pathlib import Path

from sglang_kvxfer import envs
from sglang_kvxfer.errors import AuthenticationError

__all__ = ["resolve_key", "default_key_file", "is_loopback", "key_from_secret", "OFF"]

log = logging.getLogger("sglang_kvxfer.auth")

OFF = b""  # the key value meaning "authentication disabled"
MIN_SECRET_CHARS = 16
_warned_off = False


def key_from_secret(secret: str | bytes) -> bytes:
    """The 32-byte HMAC key of a secret text (or raw bytes)."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw.strip()) < MIN_SECRET_CHARS:
        raise AuthenticationError(
            f"the authentication secret has {len(raw.strip())} characters; "
            f"use at least {MIN_SECRET_CHARS} (e.g. `openssl rand -hex 32`)"
        )
    return hashlib.sha256(b"sglang_kvxfer key v1\x00" + raw.strip()).digest()


def default_key_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kvxfer" / "auth_key"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) resolves to a loopback address only."""
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _read_key_file(path: Path, created_here: bool = False) -> bytes:
    try:
        st = path.stat()
    except OSError as exc:
        raise AuthenticationError(f"cannot read key file {path}: {exc.strerror}") from None
    if st.st_uid != os.geteuid():
        raise AuthenticationError(
            f"key file {path} is owned by uid {st.st_uid}, not this user ({os.geteuid()}); use your own key file"
        )
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthenticationError(
            f"key file {path} has mode {stat.S_IMODE(st.st_mode):o}; other users could read it: chmod 600 {path}"
        )
    text = path.read_bytes().strip()
    return key_from_secret(text)


def _per_user_key() -> bytes:
    path = default_key_file()
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process of this user created it first: read theirs
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            log.info("created the per-user kvxfer key file %s (mode 0600)", path)
    return _read_key_file(path)


def resolve_key(bind_host: str | None = None) -> bytes:
    """The key this process uses: 32 bytes, or ``OFF`` (``b""``) with ``KVXFER_AUTH=off``.

    ``bind_host``: the address this process listens on; a non-loopback one needs an
    explicit key (``KVXFER_AUTH_KEY`` or ``KVXFER_AUTH_KEY_FILE``), since the per-user
    key file is not shared across hosts.

    Raises ``AuthenticationError`` with a one-line fix when no usable key is found.
    """
    global _warned_off
    if envs.KVXFER_AUTH.get() == "off":
        if not _warned_off:
            _warned_off = True
            log.warning(
                "KVXFER_AUTH=off: control frames are not authenticated; any process that "
                "can reach this engine's ports can read, redirect or fake KV transfers"
            )
        return OFF
    if envs.KVXFER_AUTH_KEY.is_set():
        return key_from_secret(envs.KVXFER_AUTH_KEY.get())
    if envs.KVXFER_AUTH_KEY_FILE.is_set():
        return _read_key_file(Path(envs.KVXFER_AUTH_KEY_FILE.get()).expanduser())
    if bind_host is not None and not is_loopback(bind_host):
        raise AuthenticationError(
            f"binding {bind_host} (not loopback) needs an explicit key: set KVXFER_AUTH_KEY (the same "
            f"secret on every prefill and decode process) or KVXFER_AUTH_KEY_FILE; KVXFER_AUTH=off "
            f"disables authentication"
        )
    return _per_user_key()
