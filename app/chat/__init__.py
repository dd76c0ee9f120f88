"""The chat view: conversations, the streaming reply and per-reply stats."""
