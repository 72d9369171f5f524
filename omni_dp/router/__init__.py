"""The aiohttp router in front of the replicas: forwarding, policies, health, admission."""
