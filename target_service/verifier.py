"""The verifier: target model, per-session KV caches, and draft verification.

A session's KV cache holds every committed token except the last one, which
is "pending": each Verify forwards the pending token followed by the draft
nodes, so the target scores the draft and produces its bonus token in one
forward pass. The cache is then cut back to the committed tokens (the pending
token plus the accepted drafts); the new bonus token becomes the pending one.
A tree of size zero is plain decoding.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from specserve.acceptance import Acceptance, PrefillResult, VerifyResult, accept_greedy, accept_sampled
from specserve.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specserve.keyed_noise import PositionNoise, fresh_seed
from specserve.sampling import SamplingParams, target_probs
from specserve.token_tree import InvalidTreeError, TokenTree
from target_service.config import VerifierConfig
from target_service.session_store import SessionStore
from target_service.tree_attention import keep_path, tree_inputs


@dataclass
class _Session:
    committed: list[int]  # all committed tokens; the cache holds all but the last
    cache: DynamicCache
    sampling: SamplingParams
    seed: int  # keys the sampling draws by position (keyed_noise)


def _float16(hidden: torch.Tensor | None) -> np.ndarray | None:
    return None if hidden is None else hidden.detach().to("cpu", torch.float16).numpy()


@dataclass(frozen=True)
class VerifierLimits:
    max_tree_nodes: int
    max_tree_depth: int
    max_sessions: int
    max_session_tokens: int


class Verifier:
    """Holds the target model and its sessions; thread-safe."""

    supports_branching = True

    def __init__(
        self,
        model: Any,
        vocab_fingerprint: str,
        *,
        model_name: str = "",
        max_sessions: int = 64,
        session_ttl_s: float = 600.0,
        max_tree_nodes: int = 64,
        max_tree_depth: int = 32,
        max_session_tokens: int = 0,
    ) -> None:
        self._model = model
        self.model_name = model_name
        self.vocab_fingerprint = vocab_fingerprint
        self.vocab_size = int(model.config.vocab_size)
        self.hidden_size = int(model.config.hidden_size)
        context = int(getattr(model.config, "max_position_embeddings", 2048))
        self.limits = VerifierLimits(
            max_tree_nodes=max_tree_nodes,
            max_tree_depth=max_tree_depth,
            max_sessions=max_sessions,
            max_session_tokens=min(max_session_tokens, context) if max_session_tokens > 0 else context,
        )
        self._sessions: SessionStore[_Session] = SessionStore(max_sessions, session_ttl_s)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, model: Any, vocab_fingerprint: str, config: VerifierConfig) -> Verifier:
        """A verifier over an already loaded ``model`` with the limits ``config`` sets."""
        return cls(
            model,
            vocab_fingerprint,
            model_name=config.model,
            max_sessions=config.max_sessions,
            session_ttl_s=config.session_ttl_s,
            max_tree_nodes=config.max_tree_nodes,
            max_tree_depth=config.max_tree_depth,
            max_session_tokens=config.max_session_tokens,
        )

    @property
    def device(self) -> torch.device:
        return next(self._model.parameters()).device

    @property
    def num_active_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def prefill(
        self, session_id: str, token_ids: list[int], sampling: SamplingParams, return_features: bool = False
    ) -> PrefillResult:
        """Create (or replace) a session holding ``token_ids``.

        With ``return_features``, the result holds the target's last hidden
        state at every position but the last (whose token is pending).
        """
        start = time.perf_counter_ns()
        if not session_id:
            raise InvalidArgument("session_id must not be empty")
        if not token_ids:
            raise InvalidArgument("prefill needs at least one token")
        self._check_tokens(token_ids, "prefill token")
        if len(token_ids) >= self.limits.max_session_tokens:
            raise InvalidArgument(
                f"{len(token_ids)} tokens do not fit the context: at most "
                f"{self.limits.max_session_tokens - 1} leave room for one new token"
            )
        try:
            sampling.validate()
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        seed = sampling.seed if sampling.seed is not None else fresh_seed()
        session = _Session(list(token_ids), DynamicCache(), sampling, seed)
        with self._lock:
            self._sessions.pop(session_id)
            features = None
            if len(token_ids) > 1:
                _, hidden = self._forward(session, token_ids[:-1], logits_to_keep=1, return_features=return_features)
                features = _float16(hidden)
            elif return_features:
                features = np.zeros((0, self.hidden_size), dtype=np.float16)
            self._sessions.put(session_id, session)
        return PrefillResult(time.perf_counter_ns() - start, features)

    def verify(
        self, session_id: str, num_committed: int, tree: TokenTree, top_k: int = 0, return_features: bool = False
    ) -> VerifyResult:
        """Verify ``tree`` on top of the session.

        ``top_k`` > 0 also returns the target's top next tokens at every scored
        position; ``return_features`` its hidden states at the committed ones.
        """
        start = time.perf_counter_ns()
        try:
            tree.validate(self.vocab_size, self.limits.max_tree_nodes, self.limits.max_tree_depth)
        except InvalidTreeError as exc:
            raise InvalidArgument(str(exc)) from exc
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise NotFound(f"unknown session {session_id!r} (never prefilled, released or evicted): prefill it")
            if num_committed != len(session.committed):
                raise FailedPrecondition(
                    f"session {session_id!r} holds {len(session.committed)} committed tokens, "
                    f"the request says {num_committed}: prefill it again"
                )
            depth = max(tree.depths(), default=0)
            if len(session.committed) + depth + 1 > self.limits.max_session_tokens:
                raise ResourceExhausted(
                    f"session {session_id!r} would exceed the context limit of {self.limits.max_session_tokens} tokens"
                )
            num_cached = len(session.committed) - 1
            logits, hidden = self._forward_tree(session, tree, return_features)
            acceptance = self._accept(tree, logits, session)
            # Keep the pending token and the accepted path; rejected branches leave no trace.
            keep_path(session.cache, num_cached, acceptance.path)
            accepted = [tree.token_ids[node] for node in acceptance.path]
            session.committed.extend([*accepted, acceptance.bonus_token])
            top_tokens = logits.topk(min(top_k, self.vocab_size), dim=-1).indices.tolist() if top_k > 0 else []
            rows = [0, *(node + 1 for node in acceptance.path)]
            features = _float16(hidden[rows]) if hidden is not None else None
        return VerifyResult(
            accepted_tokens=accepted,
            accepted_nodes=acceptance.path,
            bonus_token=acceptance.bonus_token,
            verify_ns=time.perf_counter_ns() - start,
            top_tokens=top_tokens,
            features=features,
        )

    def release(self, session_id: str) -> bool:
        with self._lock:
            return self._sessions.pop(session_id) is not None

    def _check_tokens(self, token_ids: list[int], what: str) -> None:
        for token in token_ids:
            if not 0 <= token < self.vocab_size:
                raise InvalidArgument(f"{what} id {token} is outside the vocabulary [0, {self.vocab_size})")

    @torch.inference_mode()
    def _forward(
        self, session: _Session, token_ids: list[int], logits_to_keep: int = 0, return_features: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``token_ids`` to the session's cache; returns their logits [n, vocab] and last hidden states.

        ``logits_to_keep`` > 0 computes only the last rows (prefill needs none).
        """
        num_cached = session.cache.get_seq_length()
        input_ids = torch.tensor([token_ids], device=self.device)
        positions = torch.arange(num_cached, num_cached + len(token_ids), device=self.device)[None]
        out = self._model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=session.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=return_features,
        )
        return out.logits[0].float(), out.hidden_states[-1][0] if return_features else None

    @torch.inference_mode()
    def _forward_tree(
        self, session: _Session, tree: TokenTree, return_features: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Score the pending token and every tree node in one forward: logits [n + 1, vocab], hidden states."""
        dtype = next(self._model.parameters()).dtype
        input_ids, positions, mask = tree_inputs(
            tree, session.committed[-1], session.cache.get_seq_length(), dtype, self.device
        )
        out = self._model(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            past_key_values=session.cache,
            use_cache=True,
            output_hidden_states=return_features,
        )
        return out.logits[0].float(), out.hidden_states[-1][0] if return_features else None

    @staticmethod
    def _accept(tree: TokenTree, logits: torch.Tensor, session: _Session) -> Acceptance:
        if session.sampling.greedy:
            return accept_greedy(tree, logits.argmax(dim=-1).tolist())
        p = target_probs(logits, session.sampling).cpu()
        return accept_sampled(tree, p, PositionNoise(session.seed, first_position=len(session.committed)))
