"""API keys on the HTTP API: the gRPC edge's keys and tenants, sent as ``Authorization: Bearer <key>``."""

from __future__ import annotations

from coordinator.openai_api.errors import ApiError
from specserve.auth.interceptors import bearer, refusal
from specserve.auth.keys import ApiKeys
from specserve.tenancy import ANONYMOUS, Tenant

MISSING_KEY = "send an API key as `Authorization: Bearer <key>` (the OpenAI client's api_key)"
_CHALLENGE = {"www-authenticate": 'Bearer realm="specserve"'}


def authenticate(keys: ApiKeys | None, authorization: str | None) -> Tenant:
    """The caller's tenant (``ANONYMOUS`` with auth off); a 401 without a key or with an unknown one."""
    if keys is None:
        return ANONYMOUS
    key = bearer([("authorization", authorization)] if authorization else None)
    if key is None:
        raise ApiError(401, MISSING_KEY, code="invalid_api_key", headers=_CHALLENGE)
    principal = keys.lookup(key)
    if principal is None:
        raise ApiError(401, refusal(keys), code="invalid_api_key", headers=_CHALLENGE)
    return principal.tenant
