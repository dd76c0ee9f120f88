"""vLLM's formats for its source (app.sources.vllm_source): /metrics text, samples between two
scrapes, the prefix cache from KV events, the OpenAI chat client, frames for the plots."""
