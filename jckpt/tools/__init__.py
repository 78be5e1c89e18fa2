"""Tools that look into and rewrite checkpoints: info, verify, diff, merge, and the command line."""
