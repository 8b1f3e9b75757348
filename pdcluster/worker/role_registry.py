"""The worker roles by name: what each role package contributes to the shared worker core.

    role      package                     connector half   serves
    both      pdcluster.worker (core)     both             local requests and either remote leg
    prefill   pdcluster.prefill_worker    producer         local requests and prefill legs
    decode    pdcluster.decode_worker     consumer         local requests and decode legs
    encode    pdcluster.encode_worker     none             Worker.Encode only (encoder-only engine)

A role is a `WorkerRole`: its name, the RoleHandler that admits or refuses each request's
kv_transfer_params (its admission rule), the half of the KV connector the engine wires for it,
and the engine stats that describe its own work. Roles resolve through one `Registry`
(pdcluster/registry.py): the built-ins above, a dotted path "pkg.module:ROLE", or an entry point
in the group `pdcluster.worker_roles`, so a new role is a package beside prefill_worker/ that
defines its WorkerRole, without a change to the core (encode_worker/ is one: an encoder-only
engine, `encoder_only=True`, with an EC connector by default).

The core never imports a role package: built-ins are lazy "module:attr" strings. This module
imports only the standard library at import time (the CLI builds its parser from it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.registry import Registry
    from pdcluster.worker.roles import RoleHandler

ENTRY_POINT_GROUP = "pdcluster.worker_roles"
KV_ROLES = ("producer", "consumer", "both")  # EngineArgs.kv_role: the connector half wired


@dataclass(frozen=True)
class WorkerRole:
    name: str
    handler: type[RoleHandler] | str  # the class, or a lazy "module:Class"
    kv_role: str  # the connector half the engine wires (one of KV_ROLES)
    summary: str = ""
    # False: the role is whole without a connector (aggregated); True: without one it serves only
    # local requests and every remote leg is refused (the worker warns at start).
    needs_connector: bool = False
    # Engine stats (AsyncEngine.get_stats keys) that describe this role's own work.
    metrics: tuple[str, ...] = ()
    # True: the engine loads and runs only the vision tower + projector (EngineArgs.encoder_only).
    encoder_only: bool = False
    # The EC connector the role uses when the deployment names none ("" = none), and the half of
    # it the role needs: "producer" (holds encoder outputs for others), "consumer" (fetches only)
    # or "both" (a prefill worker fetches from an encoder and holds what it encoded itself).
    default_ec_connector: str = ""
    ec_role: str = "both"

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"role {self.name!r}: kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")

    def make_handler(self, connector_name: str | None = None) -> RoleHandler:
        """This role's RoleHandler for a worker with the named connector (None: no connector)."""
        from pdcluster.registry import load_dotted
        from pdcluster.worker.roles import RoleHandler

        cls = load_dotted(self.handler, "role handler") if isinstance(self.handler, str) else self.handler
        if not (isinstance(cls, type) and issubclass(cls, RoleHandler)):
            raise ValueError(f"role {self.name!r}: handler {cls!r} is not a RoleHandler subclass")
        handler = cls(connector_name)
        if handler.name != self.name:
            raise ValueError(f"role {self.name!r}: its handler calls itself {handler.name!r}")
        return handler

    def role_metrics(self, stats: Mapping[str, object]) -> dict[str, object]:
        """The subset of the engine's stats this role reports as its own."""
        return {name: stats[name] for name in self.metrics if name in stats}


AGGREGATED = WorkerRole(
    "both", "pdcluster.worker.roles:AggregatedRole", kv_role="both",
    summary="prefill and decode in one engine (either remote leg, given a connector)",
    metrics=("num_running", "num_waiting", "num_waiting_for_remote_kv", "kv_connector"))

BUILTIN_ROLES: Mapping[str, str] = MappingProxyType({
    "prefill": "pdcluster.prefill_worker.spec:ROLE",
    "decode": "pdcluster.decode_worker.spec:ROLE",
    "both": "pdcluster.worker.role_registry:AGGREGATED",
    "encode": "pdcluster.encode_worker.spec:ROLE",
})


def _worker_role(obj: object) -> WorkerRole:
    if not isinstance(obj, WorkerRole):
        raise ValueError("not a pdcluster.worker.role_registry.WorkerRole")
    return obj


def worker_roles() -> Registry[WorkerRole]:
    """A registry of every worker role: the built-ins, dotted paths and installed plugins."""
    from pdcluster.registry import Registry

    registry: Registry[WorkerRole] = Registry("worker role", entry_point_group=ENTRY_POINT_GROUP,
                                              check=_worker_role, list_sources=True)
    for name, path in BUILTIN_ROLES.items():
        registry.register(name, path)
    return registry


def resolve_role(name: str) -> WorkerRole:
    """The role a name stands for; ValueError listing every role that exists."""
    role = worker_roles().get(name)
    if ":" not in name and role.name != name:
        raise ValueError(f"worker role {name!r} resolved to a role named {role.name!r}")
    return role
