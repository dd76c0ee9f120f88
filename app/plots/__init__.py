"""Live plots over time: batch occupancy, queues, throughput (shared series and time windows)."""
