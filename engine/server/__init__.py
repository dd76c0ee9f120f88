"""`kvscope serve`'s machinery: engine and I/O threads, snapshots, metrics, device monitor."""
