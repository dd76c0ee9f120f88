"""CUDA graphs for decode steps: static inputs, a graph backend, capture, replay (issue 54).

A decode-only step of B sequences replays the graph captured for the smallest batch-size
bucket >= B; every other step (prefill, mixed, speculative verify, above the largest bucket)
runs eagerly. The capture/replay code is written against a small graph backend
(`backend.GraphBackend`): CUDA graphs on a GPU, and on the CPU a stand-in that records the
step once (make_fx) and replays that recording, so the tests exercise the same code without
a GPU. docs/gpu.md has the design.
"""
