// Package testhook lets the project's own tests steer choices the engine
// otherwise makes by itself, such as the claim path, so a test of a
// guarantee runs on the path it names instead of retrying until the path
// it wanted happened. Nothing outside tests sets a hook.
package testhook

import (
	"sync"
	"sync/atomic"
	"time"
)

// Claim paths a test can force.
const (
	PathHeld  = "held"
	PathLease = "lease"
)

var claimPaths sync.Map // worker id -> path

// ForceClaimPath makes every claim of the subscriber with workerID take
// path (PathHeld: even the first claims and those that would lease to
// reclaim expired leases or follow ordering keys; a claim still leases
// when the pool has no spare connection or three batches are open).
// An empty path removes the hook.
func ForceClaimPath(workerID, path string) {
	if path == "" {
		claimPaths.Delete(workerID)
		return
	}
	claimPaths.Store(workerID, path)
}

// ClaimPath returns the path forced for workerID, or "".
func ClaimPath(workerID string) string {
	p, _ := claimPaths.Load(workerID)
	s, _ := p.(string)
	return s
}

var rotateLockTimeout atomic.Int64 // nanoseconds; 0: the default

// SetRotateLockTimeout makes every rotation step's TRUNCATE wait up to d
// for its lock instead of schema.RotateLockTimeout, so a test can change
// the partition while the TRUNCATE waits. 0 removes the hook.
func SetRotateLockTimeout(d time.Duration) { rotateLockTimeout.Store(int64(d)) }

// RotateLockTimeout returns the lock timeout forced for rotation steps, or 0.
func RotateLockTimeout() time.Duration { return time.Duration(rotateLockTimeout.Load()) }
