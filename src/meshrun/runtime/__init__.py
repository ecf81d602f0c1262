"""Worker runtime: launcher env, device and backend choice, the process's one Runtime, init/shutdown."""
