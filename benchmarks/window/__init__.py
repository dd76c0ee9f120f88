"""Window benchmarks: frame cost under synthetic and attached sources, and the long soak."""
