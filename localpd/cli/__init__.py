"""The `localpd` command."""
