"""The commands the engine implements (generate, serve, trace, fragsim, kv-calc), each a module with
add_parser(sub) and run(args); kvscope/commands.py is the table that names them."""
