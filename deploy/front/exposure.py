"""Who can reach the server: a server other machines reach answers only with a key, unless the config says
`front_door.open: true`.

Serve binds its HTTP proxy to `http_options.host` and its gRPC proxy to every interface (it has no host
setting) once `grpc_options` names a servicer. Either, without `front_door.api_key_env` or `api_key`, would
serve every request of anyone who can reach the port, so the application refuses to build: `serve run` and
`serve deploy` stop with the reason and the fix. A deliberate open door (a network of its own behind a gateway
that authenticates) says `front_door.open: true`.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

from deploy.front.frontdoor import FrontDoorConfig

logger = logging.getLogger(__name__)


def reachable(http_host: str | None, grpc_servicers: list[str]) -> list[str]:
    """Why Serve's proxies are reachable from other machines: an HTTP host other than loopback, gRPC served."""
    why = []
    if http_host is not None and not _loopback(http_host):
        why.append(f"HTTP listens on {http_host} (http_options.host)")
    if grpc_servicers:
        why.append("gRPC listens on every interface (grpc_options names a servicer; Serve's gRPC proxy has no host)")
    return why


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it resolves somewhere else
        return False


def check(front: FrontDoorConfig, why: list[str]) -> None:
    """Raises where the server is reachable (`why`) with no key, unless the config opened it on purpose."""
    if not why or front.api_key is not None or front.api_key_env is not None:
        return
    if front.open:
        logger.warning("front_door.open: serving without an API key although %s", "; ".join(why))
        return
    raise ValueError(
        f"refusing to serve without an API key where other machines can reach it: {'; '.join(why)}. Set "
        "front_door.api_key_env to the environment variable holding the key (a Kubernetes Secret, or `export` "
        "before `ray start`), or bind loopback (http_options.host: 127.0.0.1, no grpc_options); on a network "
        "of its own behind a gateway that authenticates, front_door.open: true serves without a key."
    )


def running_serve() -> list[str]:
    """`reachable` for the Serve instance this process is connected to; [] where none runs yet (`serve.run`
    then starts it on its defaults: HTTP on 127.0.0.1, no gRPC)."""
    import ray
    from ray.serve.context import _get_global_client

    if not ray.is_initialized():  # (Serve's client would start a Ray of its own here)
        return []
    try:
        client = _get_global_client(raise_if_no_controller_running=False)
    except Exception as e:
        logger.debug("no Serve instance to read the binds of: %r", e)
        return []
    if client is None:
        return []
    details: dict[str, Any] = client.get_serve_details()
    http = details.get("http_options") or {}
    proxies_off = str(details.get("proxy_location", "")).lower() in ("disabled", "proxylocation.disabled")
    grpc = details.get("grpc_options") or {}
    return reachable(None if proxies_off else http.get("host"), list(grpc.get("grpc_servicer_functions") or []))
