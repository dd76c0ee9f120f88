"""The desktop window (Qt): it never imports torch or the engine, only ipc/."""
