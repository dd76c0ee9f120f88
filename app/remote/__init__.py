"""Views of engines kvscope does not run (vLLM, llama-server): they draw what a source of
app.sources.source reports and say in place what it does not."""
