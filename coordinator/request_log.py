"""One JSON line per request on stderr (logger ``specserve.requests``), keyed by the id the client also gets.

A line carries who asked (tenant, API), how it ended (status, finish reason, error message), its sizes and its
times, so a client's report ("request 3f2a... was slow") leads straight to what happened. Prompt and output
text are never logged.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from typing import TextIO

from coordinator.rounds import GenerationStats

log = logging.getLogger("specserve.requests")


def configure(stream: TextIO | None = None) -> None:
    """Write request lines as bare JSON (no logging prefix), apart from the service's own log format."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


@dataclass
class RequestRecord:
    request_id: str
    api: str
    tenant: str
    status: str = "OK"  # a gRPC status name: OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, CANCELLED, ...
    error: str = ""  # what the client was told
    error_detail: str = ""  # what operators need: addresses, a peer's own words (never sent to the client)
    drafter_error: str = ""  # why drafting stopped, in full (the client's stats hold the short cause)
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of those, copied from a kept cache (the verifier's --kept-prefixes)
    completion_tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    speculation: str = ""
    constraint: str = ""  # structured output: the constraint's kind ("" without one)
    constraint_complete: bool | None = None  # with a constraint: the output completed it (false: cut, not valid)
    queue_s: float = 0.0
    first_token_s: float | None = None  # time to first streamed text, from the request's arrival
    total_s: float = 0.0  # from arrival to the end, queue and tokenization included

    def finished(self, stats: GenerationStats, total_s: float) -> None:
        self.finish_reason = stats.finish_reason.value
        self.drafter_error = stats.drafter_error_logged
        self.prompt_tokens = stats.num_prompt_tokens
        self.cached_prompt_tokens = stats.num_cached_prompt_tokens
        self.completion_tokens = stats.num_generated_tokens
        self.rounds = stats.num_rounds
        self.draft_tokens = stats.num_draft_tokens
        self.accepted_tokens = stats.num_accepted_tokens
        self.speculation = stats.speculation.value
        self.constraint = stats.constraint_kind
        self.constraint_complete = stats.constraint_complete if stats.constrained else None
        self.queue_s = stats.queue_ns / 1e9
        self.total_s = total_s

    def log(self) -> None:
        line = {"ts": round(time.time(), 3), "event": "request", **asdict(self)}
        for key in ("queue_s", "first_token_s", "total_s"):
            if line[key] is not None:
                line[key] = round(line[key], 4)
        log.info("%s", json.dumps(line, separators=(",", ":")))
