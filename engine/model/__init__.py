"""The decoder over the paged KV cache, its families, RoPE, weights and weight formats.

PagedLlama (paged_decoder) runs seven dense families; what sets a family apart is in family,
what is refused in support, and the fused CPU decode step in fused/."""
