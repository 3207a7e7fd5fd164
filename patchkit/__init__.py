"""patchkit: repair installed vLLM trees with versioned, reversible patches."""

__version__ = "0.1.0"
