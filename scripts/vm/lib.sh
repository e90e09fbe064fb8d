# Helpers every guest role sources (busybox ash).

# say TEXT: a marker line on the serial console for the host to poll.
say() {
    echo "@@vm $*" >/dev/console
}

# fail TEXT: report and stop the role with status 1 (the host fails the
# test on any role exit status but 0).
fail() {
    say "FAIL $*"
    exit 1
}

# arg NAME: the value of vm.NAME=VALUE on the kernel command line (empty
# when absent).
arg() {
    for word in $(cat /proc/cmdline); do
        case "$word" in
        "vm.$1="*) echo "${word#"vm.$1="}" ;;
        esac
    done
}

# wait_for_device PATH: devtmpfs creates the node once the driver probed
# the device; bounded, polled.
wait_for_device() {
    tries=0
    while [ ! -b "$1" ]; do
        tries=$((tries + 1))
        [ "$tries" -le 200 ] || fail "no block device $1"
        sleep 0.05
    done
}
