"""CPU benchmarks: a decode step's shares, the int4 matmuls timed the step's way, and one chat's
tok/s and agreement per weight format (the measurements behind the CPU default)."""
