"""Offline checks of deploy/: the Helm chart, the Dockerfile, EndpointSlice discovery."""
