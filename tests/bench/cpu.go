package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// CPU time of the server and of this process: on a shared 2-core machine
// the wall-clock rates of two runs differ by a third, what a run costs the
// CPUs far less.

// backendCPU is the CPU time a server process has run, or -1 when the
// server is not on this machine (or /proc cannot be read).
func backendCPU(pid int) time.Duration {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/schedstat", pid))
	if err != nil {
		return -1
	}
	fields := strings.Fields(string(raw))
	if len(fields) == 0 {
		return -1
	}
	ns, err := strconv.ParseInt(fields[0], 10, 64)
	if err != nil {
		return -1
	}
	return time.Duration(ns)
}

// cpuUse is the CPU time a drain took: the server's (-1 when it is not on
// this machine) and this process's.
type cpuUse struct{ server, client time.Duration }

// perMessage is d per message in microseconds, -1 when d is unknown.
func (cpuUse) perMessage(d time.Duration, n int) float64 {
	if d < 0 || n == 0 {
		return -1
	}
	return float64(d.Microseconds()) / float64(n)
}

// findPostmaster returns the pid of the server's postmaster when the
// server runs on this machine (the parent of a backend of the pool), else
// 0.
func findPostmaster(ctx context.Context, pool *pgxpool.Pool) int {
	var backend int
	if err := pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
		return 0
	}
	st, err := readStat(backend)
	if err != nil || len(st) < 2 {
		return 0
	}
	ppid, err := strconv.Atoi(st[1])
	if err != nil {
		return 0
	}
	return ppid
}

// machineCPU is the CPU time every process of this machine has run, user
// and system (/proc/stat: neither idle nor iowait nor steal), or -1 when
// the server is not on this machine (postmaster 0). Less the bench's own
// time it is the server's: summing the server's processes instead would
// lose the backends that end during a drain.
func machineCPU(postmaster int) time.Duration {
	if postmaster == 0 {
		return -1
	}
	raw, err := os.ReadFile("/proc/stat")
	if err != nil {
		return -1
	}
	line, _, _ := strings.Cut(string(raw), "\n")
	f := strings.Fields(line)
	if len(f) < 8 || f[0] != "cpu" {
		return -1
	}
	// user nice system idle iowait irq softirq
	return time.Duration(statTicks(f[1:], 0, 1, 2, 5, 6)) * 10 * time.Millisecond
}

// readStat returns the fields of /proc/PID/stat after the command name
// (field 3, the state, comes first).
func readStat(pid int) ([]string, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, err
	}
	s := string(raw)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return nil, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	return strings.Fields(s[i+1:]), nil
}

// statTicks sums the given fields of a readStat result.
func statTicks(st []string, idx ...int) int64 {
	var sum int64
	for _, i := range idx {
		if i < len(st) {
			v, _ := strconv.ParseInt(st[i], 10, 64)
			sum += v
		}
	}
	return sum
}

// processCPU is the benchmark process's CPU time, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
