"""Patch machinery and per-framework generation code (imports models and ops, never the reverse)."""
