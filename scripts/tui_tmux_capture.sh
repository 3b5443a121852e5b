#!/usr/bin/env bash
# Run `localpd tui` in a real terminal (a detached tmux session of fixed size), send one message, wait for the
# reply and write the screen as text.   usage: scripts/tui_tmux_capture.sh MODEL OUT.txt [MESSAGE] [EXPECT]
set -euo pipefail
model=${1:?model (registry name, .gguf or directory)}
out=${2:?output text file}
message=${3:-What is the capital of France?}
expect=${4:-Paris}
session=localpd-capture-$$
unset COLUMNS LINES  # the app takes the terminal's size, which these override (pytest-xdist's workers set 80x24)
home=$(mktemp -d)
trap 'tmux kill-session -t "$session" 2>/dev/null || true; rm -rf "$home"' EXIT
tmux new-session -d -s "$session" -x 140 -y 40 \
  "LOCALPD_HOME=$home ${PYTHON:-python3} -m localpd.cli tui '$model' --temperature 0 --max-tokens 32"
for _ in $(seq 1 120); do  # the model loads
  tmux capture-pane -p -t "$session" | grep -q " on " && break
  sleep 0.5
done
tmux send-keys -t "$session" "$message" Enter
for _ in $(seq 1 240); do
  if tmux capture-pane -p -t "$session" | grep -q "$expect"; then
    sleep 1  # let the reply and the panel finish
    tmux capture-pane -p -t "$session" > "$out"
    exit 0
  fi
  sleep 0.5
done
tmux capture-pane -p -t "$session" > "$out"
echo "no '$expect' on the screen after 2 minutes; screen in $out" >&2
exit 1
