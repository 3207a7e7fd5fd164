"""The real Docker build check's parts (scripts/docker_build_check.py runs them)."""
