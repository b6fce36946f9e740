"""Recording the engine's own traffic as a Mooncake-format trace for ``kvtier replay`` (torch-free)."""
from .recorder import META_FILE, RECORDER_VERSION, TraceRecorder, trace_file_name

__all__ = ["META_FILE", "RECORDER_VERSION", "TraceRecorder", "trace_file_name"]
