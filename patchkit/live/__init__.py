"""Watching a running vLLM (layer 5): ``patchkit canary`` asks a live server for answers.

Talks HTTP to a server; never touches a vLLM tree. httpx and
prometheus_client are imported only here, by the command that needs them.
"""
