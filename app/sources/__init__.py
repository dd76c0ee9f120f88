"""The engines the window watches, behind one interface (source.py): kvscope, vLLM, llama-server."""
