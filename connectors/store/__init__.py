"""connectors/store"""
