"""pdcluster/models/layers"""
