"""Start-up results that depend only on what they are computed from, kept on disk between starts.

A service computes some things at every start that come out the same each time: which row counts a packed
product computes each row alike at (``packed_linear.kept_invariant_rows``, a probe of seconds) and a GGUF
model's llama.cpp blocks found again in its fp32 weights (``block_weights.kept_blocks``). Each is kept as a
record named by a hash of its key, which names everything the result depends on (for blocks, the hash of the
weight's own bytes), so a record that is found is the result the computation would give. The key is kept in
the record and compared in full on reading; tensors are kept with a checksum of their bytes, checked too.

Records of a kind live in a folder of their own under the cache root (``model_loading.default_cache_root``:
``SPECSERVE_CACHE_DIR``, else ``~/.cache/specserve``), beside the converted models and the block kernel's
builds. ``SPECSERVE_STARTUP_CACHE=off`` neither reads nor keeps them. The cache never stops a start: a missing
record is computed and kept, one that does not read or does not check out is computed again and replaced, and
where the folder cannot be written the result is used and not kept; each of these is logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specserve.model_loading import default_cache_root

log = logging.getLogger(__name__)

STARTUP_CACHE_ENV = "SPECSERVE_STARTUP_CACHE"  # "off": compute every start-up result, keep none


def key_digest(key: dict[str, Any]) -> str:
    """A file name for ``key`` (JSON values): the hash of its canonical JSON."""
    return hashlib.sha256(_canonical(key).encode()).hexdigest()[:24]


def tensor_digest(tensor: torch.Tensor) -> str:
    """The sha256 of a CPU tensor's bytes."""
    digest = hashlib.sha256()
    _hash_bytes(digest, tensor)
    return digest.hexdigest()


def _hash_bytes(digest: Any, tensor: torch.Tensor) -> None:
    digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _canonical(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True)


class _Store:
    """A folder of records; a write that fails is logged once, and the store then stops writing."""

    suffix = ""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.written = 0  # records this store wrote
        self._unwritable = False

    def path(self, key: dict[str, Any]) -> Path:
        return self.folder / f"{key_digest(key)}{self.suffix}"

    def _write(self, key: dict[str, Any], write: Callable[[Path], object]) -> None:
        """``write`` the record for ``key`` aside, then rename it into place: a reader sees a whole file or none."""
        if self._unwritable:
            return
        path = self.path(key)
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}-{threading.get_ident()}")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write(partial)
            partial.replace(path)
            self.written += 1
        except (OSError, TypeError, ValueError) as exc:
            self._unwritable = True
            log.warning("could not keep start-up results in %s (%s): computed again at the next start", path, exc)
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)


class ResultStore(_Store):
    """JSON results, one file a key."""

    suffix = ".json"

    def get(self, key: dict[str, Any]) -> Any | None:
        """The result kept for ``key``; None where there is none, or the file does not read as a record of it."""
        path = self.path(key)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("start-up cache record %s does not read (%s): computed again", path, exc)
            return None
        if not isinstance(record, dict) or record.get("key") != json.loads(_canonical(key)) or "result" not in record:
            log.warning("start-up cache record %s is not the one for its key: computed again", path)
            return None
        return record["result"]

    def put(self, key: dict[str, Any], result: Any) -> None:
        """Keep ``result`` (JSON values) for ``key``, replacing any record; logged, not raised, where it cannot."""
        text = json.dumps({"key": key, "result": result}, sort_keys=True)
        self._write(key, lambda path: path.write_text(text))


class TensorStore(_Store):
    """Named CPU tensors (a safetensors file) with string fields, one file a key."""

    suffix = ".safetensors"

    def get(self, key: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        """The tensors and fields kept for ``key``; None where there are none, or the file does not read as a
        record of it, or its tensors' bytes are not those it was written with."""
        from safetensors import safe_open

        path = self.path(key)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as record:
                fields = dict(record.metadata() or {})
                tensors = {name: record.get_tensor(name) for name in record.keys()}  # noqa: SIM118 (no __iter__)
        except Exception as exc:  # safetensors raises its own errors for a file it cannot parse
            log.warning("start-up cache record %s does not read (%s): computed again", path, exc)
            return None
        if fields.pop("key", None) != _canonical(key) or fields.pop("checksum", None) != _checksum(tensors):
            log.warning("start-up cache record %s is not the one for its key, or is damaged: computed again", path)
            return None
        return tensors, fields

    def put(self, key: dict[str, Any], tensors: dict[str, torch.Tensor], fields: dict[str, str]) -> None:
        """Keep ``tensors`` and ``fields`` for ``key``, replacing any record; logged, not raised, where it cannot."""
        from safetensors.torch import save_file

        metadata = {**fields, "key": _canonical(key), "checksum": _checksum(tensors)}
        self._write(key, lambda path: save_file({n: t.contiguous() for n, t in tensors.items()}, path, metadata))


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    """The tensors' names, dtypes, shapes and bytes, hashed."""
    named = sorted(tensors.items())
    digest = hashlib.sha256(json.dumps([[name, str(t.dtype), list(t.shape)] for name, t in named]).encode())
    for _, tensor in named:
        _hash_bytes(digest, tensor)
    return digest.hexdigest()


def _enabled() -> bool:
    return os.environ.get(STARTUP_CACHE_ENV, "") != "off"


def result_store(kind: str) -> ResultStore | None:
    """The JSON records of ``kind`` under the cache root; None where ``SPECSERVE_STARTUP_CACHE=off``."""
    return ResultStore(default_cache_root() / kind) if _enabled() else None


def tensor_store(kind: str) -> TensorStore | None:
    """The tensor records of ``kind`` under the cache root; None where ``SPECSERVE_STARTUP_CACHE=off``."""
    return TensorStore(default_cache_root() / kind) if _enabled() else None
