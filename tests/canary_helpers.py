"""What the canary tests' fake vLLM server answers with (shared by the canary tests)."""

from __future__ import annotations

import time

from patchkit.canary import prompt

BASE = "Qwen/Qwen3.5-tiny"


def completion(body: dict, ids: list[int], logprob: float, text: str | None = None) -> dict:
    """A CompletionResponse as vLLM 0.26.0 writes it, honouring the request's options."""
    ids = ids[: body.get("max_tokens", 16)]
    text = " the keeper" * (len(ids) // 2) if text is None else text[: len(ids)]
    as_ids = body.get("return_tokens_as_token_ids")
    tokens = [f"token_id:{i}" if as_ids else ("!" if i == 0 else "x") for i in ids]
    logprobs = None
    if body.get("logprobs") is not None:
        logprobs = {
            "text_offset": list(range(len(ids))),
            "token_logprobs": [logprob] * len(ids),
            "tokens": tokens,
            "top_logprobs": [{t: logprob} for t in tokens],
        }
    prompt_tokens = prompt.estimate(body["prompt"])
    return {
        "id": "cmpl-0123456789abcdef",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body["model"],
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": ids if body.get("return_token_ids") else None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + len(ids),
            "completion_tokens": len(ids),
            "prompt_tokens_details": None,
        },
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def words(messages: list[dict]) -> list[str]:
    """The words of the canary's JSON messages (``{"code", "message", ...}``)."""
    return [m["message"] for m in messages]
