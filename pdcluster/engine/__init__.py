"""pdcluster/engine"""
