"""specserve: distributed, lossless speculative decoding.

This package holds the domain code shared by the services. It must stay
importable without torch or grpc so that the client SDK can depend on the
generated protobuf modules under ``specserve.v1`` alone.
"""
