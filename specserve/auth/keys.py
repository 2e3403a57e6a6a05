"""API keys: a YAML file of SHA-256 digests mapped to tenants, reloaded while the service runs.

The file (a Kubernetes Secret mounted as a file)::

    tenants:            # optional per-tenant settings
      acme: {max_concurrent_streams: 8, share_ngram_pool: false}
    keys:               # only SHA-256 hex digests of the keys are stored
      - {name: acme-ci, tenant: acme, sha256: "<hex>"}

Keys are 32 random bytes (``new_key``), so a plain SHA-256 digest is enough to store them: there is nothing
to brute-force that a slow, salted password hash would protect (that is for low-entropy passwords).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from specserve.tenancy import Tenant

log = logging.getLogger(__name__)

KEY_PREFIX = "ssk_"
"""Marks a string as a specserve API key (easy to spot in logs and secret scanners)."""

_HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
"""Tenant names: they become Redis key prefixes and metadata values, so no separators or glob characters."""


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file, the entry and what is wrong."""


def new_key() -> str:
    """A fresh API key: 32 random bytes."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def digest(key: str) -> str:
    """What the key file stores for ``key``: its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """The holder of an API key: the key's name and the tenant it acts for."""

    key_name: str
    tenant: Tenant


@dataclass(frozen=True)
class KeyTable:
    """The parsed key file: digest -> principal."""

    principals: dict[str, Principal]

    def lookup(self, key: str) -> Principal | None:
        """The key's principal, or None. Compares digests in constant time, over every entry."""
        wanted = digest(key)
        found = None
        for stored, principal in self.principals.items():
            if hmac.compare_digest(stored, wanted):
                found = principal
        return found


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise KeyFileError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def _tenant(name: str, settings: Any, where: str) -> Tenant:
    if not TENANT_NAME.match(name):
        raise KeyFileError(f"{where}: tenant name {name!r} must be letters, digits, '.', '_' or '-' (at most 63)")
    options = _mapping(settings, where)
    unknown = set(options) - {"max_concurrent_streams", "share_ngram_pool"}
    if unknown:
        raise KeyFileError(
            f"{where}: unknown settings {sorted(unknown)}; known: max_concurrent_streams, share_ngram_pool"
        )
    streams = options.get("max_concurrent_streams", 0)
    if not isinstance(streams, int) or isinstance(streams, bool) or streams < 0:
        raise KeyFileError(f"{where}: max_concurrent_streams must be an integer >= 0, got {streams!r}")
    share = options.get("share_ngram_pool", False)
    if not isinstance(share, bool):
        raise KeyFileError(f"{where}: share_ngram_pool must be true or false, got {share!r}")
    return Tenant(name, max_concurrent_streams=streams, share_ngram_pool=share)


