"""connectors/ec"""
