"""pdcluster/distributed"""
