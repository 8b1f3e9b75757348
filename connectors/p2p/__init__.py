"""connectors/p2p"""
