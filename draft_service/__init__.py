"""The drafter worker: proposes token trees from cheap draft sources."""
