"""Steering the engine: block size, KV dtype, budgets, and the load generator."""
