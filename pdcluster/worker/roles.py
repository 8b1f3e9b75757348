"""Worker roles: which legs of a request a worker serves and what kv_transfer_params it honours.

    leg                         kv_transfer_params          served by
    aggregated / local prefill  none                        every role
    prefill (producer)          do_remote_decode=true       prefill, both   (needs a KV connector)
    decode (consumer)           do_remote_prefill=true      decode, both    (needs a KV connector)

`RoleHandler.accept` checks the request's KVTransferParams (already typed and validated by
pdcluster.proto_convert) and passes them to the engine, or refuses:
contradictory params are the caller's mistake (ValueError -> INVALID_ARGUMENT); params this
worker cannot honour (wrong role, no connector, another connector) are FAILED_PRECONDITION, so
the router can tell "fix the request" from "send it elsewhere".

The aggregated role lives here (core); the producer and consumer roles live in
pdcluster.prefill_worker and pdcluster.decode_worker (imports point down: core never imports
them). The KV hand-off itself arrives with the connectors; until then a worker has no connector
and refuses every remote leg with a message that says so.
"""

from __future__ import annotations

from pdcluster.engine.kv_connector import KVTransferParams
from pdcluster.proto_convert import ROLE_TO_PROTO

_UNSET = KVTransferParams()  # an empty message on the wire: no hand-off asked for


class KvTransferRejected(Exception):
    """This worker cannot honour the request's kv_transfer_params (gRPC FAILED_PRECONDITION)."""


class RoleHandler:
    """Base of the roles: refuses both remote legs; a role overrides the legs it serves."""

    name: str = ""  # "prefill" | "decode" | "both"

    def __init__(self, connector_name: str | None = None) -> None:
        # The engine holds the connector object; the role only needs its name to check that a
        # consumer leg's params were produced by a connector of the same kind.
        self.connector_name = connector_name or ""

    @property
    def proto_role(self) -> int:
        return ROLE_TO_PROTO[self.name]

    def accept(self, kv: KVTransferParams | None) -> KVTransferParams | None:
        """The engine's kv_transfer_params for this request (None: an ordinary local request)."""
        if kv is None or kv == _UNSET:
            return None
        remote_decode, remote_prefill = kv.do_remote_decode, kv.do_remote_prefill
        if remote_decode and remote_prefill:
            raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive")
        if not (remote_decode or remote_prefill):
            raise ValueError("kv_transfer_params: set do_remote_decode (prefill leg) or do_remote_prefill "
                             "(decode leg), or leave kv_transfer_params unset")
        if not self.connector_name:
            leg = "prefill leg (do_remote_decode)" if remote_decode else "decode leg (do_remote_prefill)"
            raise KvTransferRejected(
                f"{self.name} worker has no KV connector configured, so it cannot serve a remote {leg}; "
                "send the request without kv_transfer_params (aggregated) or to a worker with a connector")
        wanted = kv.connector
        if wanted and wanted != self.connector_name:
            raise KvTransferRejected(
                f"kv_transfer_params.connector is {wanted!r} but this worker's connector is {self.connector_name!r}")
        return self.accept_producer_leg(kv) if remote_decode else self.accept_consumer_leg(kv)

    def accept_producer_leg(self, kv: KVTransferParams) -> KVTransferParams:
        """Prefill leg: compute the prompt's KV and keep it for a remote decode."""
        raise KvTransferRejected(f"a {self.name} worker does not serve prefill legs (do_remote_decode); "
                                 "send it to a prefill or aggregated worker")

    def accept_consumer_leg(self, kv: KVTransferParams) -> KVTransferParams:
        """Decode leg: load the prompt's KV from the producer named in kv, then decode."""
        raise KvTransferRejected(f"a {self.name} worker does not serve decode legs (do_remote_prefill); "
                                 "send it to a decode or aggregated worker")


def check_consumer_params(kv: KVTransferParams) -> KVTransferParams:
    """What every consumer leg needs, whatever the connector: who produced the KV, and how many
    prompt tokens it covers (unset means none: proto3 does not send a zero; a store producer
    with less than one full block covers none, and the decode leg computes the prompt)."""
    if not kv.producer_id:
        raise ValueError("kv_transfer_params: a decode leg needs producer_id")
    return kv  # num_tokens is a non-negative integer by construction


class AggregatedRole(RoleHandler):
    """Role `both`: prefill and decode in one engine; serves either remote leg given a connector."""

    name = "both"

    def accept_producer_leg(self, kv: KVTransferParams) -> KVTransferParams:
        return kv

    def accept_consumer_leg(self, kv: KVTransferParams) -> KVTransferParams:
        return check_consumer_params(kv)
