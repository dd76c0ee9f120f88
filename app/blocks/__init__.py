"""The KV block map: one ImageItem cell per physical block, and its hover/selection details."""
