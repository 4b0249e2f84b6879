"""Ways to make traces from real runs: HF transformers hooks (:mod:`routetool.capture.hf`)."""
