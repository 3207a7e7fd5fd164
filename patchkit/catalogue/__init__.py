"""The patch catalogue: ``patches/series.toml``, ``patches/bugs.toml``, ``patches/<id>/``.

Layer 2: the data model of patches, variants and decisions, loaded and
checked when it loads. It uses the engine's diff parser (hunks) and nothing
above it.
"""
