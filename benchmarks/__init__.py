"""Developer benchmarks, grouped by what they measure; run from the repository's root, never
installed (`kvscope bench` and `kvscope kv-accuracy` are engine/measure/).

    python -m benchmarks.serving.soak ...     serving/: the engine behind its sockets and HTTP
    python -m benchmarks.window.gui_bench     window/: what the window costs a frame
    python -m benchmarks.cpu.step_profile     cpu/: where a CPU decode step's time goes
    python -m benchmarks.device.gpu_check     device/: checks on a real GPU
"""
