"""pdcluster.security: the pieces every listening socket and control message goes through.

- keys.py      CURVE key pairs: `init_keys` (`pdcluster keys init DIR`), loading, string form
- curve.py     CURVE server/client sockets, the fail-closed ZAP allow-list, refusal metrics
- envelope.py  schema-checked, size-bounded msgpack messages; HMAC-signed, replay-proof envelopes

Submodules are imported explicitly (`from pdcluster.security.envelope import decode`) so that a
process needing only envelopes does not start ZMQ machinery.
"""
