"""Offline checks of deploy/: the Helm chart and the Dockerfile."""
