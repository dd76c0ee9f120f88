"""The measured long-context grid (passkey per KV dtype) where the KV dtype is chosen."""
