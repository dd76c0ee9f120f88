"""The `kvscope` launcher: the only package that may import both the window and the engine."""
