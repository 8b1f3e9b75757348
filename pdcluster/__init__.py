"""pdcluster"""
