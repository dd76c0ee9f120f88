"""Speculative decoding from the context: n-gram drafts, verification, and when drafts pay."""
