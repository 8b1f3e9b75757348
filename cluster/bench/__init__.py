"""cluster/bench"""
