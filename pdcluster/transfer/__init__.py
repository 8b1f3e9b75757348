"""pdcluster/transfer"""
