"""Structured output: constraints on the generated text, compiled by llguidance, applied through token trees.

``spec`` says what a request asks for, ``compiler`` turns it into a grammar
(off the event loop, cached by constraint hash and vocabulary fingerprint),
``grammar_state`` follows one request's committed tokens and gives each
round's tree its per-row token masks, pruned of the nodes the grammar forbids
and extended by the tokens it forces; ``shortest`` bounds how few tokens a
complete output takes, so a request with fewer is refused up front.
"""
