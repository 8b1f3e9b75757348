"""pdcluster/_proto"""
