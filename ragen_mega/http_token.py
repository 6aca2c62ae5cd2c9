"""Bearer tokens for the project's own HTTP servers: the env server, the agent gateway and the
trajectory viewer.

On loopback only the machine's own users reach a server. On any other address anyone who
reaches the node could open env sessions, generate on the run's engines or read a run's
episodes, so these servers refuse to listen there without a token; with one, every request
must carry ``Authorization: Bearer TOKEN`` (else 401). A browser, which cannot set that header,
opens the viewer once at ``/?token=TOKEN`` and is then known by a cookie (as Jupyter does). The
token comes from an environment variable, never a flag: every user of the node can read a
command line.
"""
from __future__ import annotations

import ipaddress
import os
import secrets

ENV_SERVER_TOKEN = "RAGEN_MEGA_ENV_SERVER_TOKEN"
GATEWAY_TOKEN = "RAGEN_MEGA_GATEWAY_TOKEN"
VIEW_TOKEN = "RAGEN_MEGA_VIEW_TOKEN"
#: the viewer's cookie, set by a request that carried the token as ``?token=``
COOKIE = "ragen_mega_token"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and the loopback ranges (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_from_env(variable: str) -> str | None:
    """The token in ``variable`` (None when unset or empty)."""
    return os.environ.get(variable) or None


def check_listen(host: str, token: str | None, variable: str, where: str) -> None:
    """ValueError naming ``where`` (the flag or config key of the address) and ``variable``
    when ``host`` is not loopback and there is no token."""
    if token is None and not is_loopback(host):
        raise ValueError(f"{where}: {host} is not a loopback address, and a server there "
                         f"answers anyone who reaches this node; set {variable} to a secret "
                         f"token (its clients send it as 'Authorization: Bearer TOKEN'), or "
                         f"listen on 127.0.0.1")


def bearer_headers(token: str | None) -> dict[str, str]:
    """The request headers that carry ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def require_token(app, token: str | None, *, browser: bool = False) -> None:
    """With ``token``, ``app`` (FastAPI) answers 401 to every request that does not carry it.
    ``browser``: the token may also come as the ``?token=`` query of a request, which then
    sets it as an HTTP-only cookie, or as that cookie (the viewer's page and its fetches)."""
    if token is None:
        return
    from fastapi.responses import JSONResponse

    def matches(given: str | None) -> bool:
        return given is not None and secrets.compare_digest(given.encode(), token.encode())

    @app.middleware("http")
    async def check_token(request, call_next):
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        from_query = request.query_params.get("token") if browser else None
        if not ((scheme == "Bearer" and matches(given)) or matches(from_query) or
                (browser and matches(request.cookies.get(COOKIE)))):
            return JSONResponse({"error": {"message": "missing or wrong bearer token",
                                           "type": "invalid_request_error",
                                           "code": "invalid_api_key"}},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        response = await call_next(request)
        if matches(from_query):
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response
