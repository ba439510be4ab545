#!/usr/bin/env bash
# GPU run 19 (session 3): run 18's commands after the fix (the split forks
# after the kernel's descriptor upload).
RUN_NAME=run19 exec "$(dirname "$0")/gpu-run18.sh" "$@"
