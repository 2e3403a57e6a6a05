"""The budget policy: how many draft nodes per session pay at the current load.

The verifier measures its own cost curve at start-up: the time of one forward
scoring T tokens, and the extra time per session sharing it. A step serving
L sessions with k draft nodes each costs about c(L * (1 + k)) + L * s and
commits L * (1 + g(k)) tokens, where g(k) is the expected number of accepted
draft tokens. The budget is the k that maximises committed tokens per second:
on hardware where extra rows are nearly free (a GPU, bf16 on AMX) it is
large, and it shrinks as L grows until, at saturation, k = 0 and speculation
switches off rather than lowering aggregate throughput (the adaptive
verification idea of vLLM's and SGLang's schedulers).

g(k) follows a chain with a per-token acceptance rate alpha learnt from recent
Verify calls (accepted tokens over tokens tried, exponentially weighted):
alpha (1 - alpha^k) / (1 - alpha).
Trees accept at least as much as a chain of the same depth, so the estimate
errs towards smaller trees.

A drafted round also waits for its tree: the coordinator sends how long its
drafter took (``draft_micros``), and each session's budget counts that time,
smoothed over its recent drafted rounds, as a cost of every k > 0. A session
is served in rounds, each one draft and one verify, so for one stream the
round costs their sum (and on two shared cores drafting also takes the
verifier's CPU); with L sessions the engine steps for the others while one
drafts, so a draft counts 1/L of its time (counting it whole would switch
drafting off under load where it still pays the aggregate). Where drafting
costs more than the tree saves, the budget goes to 0 and the session decodes
plainly, and its probe rounds measure the drafter again. What a round costs
outside the engine (the hops, the coordinator's work) the coordinator judges
itself, end to end (``coordinator.drafting_gate``).

alpha is learnt for the whole engine and for each session (``SessionAcceptance``,
starting from the engine's): drafts pay on some requests (a summary copies
its document, n-gram drafts land) and not on others, so each session's
budget follows its own acceptance. A session whose drafts stopped paying
drifts back towards the engine's rate while it drafts nothing, and so tries
again now and then. The engine's rate learns only from trees, so where it too
says "no drafts" (a long context on a CPU, where every extra row costs) no
session would ever draft again: a session with no tree for ``PROBE_AFTER``
rounds gets a small probe budget instead of none, and its answer revises both
rates. A probe that lands nothing doubles the wait for the next (up to
``PROBE_AFTER_MAX``): a request whose drafts never land pays for few probes.
"""

from __future__ import annotations

from target_service.cost_curve import CostCurve
from target_service.served_costs import ServedCosts


class DraftBudget:
    """The draft-node budget per session for a batch of a given size; learns the acceptance rate."""

    # Each verified tree weighs this much less than the next: the estimate follows the last few hundred.
    DECAY = 0.99
    CACHE_LIMIT = 4096  # budgets kept by (sessions, alpha, drafting time to 0.5 ms, context to CONTEXT_STEP)
    CONTEXT_STEP = 64  # cached tokens: contexts are priced in steps of this

    def __init__(self, curve: CostCurve, max_nodes: int, prior_accepted: float = 3.0, prior_tried: float = 5.0) -> None:
        self.curve = curve
        self._served = ServedCosts(curve)  # ``curve`` as measured, corrected by served steps
        self.max_nodes = max_nodes
        self._accepted = prior_accepted
        self._tried = prior_tried
        self._cache: dict[tuple[int, float, float, int], int] = {}

    def observe_step(self, tokens: int, context: int, seconds: float) -> None:
        """One served step of one session scoring ``tokens`` over ``context`` cached tokens took ``seconds``:
        where it moves a size's price (``served_costs``), budgets are sized with the corrected curve from now on,
        keeping what was learnt of acceptance."""
        corrected = self._served.observe(tokens, context, seconds)
        if corrected is not None:
            self.curve = corrected
            self._cache.clear()

    @property
    def alpha(self) -> float:
        """Estimated probability that the next draft token on a path is accepted."""
        return min(0.98, self._accepted / self._tried)

    def observe(self, tree_depth: int, num_accepted: int) -> None:
        """One verified tree: ``num_accepted`` tokens kept out of a deepest path of ``tree_depth``."""
        if tree_depth <= 0:
            return
        before = round(self.alpha, 2)
        self._accepted = self.DECAY * self._accepted + num_accepted
        self._tried = self.DECAY * self._tried + num_accepted + (1 if num_accepted < tree_depth else 0)
        if round(self.alpha, 2) != before:
            self._cache.clear()

    def expected_accepted(self, nodes: int, alpha: float | None = None) -> float:
        a = self.alpha if alpha is None else min(0.98, alpha)
        return a * (1 - a**nodes) / (1 - a)

    def nodes_for(self, sessions: int, alpha: float | None = None, draft_s: float = 0.0, context: int = 0) -> int:
        """The k in [0, max_nodes] that maximises tokens committed per second with ``sessions`` sharing steps.

        ``alpha``: the session's own acceptance rate (default: the engine's). ``draft_s``: what a drafted round
        waits for its tree (0: nothing known), for every k > 0 added to the step's cost divided by ``sessions``:
        alone, a session's draft leaves the engine idle; among others, the engine steps for them meanwhile.
        ``context``: the session's cached tokens, taken as every session's (0: the curve's own context).
        """
        sessions = max(1, sessions)
        draft = round(max(0.0, draft_s) * 2000) / 2000  # to 0.5 ms: the cache's key
        context = context // self.CONTEXT_STEP * self.CONTEXT_STEP
        key = (sessions, round(self.alpha if alpha is None else alpha, 2), draft, context)
        if key not in self._cache:
            if len(self._cache) >= self.CACHE_LIMIT:  # sessions' rates and drafting times vary: keep it bounded
                self._cache.clear()
            best_k, best_rate = 0, 0.0
            for k in range(self.max_nodes + 1):
                cost = self.curve.step_s(sessions, sessions * (1 + k), context) + (draft / sessions if k else 0.0)
                rate = sessions * (1 + self.expected_accepted(k, key[1])) / cost
                if rate > best_rate * 1.0001:  # ties go to the smaller tree
                    best_k, best_rate = k, rate
            self._cache[key] = best_k
        return self._cache[key]


