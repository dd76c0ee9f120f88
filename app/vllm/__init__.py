"""The window over a vLLM server (`kvscope --attach-vllm URL`): /metrics, KV events, chat."""
