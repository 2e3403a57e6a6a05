"""The verifier worker: target model, per-session KV caches, draft verification."""