def parse_key_file(text: str, source: str = "the key file") -> KeyTable:
    """Parse the key file's YAML; KeyFileError says what is wrong and where."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KeyFileError(f"{source} is not valid YAML: {exc}") from exc
    document = _mapping(document, source)
    unknown = set(document) - {"tenants", "keys"}
    if unknown:
        raise KeyFileError(f"{source}: unknown sections {sorted(unknown)}; expected 'tenants' and 'keys'")
    tenants = {
        str(name): _tenant(str(name), settings, f"{source}: tenants.{name}")
        for name, settings in _mapping(document.get("tenants"), f"{source}: tenants").items()
    }
    entries = document.get("keys") or []
    if not isinstance(entries, list):
        raise KeyFileError(f"{source}: 'keys' must be a list of {{name, tenant, sha256}} entries")
    principals: dict[str, Principal] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: keys[{i}]"
        entry = _mapping(entry, where)
        missing = [f for f in ("name", "tenant", "sha256") if not entry.get(f)]
        if missing:
            raise KeyFileError(f"{where} lacks {', '.join(missing)} (each key needs name, tenant and sha256)")
        sha = str(entry["sha256"]).lower()
        if not _HEX_DIGEST.match(sha):
            raise KeyFileError(
                f"{where} ({entry['name']}): sha256 must be 64 hex digits (the key's SHA-256, "
                "from `python -m specserve.auth new-key`), never the key itself"
            )
        if sha in principals:
            raise KeyFileError(f"{where} ({entry['name']}): the same digest as {principals[sha].key_name!r}")
        name = str(entry["tenant"])
        tenant = tenants.get(name) or _tenant(name, None, where)
        principals[sha] = Principal(str(entry["name"]), tenant)
    return KeyTable(principals)


class ApiKeys:
    """The key file at ``path``, re-read when its content changes (checked at most every ``reload_s``).

    The path is stat'ed and read on each check, never an inode kept open: a Kubernetes Secret update swaps a
    symlink. At start an unusable file is an error. Later:

    - a file that exists but cannot be read or parsed keeps the last good keys (and logs why): an editor's or a
      script's partial write is a moment in an edit, and must not lock every caller out;
    - a file that is gone (or a dangling symlink: the Secret was deleted) revokes every key, with an ERROR log
      line, until it is back: removing the file is how an operator says "no key is valid now", and keeping the
      last keys would leave a leaked key working with nothing on disk to show it. ``revoked`` then says so, for
      the refusal's message.
    """

    def __init__(self, path: Path, reload_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._path = path
        self._reload_s = reload_s
        self._clock = clock
        self._lock = threading.Lock()
        try:
            self._text = path.read_text()
        except OSError as exc:
            raise KeyFileError(f"cannot read the API key file {path}: {exc}") from exc
        self._table = parse_key_file(self._text, str(path))
        self._revoked = False
        self._checked = self._read_at = clock()
        self._stamp = self._stat()
        log.info("API keys: %d keys from %s", len(self._table.principals), path)

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = self._path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def lookup(self, key: str) -> Principal | None:
        self._maybe_reload()
        return self._table.lookup(key)

    @property
    def revoked(self) -> bool:
        """True while the key file is gone: every key is refused until it is back."""
        return self._revoked

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked < self._reload_s or not self._lock.acquire(blocking=False):
            return
        try:
            self._checked = now
            stamp = self._stat()
            # Content decides; the stamp only spares reading it. Same-second rewrites of the same size are
            # caught by reading anyway every time the stamp is unchanged for a whole minute.
            if stamp == self._stamp and stamp is not None and now - self._read_at < 60:
                return
            self.reload()
        finally:
            self._lock.release()

    def reload(self) -> bool:
        """Re-read the file now; False (last good keys kept, error logged) when it cannot be used."""
        self._read_at = self._clock()
        self._stamp = self._stat()
        try:
            text = self._path.read_text()
        except (FileNotFoundError, NotADirectoryError):
            self._revoke()
            return False
        except OSError as exc:
            log.error("API key file %s unreadable (%s): keeping the last good keys", self._path, exc)
            return False
        if text == self._text and not self._revoked:
            return True
        try:
            table = parse_key_file(text, str(self._path))
        except KeyFileError as exc:
            log.error("%s: %s", exc, "every key stays revoked" if self._revoked else "keeping the last good keys")
            return False
        if self._revoked:
            log.warning("API key file %s is back: %d keys in force again", self._path, len(table.principals))
        else:
            log.info("API keys reloaded: %d keys from %s", len(table.principals), self._path)
        self._text, self._table, self._revoked = text, table, False
        return True

    def _revoke(self) -> None:
        """The file is gone: refuse every key from now on (logged once per removal)."""
        if not self._revoked:
            log.error(
                "API key file %s is gone: EVERY API KEY IS REVOKED and every call is refused (UNAUTHENTICATED / "
                "401) until the file is restored",
                self._path,
            )
        self._table, self._revoked = KeyTable({}), True


def key_entry(key: str, tenant: str, name: str) -> str:
    """The YAML line of the key file for ``key``."""
    entry = [{"name": name, "tenant": tenant, "sha256": digest(key)}]
    return yaml.safe_dump(entry, default_flow_style=None, sort_keys=False, width=1000).strip()
