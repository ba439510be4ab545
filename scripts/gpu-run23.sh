#!/usr/bin/env bash
# GPU run 23 (session 3): run 22's commands after "a late split pauses its
# size class (any budget)".
RUN_NAME=run23 exec "$(dirname "$0")/gpu-run22.sh" "$@"
