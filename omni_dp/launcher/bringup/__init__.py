"""A planned run brought up step by step: the MPS daemon, the replicas through their gates (health,
equal KV, attachment), the router, the gateway registration.
"""
