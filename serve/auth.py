"""Bearer-token authentication for /v1/* (`--api-key` or SETDLM_API_KEY).

The key is compared in constant time and never written anywhere: not to the log, not into an error
message (a refused request is told only that its token is missing or wrong), not to the access log
(whose format holds no request header). /v1/*, /tokenize, /tokenizer_info and /detokenize need it; /health and
/metrics stay open for probes and scrapers.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from .schema import RequestError

ENV = "SETDLM_API_KEY"
PROTECTED = ("/v1/", "/tokenize", "/detokenize")


def auth_middleware(key: str | None):
    expected = f"Bearer {key}".encode() if key else None

    @web.middleware
    async def check(request: web.Request, handler):
        if expected is not None and request.path.startswith(PROTECTED):
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                raise RequestError(None, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                   401, "authentication_error")
        return await handler(request)

    return check
