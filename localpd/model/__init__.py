"""The transformer: its configuration, layers and forward pass."""
