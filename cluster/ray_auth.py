"""Ray's token authentication for `pdcluster up` on an existing (multi-node) cluster.

A Ray cluster without authentication runs code for anyone who reaches its ports, so `up` joins
one only if it requires Ray's token (RAY_AUTH_MODE=token), checked from outside: an unauthenticated
call to the GCS must be refused with UNAUTHENTICATED. A Ray without token authentication, a
cluster that does not enforce it, or a driver without a token is refused unless --insecure.
Imports only the standard library and grpc (never ray: Ray reads RAY_AUTH_MODE at import). It
never sets that itself: the `up` CLI process applies driver_auth_env() before it imports ray, so
a library caller's environment is never changed behind its back.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

# Any GCS method will do: an enforcing GCS refuses it before looking at the (empty) request.
_PROBE_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def ray_has_token_auth() -> bool:
    """Whether the installed Ray has token authentication (the ray._private.authentication package)."""
    try:
        return importlib.util.find_spec("ray._private.authentication") is not None
    except ModuleNotFoundError:
        return False


def has_token() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return True
    return (pathlib.Path.home() / ".ray" / "auth_token").is_file()


def gcs_auth_state(address: str, timeout_s: float = 5.0) -> str:
    """"token" (the GCS refused a call without a token), "open" (it answered one), or "unknown"
    (not a HOST:PORT GCS address, e.g. ray:// or auto, or no answer)."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return "unknown"
    import grpc

    with grpc.insecure_channel(f"{host}:{port}") as ch:
        try:
            ch.unary_unary(_PROBE_METHOD)(b"", timeout=timeout_s)
        except grpc.RpcError as e:
            return "token" if e.code() == grpc.StatusCode.UNAUTHENTICATED else "unknown"
    return "open"


def driver_auth_env() -> dict[str, str]:
    """What a driver joining an existing cluster sets before `import ray`: token authentication,
    unless RAY_AUTH_MODE is set already (require_token_auth refuses any other mode without
    --insecure)."""
    if not ray_has_token_auth() or os.environ.get("RAY_AUTH_MODE") is not None:
        return {}
    return {"RAY_AUTH_MODE": "token"}


def require_token_auth(address: str, *, insecure: bool) -> str:
    """Before `import ray`: check that this driver will use token authentication (with
    driver_auth_env() applied) and that the cluster at `address` enforces it. Returns the line
    `up` prints about it; raises ValueError (refusal). Changes no environment."""
    if not ray_has_token_auth():
        if insecure:
            return "Ray token authentication: NOT available in this Ray version (--insecure)"
        raise ValueError("this Ray version has no token authentication, so the cluster at "
                         f"{address!r} would run code for anyone who reaches it; upgrade Ray to one with token "
                         "authentication (RAY_AUTH_MODE=token), or pass "
                         "--insecure to join it anyway")
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token" and not insecure:
        raise ValueError(f"RAY_AUTH_MODE={mode!r}: joining a Ray cluster requires token authentication "
                         "(RAY_AUTH_MODE=token), or --insecure")
    if not has_token() and not insecure:
        raise ValueError("Ray token authentication needs the cluster's token: set RAY_AUTH_TOKEN or "
                         "RAY_AUTH_TOKEN_PATH, or copy it to ~/.ray/auth_token (mode 0600); or pass --insecure")
    state = gcs_auth_state(address)
    if state == "open":
        if insecure:
            return f"Ray token authentication: NOT enforced by the cluster at {address} (--insecure)"
        raise ValueError(f"the Ray cluster at {address!r} answers without a token (it was not started with "
                         "RAY_AUTH_MODE=token): anyone who reaches it can run code there. Restart it with token "
                         "authentication, or pass --insecure to join it anyway")
    if state == "token":
        return f"Ray token authentication: required, and enforced by the cluster at {address}"
    return (f"Ray token authentication: required by this driver (RAY_AUTH_MODE=token); could not check that "
            f"{address} enforces it")
