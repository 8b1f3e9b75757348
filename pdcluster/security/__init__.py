"""pdcluster/security"""
