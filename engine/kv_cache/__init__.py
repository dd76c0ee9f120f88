"""The paged KV cache: the block manager, the evictable-block queue, the pool and its memory.

Also the prefix cache's events, the exact anchor tokens beside a 1-byte pool, and the per-model
K calibration that a quantized pool reads."""
