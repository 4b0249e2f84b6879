"""What the commands compute: replay, validate and its suite, balance and EPLB, bench."""
