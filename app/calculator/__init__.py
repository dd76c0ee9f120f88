"""The KV calculator: bytes per token, what fits on this device, paged vs reserved waste."""
