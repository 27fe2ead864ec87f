"""fp8comm.bench."""
