"""Session traces in the window: record, replay against other settings, compare."""
