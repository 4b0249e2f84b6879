"""Reading and writing: the trace format, sharded traces, dump importers, strict JSON, paths and safe writes, the input budget."""
