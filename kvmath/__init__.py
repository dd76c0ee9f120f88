"""Pure KV-cache arithmetic (no torch, no Qt) that the window and the engine's commands share."""
