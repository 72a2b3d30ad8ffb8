"""Models ratchet can build by itself (no downloads)."""
