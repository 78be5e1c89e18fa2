"""Services built on the API: the background mirror, the checkpoint manager and training state."""
