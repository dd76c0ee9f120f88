"""Serving benchmarks: the engine behind ZeroMQ and the HTTP API, priorities, soak runs,
speculative decoding, and the engine beside llama.cpp and Hugging Face."""
