"""Layer 6: `patchkit canary`: asks a live vLLM server for answers over HTTP. httpx and
prometheus_client are imported only here.
"""
