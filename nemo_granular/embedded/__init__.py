"""The embedded single-machine trainer: the same plugin objects, on CPU or one GPU."""
