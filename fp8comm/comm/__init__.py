"""FP8 collectives (all-gather, reduce-scatter, all-to-all) built on the packed wire format."""
