"""The window over a vLLM server (`kvscope --attach-vllm URL`): its /metrics, KV events and OpenAI chat."""
