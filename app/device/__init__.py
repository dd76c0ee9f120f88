"""The device view: memory breakdown bar, NVML numbers, utilization and memory history."""
