"""The coordinator's OpenAI-compatible HTTP API (FastAPI on uvicorn, in the coordinator's process and loop).

- ``app``: routes, request parsing, error handlers, the request id middleware (``create_app``)
- ``schemas``: request and response bodies (pydantic)
- ``translate``: OpenAI parameters -> ``coordinator.frontend.EdgeRequest``; stats -> ``usage`` and speculation
- ``responses``: one generation as a JSON body or server-sent events; a client that goes away stops it
- ``errors``: OpenAI's error body and status codes from ``specserve.errors``
- ``auth``: ``Authorization: Bearer <key>`` against the coordinator's API keys
- ``serve``: uvicorn in the coordinator's loop, without its own signal handling (``HttpServer``)
"""
