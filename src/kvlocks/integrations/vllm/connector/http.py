"""Refuse a bad compacted-cache request in vLLM's OpenAI server with HTTP 400 and its reason.

The kvlocks connector checks every request that names a file (``kv_transfer_params``) in the
engine's scheduler; a request it refuses finishes with ``finish_reason="error"``, which vLLM's
OpenAI server turns into HTTP 500 "Internal server error", the reason left in the server log.
This ASGI middleware runs the same checks (:func:`.compacted.check_request`: the name stays in
``cache_dir``, the header is valid and made for the served model, no logit bias, the prompt's
placeholder ids) in the API server before the request reaches the engine, and answers 400 with
the reason::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvlocksConnector", ...}' \\
        --middleware kvlocks.integrations.vllm.connector.http.check_compacted_requests

A file whose header is fine but whose data is not (tampered after saving, NaN) is still refused
by the worker's full load, as before (HTTP 500). Requests without the parameter pass untouched.
"""

from __future__ import annotations

import json

from kvlocks.integrations.vllm.connector.compacted import PARAM, check_request, served_model_info

_SERVED: dict[int, tuple] = {}  # id(vllm_config) -> (cache_dir, ModelInfo, vocab size)


def _served(vllm_config) -> tuple:
    key = id(vllm_config)
    if key not in _SERVED:
        from kvlocks.integrations.vllm import compat

        served = compat.served_model(vllm_config)
        _SERVED[key] = (served.extra_config.get("cache_dir"), served_model_info(served.hf_config, served.model_dir),
                        served.vocab_size)
    return _SERVED[key]


def _prompts(data: dict, path: str) -> list[list[int] | None]:
    """The token-id prompts of a completions request (None where the server renders the text)."""
    if path.endswith("/chat/completions"):
        return [None]
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return prompt
    return [None]  # text: the server tokenizes it; the placeholders cannot be text


async def check_compacted_requests(request, call_next):
    """Starlette HTTP middleware (module docstring)."""
    if request.method != "POST" or not request.url.path.endswith("/completions"):
        return await call_next(request)
    try:
        data = json.loads(await request.body())
    except ValueError:
        return await call_next(request)  # vLLM answers malformed JSON itself
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    name = params.get(PARAM) if isinstance(params, dict) else None
    config = getattr(request.app.state, "vllm_config", None)
    if name is None or config is None or getattr(config, "kv_transfer_config", None) is None:
        return await call_next(request)  # no connector: vLLM ignores the parameter
    try:
        cache_dir, model, vocab = _served(config)
        for prompt in _prompts(data, request.url.path):
            check_request(name, prompt, cache_dir, model, vocab)
    except (ValueError, OSError) as exc:
        from starlette.responses import JSONResponse

        return JSONResponse(status_code=400, content={"error": {
            "message": f"kvlocks: {exc}", "type": "BadRequestError", "param": "kv_transfer_params", "code": 400}})
    return await call_next(request)
