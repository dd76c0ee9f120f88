"""Session traces on the engine side: the recorder the engine calls, replay input and replay,
and the analysis (summary, compare, output check, Perfetto and CSV export). The file format
itself is kvscope.ipc.trace_format, shared with the window."""
