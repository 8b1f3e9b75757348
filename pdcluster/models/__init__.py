"""pdcluster/models"""
