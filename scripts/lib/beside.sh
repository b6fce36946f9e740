# Sourced by scripts/setup and .ci/test-envs: run one CPU-bound build beside foreground work that mostly waits on
# the network and the disk (env installs), instead of one after the other.
#
#   beside_start PREFIX WHAT SCRIPT   run SCRIPT (bash, under set -euo pipefail) in the background, in its own
#                                     process group; its output goes to stderr, each line prefixed [PREFIX]
#   beside_wait                       wait for it; on failure say "WHAT failed" and return 1
#
# If the sourcing script exits before beside_wait (an error under set -e, Ctrl-C, SIGTERM), the whole build's
# process group is stopped with it: no compiler outlives the command that started it. One build at a time.
beside_pid=""
beside_what=""
beside_prefix=""

beside_stop() {
    [ -z "$beside_pid" ] || kill -TERM -- "-$beside_pid" 2>/dev/null || true
    beside_pid=""
}

beside_start() {
    beside_prefix=$1
    beside_what=$2
    trap beside_stop EXIT
    trap 'exit 130' INT TERM
    # setsid: a process group of its own (kill -- -PID reaches the build's children); -w in case it has to fork.
    setsid -w bash -c "set -euo pipefail; $3" > >(sed -u "s/^/[$beside_prefix] /" >&2) 2>&1 &
    beside_pid=$!
}

beside_wait() {
    if wait "$beside_pid"; then
        beside_pid=""
        return 0
    fi
    beside_pid=""
    echo "$beside_what failed (its [$beside_prefix] lines above say why)" >&2
    return 1
}
