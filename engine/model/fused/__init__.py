"""The fused CPU decode: one step's glue between matmuls fused, row by row or in one region."""
