"""FP8 GEMMs and Fp8Linear."""
