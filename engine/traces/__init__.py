"""Session traces: the JSONL schema, the recorder the engine calls, the reader and workloads."""
