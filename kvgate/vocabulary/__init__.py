"""The vocabulary every layer shares: a trace's config and its schema, token
ids and prefix keys, KV-cache events, the strict snapshot, the action table,
residency evictions, what a target offers, and the scheduler-level contract.
It imports nothing of kvgate's but `errors.py`."""
