// Package owner ties a process's life to another's: when the owner process exits, the watcher stops this
// one. Linux only (it reads /proc).
package owner

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Env names the process whose death must end this one, as "PID:STARTTIME". The start time (field 22 of
// /proc/PID/stat) guards against a recycled PID keeping an orphaned control plane alive.
const Env = "KVTIER_CONTROLPLANE_OWNER"

// Grace is how long a graceful shutdown may take after the owner died before the process exits anyway.
const Grace = 20 * time.Second

// Owner identifies one process incarnation: a PID plus its kernel start time.
type Owner struct {
	pid       int
	startTime uint64
}

// String is the form Env carries and Parse reads.
func (o Owner) String() string { return fmt.Sprintf("%d:%d", o.pid, o.startTime) }

// Parse reads the "PID:STARTTIME" form written by Owner.String.
func Parse(s string) (Owner, error) {
	pidText, startText, ok := strings.Cut(s, ":")
	if !ok {
		return Owner{}, fmt.Errorf("%s=%q: want PID:STARTTIME", Env, s)
	}
	pid, err := strconv.Atoi(pidText)
	if err != nil || pid <= 0 {
		return Owner{}, fmt.Errorf("%s=%q: PID must be a positive integer", Env, s)
	}
	start, err := strconv.ParseUint(startText, 10, 64)
	if err != nil {
		return Owner{}, fmt.Errorf("%s=%q: STARTTIME must be an unsigned integer", Env, s)
	}
	return Owner{pid: pid, startTime: start}, nil
}

// StatStartTime extracts field 22 (starttime) from the text of /proc/PID/stat. The command name (field 2) may
// hold spaces and parentheses, so fields are counted from the last ')'.
func StatStartTime(stat string) (uint64, error) {
	end := strings.LastIndexByte(stat, ')')
	if end < 0 {
		return 0, fmt.Errorf("malformed /proc stat line: no ')'")
	}
	fields := strings.Fields(stat[end+1:])
	const startTimeIndex = 22 - 3 // fields after ')' begin at field 3 (state)
	if len(fields) <= startTimeIndex {
		return 0, fmt.Errorf("malformed /proc stat line: %d fields after the command name", len(fields))
	}
	return strconv.ParseUint(fields[startTimeIndex], 10, 64)
}

// processStartTime returns the kernel start time of pid, or an error when no such process exists.
func processStartTime(pid int) (uint64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	return StatStartTime(string(data))
}

// Of identifies the running process pid.
func Of(pid int) (Owner, error) {
	start, err := processStartTime(pid)
	if err != nil {
		return Owner{}, fmt.Errorf("owner process %d: %w", pid, err)
	}
	return Owner{pid: pid, startTime: start}, nil
}

// Alive reports whether that same process (not a later one with a recycled PID) still runs.
func (o Owner) Alive() bool {
	start, err := processStartTime(o.pid)
	return err == nil && start == o.startTime
}

// Watch polls the owner and, once it is gone, asks this process to stop (SIGTERM runs the components'
// own graceful shutdown) and exits outright if that takes longer than Grace.
func Watch(o Owner) {
	go func() {
		for o.Alive() {
			time.Sleep(500 * time.Millisecond)
		}
		fmt.Fprintf(os.Stderr, "kvtier-controlplane: owner process %d is gone; shutting down\n", o.pid)
		_ = syscall.Kill(os.Getpid(), syscall.SIGTERM)
		time.Sleep(Grace)
		fmt.Fprintf(os.Stderr, "kvtier-controlplane: graceful shutdown took over %s; exiting\n", Grace)
		os.Exit(1)
	}()
}

// WatchFromEnv watches the owner named in Env, if any; a malformed value ends the process.
func WatchFromEnv() {
	value := os.Getenv(Env)
	if value == "" {
		return
	}
	o, err := Parse(value)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvtier-controlplane:", err)
		os.Exit(2)
	}
	Watch(o)
}
