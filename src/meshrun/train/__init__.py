"""Training: the worker entry, the step loop, optimizer and LR schedule."""
