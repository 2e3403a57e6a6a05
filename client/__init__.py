"""specserve client SDK: sync and asyncio clients for the Generation service.

Depends on grpcio and protobuf only (the generated modules under specserve.v1).

    from client import SpecserveClient
    with SpecserveClient("localhost:50051") as c:
        for chunk in c.generate_chat([("user", "Write a haiku about the sea")]):
            print(chunk.text, end="")

Against an authenticated deployment: ``SpecserveClient(target, api_key=key, tls=True)`` (or ``tls_ca="ca.pem"``).
"""

from client.sdk import (
    AsyncSpecserveClient,
    GenerationParams,
    SpecserveClient,
    Stats,
    TextChunk,
)

__all__ = ["AsyncSpecserveClient", "GenerationParams", "SpecserveClient", "Stats", "TextChunk"]
