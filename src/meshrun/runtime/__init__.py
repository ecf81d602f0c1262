"""Worker runtime: launcher env, device and backend choice, process-group init and clean shutdown."""