class SessionAcceptance:
    """One session's acceptance rate: its own recent trees, on a prior worth ``prior_tries`` at the engine's."""

    DECAY = 0.9  # a request's drafts change character within tens of rounds
    PRIOR_TRIES = 2.0
    PROBE_AFTER = 16  # rounds without a tree before a zero budget becomes a probe: at most ~1 round in 17 pays it
    PROBE_AFTER_MAX = 128  # each probe that lands nothing doubles the wait for the next, up to this
    PROBE_NODES = 4

    DRAFT_DECAY = 0.8  # weight of the drafting time known before each new drafted round's

    def __init__(self) -> None:
        self._accepted = 0.0
        self._tried = 0.0
        self._rounds_without_tree = 0
        self._probe_after = self.PROBE_AFTER  # quiet rounds before the next probe
        self._probing = False  # the last budget sent was a probe
        self.draft_s = 0.0  # what a drafted round waits for its tree, smoothed (0: no drafted round yet)

    def alpha(self, engine_alpha: float) -> float:
        return (self._accepted + self.PRIOR_TRIES * engine_alpha) / (self._tried + self.PRIOR_TRIES)

    def observe_draft(self, seconds: float) -> None:
        """A drafted round's wait for its tree (from the coordinator); rounds without a drafter send none."""
        if seconds <= 0:
            return
        decay = self.DRAFT_DECAY if self.draft_s else 0.0  # the first drafted round is taken as it is
        self.draft_s = decay * self.draft_s + (1 - decay) * seconds

    def observe(self, tree_depth: int, num_accepted: int) -> None:
        """One verified round: a tree (depth > 0) teaches the rate; an empty one lets it drift to the prior."""
        self._accepted *= self.DECAY
        self._tried *= self.DECAY
        if tree_depth > 0:
            self._accepted += num_accepted
            self._tried += num_accepted + (1 if num_accepted < tree_depth else 0)
            self._rounds_without_tree = 0
            if num_accepted:
                self._probe_after = self.PROBE_AFTER
            elif self._probing:  # a probe that landed nothing: the next comes after twice the quiet stretch
                self._probe_after = min(2 * self._probe_after, self.PROBE_AFTER_MAX)
        else:
            self._rounds_without_tree += 1

    def budget(self, nodes: int, max_nodes: int) -> int:
        """The budget to send: the cost model's ``nodes``, or a probe after a quiet stretch without a tree.

        The stretch is ``PROBE_AFTER`` rounds, doubled by each probe that lands nothing (up to
        ``PROBE_AFTER_MAX``: a request whose drafts never land, a translation say, pays for a probe about once
        in 129 rounds) and back to ``PROBE_AFTER`` once drafts land. The probe repeats each round until a tree
        comes back (a drafter with nothing to propose sends none, at no cost).
        """
        self._probing = nodes == 0 and self._rounds_without_tree >= self._probe_after
        return min(self.PROBE_NODES, max_nodes) if self._probing else nodes
