"""Correctness on a device: the Triton kernels against their references, the device monitor
against nvidia-smi, the kernels' register use. Not timings, and not installed."""
