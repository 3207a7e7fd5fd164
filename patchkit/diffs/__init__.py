"""Layer 2: unified diffs: parse and apply hunks exactly (hunks), write them (unified)."""
