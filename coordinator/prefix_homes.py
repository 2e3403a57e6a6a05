"""Where each prompt prefix was last prefilled, so that a conversation's next turn goes back there.

A verifier keeps a released session's cache for a new session of the same caller whose prompt starts with the
same tokens (``target_service.kept_prefixes``). With several verifier replicas that saves a prefill only where the
next turn reaches the replica that holds the cache. So the router remembers, for the leading blocks of every prompt
it sends, the replica that prefilled it, and a new session goes to the replica of its longest known prefix unless
that replica already carries ``slack`` sessions more than the least loaded one (balance wins over reuse there).

Prefixes are keyed by a running hash over whole blocks of ``BLOCK_TOKENS`` (shorter prompts have none): a turn
shares with the last its whole previous prompt, many blocks, while unrelated conversations share at most their
system prompt's. The table is bounded (least recently used keys go first); it is the coordinator's alone and
forgets everything at a restart, which costs prefills, never tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

BLOCK_TOKENS = 64
MAX_KEYS = 16384  # a million prompt tokens' worth of leading blocks, in about 2 MB


def block_keys(tokens: Sequence[int]) -> list[int]:
    """A key per whole leading block: the running hash of tokens[:64], tokens[:128], ... (computed once a
    prefill: the router looks them up to pin the session and records them once it is prefilled)."""
    keys = []
    key = 0
    for end in range(BLOCK_TOKENS, len(tokens) + 1, BLOCK_TOKENS):
        key = hash((key, tuple(tokens[end - BLOCK_TOKENS : end])))
        keys.append(key)
    return keys


class PrefixHomes:
    """Prompt prefix (its block keys) -> the replica address that last prefilled it."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self._homes: OrderedDict[int, str] = OrderedDict()
        self._max_keys = max_keys

    def __len__(self) -> int:
        return len(self._homes)

    def record(self, keys: Sequence[int], address: str) -> None:
        """``address`` prefilled a prompt of these ``block_keys``: it is now the home of each leading block."""
        for key in keys:
            self._homes[key] = address
            self._homes.move_to_end(key)
        while len(self._homes) > self._max_keys:
            self._homes.popitem(last=False)

    def home(self, keys: Sequence[int], among: Collection[str]) -> str | None:
        """The replica (one of ``among``) that prefilled the longest leading blocks of a prompt of these
        ``block_keys``; None: none."""
        found = None
        for key in keys:
            address = self._homes.get(key)
            if address is not None and address in among:
                found = address
        return found

    def forget(self, address: str) -> None:
        """A replica left: its prefixes have no home."""
        for key in [k for k, a in self._homes.items() if a == address]:
            del self._homes[key]
