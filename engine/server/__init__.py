"""`kvscope serve`'s machinery: the engine and I/O threads, state snapshots, metrics, device monitor."""
