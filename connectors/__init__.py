"""connectors"""
