"""connectors/ec: the encoder-cache (EC) connector. NOT BUILT YET.

Multimodal models, the engine-local encoder cache and image-aware prefix hashing exist
(`pdcluster/models/llava.py`, `pdcluster/engine/encoder_cache.py`); sharing encoder outputs between
instances (the EC contract beside the KV one, its P2P connector over CURVE ZMQ + the transfer
plane, and the E/P/D roles) is issue 15's remaining work. Nothing imports this package.
"""
