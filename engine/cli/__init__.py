"""The engine's commands (generate, serve, trace, fragsim, kv-calc); `kvscope/` routes to them."""
