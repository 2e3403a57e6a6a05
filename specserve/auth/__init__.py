"""Who may call what: API keys for the public tier, an internal token and TLS/mTLS for the tiers behind it.

- ``keys``: the API key file (SHA-256 digests mapped to tenants), reloaded when it changes.
- ``tls``: server and channel credentials from certificate files; the loopback-only rule for unauthenticated servers.
- ``interceptors``: the gRPC server interceptors that check API keys (coordinator) and the internal token
  (verifier, drafter); health checks stay open.
- ``internal``: the metadata the coordinator sends on internal calls, and who owns a verifier session.

``python -m specserve.auth new-key --tenant acme --name ci`` mints a key.
"""
