"""Per-architecture attention and cache rewrites (imports ops only)."""
