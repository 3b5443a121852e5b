"""The Textual chat app (installed as localpd.tui); arrives with the TUI issue."""
