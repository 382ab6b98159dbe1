"""`pulsescale bench decide` (`pulsescale.bench.decide:decide`) and its parts: traffic, watch, run."""
